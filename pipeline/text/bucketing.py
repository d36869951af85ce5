"""Length buckets: rows of similar prompt length share an engine call.

Pure: no Ray, no engine, no I/O.

A bucket is named by its inclusive upper bound: with boundaries
(128, 256, ...), a 128-token prompt is `le128`, a 129-token one `le256`, and a
prompt past the last boundary `gt8192`. Bucket indexes sort in length order,
so sorting by index sorts rows from short to long.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

DEFAULT_BOUNDARIES: tuple[int, ...] = tuple(2**k for k in range(7, 14))  # 128 .. 8192


class LengthBucketer:
    """Maps a prompt length in tokens to a bucket index and name."""

    def __init__(self, boundaries: Sequence[int] = DEFAULT_BOUNDARIES):
        bounds = tuple(int(b) for b in boundaries)
        if not bounds:
            raise ValueError("bucket boundaries must not be empty")
        if any(b <= 0 for b in bounds):
            raise ValueError(f"bucket boundaries must be positive, got {list(bounds)}")
        if any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"bucket boundaries must increase strictly, got {list(bounds)}")
        self.boundaries = bounds
        self.names: tuple[str, ...] = tuple(f"le{b}" for b in bounds) + (f"gt{bounds[-1]}",)

    def index(self, tokens: int) -> int:
        """The bucket index of a prompt of `tokens` tokens (upper bound inclusive)."""
        if tokens < 0:
            raise ValueError(f"a prompt cannot have {tokens} tokens")
        return bisect.bisect_left(self.boundaries, tokens)

    def name(self, tokens: int) -> str:
        return self.names[self.index(tokens)]


MIN_PIECE_ROWS = 8  # the fewest rows a long bucket is spread in (`window_order`'s `bounds`)


def piece_rows(buckets: Sequence[int], block_rows: int, bounds: Sequence[int]) -> dict[int, int]:
    """Rows per piece for each bucket of a window: as many prompt tokens per piece as a
    block of the window's most common bucket holds, so a bucket 4x as long comes in
    pieces a quarter of a block. Buckets no longer than that one: a whole block each."""
    counts: dict[int, int] = {}
    for b in buckets:
        counts[b] = counts.get(b, 0) + 1
    if not counts:
        return {}

    def bound(b: int) -> int:  # past the last boundary: twice it, as the bucket has no bound
        return bounds[b] if b < len(bounds) else 2 * bounds[-1]

    bulk = bound(max(counts, key=lambda b: (counts[b], -b)))
    return {b: max(min(block_rows, MIN_PIECE_ROWS), min(block_rows, block_rows * bulk // bound(b))) for b in counts}


def window_order(buckets: Sequence[int], block_rows: int | None = None,
                 bounds: Sequence[int] | None = None) -> list[int]:
    """Positions of a window's rows grouped by bucket: the window's blocks then hold one
    bucket each, except where one bucket ends and the next begins, and the engine calls
    they are split into never mix buckets.

    `block_rows` None: the buckets one after another, short to long, arrival order kept
    within one. Else the buckets are interleaved a block at a time, each spread evenly
    over the window: block `j` of `n` comes at `(j + 1/2) / n` of the way through. A continuous-batching engine (vLLM)
    then prefills a long bucket's prompts beside the other buckets' decodes, instead of
    all of them together at the window's end, where each long prefill filled a step of
    its own with few decodes beside it (measured: `bench/README.md`, engine steps).

    Each bucket's last rows (fewer than a block) are gathered, longest bucket first,
    into blocks of their own, spread like the rest; such a block is split into a call
    per bucket. The rows that do not fill a last block, the shortest, end the window. So
    the blocks the window is cut into line up with the blocks here: one bucket each
    but for the gathered ones.

    `bounds` (the buckets' upper bounds, `LengthBucketer.boundaries`): a bucket longer
    than the window's most common one is spread in smaller pieces (`piece_rows`), with
    as many prompt tokens as a block of that one, so its prefills are spread as finely
    as the rest of the window's. The blocks then no longer line up: a block may hold a
    piece and the rows around it, served as a call per bucket, at once."""
    by_bucket: dict[int, list[int]] = {}
    for i, b in enumerate(buckets):
        by_bucket.setdefault(b, []).append(i)
    if block_rows is None:
        return [i for b in sorted(by_bucket) for i in by_bucket[b]]
    pieces = piece_rows(buckets, block_rows, bounds) if bounds else {b: block_rows for b in by_bucket}
    blocks: list[tuple[float, int, list[int]]] = []
    rest: list[int] = []
    for b in sorted(by_bucket, reverse=True):
        rows, size = by_bucket[b], pieces[b]
        n = len(rows) // size
        blocks += [((j + 0.5) / n, b, rows[j * size:(j + 1) * size]) for j in range(n)]
        rest += rows[n * size:]
    gathered = len(rest) - len(rest) % block_rows
    k = gathered // block_rows
    blocks += [((j + 0.5) / k, -1, rest[j * block_rows:(j + 1) * block_rows]) for j in range(k)]
    blocks.sort(key=lambda c: (c[0], c[1]))
    return [i for _, _, rows in blocks for i in rows] + rest[gathered:]
