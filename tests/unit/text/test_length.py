"""Truncation and windowing: properties that must hold for any input (hypothesis)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.text.length import truncate_ids, windows

ids_lists = st.lists(st.integers(0, 50_000), max_size=400)


@given(ids=ids_lists, cap=st.integers(1, 500), keep=st.sampled_from(["head", "head_tail"]))
def test_truncation_never_exceeds_the_cap_and_keeps_what_it_says(ids, cap, keep):
    out = truncate_ids(ids, cap, keep)
    assert len(out) == min(len(ids), cap)
    if len(ids) <= cap:
        assert out == ids
    elif keep == "head":
        assert out == ids[:cap]
    else:
        head = (cap + 1) // 2
        assert out[:head] == ids[:head]
        assert out[head:] == ids[len(ids) - (cap - head):]


def test_truncation_rejects_nonsense():
    with pytest.raises(ValueError):
        truncate_ids([1, 2], 0)
    with pytest.raises(ValueError, match="keep"):
        truncate_ids([1, 2, 3], 2, "middle")


def fake_tokenize(text: str) -> list[tuple[int, int]]:
    """Whitespace-and-punctuation tokens with character offsets, like a fast tokenizer's."""
    import re

    return [(m.start(), m.end()) for m in re.finditer(r"\s*\S+", text)]


texts = st.lists(
    st.tuples(
        st.lists(st.text(alphabet="abcdéf ✓", min_size=1, max_size=8), min_size=1, max_size=12),
        st.sampled_from([". ", "! ", "\n", "\n\n", " "]),
    ),
    max_size=40,
).map(lambda parts: "".join(" ".join(words) + sep for words, sep in parts))


@settings(max_examples=200)
@given(text=texts, window=st.integers(2, 60), overlap_frac=st.floats(0, 0.9))
def test_windows_fit_cover_in_order_and_overlap(text, window, overlap_frac):
    offsets = fake_tokenize(text)
    overlap = min(int(window * overlap_frac), window - 1)
    spans = windows(offsets, text, window, overlap)
    if not offsets:
        assert spans == []
        return
    assert spans[0][0] == 0 and spans[-1][1] == len(offsets)
    for (s, e) in spans:
        assert 0 < e - s <= window  # no piece exceeds the limit
    for (s1, e1), (s2, e2) in zip(spans, spans[1:]):
        assert s1 < s2 <= e1 < e2  # in order, no gap
        assert e1 - s2 <= overlap  # overlap as configured (or less, at a boundary)


def test_windows_prefer_paragraph_then_sentence_breaks():
    text = "One two three four. Five six seven.\n\nEight nine ten eleven twelve thirteen."
    offsets = fake_tokenize(text)
    spans = windows(offsets, text, window=10, overlap=0)
    first_end = offsets[spans[0][1] - 1][1]
    assert text[:first_end].endswith("seven.")  # the paragraph break, not the 10th token
    spans = windows(offsets, text, window=6, overlap=0)
    assert text[: offsets[spans[0][1] - 1][1]].endswith("four.")  # a sentence end in the second half
