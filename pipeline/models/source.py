"""Which model a run loads, found and checked before Ray starts.

`model.name` is one of four things:
- `tiny` (or `tiny-bart`): the offline tiny random model, asked for by name. It lives in
  the pipeline's cache (`pipeline.models.tiny.cache_dir`), built there on first use.
- `smollm2-135m`: a real instruct model the package registry carries, converted once
  into the same cache (`pipeline.models.packaged`).
- a local folder (or a `.gguf` file): *your* model. It is only ever read. Its files are
  checked here, cheaply (config.json, the tokenizer, every safetensors header), so a
  broken or half-copied model stops the run with exit 2 before any engine starts.
- anything else: a Hugging Face hub id, passed to the engine as it is.

The old way to ask for the tiny model, a folder in `model.name` with
`model.tiny_model_seed` set, still works where that folder is absent, empty or already
holds the tiny model, of this build or an older one (with a warning). Where it holds anything else, the run stops and
the folder is left as it is: a user's model is never overwritten.
"""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pipeline.models.packaged import PACKAGED, ensure_packaged_model
from pipeline.models.tiny import TINY_MODELS, cached_tiny_model, ensure_tiny_model
from pipeline.storage.ownership import NotOurs, entries, shown

log = logging.getLogger(__name__)

YOUR_OWN = ("To run your own model, set model.name to its folder (it is only ever read) and leave "
            "model.tiny_model_seed unset (--set model.tiny_model_seed=null); for the tiny random model, "
            "set model.name: tiny (kept in the pipeline's cache, $PIPELINE_CACHE_DIR).")
WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
TOKENIZERS = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "tiktoken.model")


class ModelError(ValueError):
    """`model.name` names a local model that can't be loaded; nothing ran."""


@dataclass(frozen=True)
class ModelSource:
    """What `model.name` resolved to: `path` is what the engine loads (an absolute folder
    or file, or the hub id as written)."""

    name: str
    path: str
    kind: Literal["tiny", "packaged", "local", "hub"]


def resolve_model(name: str, tiny_model_seed: int | None = None) -> ModelSource:
    """The model `name` names, checked (see the module's docstring); the tiny model is
    built into the cache if it is not there. `NotOurs` or `ModelError`: exit 2."""
    if name in TINY_MODELS:
        folder = cached_tiny_model(name, tiny_model_seed or 0)
        instead = ("The cache holds only what this pipeline builds: move that folder away, or set "
                   "PIPELINE_CACHE_DIR to another folder.")
        ensure_tiny_model(folder, tiny_model_seed or 0, TINY_MODELS[name], instead=instead)
        return ModelSource(name, str(folder), "tiny")
    if name in PACKAGED:
        return ModelSource(name, str(ensure_packaged_model(PACKAGED[name])), "packaged")
    local = Path(name).expanduser()
    if tiny_model_seed is not None:
        return _old_tiny_model(name, local, tiny_model_seed)
    if local.exists():
        check_local_model(local)
        return ModelSource(name, str(local.resolve()), "local")
    if name.startswith(("/", "./", "../", "~")) or name.count("/") > 1:
        raise ModelError(f"model.name: {name}: no such folder (a local model must exist; a hub id is owner/name)")
    return ModelSource(name, name, "hub")


def _old_tiny_model(name: str, folder: Path, seed: int) -> ModelSource:
    """model.name: FOLDER with model.tiny_model_seed: the tiny model at FOLDER, only where
    FOLDER is free or already holds it."""
    ensure_tiny_model(folder, seed, "llama", instead=YOUR_OWN)
    log.warning("model.name: %s with model.tiny_model_seed: %d asks for the tiny model at a folder of your "
                "choosing; write model.name: tiny (and model.tiny_model_seed: %d, or leave it unset for 0) to "
                "keep it in the pipeline's cache", name, seed, seed)
    return ModelSource(name, str(folder.resolve()), "tiny")


def check_local_model(path: Path) -> None:
    """Read-only checks that catch a model folder that can't load, before any engine
    starts: a config, a tokenizer, weights, and every safetensors file whole (its header
    parses and its tensors fit in the file). Reads the headers only, not the weights."""
    where = f"model.name: {path}"
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelError(f"{where} is a file, not a model folder (or a .gguf file)")
        with path.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelError(f"{where} is not a GGUF file (it does not start with GGUF)")
        return
    found = entries(path)
    if not found:
        raise ModelError(f"{where} is an empty folder, not a model")
    config = path / "config.json"
    if not config.is_file():
        raise ModelError(f"{where} holds no config.json, so it is not a Hugging Face model folder "
                         f"(it holds {shown(found)})")
    _json_object(config, where)
    if not any((path / t).is_file() for t in TOKENIZERS):
        raise ModelError(f"{where} holds no tokenizer ({', '.join(TOKENIZERS)}); the prompts are tokenized "
                         f"with the model's own (it holds {shown(found)})")
    if (path / "tokenizer.json").is_file():
        _json_object(path / "tokenizer.json", where)
    weights = sorted({p for pattern in WEIGHTS for p in path.glob(pattern)})
    if not weights:
        raise ModelError(f"{where} holds no weights ({', '.join(WEIGHTS)}; it holds {shown(found)})")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = set(_json_object(index, where).get("weight_map", {}).values())
        missing = sorted(s for s in shards if not (path / s).is_file())
        if missing:
            raise ModelError(f"{where}: {index.name} names shards that are not there: {shown(missing)}")
    for w in weights:
        if w.stat().st_size == 0:
            raise ModelError(f"{where}: {w.name} is empty")
        if w.suffix == ".safetensors":
            _check_safetensors(w, where)


POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length")


def check_context(path: str, max_model_len: int | None) -> None:
    """`engine.max_model_len` within the positions the model at `path` (a local folder)
    was built for, from its config.json: above them the engine refuses to start, and would
    again on every restart. A model with rope scaling, or one without such a key (a hub
    id, a .gguf file), is left to the engine to judge."""
    config_file = Path(path) / "config.json"
    if max_model_len is None or not config_file.is_file():
        return
    config = json.loads(config_file.read_bytes())
    config = config.get("text_config", config)  # a multimodal model's language half
    if config.get("rope_scaling"):
        return
    key = next((k for k in POSITION_KEYS if isinstance(config.get(k), int)), None)
    if key is not None and max_model_len > config[key]:
        raise ModelError(f"engine.max_model_len {max_model_len:,} is above the {config[key]:,} positions of the "
                         f"model at {path} ({key} in its config.json): set engine.max_model_len to "
                         f"{config[key]} or less (--set engine.max_model_len={config[key]}), or remove it "
                         f"to use the model's own")


def _json_object(path: Path, where: str) -> dict:
    try:
        value = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelError(f"{where}: {path.name} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ModelError(f"{where}: {path.name} is not a JSON object")
    return value


def _check_safetensors(path: Path, where: str) -> None:
    """The format: an 8-byte little-endian header length, a JSON header naming each
    tensor's byte range, then the data."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        (length,) = struct.unpack("<Q", head) if len(head) == 8 else (size,)
        if len(head) < 8 or length > size - 8:
            raise ModelError(f"{where}: {path.name} is not a safetensors file: its header would be {length:,} bytes "
                             f"in a file of {size:,} (a partial copy, or another format)")
        try:
            header = json.loads(f.read(length))
            end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, UnicodeDecodeError, TypeError, KeyError, IndexError) as e:
            raise ModelError(f"{where}: {path.name} is not a safetensors file: its header does not parse "
                             f"({type(e).__name__}: {e})") from None
    if 8 + length + end > size:
        raise ModelError(f"{where}: {path.name} is cut short: its tensors need {8 + length + end:,} bytes, "
                         f"the file has {size:,} (a partial copy)")


__all__ = ["ModelError", "ModelSource", "NotOurs", "check_local_model", "resolve_model"]
