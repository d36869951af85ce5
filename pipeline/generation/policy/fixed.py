"""A fixed number of rows in flight per bucket: the baseline, and what `pipeline tune` chose."""

from __future__ import annotations

import math
import time
from typing import Any

from pipeline.generation.policy.base import Observation


class FixedBatchPolicy:
    """A fixed number of rows per bucket, from the profile; no memory budget.

    `per_bucket` (from `pipeline tune`) sets a bucket's own row count; other
    buckets get `rows_per_call`. An out-of-memory halves the bucket's rows (down
    to one; a row that fails alone is the feeder's to mark as an error), and the
    halved size holds for the rest of the run: a ceiling learned from a failure.
    Each halving goes to the bucket's `backoffs`, as the adaptive controller's do.
    """

    def __init__(self, rows_per_call: int, per_bucket: dict[str, int] | None = None):
        if rows_per_call < 1:
            raise ValueError(f"rows_per_call must be at least 1, got {rows_per_call}")
        self.rows_per_call = rows_per_call
        self.per_bucket = dict(per_bucket or {})
        self._t0 = time.monotonic()
        self._rows: dict[str, int] = {}  # each bucket's rows now: the configured size, or less after an OOM
        self._seen: dict[str, list[dict[str, Any]]] = {}
        self._backoffs: dict[str, list[dict[str, Any]]] = {}

    def budget(self, bucket: str, tokens_per_row: float) -> float:
        return math.inf

    def rows_for(self, bucket: str, tokens_per_row: float) -> int:
        self._seen.setdefault(bucket, [])
        return self._current(bucket)

    def _current(self, bucket: str) -> int:
        return self._rows.setdefault(bucket, self.per_bucket.get(bucket, self.rows_per_call))

    def _now(self) -> float:
        return round(time.monotonic() - self._t0, 4)

    def observe(self, bucket: str, obs: Observation) -> None:
        action, reason = "fixed", "drain" if obs.drained else None
        if obs.oom:
            failed = self._current(bucket)
            self._rows[bucket] = max(1, failed // 2)
            action, reason = "backoff", "oom"
            self._backoffs.setdefault(bucket, []).append(
                {"t": self._now(), "reason": "oom", "from": failed, "to": self._rows[bucket],
                 "ceiling": self._rows[bucket], "pressure": round(obs.pressure, 4), "preemptions": obs.preemptions}
            )
        self._seen.setdefault(bucket, []).append(
            {"t": self._now(), "budget": None, "rows": self._current(bucket), "pressure": round(obs.pressure, 4),
             "throughput": round(obs.throughput, 2), "preemptions": obs.preemptions, "oom": obs.oom,
             "action": action, "reason": reason}
        )

    def limit_rows(self, max_rows: int) -> None:
        """A fixed size is the user's choice: rows beyond the engine's own limit wait in its queue."""

    def backoffs(self, bucket: str) -> list[dict[str, Any]]:
        return list(self._backoffs.get(bucket, []))

    def trajectory(self, bucket: str, steps_from: int = 0) -> dict[str, Any]:
        steps = self._seen.get(bucket, [])
        return {"steps": steps[steps_from:], "backoffs": self.backoffs(bucket), "ceiling": None, "budget": None,
                "peak_pressure": max((x["pressure"] for x in steps), default=0.0)}

    def learned_limits(self) -> dict[str, int]:
        return {}
