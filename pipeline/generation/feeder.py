"""Keep one engine fed with one bucket's rows, within the batch policy's budget.

Rows are admitted as others finish, so the engine never idles while the last
straggler of a batch completes: whenever a request finishes, the freed budget
goes to the next row in the queue. Work is observed in *windows*: a window
closes once as many rows have completed as the policy admitted when it
opened, and its peak memory pressure, preemptions and throughput go to the
policy, which answers with the next budget. A window is the adaptive
equivalent of one batch.

Out-of-memory during generation (a CUDA OOM in-process, or the engine core
dying of one, which is how an OOM in vLLM's separate engine process surfaces)
aborts the requests in flight, puts their rows back at the head of the queue,
halves the budget through the policy, and, if the engine died, rebuilds it
smaller. An engine core that dies of anything else (a crash, a kill) is not an
OOM: the feeder raises `EngineCrashed` to every open call, and the actor is
started afresh with their rows (see `pipeline.stages.lifeline`).
Any other failure of a step is blamed on one request: the rows in flight are
retried in halves (bisection) until the culprit runs alone. A row that fails
alone gets an error; no row is ever dropped.

Several calls may be open at once, from several threads (the generate stage
runs a few Ray Data batches per actor at a time). Fed `mixed` (the job's
default), rows go in a row at a time across them, each call's spread over
the admissions of `mix_span` calls and the oldest ending first, so a long
bucket's prompts reach the engine spread among short ones; fed
`continuous`, one call's rows after another's, the bucket the engine runs
first. Either way the next call's rows take the room the last wave of the
others leaves, so a block boundary, or a bucket boundary, costs no drain.
Each call (`serve`) is a `_Call` with its own rows, window and record;
admission, one engine step, recovery and completions are the feeder's
separate methods, and the loop in `_drive` reads as those steps in order.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from typing import Any

from pipeline.generation.engine import Completion, Engine, EngineCrashed, EngineDead, PaddingTotals, Sampling, is_oom
from pipeline.generation.memory import MemoryProbe
from pipeline.generation.policy.base import BatchPolicy, Observation


# Fed `mixed`, each call's rows are spread over the admissions of this many calls: the
# blocks an engine actor serves at once (`batching.concurrent_batches`, 8 by default; the
# job passes its own).
MIX_SPAN = 8.0


class CallOutOfMemory(RuntimeError):
    """`stop_on_oom`: the call ran out of memory; the engine is usable again, the rows in
    flight were dropped. For measuring (pipeline tune), where an OOM is a result."""


class InjectedOutOfMemory(MemoryError):
    """Raised by fault injection in place of torch's OutOfMemoryError."""


class FaultInjector:
    """A fault in the `at`-th window (once), and any number more (`then`: (window, kind)
    each, once each, in window order), for tests and drills.

    `oom` raises in this process, as a CUDA allocation failure would;
    `engine_oom_death` ends the engine's core as if it had run out of memory, so the
    engine itself reports it dead of memory; `engine_crash` ends it with no cause.
    A fault is due from its window on, and fires at the first step of a window at least
    that late with two rows or more in flight (the feeder checks before each step), on
    every machine whatever its speed: with one row alone it would fail that row, as the
    out-of-memory of a row alone does, where a drill means to show the rows retried.
    `fired` records each one (window, kind, time) for the report, so a drill's test can
    tell a fault that never fired from a recovery that failed.
    """

    def __init__(self, at: int | None = None, kind: str = "oom", then: tuple[tuple[int, str], ...] = ()):
        self.pending = sorted(([(at, kind)] if at is not None else []) + list(then))
        self.fired: list[dict[str, Any]] = []

    def check(self, window: int, engine: Engine, rows_in_flight: int) -> None:
        if not self.pending or window < self.pending[0][0] or rows_in_flight < 2:
            return
        kind = self.pending[0][1]
        if kind in ("engine_oom_death", "engine_crash"):
            # Once a core process was found and ended: a drill that found none (the core
            # run in this process) tries again at the next step.
            if engine.kill_core(memory=kind == "engine_oom_death"):
                self._fire(window, kind)
            return
        self._fire(window, kind)
        raise InjectedOutOfMemory(f"CUDA out of memory (injected at batch {window})")

    def _fire(self, window: int, kind: str) -> None:
        self.pending.pop(0)
        self.fired.append({"window": window, "kind": kind, "at": round(time.time(), 3)})


@dataclass
class Request:
    """One row on its way through the engine: what admission, stepping and recovery pass around."""

    position: int
    ids: list[int]
    cost: int  # prompt tokens + max new tokens: its share of the budget
    first_submitted: float | None = None


class InFlight:
    """What the engine is running: each request id's call and request, with their total
    cost in tokens and each call's count, kept here and nowhere else."""

    def __init__(self) -> None:
        self._items: dict[str, tuple[_Call, Request]] = {}
        self._per_call: Counter[int] = Counter()
        self.cost = 0

    def add(self, request_id: str, call: _Call, r: Request) -> None:
        self._items[request_id] = (call, r)
        self._per_call[id(call)] += 1
        self.cost += r.cost

    def get(self, request_id: str) -> tuple[_Call, Request] | None:
        return self._items.get(request_id)

    def pop(self, request_id: str) -> tuple[_Call, Request]:
        call, r = self._items.pop(request_id)
        self._per_call[id(call)] -= 1
        if not self._per_call[id(call)]:
            del self._per_call[id(call)]  # a long run opens thousands of calls
        self.cost -= r.cost
        return call, r

    def clear(self) -> None:
        self._items.clear()
        self._per_call.clear()
        self.cost = 0

    def of(self, call: _Call) -> int:
        """The call's rows among those in flight."""
        return self._per_call[id(call)]

    def ids(self) -> list[str]:
        return list(self._items)

    def entries(self) -> list[tuple[_Call, Request]]:
        return list(self._items.values())

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class _Window:
    number: int
    opened: float
    rows_target: int
    preemptions_at_open: int
    preempted: int = 0  # of this call's rows, where the engine says which were preempted
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
    calls: int = 0
    padding: PaddingTotals = field(default_factory=PaddingTotals)  # a padding engine's, by bucket
    requests: int = 0  # rows served by every call: annotations and map-reduce levels too
    output_tokens: int = 0
    serving_s: float = 0.0  # time with at least one call waiting on this engine; the rest waited for input
    # As each request finishes, for live progress (the two above count at each call's end):
    finished_requests: int = 0
    finished_output_tokens: int = 0

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
    started_at: float | None = None  # Unix time the engine began serving the call

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ServeResult:
    completions: dict[int, Completion]
    record: CallRecord


class EngineFeeder:
    """Keeps one engine fed. `serve` may be called from several threads at once (the
    generate stage runs a few Ray Data batches per actor concurrently): the calls share
    the engine (`feed`: how, see the module's docstring), and one calling thread at a
    time drives it. The next call's rows fill the room the finishing rows leave, so
    consecutive blocks of a bucket, and the first rows of the next bucket, keep the
    engine full instead of costing a drain and a part-full start each. Each call still
    sees only its own rows: an engine call stays bucket-pure."""

    def __init__(self, engine: Engine, policy: BatchPolicy, feed: str = "continuous",
                 faults: FaultInjector | None = None, stock_engine_queue: bool = True, stop_on_oom: bool = False,
                 mix_span: float = MIX_SPAN):
        self.engine = engine
        self.policy = policy
        self.feed = feed
        self.mix_span = mix_span
        # Measuring wants exactly the policy's rows in flight, and an OOM as a result.
        self.stock_engine_queue = stock_engine_queue
        self.stop_on_oom = stop_on_oom
        self.probe = MemoryProbe(kv_gauges=lambda: self.engine.kv_gauges(), preallocated=True)
        self.faults = faults or FaultInjector()
        self.totals = FeederTotals()
        self._cv = threading.Condition()
        self._calls: list[_Call] = []  # open calls, oldest first
        self._opened = 0  # calls opened so far: each call's place in the mixed feed's order
        self._driving = False
        self._serving_since: float | None = None
        self.in_flight = InFlight()  # shared by the open calls: what the engine is running
        self._mark = time.monotonic()  # since when requests have been in flight
        self._bucket: str | None = None  # the bucket whose rows the engine is running
        # Each policy step and preemption goes to the report once, with the call that ends next.
        self._trajectory_seen: dict[str, tuple[int, int]] = {}
        # From the engine's count now: the first call's preemptions are its own, not lost.
        self._preemptions_seen = self.preemptions()
        # Whether the engine says which requests it preempted (then each preemption is
        # charged to the window of the call whose row it hit, not to every open window).
        self._attributed = self.engine.preempted() is not None
        self._step_started: float | None = None  # while a step runs: when it began (the stall watchdog reads it)

    def preemptions(self) -> int:
        return self.engine.kv_gauges()[1]

    def admission_cost(self, r: Request) -> int:
        """Tokens in flight once `r` is admitted. An engine that pads its batches (static
        batches: `pads_batches`) runs every row at the batch's longest, so there the batch
        costs its rows times its longest row: a long row admitted into short ones costs
        what its padding makes of them."""
        if not self.engine.pads_batches:
            return self.in_flight.cost + r.cost
        return (len(self.in_flight) + 1) * max(r.cost, max((q.cost for _, q in self.in_flight.entries()), default=0))

    def open_calls(self) -> list[tuple[str, int, int]]:
        """(bucket, rows in flight, rows allowed) of each open call, oldest first: a moment's
        view, safe to read from another thread."""
        with self._cv:
            return [(c.bucket, c.in_flight, c.max_rows) for c in self._calls]

    def stalled_s(self) -> float:
        """How long the engine step now running has run; 0 between steps."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    def serve(self, bucket: str, rows: list[tuple[int, list[int]]], sampling: Sampling) -> ServeResult:
        """Generate for `rows` (position, prompt token ids), all of one bucket, with `sampling`."""
        call = _Call(self, bucket, rows, sampling)
        with self._cv:
            if not self._calls:
                self._serving_since = time.monotonic()
            call.seq = self._opened
            self._opened += 1
            self._calls.append(call)
            while not call.done and self._driving:
                self._cv.wait()
            drive = not call.done
            self._driving = self._driving or drive
        if drive:
            try:
                self._drive(call)
            except BaseException as e:
                self._fail_open_calls(e)
                raise
            finally:
                with self._cv:
                    self._driving = False
                    self._cv.notify_all()
        if call.failure is not None:
            raise call.failure
        assert call.outcome is not None
        return call.outcome

    def _drive(self, mine: _Call) -> None:
        """Step the engine for every open call until `mine` is done."""
        while not mine.done:
            with self._cv:
                calls = list(self._calls)
            try:
                self._admit(calls)
            except EngineDead as e:  # the core died between steps: as a failed step
                self._recover(e, calls)
                continue
            if not self.in_flight:
                self._mark = time.monotonic()
                self._finish(calls)
                continue
            padding = self.engine.padding
            before = (padding.padded, padding.real) if padding is not None else None
            step_start = self._step_started = time.monotonic()
            try:
                self.faults.check(self.totals.windows, self.engine, len(self.in_flight))
                finished = self.engine.step()
            except Exception as e:
                # The step is over: a recovery's rebuild (an engine's whole start) is no stall.
                self._step_started = None
                self._recover(e, calls)
                continue
            finally:
                self._step_started = None
            if padding is not None and before is not None:  # the batch was the oldest call's bucket
                bucket = next((c.bucket for c in calls if c.in_flight), "unknown")
                self.totals.padding.add(*padding.since(*before), bucket=bucket)
            self._stepped(step_start, calls)
            self._charge_preemptions()
            self._complete(finished)
            reading = self.probe.read()  # after every step: KV usage reads 0 once requests finish
            for c in calls:
                c.read_pressure(reading.pressure, reading.kv_cache or 0.0)
                c.close_window_if_done()
            self._finish(calls)

    # 1. Admission: the oldest call first --------------------------------------------

    def _admit(self, calls: list[_Call]) -> None:
        for c in calls:
            c.begin()
        idle = not self.in_flight
        bisecting = [c for c in calls if c.suspects][:1]
        if self.feed == "mixed" and not bisecting:
            self._admit_mixed(self._bucket_first(calls))
        else:
            for c in bisecting or self._bucket_first(calls):
                if not c.admit():
                    break  # its next row does not fit: later calls wait their turn
        if idle:
            self._mark = time.monotonic()  # busy from the first row in, not from the last call out
        for c in calls:
            # A call whose last rows are in, fewer than its bucket may have: its window says
            # little about what the bucket can take (the next call's rows fill the engine,
            # and its own window measures them), so the policy does not learn from it.
            if not c.queue and c.in_flight < c.max_rows and c.window is not None:
                c.window.drained = True

    def _admit_mixed(self, calls: list[_Call]) -> None:
        """A row at a time across the open calls, so a long bucket's rows reach the engine's
        queue spread among short ones (as a corpus in its own order would), not as a burst
        of prefills. Row `i` of the `k`-th call opened goes in at `k + mix_span * i / rows`,
        earliest first: each call's rows are spread over the span of `mix_span` calls, and
        the oldest still finishes first, so the calls end one after another and Ray Data's
        next blocks arrive as the engine has room (spread by each call's share alone, the
        open calls ended together and the engine waited for the next: busy 0.968 against
        0.997 at 4,000 rows).

        Each row in flight takes `1 / cap` of the engine, `cap` being its own call's row cap
        (what its bucket may have in flight alone), and a row goes in while the shares sum
        to at most 1; its tokens count against its own bucket's budget. So rows of equal
        caps count as rows, and a long bucket's few rows and a short one's many share the
        engine by what each could hold alone. (Counted as rows against the next row's cap,
        a long bucket's cap of a few rows held the engine there; counted as tokens in rows
        of the next row's bucket, a few long rows in flight filled a short bucket's cap of
        512 rows at 196 running and none waiting: bench/README.md, engine steps.)"""
        limits = {c: c.limits() for c in calls if c.queue or c.in_flight}
        share = sum(c.in_flight / cap for c, (_, cap) in limits.items() if cap > 0)
        queued = {c: limit for c, limit in limits.items() if c.queue}
        while queued:
            c = min(queued, key=lambda c: c.seq + self.mix_span * (c.rows - len(c.queue)) / c.rows)
            budget, cap = queued[c]
            held = len(self.in_flight)
            if not c.admit_next(budget, cap, share=share) and c.queue:
                break  # its next row does not fit: the others wait their turn
            share += (len(self.in_flight) - held) / cap
            if not c.queue:
                del queued[c]

    def _bucket_first(self, calls: list[_Call]) -> list[_Call]:
        """The open calls in admission order: the bucket the engine is running first (its
        calls oldest first), then the rest oldest first. Blocks of several buckets may be
        open at once; the engine switches bucket only when the one it runs has no rows
        left waiting, and then the next bucket's rows fill the room its last wave leaves."""
        if not any(c.queue for c in calls if c.bucket == self._bucket):
            self._bucket = next((c.bucket for c in calls if c.queue), self._bucket)
        return [c for c in calls if c.bucket == self._bucket] + [c for c in calls if c.bucket != self._bucket]

    # 2. Recovery from a failed step ----------------------------------------------------

    def _recover(self, error: Exception, calls: list[_Call]) -> None:
        """An out-of-memory puts the rows in flight back and shrinks the budget; any other
        failure bisects them, until a row that fails alone gets the error."""
        if isinstance(error, EngineDead) and not error.memory:
            raise EngineCrashed(f"the engine core died ({error}), not of memory") from error
        oom = is_oom(error)
        victims = sorted(self.in_flight.entries(), key=lambda v: v[1].position)
        self.restore(error, self.in_flight.ids())
        self.in_flight.clear()
        if oom and self.stop_on_oom:
            raise CallOutOfMemory(f"{type(error).__name__}: {error}") from error
        affected = [c for c in calls if any(v[0] is c for v in victims)]
        if oom:
            self.totals.oom_retries += 1
            halved: set[str] = set()
            for c in affected:  # one back-off per bucket, however many calls it has open
                if c.bucket not in halved and c.window is not None:
                    self.close_window(c.bucket, c.window, c.tokens_per_row, oom=True)
                    halved.add(c.bucket)
        else:
            # One request may be poisoning the engine: retry in halves until it runs alone.
            self.totals.bisections += 1
        for c in affected:
            mine = [r for call, r in victims if call is c]
            if not oom:
                c.suspects = {r.position for r in mine}
                c.isolate = max(1, len(mine) // 2)
            if len(victims) == 1:
                c.fail_alone(mine[0], oom, error)
            else:
                c.queue.extendleft(reversed(mine))
            c.window = self.open_window(c.bucket, c.tokens_per_row)
        self._mark = time.monotonic()  # recovery time is not busy time

    def restore(self, error: Exception, request_ids: list[str]) -> None:
        """Make the engine usable again after a failed step."""
        if restore_engine(self.engine, error, request_ids):
            self.policy.limit_rows(self.engine.max_num_seqs)

    # 3. A step that went through ---------------------------------------------------------

    def _stepped(self, step_start: float, calls: list[_Call]) -> None:
        now = time.monotonic()
        step, busy = now - step_start, now - self._mark
        self.totals.step_s += step
        self.totals.busy_s += busy
        total, queued = len(self.in_flight), sum(len(c.queue) for c in calls)
        for c in calls:
            if c.in_flight:
                c.stepped(step, busy, total, queued)
        self._mark = now

    def _charge_preemptions(self) -> None:
        """Each preempted row's call has its window charged: when several buckets' calls
        share the engine, the bucket that overfilled it backs off, not every open one."""
        if not self._attributed:
            return
        for request_id in self.engine.preempted() or ():
            entry = self.in_flight.get(request_id)
            if entry is not None and entry[0].window is not None:
                entry[0].window.preempted += 1

    def _complete(self, finished: list[tuple[str, Completion]]) -> None:
        """Completions free their share of the budget."""
        now = time.monotonic()
        for request_id, c in finished:
            call, r = self.in_flight.pop(request_id)
            call.completed(r, c, now)

    # 4. Calls that are done ------------------------------------------------------------

    def _finish(self, calls: list[_Call]) -> None:
        ended = [c for c in calls if not c.queue and not c.in_flight and c.started is not None]
        if not ended:
            return
        for c in ended:
            c.outcome = c.result()
        with self._cv:
            for c in ended:
                self._calls.remove(c)
                c.done = True
            if not self._calls and self._serving_since is not None:
                self.totals.serving_s += time.monotonic() - self._serving_since
                self._serving_since = None
            self._cv.notify_all()

    def _fail_open_calls(self, error: BaseException) -> None:
        """The driver failed outside any one row (an engine that cannot be rebuilt): every
        open call fails with it, rather than waiting for a driver that is gone."""
        with self._cv:
            for c in self._calls:
                if not c.done:
                    c.failure, c.done = error, True
            self._calls.clear()
            self.in_flight.clear()
            self._cv.notify_all()

    # Windows and what goes to the report -----------------------------------------------

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
            preemptions=0 if oom else self._window_preemptions(w),
            oom=oom,
            tokens_per_row=tokens_per_row,
            drained=w.drained,
        ))

    def _window_preemptions(self, w: _Window) -> int:
        if self._attributed:
            return w.preempted
        return max(0, self.preemptions() - w.preemptions_at_open)  # every preemption while it was open

    def unreported(self, bucket: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
        """The policy's steps and back-offs for `bucket`, and the preemptions, that no
        earlier call has reported."""
        steps_from, backoffs_from = self._trajectory_seen.get(bucket, (0, 0))
        traj = self.policy.trajectory(bucket, steps_from)
        self._trajectory_seen[bucket] = (steps_from + len(traj["steps"]), len(traj["backoffs"]))
        now = self.preemptions()
        # Clamped: a rebuilt engine starts its counter again from 0.
        seen = now if self._preemptions_seen > now else self._preemptions_seen
        self._preemptions_seen = now
        return traj["steps"], traj["backoffs"][backoffs_from:], now - seen


def restore_engine(engine: Engine, error: Exception, request_ids: list[str]) -> bool:
    """After a failed step: rebuild a dead engine (True), else abort what was in flight.
    The one recovery path, for the feeder and `pipeline tune` alike."""
    if isinstance(error, EngineDead):
        engine.rebuild(str(error))
        return True
    engine.abort(request_ids)
    return False


class _Call:
    """One `serve` call: its queue, its rows in flight, its measurements. The feeder's
    driving thread alone touches it after `begin`."""

    def __init__(self, feeder: EngineFeeder, bucket: str, rows: list[tuple[int, list[int]]], sampling: Sampling):
        self.feeder, self.bucket, self.sampling = feeder, bucket, sampling
        self.rows = len(rows)
        self.seq = 0  # its place among the feeder's calls, oldest first (set as it opens)
        self.queue: deque[Request] = deque(
            Request(pos, ids, len(ids) + sampling.max_new_tokens) for pos, ids in rows)
        self.tokens_per_row = sum(r.cost for r in self.queue) / max(len(self.queue), 1)
        self.results: dict[int, Completion] = {}
        self.steps = self.output_tokens = self.rejected = 0
        self.busy_s = self.step_s = 0.0
        # Fill: rows in flight over rows allowed, weighted by time. It is what
        # the busy fraction cannot see: a drained batch's lone straggler keeps
        # the engine "busy" at a fraction of its batch.
        self.filled = self.allowed = 0.0
        self.peak_pressure = self.peak_kv = 0.0
        self.started: float | None = None
        self.window: _Window | None = None
        self.suspects: set[int] = set()  # rows of a failed step, being bisected
        self.isolate = 0
        self.max_rows = 1
        self.done = False
        self.outcome: ServeResult | None = None
        self.failure: BaseException | None = None

    @property
    def in_flight(self) -> int:
        """This call's rows among the feeder's."""
        return self.feeder.in_flight.of(self)

    def begin(self) -> None:
        """The first time the driver sees this call: its clock starts. Its first window
        opens with its first row in (`admit`): a call waiting behind another bucket's
        measures nothing of its own bucket meanwhile."""
        if self.started is not None:
            return
        self.started = time.monotonic()
        totals = self.feeder.totals
        if totals.first_start is None:
            totals.first_start = self.started

    def admit(self) -> bool:
        """Submit rows while the budget allows (always at least one in flight). True when
        none of this call's rows is left waiting."""
        budget, cap = self.limits()
        while self.admit_next(budget, cap):
            pass
        return not self.queue

    def limits(self) -> tuple[float, int]:
        """The token budget and the cap on rows in flight (every call's; fed mixed, a row
        of this call takes `1 / cap` of the engine) for this call's next rows, from the
        policy now."""
        feeder = self.feeder
        policy, engine = feeder.policy, feeder.engine
        budget = policy.budget(self.bucket, self.tokens_per_row)
        self.max_rows = policy.rows_for(self.bucket, self.tokens_per_row)
        if self.suspects:  # bisecting a failed step: at most half the last failing group
            self.max_rows = min(self.max_rows, self.isolate)
        # The engine runs at most max_num_seqs requests at once and queues the rest
        # itself. When that limit, not the policy's token budget, is what binds, keep
        # its queue stocked with up to as many again: a wave of completions is then
        # replaced inside the engine at once, instead of after a round trip through
        # this process (the core idled for it: 0.73 of raw vLLM's tokens/s at 4k rows).
        cap = self.max_rows
        if feeder.feed == "drain" and feeder.in_flight:
            cap = 0  # a drained batch takes no row until its last one is done
        elif (not self.suspects and self.max_rows >= engine.max_num_seqs and feeder.feed != "drain"
                and feeder.stock_engine_queue):
            cap = self.max_rows + engine.max_num_seqs
        return budget, cap

    def admit_next(self, budget: float, cap: int, share: float | None = None) -> bool:
        """Submit this call's next row if it fits `budget` and `cap`; whether it went in.
        `share`: fed mixed, the share of the engine the rows in flight take, each `1 / cap`
        of its own call's cap (`EngineFeeder._admit_mixed`); this row goes in while its own
        `1 / cap` fits beside them. Otherwise the rows in flight count against `cap`."""
        feeder = self.feeder
        # share + 1/cap > 1, without dividing: a cap of 0 (a drained batch's) is full too.
        if not self.queue or (len(feeder.in_flight) >= cap if share is None else cap * (1 - share) < 1 - 1e-9):
            return False
        if feeder.in_flight and feeder.admission_cost(self.queue[0]) > budget:
            return False
        if self.window is None:
            self.window = feeder.open_window(self.bucket, self.tokens_per_row)
        self._submit(self.queue.popleft())
        return True

    def _submit(self, r: Request) -> None:
        now = time.monotonic()
        feeder = self.feeder
        try:
            request_id = feeder.engine.submit(r.ids, self.sampling)
        except EngineDead:
            self.queue.appendleft(r)  # not this row's doing: it waits for the engine's recovery
            raise
        except Exception as e:  # the engine refused this prompt alone
            self.results[r.position] = Completion(None, 0, 0.0, error=f"{type(e).__name__}: {e}")
            self.rejected += 1
            return
        if r.first_submitted is None:
            r.first_submitted = now
        feeder.in_flight.add(request_id, self, r)

    def fail_alone(self, r: Request, oom: bool, error: Exception) -> None:
        reason = "out of memory with this row alone in the engine" if oom else "the engine failed on this row alone"
        self.results[r.position] = Completion(
            None, 0, time.monotonic() - (r.first_submitted or self.started or time.monotonic()),
            error=f"{reason}: {type(error).__name__}: {error}",
        )
        self.suspects.discard(r.position)

    def stepped(self, step: float, busy: float, in_flight: int, queued: int) -> None:
        self.step_s += step
        self.busy_s += busy
        self.filled += min(in_flight, self.max_rows) * busy
        self.allowed += min(self.max_rows, in_flight + queued) * busy
        self.steps += 1

    def completed(self, r: Request, c: Completion, now: float) -> None:
        self.results[r.position] = Completion(c.text, c.output_tokens, now - (r.first_submitted or now),
                                              c.finish_reason, first_token_s=c.first_token_s, finished_at=now)
        self.suspects.discard(r.position)
        self.output_tokens += c.output_tokens
        self.feeder.totals.finished_requests += 1
        self.feeder.totals.finished_output_tokens += c.output_tokens
        if self.window is not None:
            self.window.done += 1
            self.window.output_tokens += c.output_tokens
            self.window.cost += r.cost

    def read_pressure(self, pressure: float, kv_cache: float) -> None:
        if self.window is None or not (self.in_flight or self.window.done):
            return
        self.window.peak_pressure = max(self.window.peak_pressure, pressure)
        self.peak_pressure = max(self.peak_pressure, pressure)
        self.peak_kv = max(self.peak_kv, kv_cache)

    def close_window_if_done(self) -> None:
        """A window closes once it has completed the rows it admitted; fed in drain mode,
        with its batch: a padded batch admits fewer rows than the budget's mean row, and a
        window of two batches halved how fast the policy learned (an H200's GPU check)."""
        w = self.window
        batch_done = self.feeder.feed == "drain" and not self.in_flight
        if w is None or not (w.done >= w.rows_target or batch_done or not (self.queue or self.in_flight)):
            return
        self.feeder.close_window(self.bucket, w, w.cost / max(w.done, 1))
        # With rows still running, the next window opens now; else with its next row in.
        self.window = self.feeder.open_window(self.bucket, self.tokens_per_row) if self.in_flight else None

    def result(self) -> ServeResult:
        feeder = self.feeder
        ended = time.monotonic()
        totals = feeder.totals
        totals.last_end = ended
        totals.calls += 1
        totals.requests += self.rows
        totals.output_tokens += self.output_tokens
        steps, backoffs, preemptions = feeder.unreported(self.bucket)
        started = self.started or ended
        record = CallRecord(
            bucket=self.bucket,
            rows=self.rows,
            wall_s=round(ended - started, 4),
            busy_s=round(self.busy_s, 4),
            step_s=round(self.step_s, 4),
            fill=round(self.filled / self.allowed, 4) if self.allowed > 0 else None,
            output_tokens=self.output_tokens,
            steps=self.steps,
            peak_pressure=round(self.peak_pressure, 4),
            peak_kv_cache_usage=round(self.peak_kv, 4),
            preemptions=preemptions,
            rejected=self.rejected,
            trajectory=steps,
            backoffs=backoffs,
            started_at=round(time.time() - (ended - started), 3),
        )
        return ServeResult(self.results, record)
