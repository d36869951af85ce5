import pytest

from pipeline.bucketing import DEFAULT_BOUNDARIES, LengthBucketer


def test_default_boundaries_are_powers_of_two_128_to_8192():
    assert DEFAULT_BOUNDARIES == (128, 256, 512, 1024, 2048, 4096, 8192)


@pytest.mark.parametrize(
    ("tokens", "name"),
    [
        (0, "le128"),
        (1, "le128"),
        (127, "le128"),
        (128, "le128"),  # exactly at a boundary: the bound is inclusive
        (129, "le256"),
        (256, "le256"),
        (257, "le512"),
        (8192, "le8192"),
        (8193, "gt8192"),
        (10**6, "gt8192"),
    ],
)
def test_bucket_names_at_and_around_boundaries(tokens, name):
    assert LengthBucketer().name(tokens) == name


def test_indexes_sort_in_length_order():
    b = LengthBucketer([10, 20, 30])
    lengths = [35, 5, 20, 21, 10, 11]
    by_index = sorted(lengths, key=b.index)
    assert [b.index(t) for t in by_index] == sorted(b.index(t) for t in lengths)
    assert b.names == ("le10", "le20", "le30", "gt30")


@pytest.mark.parametrize("bad", [[], [0, 10], [10, 10], [20, 10], [-5]])
def test_rejects_bad_boundaries(bad):
    with pytest.raises(ValueError, match="boundaries"):
        LengthBucketer(bad)


def test_rejects_negative_length():
    with pytest.raises(ValueError):
        LengthBucketer().index(-1)
