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
from pathlib import Path
from typing import Any

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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import BartConfig, BartForConditionalGeneration, LlamaConfig, LlamaForCausalLM
    from transformers import PreTrainedTokenizerFast

    from pipeline.dev.corpus import tokenizer_training_text

    out.mkdir(parents=True, exist_ok=True)

    # 1. Tokenizer: byte-level BPE, so any input string encodes (no <unk>).
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_training_text(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=max_position_embeddings,
    )
    if kind == "llama":
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    if kind == "bart":
        config = BartConfig(
            vocab_size=len(fast), d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128,
            max_position_embeddings=max_position_embeddings, bos_token_id=fast.bos_token_id,
            eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
            decoder_start_token_id=fast.eos_token_id, forced_bos_token_id=None, forced_eos_token_id=None,
            # Untied: a random head tied to the embeddings echoes the decoder's start token, eos.
            tie_word_embeddings=False,
        )
        torch.manual_seed(seed)
        bart = BartForConditionalGeneration(config)
        with torch.no_grad():
            bart.get_output_embeddings().weight[blank_tokens(fast)] = 0.0
        bart.save_pretrained(out, safe_serialization=True)
        return out

    # 2. Model: random weights from a seeded generator.
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.get_output_embeddings().weight[blank_tokens(fast)] = 0.0
    # bfloat16 on disk: the dtype the CPU backend runs, so loading casts nothing.
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return out


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


def ensure_tiny_model(out: Path, seed: int = 0, kind: str = "llama") -> Path:
    """Build the model into `out` unless a complete copy for `seed` (and `kind`) is there."""
    marker = out / "tiny_model.json"
    if marker.exists() and json.loads(marker.read_text()) == ({"seed": seed} if kind == "llama"
                                                             else {"seed": seed, "kind": kind}):
        return out
    build_tiny_model(out, seed=seed, kind=kind, **({"max_position_embeddings": 4096} if kind == "bart" else {}))
    marker.write_text(json.dumps({"seed": seed} if kind == "llama" else {"seed": seed, "kind": kind}))
    return out
