"""A completion's text, decoded once when it finishes instead of token by token as it runs.

vLLM detokenizes every running request after every step (`IncrementalDetokenizer`),
in the process that steps the engine. Where that process also runs the model (the
in-process engine), those per-token Python calls sit between one step and the next:
about 2% of the run's wall time at 4,000 rows (bench/README, *Engine steps*). The
engine asks vLLM for token ids only, and decodes each finished request's ids here, in
one batch per step, with the fast tokenizer's own `decode_batch`.

The text is the one vLLM's incremental detokenizer gives: that one is primed with the
prompt, so an output's first word keeps the space a tokenizer drops at the start of a
text (SentencePiece does). Here the last prompt tokens are decoded with the output,
and their own text taken off the front. A character whose bytes the output never
finished is left out, as the incremental detokenizer never emits it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

CONTEXT_TOKENS = 6  # prompt tokens decoded before the output (vLLM's slow detokenizer primes with 5)
INCOMPLETE = "\ufffd"  # what a decode writes for bytes of a character not yet finished


def fast_tokenizer(tokenizer: Any) -> Any | None:
    """The `tokenizers.Tokenizer` inside vLLM's tokenizer (or a transformers fast one),
    or None where there is none: then vLLM detokenizes, as it does by default."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    inner = getattr(tokenizer, "_tokenizer", None)
    return inner if isinstance(inner, Tokenizer) else None


def decode_outputs(tokenizer: Any, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> list[str]:
    """Each output's text, special tokens skipped, as if decoded after its prompt.

    `tokenizer` is a `tokenizers.Tokenizer`; `prompts[i]` is output i's prompt token ids."""
    heads = [list(prompt[-CONTEXT_TOKENS:]) for prompt in prompts]
    both = tokenizer.decode_batch([head + list(out) for head, out in zip(heads, outputs)], skip_special_tokens=True)
    alone = tokenizer.decode_batch(heads, skip_special_tokens=True)
    texts = []
    for full, head, out in zip(both, alone, outputs):
        if full.startswith(head):
            text = full[len(head):]
        else:  # the head's text changed with what followed: the output on its own
            text = tokenizer.decode(list(out), skip_special_tokens=True)
        texts.append(text.rstrip(INCOMPLETE))
    return texts
