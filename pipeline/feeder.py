"""Keep one engine fed with one bucket's rows, within the batch policy's budget.

Rows are admitted as others finish, so the engine never idles while the last
straggler of a batch completes: whenever a request finishes, the freed budget
goes to the next row in the queue. Work is observed in *windows*: a window
closes once as many rows have completed as the policy admitted when it
opened, and its peak memory pressure, preemptions and throughput go to the
policy, which answers with the next budget. A window is the adaptive
equivalent of one batch.

Out-of-memory during generation (a CUDA OOM in-process, or the engine core
dying, which is how an OOM in vLLM's separate engine process surfaces) aborts
the requests in flight, puts their rows back at the head of the queue, halves
the budget through the policy, and, if the engine died, rebuilds it smaller.
Any other failure of a step is blamed on one request: the rows in flight are
retried in halves (bisection) until the culprit runs alone. A row that fails
alone gets an error; no row is ever dropped.
"""

from __future__ import annotations

import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pipeline.batching import BatchPolicy
from pipeline.config import DebugConfig, SamplingConfig
from pipeline.controller import Observation
from pipeline.engine import Completion, VLLMEngine, is_engine_oom
from pipeline.memory import MemoryProbe


class InjectedOutOfMemory(MemoryError):
    """Raised by fault injection in place of torch's OutOfMemoryError."""


class FaultInjector:
    """`debug.inject_oom_at_batch=N`: an out-of-memory in the N-th window (once).

    `oom` raises in this process, as a CUDA allocation failure would; `engine_death`
    kills the engine core with SIGKILL, so vLLM itself raises EngineDeadError.
    """

    def __init__(self, debug: DebugConfig):
        self.at = debug.inject_oom_at_batch
        self.kind = debug.inject_oom_kind
        self.fired = False

    def check(self, window: int, engine: VLLMEngine) -> None:
        if self.fired or self.at is None or window < self.at:
            return
        self.fired = True
        if self.kind == "engine_death":
            for pid in engine.core_pids():
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)  # let vLLM notice before the next step
            return
        raise InjectedOutOfMemory(f"CUDA out of memory (injected at batch {window})")


@dataclass
class _Window:
    number: int
    opened: float
    rows_target: int
    preemptions_at_open: int
    peak_pressure: float = 0.0
    done: int = 0
    output_tokens: int = 0
    cost: int = 0
    drained: bool = False


@dataclass
class _InFlight:
    position: int
    ids: list[int]
    cost: int
    first_submitted: float


@dataclass
class FeederTotals:
    """Across every call of one actor: what the busy fraction is made of."""

    busy_s: float = 0.0  # time with at least one request in flight
    step_s: float = 0.0  # time inside engine steps (the rest of busy_s is this loop's own work)
    first_start: float | None = None
    last_end: float | None = None
    windows: int = 0
    oom_retries: int = 0
    bisections: int = 0

    def busy_fraction(self) -> float | None:
        if self.first_start is None or self.last_end is None or self.last_end <= self.first_start:
            return None
        return min(1.0, self.busy_s / (self.last_end - self.first_start))


@dataclass
class ServeResult:
    completions: dict[int, Completion]
    record: dict[str, Any] = field(default_factory=dict)


class EngineFeeder:
    def __init__(
        self,
        engine: VLLMEngine,
        policy: BatchPolicy,
        sampling: SamplingConfig,
        feed: str = "continuous",
        debug: DebugConfig | None = None,
    ):
        self.engine = engine
        self.policy = policy
        self.sampling = sampling
        self.params = engine.sampling_params(sampling)
        self.feed = feed
        self.probe = MemoryProbe(kv_gauges=lambda: self.engine.kv_gauges(), preallocated=True)
        self.faults = FaultInjector(debug or DebugConfig())
        self.totals = FeederTotals()

    def _preemptions(self) -> int:
        return self.engine.kv_gauges()[1]

    def serve(self, bucket: str, rows: list[tuple[int, list[int]]], params: Any = None,
              max_new_tokens: int | None = None) -> ServeResult:
        """Generate for `rows` (position, prompt token ids), all of one bucket.

        `params` (with `max_new_tokens`, what they allow) replace the job's
        sampling for this call: annotations use their own."""
        started = time.monotonic()
        if self.totals.first_start is None:
            self.totals.first_start = started
        own_params = params is None
        max_new = self.sampling.max_new_tokens if own_params else (max_new_tokens or self.sampling.max_new_tokens)
        queue = deque((pos, ids, len(ids) + max_new) for pos, ids in rows)
        tokens_per_row = sum(c for _, _, c in queue) / max(len(queue), 1)
        first_submit: dict[int, float] = {}
        results: dict[int, Completion] = {}
        in_flight: dict[str, _InFlight] = {}
        in_flight_cost = 0
        steps = output_tokens = rejected = 0
        busy_s = step_s = 0.0
        # Fill: rows in flight over rows allowed, weighted by time. It is what
        # the busy fraction cannot see: a drained batch's lone straggler keeps
        # the engine "busy" at a fraction of its batch.
        filled = allowed = 0.0
        peak_pressure = peak_kv = 0.0
        preempt_start = self._preemptions()
        before = self.policy.trajectory(bucket)
        trajectory_from, backoffs_from = len(before["steps"]), len(before["backoffs"])
        window = self._open_window(bucket, tokens_per_row)
        mark = time.monotonic()  # since when requests have been in flight
        suspects: set[int] = set()  # rows of a call that failed, being bisected
        isolate = 0

        while queue or in_flight:
            # 1. Admit rows while the budget allows (always at least one in flight).
            budget = self.policy.budget(bucket, tokens_per_row)
            max_rows = self.policy.rows_for(bucket, tokens_per_row)
            if suspects:  # bisecting a failed call: at most half the last failing group
                max_rows = min(max_rows, isolate)
            admit = self.feed == "continuous" or not in_flight
            # The engine runs at most max_num_seqs requests at once and queues the rest
            # itself. When that limit, not the policy's token budget, is what binds, keep
            # its queue stocked with up to as many again: a wave of completions is then
            # replaced inside the engine at once, instead of after a round trip through
            # this process (the core idled for it: 0.73 of raw vLLM's tokens/s at 4k rows).
            engine_limit = getattr(self.engine, "max_num_seqs", None)
            cap = max_rows
            if admit and engine_limit and not suspects and max_rows >= engine_limit and self.feed == "continuous":
                cap = max_rows + engine_limit
            while admit and queue and len(in_flight) < cap and (
                not in_flight or in_flight_cost + queue[0][2] <= budget
            ):
                pos, ids, cost = queue.popleft()
                now = time.monotonic()
                try:
                    request_id = self.engine.submit(ids, self.params if own_params else params)
                except Exception as e:  # the engine refused this prompt alone
                    results[pos] = Completion(None, 0, 0.0, error=f"{type(e).__name__}: {e}")
                    rejected += 1
                    continue
                first_submit.setdefault(pos, now)
                in_flight[request_id] = _InFlight(pos, ids, cost, first_submit[pos])
                in_flight_cost += cost
            if not queue and len(in_flight) < max_rows:
                window.drained = True
            if not in_flight:
                mark = time.monotonic()
                continue

            # 2. One engine step; an out-of-memory puts the rows in flight back.
            step_start = time.monotonic()
            try:
                self.faults.check(window.number, self.engine)
                finished = self.engine.step()
            except Exception as e:
                oom = is_engine_oom(e)
                victims = sorted(in_flight.values(), key=lambda f: f.position)
                self._recover(e, [rid for rid in in_flight])
                in_flight.clear()
                in_flight_cost = 0
                if oom:
                    self.totals.oom_retries += 1
                    self._close_window(bucket, window, tokens_per_row, oom=True)
                else:
                    # Any other failure: one request may be poisoning the call.
                    # Bisect: retry the rows in halves until the culprit runs alone.
                    self.totals.bisections += 1
                    suspects = {v.position for v in victims}
                    isolate = max(1, len(victims) // 2)
                if len(victims) == 1:
                    v = victims[0]
                    reason = "out of memory with this row alone in the engine" if oom else "the engine failed on this row alone"
                    results[v.position] = Completion(
                        None, 0, time.monotonic() - v.first_submitted,
                        error=f"{reason}: {type(e).__name__}: {e}",
                    )
                    suspects.discard(v.position)
                else:
                    for v in reversed(victims):
                        queue.appendleft((v.position, v.ids, v.cost))
                window = self._open_window(bucket, tokens_per_row)
                mark = time.monotonic()  # recovery time is not busy time
                continue
            now = time.monotonic()
            step_s += now - step_start
            busy_s += now - mark
            filled += min(len(in_flight), max_rows) * (now - mark)
            allowed += min(max_rows, len(in_flight) + len(queue)) * (now - mark)
            mark = now
            steps += 1

            # 3. Completions free their share of the budget.
            for request_id, c in finished:
                f = in_flight.pop(request_id)
                in_flight_cost -= f.cost
                results[f.position] = Completion(c.text, c.output_tokens, now - f.first_submitted, c.finish_reason)
                suspects.discard(f.position)
                output_tokens += c.output_tokens
                window.done += 1
                window.output_tokens += c.output_tokens
                window.cost += f.cost

            # 4. Pressure, read after every step: KV usage reads 0 once requests finish.
            reading = self.probe.read()
            window.peak_pressure = max(window.peak_pressure, reading.pressure)
            peak_pressure = max(peak_pressure, reading.pressure)
            peak_kv = max(peak_kv, reading.kv_cache or 0.0)

            # 5. A window closes once it has completed the rows it admitted.
            if window.done >= window.rows_target or not (queue or in_flight):
                self._close_window(bucket, window, window.cost / max(window.done, 1))
                if queue or in_flight:
                    window = self._open_window(bucket, tokens_per_row)

        ended = time.monotonic()
        self.totals.busy_s += busy_s
        self.totals.step_s += step_s
        self.totals.last_end = ended
        traj = self.policy.trajectory(bucket)
        record = {
            "bucket": bucket,
            "rows": len(rows),
            "wall_s": round(ended - started, 4),
            "busy_s": round(busy_s, 4),
            "step_s": round(step_s, 4),
            "fill": round(filled / allowed, 4) if allowed > 0 else None,
            "output_tokens": output_tokens,
            "steps": steps,
            "peak_pressure": round(peak_pressure, 4),
            "peak_kv_cache_usage": round(peak_kv, 4),
            # Clamped: a rebuilt engine starts its counter again from 0.
            "preemptions": max(0, self._preemptions() - preempt_start),
            "rejected": rejected,
            "trajectory": traj["steps"][trajectory_from:],
            "backoffs": traj["backoffs"][backoffs_from:],
        }
        return ServeResult(results, record)

    def _open_window(self, bucket: str, tokens_per_row: float) -> _Window:
        self.totals.windows += 1
        return _Window(
            number=self.totals.windows,
            opened=time.monotonic(),
            rows_target=self.policy.rows_for(bucket, tokens_per_row),
            preemptions_at_open=self._preemptions(),
        )

    def _close_window(self, bucket: str, w: _Window, tokens_per_row: float, oom: bool = False) -> None:
        elapsed = max(time.monotonic() - w.opened, 1e-6)
        self.policy.observe(
            bucket,
            Observation(
                pressure=1.0 if oom else w.peak_pressure,
                throughput=w.output_tokens / elapsed,
                rows=w.done,
                preemptions=0 if oom else max(0, self._preemptions() - w.preemptions_at_open),
                oom=oom,
                tokens_per_row=tokens_per_row,
                drained=w.drained,
            ),
        )

    def _recover(self, error: Exception, request_ids: list[str]) -> None:
        """Make the engine usable again after a failed step."""
        if type(error).__name__ == "EngineDeadError":
            self.engine.rebuild(f"{type(error).__name__}: {error}")
            self.params = self.engine.sampling_params(self.sampling)
            self.policy.max_rows = min(self.policy.max_rows or self.engine.max_num_seqs, self.engine.max_num_seqs)
        else:
            self.engine.abort(request_ids)
