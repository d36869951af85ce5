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

One call (`serve`) is a `_Call`: admission, one engine step, recovery,
completions and pressure are its separate methods, and the loop in `serve`
reads as those steps in order.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from pipeline.generation.engine import Completion, Engine, EngineDead, Sampling, is_oom
from pipeline.generation.memory import MemoryProbe
from pipeline.generation.policy.base import BatchPolicy, Observation


class CallOutOfMemory(RuntimeError):
    """`stop_on_oom`: the call ran out of memory; the engine is usable again, the rows in
    flight were dropped. For measuring (pipeline tune), where an OOM is a result."""


class InjectedOutOfMemory(MemoryError):
    """Raised by fault injection in place of torch's OutOfMemoryError."""


class FaultInjector:
    """An out-of-memory in the `at`-th window (once), for tests and drills.

    `oom` raises in this process, as a CUDA allocation failure would; `engine_death`
    ends the engine's core abruptly, so the engine itself reports it dead.
    """

    def __init__(self, at: int | None = None, kind: str = "oom"):
        self.at, self.kind = at, kind
        self.fired = False

    def check(self, window: int, engine: Engine) -> None:
        if self.fired or self.at is None or window < self.at:
            return
        self.fired = True
        if self.kind == "engine_death":
            engine.kill_core()
            return
        raise InjectedOutOfMemory(f"CUDA out of memory (injected at batch {window})")


@dataclass
class Request:
    """One row on its way through the engine: what admission, stepping and recovery pass around."""

    position: int
    ids: list[int]
    cost: int  # prompt tokens + max new tokens: its share of the budget
    first_submitted: float | None = None


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


@dataclass(frozen=True)
class CallRecord:
    """What one `serve` call did, for the report: its rows, times, fill and pressure, and
    the policy's trajectory and back-offs during it."""

    bucket: str
    rows: int
    wall_s: float
    busy_s: float  # time with at least one request in flight
    step_s: float  # time inside engine steps
    fill: float | None  # rows in flight over rows allowed, time-weighted
    output_tokens: int
    steps: int
    peak_pressure: float
    peak_kv_cache_usage: float
    preemptions: int
    rejected: int  # prompts the engine refused alone
    trajectory: list[dict[str, Any]]
    backoffs: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ServeResult:
    completions: dict[int, Completion]
    record: CallRecord


class EngineFeeder:
    def __init__(self, engine: Engine, policy: BatchPolicy, feed: str = "continuous",
                 faults: FaultInjector | None = None, stock_engine_queue: bool = True, stop_on_oom: bool = False):
        self.engine = engine
        self.policy = policy
        self.feed = feed
        # Measuring wants exactly the policy's rows in flight, and an OOM as a result.
        self.stock_engine_queue = stock_engine_queue
        self.stop_on_oom = stop_on_oom
        self.probe = MemoryProbe(kv_gauges=lambda: self.engine.kv_gauges(), preallocated=True)
        self.faults = faults or FaultInjector()
        self.totals = FeederTotals()

    def preemptions(self) -> int:
        return self.engine.kv_gauges()[1]

    def serve(self, bucket: str, rows: list[tuple[int, list[int]]], sampling: Sampling) -> ServeResult:
        """Generate for `rows` (position, prompt token ids), all of one bucket, with `sampling`."""
        call = _Call(self, bucket, rows, sampling)
        while call.queue or call.in_flight:
            call.admit()
            if not call.in_flight:
                call.mark = time.monotonic()
                continue
            step_start = time.monotonic()
            try:
                self.faults.check(call.window.number, self.engine)
                finished = self.engine.step()
            except Exception as e:
                call.recover(e)
                continue
            call.stepped(step_start)
            call.complete(finished)
            call.read_pressure()
            call.close_window_if_done()
        return call.result()

    def open_window(self, bucket: str, tokens_per_row: float) -> _Window:
        self.totals.windows += 1
        return _Window(number=self.totals.windows, opened=time.monotonic(),
                       rows_target=self.policy.rows_for(bucket, tokens_per_row),
                       preemptions_at_open=self.preemptions())

    def close_window(self, bucket: str, w: _Window, tokens_per_row: float, oom: bool = False) -> None:
        elapsed = max(time.monotonic() - w.opened, 1e-6)
        self.policy.observe(bucket, Observation(
            pressure=1.0 if oom else w.peak_pressure,
            throughput=w.output_tokens / elapsed,
            rows=w.done,
            preemptions=0 if oom else max(0, self.preemptions() - w.preemptions_at_open),
            oom=oom,
            tokens_per_row=tokens_per_row,
            drained=w.drained,
        ))

    def restore(self, error: Exception, request_ids: list[str]) -> None:
        """Make the engine usable again after a failed step."""
        if restore_engine(self.engine, error, request_ids):
            self.policy.limit_rows(self.engine.max_num_seqs)


def restore_engine(engine: Engine, error: Exception, request_ids: list[str]) -> bool:
    """After a failed step: rebuild a dead engine (True), else abort what was in flight.
    The one recovery path, for the feeder and `pipeline tune` alike."""
    if isinstance(error, EngineDead):
        engine.rebuild(str(error))
        return True
    engine.abort(request_ids)
    return False


class _Call:
    """The state of one `serve` call: its queue, what is in flight, its measurements."""

    def __init__(self, feeder: EngineFeeder, bucket: str, rows: list[tuple[int, list[int]]], sampling: Sampling):
        self.feeder, self.bucket, self.sampling = feeder, bucket, sampling
        self.started = time.monotonic()
        totals = feeder.totals
        if totals.first_start is None:
            totals.first_start = self.started
        self.rows = len(rows)
        self.queue: deque[Request] = deque(
            Request(pos, ids, len(ids) + sampling.max_new_tokens) for pos, ids in rows)
        self.tokens_per_row = sum(r.cost for r in self.queue) / max(len(self.queue), 1)
        self.results: dict[int, Completion] = {}
        self.in_flight: dict[str, Request] = {}
        self.in_flight_cost = 0
        self.steps = self.output_tokens = self.rejected = 0
        self.busy_s = self.step_s = 0.0
        # Fill: rows in flight over rows allowed, weighted by time. It is what
        # the busy fraction cannot see: a drained batch's lone straggler keeps
        # the engine "busy" at a fraction of its batch.
        self.filled = self.allowed = 0.0
        self.peak_pressure = self.peak_kv = 0.0
        self.preempt_start = feeder.preemptions()
        before = feeder.policy.trajectory(bucket)
        self.trajectory_from, self.backoffs_from = len(before["steps"]), len(before["backoffs"])
        self.window = feeder.open_window(bucket, self.tokens_per_row)
        self.mark = time.monotonic()  # since when requests have been in flight
        self.suspects: set[int] = set()  # rows of a call that failed, being bisected
        self.isolate = 0
        self.max_rows = 1

    # 1. Admission ------------------------------------------------------------------

    def admit(self) -> None:
        """Submit rows while the budget allows (always at least one in flight)."""
        policy, engine, feed = self.feeder.policy, self.feeder.engine, self.feeder.feed
        budget = policy.budget(self.bucket, self.tokens_per_row)
        self.max_rows = policy.rows_for(self.bucket, self.tokens_per_row)
        if self.suspects:  # bisecting a failed call: at most half the last failing group
            self.max_rows = min(self.max_rows, self.isolate)
        admit = feed == "continuous" or not self.in_flight
        # The engine runs at most max_num_seqs requests at once and queues the rest
        # itself. When that limit, not the policy's token budget, is what binds, keep
        # its queue stocked with up to as many again: a wave of completions is then
        # replaced inside the engine at once, instead of after a round trip through
        # this process (the core idled for it: 0.73 of raw vLLM's tokens/s at 4k rows).
        cap = self.max_rows
        if (admit and not self.suspects and self.max_rows >= engine.max_num_seqs and feed == "continuous"
                and self.feeder.stock_engine_queue):
            cap = self.max_rows + engine.max_num_seqs
        while admit and self.queue and len(self.in_flight) < cap and (
            not self.in_flight or self.in_flight_cost + self.queue[0].cost <= budget
        ):
            self._submit(self.queue.popleft())
        if not self.queue and len(self.in_flight) < self.max_rows:
            self.window.drained = True

    def _submit(self, r: Request) -> None:
        now = time.monotonic()
        try:
            request_id = self.feeder.engine.submit(r.ids, self.sampling)
        except Exception as e:  # the engine refused this prompt alone
            self.results[r.position] = Completion(None, 0, 0.0, error=f"{type(e).__name__}: {e}")
            self.rejected += 1
            return
        if r.first_submitted is None:
            r.first_submitted = now
        self.in_flight[request_id] = r
        self.in_flight_cost += r.cost

    # 2. Recovery from a failed step ---------------------------------------------------

    def recover(self, error: Exception) -> None:
        """An out-of-memory puts the rows in flight back and shrinks the budget; any other
        failure bisects them, until a row that fails alone gets the error."""
        feeder = self.feeder
        oom = is_oom(error)
        victims = sorted(self.in_flight.values(), key=lambda r: r.position)
        feeder.restore(error, list(self.in_flight))
        self.in_flight.clear()
        self.in_flight_cost = 0
        if oom and feeder.stop_on_oom:
            raise CallOutOfMemory(f"{type(error).__name__}: {error}") from error
        if oom:
            feeder.totals.oom_retries += 1
            feeder.close_window(self.bucket, self.window, self.tokens_per_row, oom=True)
        else:
            # One request may be poisoning the call: retry in halves until it runs alone.
            feeder.totals.bisections += 1
            self.suspects = {v.position for v in victims}
            self.isolate = max(1, len(victims) // 2)
        if len(victims) == 1:
            v = victims[0]
            reason = "out of memory with this row alone in the engine" if oom else "the engine failed on this row alone"
            self.results[v.position] = Completion(
                None, 0, time.monotonic() - (v.first_submitted or self.started),
                error=f"{reason}: {type(error).__name__}: {error}",
            )
            self.suspects.discard(v.position)
        else:
            self.queue.extendleft(reversed(victims))
        self.window = feeder.open_window(self.bucket, self.tokens_per_row)
        self.mark = time.monotonic()  # recovery time is not busy time

    # 3. A step that went through --------------------------------------------------------

    def stepped(self, step_start: float) -> None:
        now = time.monotonic()
        self.step_s += now - step_start
        self.busy_s += now - self.mark
        self.filled += min(len(self.in_flight), self.max_rows) * (now - self.mark)
        self.allowed += min(self.max_rows, len(self.in_flight) + len(self.queue)) * (now - self.mark)
        self.mark = now
        self.steps += 1

    def complete(self, finished: list[tuple[str, Completion]]) -> None:
        """Completions free their share of the budget."""
        now = time.monotonic()
        for request_id, c in finished:
            r = self.in_flight.pop(request_id)
            self.in_flight_cost -= r.cost
            self.results[r.position] = Completion(c.text, c.output_tokens, now - (r.first_submitted or now),
                                                  c.finish_reason, first_token_s=c.first_token_s, finished_at=now)
            self.suspects.discard(r.position)
            self.output_tokens += c.output_tokens
            self.window.done += 1
            self.window.output_tokens += c.output_tokens
            self.window.cost += r.cost

    def read_pressure(self) -> None:
        """Read after every step: KV usage reads 0 once requests finish."""
        reading = self.feeder.probe.read()
        self.window.peak_pressure = max(self.window.peak_pressure, reading.pressure)
        self.peak_pressure = max(self.peak_pressure, reading.pressure)
        self.peak_kv = max(self.peak_kv, reading.kv_cache or 0.0)

    def close_window_if_done(self) -> None:
        """A window closes once it has completed the rows it admitted."""
        w = self.window
        if w.done >= w.rows_target or not (self.queue or self.in_flight):
            self.feeder.close_window(self.bucket, w, w.cost / max(w.done, 1))
            if self.queue or self.in_flight:
                self.window = self.feeder.open_window(self.bucket, self.tokens_per_row)

    # 4. What the call did --------------------------------------------------------------

    def result(self) -> ServeResult:
        feeder = self.feeder
        ended = time.monotonic()
        feeder.totals.busy_s += self.busy_s
        feeder.totals.step_s += self.step_s
        feeder.totals.last_end = ended
        traj = feeder.policy.trajectory(self.bucket)
        record = CallRecord(
            bucket=self.bucket,
            rows=self.rows,
            wall_s=round(ended - self.started, 4),
            busy_s=round(self.busy_s, 4),
            step_s=round(self.step_s, 4),
            fill=round(self.filled / self.allowed, 4) if self.allowed > 0 else None,
            output_tokens=self.output_tokens,
            steps=self.steps,
            peak_pressure=round(self.peak_pressure, 4),
            peak_kv_cache_usage=round(self.peak_kv, 4),
            # Clamped: a rebuilt engine starts its counter again from 0.
            preemptions=max(0, feeder.preemptions() - self.preempt_start),
            rejected=self.rejected,
            trajectory=traj["steps"][self.trajectory_from:],
            backoffs=traj["backoffs"][self.backoffs_from:],
        )
        return ServeResult(self.results, record)
