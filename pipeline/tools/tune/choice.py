"""Which batch size to run: sweep points, early stopping and the choice.

Pure Python (numpy and `kneed`): no Ray, no vLLM, no GPU. The sweep driver
measures one `SweepPoint` per batch size on a log2 grid (1, 2, 4, 8, ...),
asks `stop_reason` after each point whether to go on, and hands the points
to `choose`.

Measuring a point
-----------------
Each batch size is measured in at least two windows, and more until the last
two agree within 10% (`repeats_agree`). A point's throughput is the median
over its windows and its `spread` is (max - min) / median.

Stopping early
--------------
After each point, in sweep order, the sweep stops when (first match wins):

1. a point ran out of memory (the OOM is recorded, never chosen);
2. peak memory pressure reached the memory target;
3. throughput gained less than 5% over the best of the three points before
   it while memory pressure rose: more rows buy latency, not tokens. The rule
   waits for three earlier points, so noise at tiny batches cannot end a sweep.

Choosing
--------
Points that ran out of memory are dropped first.

* With `latency_slo_p99_ms`, the largest batch whose P99 latency meets the
  objective wins ("latency-slo"); when none meets it, the smallest batch,
  which comes closest ("slo-unmet").
* Otherwise Kneedle (`kneed.KneeLocator`, concave, increasing) runs on
  (log2 batch, throughput), where throughput is the running maximum: a noisy
  dip cannot bend the curve, so it cannot fake a knee. The first knee wins
  ("knee"; offline mode: on noisy sweeps `online=True` chose no better, and
  the first knee is the lower-latency one): past it a doubling buys little
  throughput and a lot of latency. Kneedle is strict on short sweeps (its
  threshold is one grid step), so smooth curves often have no knee.
* The choice must keep 95% of the best measured throughput. If the knee's own
  measurement falls short, the choice moves up to the smallest batch at or
  above the knee that reaches 95% of the maximum ("within-95%-of-max"), and
  the reason says so.
* With no knee (a straight line in log2 batch, a curve still bending upwards,
  where Kneedle answers with the first point, or a sweep too short: Kneedle
  needs three points, and on exactly three its threshold cannot be crossed),
  the smallest batch within 95% of the maximum wins
  ("within-95%-of-max"); a single point is simply taken ("only-point").
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass

import numpy as np

# A choice keeps at least this share of the best measured throughput.
WITHIN_OF_MAX = 0.95
# Early stop: a point must beat the best of the last three by this much.
MIN_GAIN = 0.05
RULES = ("knee", "within-95%-of-max", "latency-slo", "slo-unmet", "only-point")


@dataclass(frozen=True)
class SweepPoint:
    """One batch size, measured over `repeats` windows."""

    batch: int  # rows in flight
    throughput: float  # output tokens/s, median over the windows
    rows_per_s: float
    p50_ms: float  # per-request latency
    p99_ms: float
    ttft_p50_ms: float | None  # time to first token; None when the engine does not report it
    peak_pressure: float  # peak memory pressure, 0..1
    preemptions: int
    oom: bool = False
    spread: float = 0.0  # (max - min) / median of throughput across windows
    repeats: int = 1

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ValueError(f"SweepPoint.batch must be >= 1, got {self.batch}")
        if self.throughput < 0 or not math.isfinite(self.throughput):
            raise ValueError(f"SweepPoint.throughput must be finite and >= 0, got {self.throughput}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Choice:
    """The batch size chosen for one bucket, beside the best one measured."""

    batch: int
    rule: str  # one of RULES
    reason: str  # a sentence with the numbers behind it
    knee: int | None  # the batch Kneedle found, if any
    best_batch: int  # the batch with the highest measured throughput
    best_throughput: float
    throughput: float  # measured at `batch`
    p99_ms: float  # measured at `batch`

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"Choice.rule must be one of {RULES}, got {self.rule!r}")

    def to_dict(self) -> dict:
        return asdict(self)


def repeats_agree(values: list[float], tolerance: float = 0.10) -> bool:
    """True when the last two windows' values are within `tolerance` of each other
    (relative to the larger). One window or none never agrees."""
    if len(values) < 2:
        return False
    a, b = values[-2], values[-1]
    return abs(a - b) <= tolerance * max(abs(a), abs(b))


def stop_reason(points: list[SweepPoint], memory_target: float) -> str | None:
    """Why the sweep should stop after the last of `points` (in sweep order), or None
    to go on. The rules are in the module docstring."""
    if not points:
        return None
    if oom := next((p for p in points if p.oom), None):
        return f"Batch {oom.batch} ran out of memory; larger batches would too."
    last = points[-1]
    if last.peak_pressure >= memory_target:
        return (f"Peak memory pressure {last.peak_pressure:.2f} at batch {last.batch} "
                f"reached the memory target {memory_target:.2f}.")
    if len(points) >= 4:
        prev = points[-2]
        best = max(points[-4:-1], key=lambda p: p.throughput)
        gain = last.throughput / best.throughput - 1 if best.throughput > 0 else math.inf
        if gain < MIN_GAIN and last.peak_pressure > prev.peak_pressure:
            return (f"Throughput at batch {last.batch} ({last.throughput:.0f} tok/s) gained "
                    f"{gain:+.1%} over the best of the last three points "
                    f"({best.throughput:.0f} tok/s at batch {best.batch}), under {MIN_GAIN:.0%}, "
                    f"while memory pressure rose from {prev.peak_pressure:.2f} to {last.peak_pressure:.2f}.")
    return None


def find_knee(points: list[SweepPoint]) -> int | None:
    """The first Kneedle knee of (log2 batch, running max of throughput), as a batch
    size; None with fewer than three points, a flat curve or no knee. `points` must
    be sorted by batch, without OOMs."""
    if len(points) < 3:
        return None
    x = np.log2([p.batch for p in points])
    y = np.maximum.accumulate([p.throughput for p in points])
    if y[-1] == y[0]:  # flat: Kneedle would divide by zero
        return None
    from kneed import KneeLocator  # imported here so that the CLI starts fast

    with warnings.catch_warnings():  # older kneed warns "No knee/elbow found"
        warnings.simplefilter("ignore")
        knee = KneeLocator(x, y, curve="concave", direction="increasing", online=False).knee
    if knee is None:
        return None
    at = int(np.argmin(np.abs(x - knee)))
    # A "knee" at the smallest batch is Kneedle's answer for a curve still bending
    # upwards there (throughput more than doubling per doubling of the batch, as on
    # CPU); a knee is where gains level off, so that is no knee.
    return None if at == 0 else points[at].batch


def choose(points: list[SweepPoint], latency_slo_p99_ms: float | None = None) -> Choice:
    """The batch size to run for one bucket; the rules are in the module docstring.
    Raises ValueError when every point ran out of memory (or there are none)."""
    usable = sorted((p for p in points if not p.oom), key=lambda p: p.batch)
    if not usable:
        raise ValueError(f"no sweep point without out-of-memory among {len(points)} point(s): "
                         "nothing to choose; lower the smallest batch size or the memory target")
    best = max(usable, key=lambda p: (p.throughput, -p.batch))  # ties: the smaller batch
    floor = WITHIN_OF_MAX * best.throughput
    oom_note = "" if len(usable) == len(points) else (
        f" Out-of-memory points (batch {', '.join(str(p.batch) for p in points if p.oom)}) were excluded.")

    def pick(p: SweepPoint, rule: str, reason: str, knee: int | None = None) -> Choice:
        share = p.throughput / best.throughput if best.throughput > 0 else 1.0
        summary = (f" Batch {p.batch}: {p.throughput:.0f} tok/s ({share:.0%} of the maximum "
                   f"{best.throughput:.0f} tok/s at batch {best.batch}), P99 {p.p99_ms:.0f} ms.")
        return Choice(batch=p.batch, rule=rule, reason=reason + summary + oom_note, knee=knee,
                      best_batch=best.batch, best_throughput=best.throughput,
                      throughput=p.throughput, p99_ms=p.p99_ms)

    # 1. A latency objective overrides throughput.
    if latency_slo_p99_ms is not None:
        meeting = [p for p in usable if p.p99_ms <= latency_slo_p99_ms]
        if meeting:
            p = meeting[-1]
            return pick(p, "latency-slo", f"Batch {p.batch} is the largest whose P99 latency "
                        f"({p.p99_ms:.0f} ms) meets the objective of {latency_slo_p99_ms:.0f} ms.")
        p = usable[0]
        return pick(p, "slo-unmet", f"No batch meets the P99 objective of {latency_slo_p99_ms:.0f} ms "
                    f"(the lowest measured is {min(q.p99_ms for q in usable):.0f} ms); "
                    f"taking the smallest batch, {p.batch}.")
    if len(usable) == 1:
        return pick(usable[0], "only-point", f"Batch {usable[0].batch} is the only point measured "
                    "without running out of memory.")

    # 2. The knee, if it keeps 95% of the maximum.
    knee = find_knee(usable)
    if knee is not None:
        at_knee = next(p for p in usable if p.batch == knee)
        if at_knee.throughput >= floor:
            return pick(at_knee, "knee", f"Kneedle found the knee of throughput against log2 batch "
                        f"at batch {knee}: past it a doubling buys little throughput and more latency.", knee)
        # On the running maximum the knee is never past the best point, so this finds one.
        p = next((q for q in usable if q.batch >= knee and q.throughput >= floor), best)
        return pick(p, "within-95%-of-max", f"Kneedle found the knee at batch {knee}, but its "
                    f"{at_knee.throughput:.0f} tok/s is under {WITHIN_OF_MAX:.0%} of the maximum; "
                    f"moved up to batch {p.batch}, the smallest at or above the knee within "
                    f"{WITHIN_OF_MAX:.0%} of the maximum.", knee)

    # 3. No knee: the smallest batch within 95% of the maximum.
    p = next(q for q in usable if q.throughput >= floor)
    why = ("fewer than three points for Kneedle" if len(usable) < 3
           else "Kneedle found no knee in throughput against log2 batch")
    return pick(p, "within-95%-of-max", f"{why[0].upper()}{why[1:]}; batch {p.batch} is the smallest "
                f"within {WITHIN_OF_MAX:.0%} of the maximum.")
