"""How many rows go into each engine call: the seam the batch-size controller plugs into.

The generate stage asks its policy `rows_for(bucket)` before each engine call
and reports what the call did with `observe(bucket, stats)`. A fixed policy
ignores the observations; an adaptive one grows and shrinks per bucket from them.
"""

from __future__ import annotations

from typing import Protocol

from pipeline.engine import EngineCallStats


class BatchPolicy(Protocol):
    def rows_for(self, bucket: str) -> int:
        """Rows to put in the next engine call for `bucket` (at least 1)."""
        ...

    def observe(self, bucket: str, stats: EngineCallStats) -> None:
        """What the last engine call for `bucket` did."""
        ...


class FixedBatchPolicy:
    """The same number of rows per call for every bucket, from the profile."""

    def __init__(self, rows_per_call: int):
        if rows_per_call < 1:
            raise ValueError(f"rows_per_call must be at least 1, got {rows_per_call}")
        self.rows_per_call = rows_per_call

    def rows_for(self, bucket: str) -> int:
        return self.rows_per_call

    def observe(self, bucket: str, stats: EngineCallStats) -> None:
        pass
