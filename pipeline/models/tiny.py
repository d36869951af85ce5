"""A tiny random-weight Llama that vLLM loads on a CPU in seconds, and a tiny random
BART (encoder-decoder) for the transformers engine, which vLLM does not serve.

Its text is gibberish; what it is for is exercising the real engine offline:
a real tokenizer (byte-level BPE trained here), a real chat template, and real
KV-cache behaviour. Shapes respect the CPU attention backend, which rejects
head_dim 16: hidden 128 over 2 heads gives head_dim 64.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Literal

from pipeline.storage.ownership import MARK, NotOurs, folder_entries, json_mark, shown

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]


def build_tiny_model(
    out: Path,
    seed: int = 0,
    vocab_size: int = 1024,
    max_position_embeddings: int = 16384,
    kind: str = "llama",
) -> Path:
    """Write a tokenizer and a randomly initialised Llama (or, `kind="bart"`, a BART
    summarizer: no chat template, as such models have none) into `out`.

    The same seed gives byte-identical files, so a cached copy can be trusted
    and tests can assert determinism.
    """
    import torch

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(seed, vocab_size, max_position_embeddings, chat=kind == "llama")
    tokenizer.save_pretrained(out)
    torch.manual_seed(seed)
    model = _bart(tokenizer, max_position_embeddings) if kind == "bart" else _llama(tokenizer, max_position_embeddings)
    with torch.no_grad():
        model.get_output_embeddings().weight[blank_tokens(tokenizer)] = 0.0
    if kind == "llama":
        model = model.to(torch.bfloat16)  # on disk in the dtype the CPU backend runs, so loading casts nothing
    model.save_pretrained(out, safe_serialization=True)
    return out


def _tokenizer(seed: int, vocab_size: int, max_length: int, chat: bool) -> Any:
    """Byte-level BPE trained on the synthetic prose, so any input string encodes (no <unk>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from pipeline.text.synthetic import tokenizer_training_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(tokenizer_training_text(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   model_max_length=max_length)
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def _llama(tokenizer: Any, max_position_embeddings: int) -> Any:
    """Two layers, hidden 128 over 2 heads (head_dim 64), tied embeddings; random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
    ))


def _bart(tokenizer: Any, max_position_embeddings: int) -> Any:
    """One encoder and one decoder layer, d_model 64; random weights."""
    from transformers import BartConfig, BartForConditionalGeneration

    return BartForConditionalGeneration(BartConfig(
        vocab_size=len(tokenizer), d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128,
        max_position_embeddings=max_position_embeddings, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        decoder_start_token_id=tokenizer.eos_token_id, forced_bos_token_id=None, forced_eos_token_id=None,
        # Untied: a random head tied to the embeddings echoes the decoder's start token, eos.
        tie_word_embeddings=False,
    ))


def blank_tokens(tokenizer: Any) -> list[int]:
    """The tokens that decode to whitespace, to nothing (special tokens, EOS among them) or,
    alone, to no character at all (a lone byte of a multi-byte character, "\ufffd").

    Random weights decode greedily to one token forever, and for the tiny Llama that
    token was "\n": every summary was whitespace, which the pipeline refuses as
    `empty_output`. Lone bytes are as bad: vLLM's detokenizer holds back an incomplete
    character, so a row of them comes out empty. A token whose output-embedding row is
    zero has a logit of 0 among random ones, so it is (all but) never picked: with these
    rows zeroed the tiny models write words, and run to max_new_tokens, as the tests
    expect of them.
    """
    def unusable(text: str) -> bool:
        return not text.strip() or "\ufffd" in text

    return [i for i in range(len(tokenizer)) if unusable(tokenizer.decode([i], skip_special_tokens=True))]


def fingerprint(model_dir: Path) -> str:
    """sha256 over every file's name and bytes: equal fingerprints, equal models."""
    digest = hashlib.sha256()
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        digest.update(path.relative_to(model_dir).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


MARKER = "tiny_model.json"
# The names `model.name` may take to ask for a tiny model, and the kind each builds.
TINY_MODELS = {"tiny": "llama", "tiny-bart": "bart"}
# The recipe's version, in the marker: 2 zeroed the blank tokens (`blank_tokens`). A folder
# of an older build is ours, and is rebuilt in place.
BUILD = 2
# What builds before the marker listed its files wrote (and so may be replaced).
OLD_BUILD_FILES = {"chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
                   "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", MARKER}


def cache_dir() -> Path:
    """Where the pipeline keeps what it builds for itself: $PIPELINE_CACHE_DIR, else
    $XDG_CACHE_HOME/llm-corpus-pipeline, else ~/.cache/llm-corpus-pipeline."""
    if os.environ.get("PIPELINE_CACHE_DIR"):
        return Path(os.environ["PIPELINE_CACHE_DIR"]).expanduser().absolute()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return (base / "llm-corpus-pipeline").absolute()


def cached_tiny_model(name: str, seed: int = 0) -> Path:
    """The cache folder of the tiny model `name` (a key of TINY_MODELS) with `seed`."""
    return cache_dir() / "models" / f"{name}-{TINY_MODELS[name]}-seed{seed}"


def _marker(seed: int, kind: str, folder: Path) -> dict[str, Any]:
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    return {"written_by": MARK, "what": "tiny random model", "build": BUILD, "seed": seed, "kind": kind,
            "files": files}


def _read_marker(folder: Path) -> dict[str, Any] | None:
    """Our marker in `folder`, new or old (`{"seed": N}`, `{"seed": N, "kind": K}`), or None."""
    path = folder / MARKER
    mark = json_mark(path.read_bytes()) if path.is_file() else None
    if mark is None:
        return None
    if mark.get("written_by") == MARK and isinstance(mark.get("files"), dict):
        return {"build": 0, **mark}
    if set(mark) in ({"seed"}, {"seed", "kind"}) and isinstance(mark["seed"], int):
        return {"seed": mark["seed"], "kind": mark.get("kind", "llama"), "files": None, "build": 1}
    return None


def tiny_model_state(out: Path, seed: int = 0, kind: str = "llama",
                     instead: str = "") -> Literal["ready", "free", "stale"]:
    """ready: `out` holds the tiny model of this seed and kind; free: nothing is there (or
    an empty folder); stale: an older build of it, every file ours, to be rebuilt. `NotOurs`,
    naming what is there, for anything else."""
    def refuse(why: str) -> NotOurs:
        return NotOurs(f"{out} {why}. Nothing was changed. {instead}".rstrip())

    found = folder_entries(out, refuse, "the tiny model's folder")
    if not found:
        return "free"
    mark = _read_marker(out)
    if mark is None:
        raise refuse(f"is not a folder of the tiny random model: it holds {shown(found)}, and no {MARKER} "
                     "of this pipeline's")
    if (mark["seed"], mark["kind"]) != (seed, kind):
        raise refuse(f"holds the tiny {mark['kind']} model for seed {mark['seed']}, not the {kind} model for "
                     f"seed {seed}")
    if mark["files"] is None:
        foreign = [n for n in found if n not in OLD_BUILD_FILES]
        if foreign:
            raise refuse(f"holds an older build of the tiny model, and files it never wrote: {shown(foreign)}")
        return "stale"
    sizes = {p.name: p.stat().st_size for p in out.iterdir() if p.is_file() and p.name != MARKER}
    changed = sorted(set(sizes) ^ set(mark["files"]) | {n for n in sizes if sizes[n] != mark["files"].get(n)})
    changed += [n for n in found if n.endswith("/")]
    if changed:
        raise refuse(f"holds the tiny model's {MARKER}, but not the files it lists: {shown(changed)} differ")
    return "ready" if mark["build"] == BUILD else "stale"


def ensure_tiny_model(out: Path, seed: int = 0, kind: str = "llama", instead: str = "") -> Path:
    """The tiny model at `out`, built there first if `out` does not exist, is an empty folder
    or holds an older build of it. A folder that holds anything else (by its marker, which
    lists every file) raises `NotOurs` and is left as it is. The model is built beside `out`
    and renamed into place, so `out` never holds half a model."""
    out = Path(out)
    state = tiny_model_state(out, seed, kind, instead)
    if state == "ready":
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    building = out.parent / f".{out.name}.building-{uuid.uuid4().hex[:8]}"
    replaced = out.parent / f".{out.name}.replaced-{uuid.uuid4().hex[:8]}"
    try:
        build_tiny_model(building, seed=seed, kind=kind,
                         **({"max_position_embeddings": 4096} if kind == "bart" else {}))
        (building / MARKER).write_text(json.dumps(_marker(seed, kind, building), indent=1))
        if state == "stale":
            os.rename(out, replaced)  # every file in it is ours (tiny_model_state checked)
        try:
            os.rename(building, out)  # onto nothing, or onto an empty folder
        except OSError:
            if tiny_model_state(out, seed, kind, instead) != "ready":  # another build finished first: use it
                raise
    finally:
        for ours in (building, replaced):  # a half-built or surplus copy; the older build
            if ours.exists():
                shutil.rmtree(ours)
    return out
