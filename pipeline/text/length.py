"""What to do with text too long for the model: keep part of it, or cut it into windows.

Pure: no Ray, no engine, no I/O.

Pure functions over token ids and character offsets; the prepare stage feeds
them the model's own tokenization.

Truncation keeps the first `cap` tokens (`head`) or the first and last halves
of them (`head_tail`, for documents whose conclusion matters as much as their
opening). Windows cut a document into pieces of at most `window` tokens that
overlap by `overlap` tokens, ending at a paragraph break where one lies in the
window's second half, else at a sentence end, else at the token limit.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_PARAGRAPH = re.compile(r"\n\s*\n")
_SENTENCE = re.compile(r"(?<=[.!?。！？])\s+|\n")


def truncate_ids(ids: Sequence[int], cap: int, keep: str = "head") -> list[int]:
    """At most `cap` tokens of `ids`, chosen by `keep` (head | head_tail)."""
    if cap < 1:
        raise ValueError(f"cannot keep {cap} tokens")
    if len(ids) <= cap:
        return list(ids)
    if keep == "head":
        return list(ids[:cap])
    if keep == "head_tail":
        head = (cap + 1) // 2
        tail = cap - head
        return list(ids[:head]) + (list(ids[-tail:]) if tail else [])
    raise ValueError(f"unknown keep policy {keep!r}")


def boundaries(text: str) -> tuple[set[int], set[int]]:
    """Character positions where a paragraph, or a sentence, ends."""
    paragraphs = {m.end() for m in _PARAGRAPH.finditer(text)}
    sentences = {m.end() for m in _SENTENCE.finditer(text)}
    return paragraphs, sentences


def windows(
    offsets: Sequence[tuple[int, int]], text: str, window: int, overlap: int
) -> list[tuple[int, int]]:
    """Token windows [start, end) over a tokenized text, in order, covering every token.

    `offsets[i]` is token i's character span. A window ends after the last
    token that finishes at a paragraph break in its second half, else at a
    sentence end there, else at `window` tokens. The next window starts
    `overlap` tokens before the previous end (always at least one token later
    than the previous start, so the walk ends).
    """
    if window < 1:
        raise ValueError("window must be at least 1 token")
    if not 0 <= overlap < window:
        raise ValueError(f"overlap must be in [0, window), got {overlap}")
    n = len(offsets)
    if n == 0:
        return []
    paragraphs, sentences = boundaries(text)

    def ends_at(i: int, marks: set[int]) -> bool:
        # Token i ends where a boundary begins: the next non-space character starts a unit.
        end = offsets[i][1]
        rest = len(text[end:]) - len(text[end:].lstrip())
        return end in marks or (end + rest) in marks

    spans: list[tuple[int, int]] = []
    start = 0
    while True:
        limit = start + window
        if limit >= n:
            spans.append((start, n))
            return spans
        end = limit
        # Search the second half of the window, and never end at or before the
        # previous window's end: each window must add tokens.
        lowest = max(start + window // 2, spans[-1][1] + 1 if spans else 1)
        for marks in (paragraphs, sentences):
            found = next((i + 1 for i in range(limit - 1, lowest - 2, -1) if ends_at(i, marks)), None)
            if found is not None:
                end = found
                break
        spans.append((start, end))
        start = max(end - overlap, start + 1)


def char_span(offsets: Sequence[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
    """Characters covered by tokens [start, end)."""
    return offsets[start][0], offsets[end - 1][1]
