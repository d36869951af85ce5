from itertools import groupby

import pytest

from pipeline.text.bucketing import DEFAULT_BOUNDARIES, LengthBucketer


def test_a_default_bucket_spans_at_most_a_doubling_of_length():
    """What bounds the waste of sharing a call: past the first bucket, no prompt is under
    half the longest one of its bucket."""
    b = LengthBucketer()
    assert all(hi == 2 * lo for lo, hi in zip(DEFAULT_BOUNDARIES, DEFAULT_BOUNDARIES[1:]))
    for tokens in (129, 1000, 4097, 8192):
        bound = DEFAULT_BOUNDARIES[b.index(tokens)]
        assert bound / 2 < tokens <= bound
    assert b.name(DEFAULT_BOUNDARIES[-1] + 1).startswith("gt")


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


# --- windowed grouping: properties for any corpus (hypothesis) ------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pipeline.text.bucketing import MIN_PIECE_ROWS, piece_rows, window_order  # noqa: E402
from pipeline.stages.generate import bucket_runs  # noqa: E402

NAMES = LengthBucketer().names


def engine_calls(buckets: list[int], window_rows: int, block_rows: int,
                 interleaved: bool = False, bounds: tuple[int, ...] | None = None) -> list[tuple[str, list[int]]]:
    """The plan's composition, in order: windows of prepared rows grouped by bucket
    (`window_order`, as the window stage does), the stream cut into blocks of
    `block_rows` (Ray Data's repartition), each block split into engine calls
    (`bucket_runs`, as the generate stage does). Row numbers are input positions."""
    stream: list[int] = []
    for start in range(0, len(buckets), window_rows):
        window = list(range(start, min(start + window_rows, len(buckets))))
        stream += [window[i] for i in window_order([buckets[p] for p in window],
                                                    block_rows if interleaved else None, bounds)]
    calls = []
    for start in range(0, len(stream), block_rows):
        block = stream[start:start + block_rows]
        local = [buckets[p] for p in block]
        for name, positions in bucket_runs(list(range(len(block))), local, "window", NAMES):
            calls.append((name, [block[i] for i in positions]))
    return calls


@settings(max_examples=300, deadline=None)
@given(buckets=st.lists(st.integers(0, len(NAMES) - 1), max_size=400),
       window_rows=st.integers(1, 120), block_rows=st.integers(1, 50), interleaved=st.booleans(),
       pieces=st.booleans())
def test_every_row_reaches_exactly_one_bucket_pure_call_no_larger_than_a_block(buckets, window_rows, block_rows,
                                                                                interleaved, pieces):
    calls = engine_calls(buckets, window_rows, block_rows, interleaved, DEFAULT_BOUNDARIES if pieces else None)
    served = sorted(p for _, positions in calls for p in positions)
    assert served == list(range(len(buckets)))  # every row once: none lost, none twice
    for name, positions in calls:
        assert {NAMES[buckets[p]] for p in positions} == {name}  # bucket-pure
        assert 1 <= len(positions) <= block_rows  # never more than its block


@given(buckets=st.lists(st.integers(0, 7), max_size=200))
def test_a_window_is_ordered_by_bucket_and_keeps_arrival_order_within_one(buckets):
    order = window_order(buckets)
    assert sorted(order) == list(range(len(buckets)))
    keyed = [(buckets[i], i) for i in order]
    assert keyed == sorted(keyed)  # by bucket, then by arrival


def test_a_window_of_mixed_rows_becomes_few_calls():
    # 3 buckets interleaved row by row: per-batch splitting would make 3 calls per block;
    # ordered by bucket first, a 90-row window in 30-row blocks makes exactly 3.
    buckets = [0, 1, 2] * 30
    assert [(n, len(p)) for n, p in engine_calls(buckets, 90, 30)] == [("le128", 30), ("le256", 30), ("le512", 30)]


def test_interleaved_spreads_a_long_bucket_through_the_window_instead_of_at_its_end():
    # 8 blocks of short rows, 2 of medium, 1 of long: ascending puts the long block last,
    # where its prefills would fill steps with few decodes beside them.
    buckets = [0] * 80 + [3] * 20 + [6] * 10
    ascending = [buckets[i] for i in window_order(buckets)]
    assert ascending[-10:] == [6] * 10
    blocks = [buckets[i] for i in window_order(buckets, 10)][::10]
    assert blocks == [0, 0, 3, 0, 0, 6, 0, 0, 3, 0, 0]  # each bucket's blocks evenly spread
    assert sorted(blocks) == sorted(ascending[::10])


@given(buckets=st.lists(st.integers(0, 7), max_size=300), block_rows=st.integers(1, 40))
def test_interleaved_blocks_line_up_and_the_shortest_last_rows_end_the_window(buckets, block_rows):
    order = window_order(buckets, block_rows)
    assert sorted(order) == list(range(len(buckets)))  # every row once
    last_rows = set()  # each bucket's rows past its last whole block
    for b in set(buckets):
        mine = [i for i, x in enumerate(buckets) if x == b]
        last_rows |= set(mine[len(mine) // block_rows * block_rows:])
    whole = len(buckets) // block_rows * block_rows
    for start in range(0, whole, block_rows):  # each block the window is cut into
        block = order[start:start + block_rows]
        assert len({buckets[i] for i in block}) == 1 or set(block) <= last_rows
    tail = [buckets[i] for i in order[whole:]]
    assert set(order[whole:]) <= last_rows and tail == sorted(tail, reverse=True)
    if tail:  # the shortest of the last rows: none gathered into a block is shorter
        gathered = [buckets[i] for i in order[:whole] if i in last_rows]
        assert all(g >= tail[0] for g in gathered)


def test_a_long_bucket_comes_in_pieces_with_as_many_tokens_as_a_block_of_the_windows_most_common_one():
    le = {name: i for i, name in enumerate(NAMES)}
    window = [le["le256"]] * 50 + [le["le1024"]] * 5 + [le["le128"]] * 3 + [le["le8192"], le["gt8192"]]
    assert piece_rows(window, 128, DEFAULT_BOUNDARIES) == {
        le["le256"]: 128, le["le128"]: 128,  # no longer than the bulk: whole blocks
        le["le1024"]: 32, le["le8192"]: MIN_PIECE_ROWS, le["gt8192"]: MIN_PIECE_ROWS}
    assert piece_rows(window, 4, DEFAULT_BOUNDARIES)[le["le8192"]] == 4  # never more than a block


def test_pieces_spread_a_long_bucket_finely_through_the_window():
    """1,024 short rows and 128 long ones (4x as long) in blocks of 128: the long rows come
    as 4 pieces of 32, one in each quarter of the window, not as one block in its middle."""
    buckets = [1] * 1024 + [3] * 128
    order = window_order(buckets, 128, DEFAULT_BOUNDARIES)
    assert sorted(order) == list(range(len(buckets)))
    long_at = [k for k, i in enumerate(order) if buckets[i] == 3]
    runs = [list(g) for _, g in groupby(long_at, key=lambda k, c=iter(range(10**6)): k - next(c))]
    assert [len(r) for r in runs] == [32] * 4
    quarter = len(order) / 4
    assert [int(r[0] // quarter) for r in runs] == [0, 1, 2, 3]
    whole_blocks = [buckets[i] for i in window_order(buckets, 128)]
    assert whole_blocks.index(3) % 128 == 0  # without bounds: one whole block of them
