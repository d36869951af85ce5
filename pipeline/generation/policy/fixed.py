"""A fixed number of rows in flight per bucket: the baseline, and what `pipeline tune` chose."""

from __future__ import annotations

import math
import time
from typing import Any

from pipeline.generation.policy.base import Observation


class FixedBatchPolicy:
    """A fixed number of rows per bucket, from the profile; no memory budget.

    `per_bucket` (from `pipeline tune`) sets a bucket's own row count; other
    buckets get `rows_per_call`.
    """

    def __init__(self, rows_per_call: int, per_bucket: dict[str, int] | None = None):
        if rows_per_call < 1:
            raise ValueError(f"rows_per_call must be at least 1, got {rows_per_call}")
        self.rows_per_call = rows_per_call
        self.per_bucket = dict(per_bucket or {})
        self._t0 = time.monotonic()
        self._seen: dict[str, list[dict[str, Any]]] = {}

    def budget(self, bucket: str, tokens_per_row: float) -> float:
        return math.inf

    def rows_for(self, bucket: str, tokens_per_row: float) -> int:
        self._seen.setdefault(bucket, [])
        return self.per_bucket.get(bucket, self.rows_per_call)

    def observe(self, bucket: str, obs: Observation) -> None:
        self._seen.setdefault(bucket, []).append(
            {"t": round(time.monotonic() - self._t0, 4), "budget": None,
             "rows": self.per_bucket.get(bucket, self.rows_per_call), "pressure": round(obs.pressure, 4),
             "throughput": round(obs.throughput, 2), "preemptions": obs.preemptions, "oom": obs.oom,
             "action": "fixed", "reason": "drain" if obs.drained else None}
        )

    def limit_rows(self, max_rows: int) -> None:
        """A fixed size is the user's choice: rows beyond the engine's own limit wait in its queue."""

    def trajectory(self, bucket: str) -> dict[str, Any]:
        steps = self._seen.get(bucket, [])
        return {"steps": steps, "backoffs": [], "ceiling": None, "budget": None,
                "peak_pressure": max((x["pressure"] for x in steps), default=0.0)}

    def learned_limits(self) -> dict[str, int]:
        return {}
