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


def window_order(buckets: Sequence[int]) -> list[int]:
    """Positions of a window's rows ordered by bucket, arrival order kept within one: the
    window's blocks then hold one bucket each, except where one bucket ends and the next
    begins, and the engine calls they are split into never mix buckets."""
    return sorted(range(len(buckets)), key=lambda i: buckets[i])
