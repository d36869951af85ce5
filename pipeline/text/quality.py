"""Cheap signs of what a model's outputs are worth, counted per bucket in the report.

None of these judges a summary; each catches a pattern a user should look at:
- **cut at the limit** (`finish_reason == "length"`): the model was still writing when
  `max_new_tokens` stopped it; many of these say the limit is too low.
- **copies the opening** (`copies_opening`): the output is mostly a stretch of the
  document's first lines, a small model's habit; many of these say the prompt needs work.
- **found in the text** (`found_in_text`): of the strings an annotation extracted
  (keywords, entity names), those that occur in the row's text; few of these say the
  values are not coming from the text.
"""

from __future__ import annotations

import math
from difflib import SequenceMatcher
from functools import lru_cache
from typing import Any

COPY_SHARE = 0.8


def normalized(text: str) -> str:
    """Whitespace runs as one space, ends stripped; case kept."""
    return " ".join(text.split())


def copies_opening(output: str | None, document: str | None, share: float = COPY_SHARE) -> bool:
    """The rule: with both texts `normalized`, the longest substring the output shares with
    the document's first 2 x len(output) characters covers at least `share` (80%) of the
    output. An empty output copies nothing."""
    out, doc = normalized(output or ""), normalized(document or "")
    if not out or not doc:
        return False
    opening = doc[: 2 * len(out)]
    need = math.ceil(share * len(out))
    # Any shared substring of `need` characters or more covers out[len(out) - need:need]:
    # where that core is not in the opening (most outputs), nothing longer can be.
    if 2 * need > len(out) and out[len(out) - need:need] not in opening:
        return False
    match = SequenceMatcher(None, out, opening, autojunk=False).find_longest_match(0, len(out), 0, len(opening))
    return match.size >= need


def found_in_text(values: list[str], text: str | None) -> int:
    """How many of `values` occur in `text`: case-insensitive, with whitespace `normalized`.
    An empty value is not found."""
    haystack = _searchable(text or "")
    return sum(bool(v) and normalized(v).casefold() in haystack for v in values)


@lru_cache(maxsize=1)
def _searchable(text: str) -> str:
    """`text` as `found_in_text` searches it; kept for the next call, which asks about the
    same row's next annotation column."""
    return normalized(text).casefold()


TRIES = ("first_try", "after_retry", "invalid_output")


def annotation_counts() -> dict[str, Any]:
    """Annotation counts at zero: rows by how their annotation ended (`TRIES`), and per
    list column the values extracted and those `found_in_text` (`found`)."""
    return {**dict.fromkeys(TRIES, 0), "found": {}}


def add_annotation_counts(into: dict[str, Any], counts: dict[str, Any]) -> None:
    """`counts` (from `annotation_counts`, or its JSON) added into `into`."""
    for k in TRIES:
        into[k] += counts[k]
    for column, f in counts["found"].items():
        g = into["found"].setdefault(column, {"values": 0, "in_text": 0})
        g["values"] += f["values"]
        g["in_text"] += f["in_text"]


def extracted_strings(value: object) -> list[str]:
    """The strings an annotation value names: a string list as it is, a list of objects by
    each one's `name` (entities); anything else names none."""
    if not isinstance(value, list):
        return []
    out = []
    for v in value:
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, dict) and isinstance(v.get("name"), str):
            out.append(v["name"])
    return out
