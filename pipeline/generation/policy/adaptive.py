"""Adaptive batch sizing: how many tokens each length bucket may have in flight.

Pure Python: no Ray, no vLLM, no GPU. The engine actor asks `rows_for` before
admitting rows and reports each window's outcome with `observe`; the
controller answers with the next budget.

The algorithm
-------------
Each bucket has its own **budget**, counted in tokens: for every row in
flight, its prompt tokens plus `max_new_tokens`. The number of rows a budget
admits is `budget // tokens_per_row`, and never less than one.

1. **Start.** If the engine reports its KV-cache capacity C (tokens), a bucket
   starts at `start_fraction` (0.9) of C, i.e. about 0.9 x C / tokens-per-row
   rows. Otherwise it starts small (`small_start_rows` rows). A learned limit
   from an earlier run, or an explicit `initial_budget_tokens`, wins over both.
2. **Grow.** After each window (one budget's worth of completed rows) the
   controller sees the peak memory pressure p (0..1) and the throughput. While
   doubling would stay under the target (2p <= target) and throughput still
   improves (by more than `plateau_gain` per doubling over the mean at the
   last smaller budget), it doubles the budget; when doubling stops paying it
   holds (a plateau: the engine is compute-bound, and more rows would only
   add latency). Near the target (2p > target) it creeps up additively: half
   the way to the budget at which the target would be reached were pressure in
   proportion to the budget (B x target / p), and at least `creep_fraction` of
   the budget at which creeping began. Memory, not one window's noisy
   throughput, decides the last steps. Pressure with a fixed part (the weights,
   for an engine that allocates as it goes) grows slower than in proportion, so
   the half-way step never aims past the target; from 0.6 it takes 4 windows to
   the band, not 7 (a GPU check on an H200 ran out of rows on the way).
3. **Hold.** At or above the target it holds; well above it (p > target +
   `overshoot`) it shrinks in proportion, to budget x target / p.
4. **Back off.** An out-of-memory error halves the budget (the rows in flight
   are retried). A KV-cache preemption, a soft out-of-memory, multiplies it by
   0.9. Either sets a **ceiling** below the budget that failed, with a safety
   margin of at least 5% (`margin`): a budget that barely fits fails later, on
   a longer row or a fuller cache. Growth never passes the ceiling.
5. **Drain.** A window in which the queue ran dry (the bucket's last rows)
   leaves the budget alone, unless it failed: its low pressure reflects the
   lack of rows, not room to grow.
6. **Floor.** The budget never admits fewer than one row. A row that fails
   alone is the caller's to mark as an error; the controller only reports
   that the floor was reached.

Oscillation bound: once a ceiling is learned, and apart from out-of-memory
halvings (which regrow), every budget lies within [0.9, 1] x the current
ceiling. Growth is capped at the ceiling, and a preemption back-off from a
budget B sets the ceiling to 0.95 B and the budget to 0.9 B, which is 0.947 of
the new ceiling. Ceilings only fall, by at least the margin each time, so the
budget settles at the largest one that causes no back-off.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pipeline.generation.policy.base import Observation

BackoffReason = Literal["oom", "preemption", "overshoot"]


@dataclass(frozen=True)
class ControllerSettings:
    target: float = 0.90
    start_fraction: float = 0.90
    small_start_rows: int = 4
    margin: float = 0.05
    plateau_gain: float = 0.05
    creep_fraction: float = 0.10
    overshoot: float = 0.05
    preemption_factor: float = 0.90
    max_rows: int | None = None  # the engine's own concurrency cap (max_num_seqs)

    def __post_init__(self) -> None:
        if not 0.5 <= self.target <= 0.98:
            raise ValueError(f"memory target must be within [0.5, 0.98], got {self.target}")
        if self.margin < 0.05:
            raise ValueError(f"safety margin must be at least 0.05, got {self.margin}")
        if self.small_start_rows < 1:
            raise ValueError("small_start_rows must be at least 1")


def static_batch_settings(target: float = 0.90, max_rows: int | None = None) -> ControllerSettings:
    """For an engine that pads each batch to its longest prompt (transformers): a new
    bucket's first batch is predicted from a cost per token measured on the batches before
    it, which were shorter, and attention's memory can grow faster than the tokens on long
    padded batches; so the first batch starts at 70% of the capacity rather than 90%, and
    grows from there (an out-of-memory on a GPU halves it, as ever)."""
    return ControllerSettings(target=target, start_fraction=0.70, max_rows=max_rows)


@dataclass
class Step:
    """One point of a bucket's trajectory."""

    t: float
    budget: int
    rows: int
    pressure: float
    throughput: float
    action: str  # start | grow | creep | hold | plateau | shrink | backoff
    reason: str | None = None


@dataclass
class BucketState:
    budget: int
    tokens_per_row: float
    ceiling: int | None = None
    throughput: dict[int, tuple[float, int]] = field(default_factory=dict)  # budget -> (sum, count)
    creep_step: int | None = None
    steps: list[Step] = field(default_factory=list)
    backoffs: list[dict[str, Any]] = field(default_factory=list)


class BatchSizeController:
    """Per-bucket token budgets that grow to the memory target and back off on failure."""

    def __init__(
        self,
        settings: ControllerSettings = ControllerSettings(),
        kv_capacity_tokens: int | Callable[[], int | None] | None = None,
        learned: dict[str, int] | None = None,
        initial_budget_tokens: int | None = None,
        clock: Any = None,
    ):
        self.settings = settings
        self.kv_capacity_tokens = kv_capacity_tokens
        self.learned = dict(learned or {})
        self.initial_budget_tokens = initial_budget_tokens
        self.buckets: dict[str, BucketState] = {}
        # The engine's own concurrency cap; it can fall if the engine is rebuilt smaller.
        self.max_rows = settings.max_rows
        self._clock = clock or time.monotonic
        self._t0 = self._clock()

    # -- what the actor asks ---------------------------------------------------

    def _start_budget(self, bucket: str, tokens_per_row: float) -> tuple[int, str]:
        if bucket in self.learned:
            return self.learned[bucket], "learned"
        if self.initial_budget_tokens is not None:
            return self.initial_budget_tokens, "configured"
        capacity = self.kv_capacity_tokens() if callable(self.kv_capacity_tokens) else self.kv_capacity_tokens
        if capacity:
            # An engine that learns its capacity as it runs (transformers: memory per token,
            # measured on the buckets before) gives each new bucket its first batch from it.
            return int(self.settings.start_fraction * capacity), "kv_capacity"
        return int(self.settings.small_start_rows * tokens_per_row), "small"

    def state(self, bucket: str, tokens_per_row: float) -> BucketState:
        s = self.buckets.get(bucket)
        if s is None:
            budget, how = self._start_budget(bucket, tokens_per_row)
            s = BucketState(budget=max(budget, int(tokens_per_row)), tokens_per_row=tokens_per_row)
            if bucket in self.learned:
                s.ceiling = self.learned[bucket]
            self.buckets[bucket] = s
            s.steps.append(Step(self._now(), s.budget, self._rows(s), 0.0, 0.0, "start", how))
        return s

    def _rows(self, s: BucketState, tokens_per_row: float | None = None) -> int:
        rows = max(1, int(s.budget // max(tokens_per_row or s.tokens_per_row, 1.0)))
        if self.max_rows is not None:
            rows = min(rows, self.max_rows)
        return rows

    def budget(self, bucket: str, tokens_per_row: float) -> int:
        """Tokens `bucket` may have in flight (prompt + max new tokens per row)."""
        return self.state(bucket, tokens_per_row).budget

    def rows_for(self, bucket: str, tokens_per_row: float) -> int:
        """Rows the budget admits; at least one, so no bucket ever starves."""
        return self._rows(self.state(bucket, tokens_per_row), tokens_per_row)

    # -- what the actor reports ------------------------------------------------

    def _now(self) -> float:
        return round(self._clock() - self._t0, 4)

    def _cap(self, s: BucketState, budget: float) -> int:
        if s.ceiling is not None:
            budget = min(budget, s.ceiling)
        return max(int(budget), int(s.tokens_per_row))

    def _backoff(self, s: BucketState, factor: float, reason: BackoffReason, obs: Observation) -> None:
        failed = s.budget
        s.ceiling = min(s.ceiling or failed, int(failed * (1 - self.settings.margin)))
        s.budget = self._cap(s, failed * factor)
        s.creep_step = None
        s.backoffs.append(
            {"t": self._now(), "reason": reason, "from": failed, "to": s.budget, "ceiling": s.ceiling,
             "pressure": round(obs.pressure, 4), "preemptions": obs.preemptions}
        )

    def _gain(self, s: BucketState, throughput: float) -> float | None:
        """Throughput now over the mean at the last smaller budget, per doubling of
        budget (log scale), so a 10% creep is not asked for a doubling's gain.
        None when there is nothing smaller to compare with."""
        smaller = [b for b in s.throughput if b < s.budget]
        if not smaller:
            return None
        prev = max(smaller)
        total, count = s.throughput[prev]
        base = total / count
        doublings = math.log2(s.budget / prev)
        if base <= 0 or doublings < 1 / 16:  # budgets within 4% of each other: nothing to tell apart
            return None
        if throughput <= 0:
            return -1.0
        # In logs, clamped: a ratio raised to 1/doublings overflowed a float (CI, 2026-12-02).
        return math.exp(min(math.log(throughput / base) / doublings, 20.0)) - 1

    def observe(self, bucket: str, obs: Observation) -> None:
        """Update `bucket`'s budget from one window's outcome."""
        s = self.buckets[bucket]
        cfg = self.settings
        if obs.tokens_per_row:
            s.tokens_per_row = obs.tokens_per_row
        before = s.budget
        action, reason = "hold", None
        if obs.oom:
            self._backoff(s, 0.5, "oom", obs)
            action, reason = "backoff", "oom"
        elif obs.preemptions > 0:
            self._backoff(s, cfg.preemption_factor, "preemption", obs)
            action, reason = "backoff", "preemption"
        elif obs.drained:
            action, reason = "hold", "drain"
        elif obs.pressure > cfg.target + cfg.overshoot:
            self._backoff(s, cfg.target / obs.pressure, "overshoot", obs)
            action, reason = "shrink", "overshoot"
        elif obs.pressure < cfg.target:
            gain = self._gain(s, obs.throughput)
            at_ceiling = s.ceiling is not None and s.budget >= s.ceiling
            at_row_cap = self.max_rows is not None and self._rows(s) >= self.max_rows
            if at_ceiling or at_row_cap:
                action, reason = "hold", "ceiling" if at_ceiling else "max_rows"
            elif obs.pressure * 2 <= cfg.target:
                # Far from the target: double, while doubling still pays.
                if gain is None or gain > cfg.plateau_gain:
                    s.budget = self._cap(s, s.budget * 2)
                    action = "grow"
                else:
                    action, reason = "plateau", f"gain {gain:.1%} per doubling"
            else:
                # Near the target: creep up additively.
                s.creep_step = s.creep_step or max(int(s.budget * cfg.creep_fraction), int(s.tokens_per_row))
                half_way = int(s.budget * (cfg.target / obs.pressure - 1) / 2)
                s.budget = self._cap(s, s.budget + max(s.creep_step, half_way))
                action = "creep"
        if not obs.drained:
            total, count = s.throughput.get(before, (0.0, 0))
            s.throughput[before] = (total + obs.throughput, count + 1)
        s.steps.append(Step(self._now(), s.budget, self._rows(s), round(obs.pressure, 4),
                            round(obs.throughput, 2), action, reason))

    # -- what the run keeps ----------------------------------------------------

    def limit_rows(self, max_rows: int) -> None:
        self.max_rows = min(self.max_rows or max_rows, max_rows)

    def learned_limits(self) -> dict[str, int]:
        """Per-bucket budgets the next run can start from: the ceiling where one
        was learned, else the budget reached."""
        return {b: (s.ceiling if s.ceiling is not None else s.budget) for b, s in self.buckets.items()}

    def backoffs(self, bucket: str) -> list[dict[str, Any]]:
        s = self.buckets.get(bucket)
        return list(s.backoffs) if s is not None else []

    def trajectory(self, bucket: str, steps_from: int = 0) -> dict[str, Any]:
        s = self.buckets.get(bucket)
        if s is None:
            return {"steps": [], "backoffs": [], "ceiling": None, "budget": None, "peak_pressure": 0.0}
        return {
            "steps": [asdict(x) for x in s.steps[steps_from:]],  # once each, not every call's
            "backoffs": list(s.backoffs),
            "ceiling": s.ceiling,
            "budget": s.budget,
            "peak_pressure": max((x.pressure for x in s.steps), default=0.0),
        }
