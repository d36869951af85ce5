"""How much work goes into the engine at once: the seam every batch policy plugs into.

The feeder asks its policy, before admitting rows, how many tokens (`budget`)
and how many rows (`rows_for`) a bucket may have in flight, and reports each
window's outcome as an `Observation`. `BatchSizeController` (adaptive.py) is
the adaptive policy; `FixedBatchPolicy` (fixed.py) a fixed row count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Observation:
    """What one window of generation did."""

    pressure: float  # peak memory pressure 0..1 seen during the window
    throughput: float  # output tokens/s over the window
    rows: int  # rows completed in the window
    preemptions: int = 0
    oom: bool = False
    tokens_per_row: float | None = None  # mean cost of the window's rows
    # The queue ran dry during the window: fewer rows were in flight than the
    # budget allowed, so its pressure and throughput say nothing about the budget.
    drained: bool = False


class BatchPolicy(Protocol):

    def budget(self, bucket: str, tokens_per_row: float) -> float:
        """Tokens (prompt + max new, per row) `bucket` may have in flight."""
        ...

    def rows_for(self, bucket: str, tokens_per_row: float) -> int:
        """Rows `bucket` may have in flight (at least 1)."""
        ...

    def observe(self, bucket: str, obs: Observation) -> None:
        """What the last window of `bucket` did."""
        ...

    def limit_rows(self, max_rows: int) -> None:
        """The engine now runs at most `max_rows` at once (it was rebuilt smaller)."""
        ...

    def trajectory(self, bucket: str, steps_from: int = 0) -> dict[str, Any]:
        """`bucket`'s steps from the `steps_from`th on, its back-offs, ceiling, budget
        and peak pressure."""
        ...

    def backoffs(self, bucket: str) -> list[dict[str, Any]]:
        """`bucket`'s back-offs so far (the live metrics count them)."""
        ...

    def learned_limits(self) -> dict[str, int]: ...
