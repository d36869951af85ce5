"""The feeder's admission and recovery logic, against a fake engine.

The real engine runs the same feeder in tests/integration/run/test_adaptive.py;
this fake only makes the edge cases deterministic: when completions happen,
when an out-of-memory strikes.
"""

from __future__ import annotations

import time

import pytest

from pipeline.generation.engine import EngineCrashed, Sampling
from pipeline.generation.feeder import EngineFeeder
from pipeline.generation.policy import BatchSizeController, ControllerSettings, FixedBatchPolicy
from tests.helpers.fake_engine import FakeEngine


SAMPLING = Sampling(max_new_tokens=4)


def rows(n, length=96):
    return [(i, [1] * length) for i in range(n)]


def test_admits_up_to_the_budget_and_keeps_the_engine_full():
    # 10 rows of 100 tokens fill the fake KV cache to 0.9, the target: the budget holds.
    engine = FakeEngine(capacity_tokens=1112)
    policy = BatchSizeController(ControllerSettings(), initial_budget_tokens=1000)
    out = EngineFeeder(engine, policy).serve("le128", rows(50), SAMPLING)
    assert sorted(out.completions) == list(range(50))
    # Never more in flight than the largest budget admitted, and the engine kept full.
    assert 10 <= engine.max_seen <= max(step.budget for step in policy.buckets["le128"].steps) // 100
    assert out.record.rows == 50 and out.record.output_tokens == 200
    assert out.record.busy_s >= out.record.step_s > 0


class EvenSteps(FakeEngine):
    """Each step takes 2 ms: fill is weighted by time, and microsecond steps on a busy
    machine weigh whatever the scheduler made of them."""

    def step(self):
        time.sleep(0.002)
        return super().step()


def test_drain_feed_waits_for_the_whole_batch():
    engine = EvenSteps(vary=True)
    feeder = EngineFeeder(engine, FixedBatchPolicy(8), feed="drain")
    sizes = []
    original = engine.submit

    def submit(ids, params):
        sizes.append(len(engine.live))
        return original(ids, params)

    engine.submit = submit
    out = feeder.serve("le128", rows(20), SAMPLING)
    # New rows are only admitted into an empty engine: 8, 8, then 4.
    assert [s for s in sizes if s == 0] == [0, 0, 0]
    # Stragglers leave a drained batch part-empty; continuous feeding refills it.
    continuous = EngineFeeder(EvenSteps(vary=True), FixedBatchPolicy(8)).serve("le128", rows(20), SAMPLING)
    assert out.record.fill < 0.9 and continuous.record.fill > out.record.fill


def test_oom_requeues_the_rows_in_flight_and_halves_the_budget():
    engine = FakeEngine(oom_when_in_flight=16)
    policy = BatchSizeController(ControllerSettings(), initial_budget_tokens=2000)  # 20 rows: too many
    feeder = EngineFeeder(engine, policy)
    out = feeder.serve("le128", rows(40), SAMPLING)
    assert all(c.error is None for c in out.completions.values())
    assert sorted(out.completions) == list(range(40))
    first = out.record.backoffs[0]
    assert (first["reason"], first["from"], first["to"]) == ("oom", 2000, 1000)
    assert first["ceiling"] == 1900  # 5% under what failed
    assert feeder.totals.oom_retries == len(out.record.backoffs) and len(engine.aborted) >= 16


class PreemptingEngine(FakeEngine):
    """vLLM's counter: one preemption per step in which more than `fits` rows run. With
    `says_which`, it also names the request preempted: the newest whose prompt starts
    with `victim_token` (the test's choice of bucket to overfill), or none."""

    def __init__(self, fits, says_which=False, victim_token=1, **kw):
        super().__init__(**kw)
        self.fits, self.preemptions, self.says_which, self.victims = fits, 0, says_which, []
        self.victim_token = victim_token

    def step(self):
        victims = [rid for rid, (_, _, ids, _) in self.live.items() if ids[0] == self.victim_token]
        if len(self.live) > self.fits and victims:
            self.preemptions += 1
            self.victims.append(victims[-1])
        return super().step()

    def kv_gauges(self):
        return super().kv_gauges()[0], self.preemptions

    def preempted(self):
        if not self.says_which:
            return None
        taken, self.victims = self.victims, []
        return taken


def test_the_first_calls_preemptions_back_off_and_reach_its_record():
    engine = PreemptingEngine(fits=8)
    policy = BatchSizeController(ControllerSettings(), initial_budget_tokens=2000)  # 20 rows: too many
    out = EngineFeeder(engine, policy).serve("le128", rows(40), SAMPLING)
    assert sorted(out.completions) == list(range(40))
    backoffs = policy.trajectory("le128")["backoffs"]
    assert backoffs and {b["reason"] for b in backoffs} == {"preemption"}
    # The engine's count since the feeder began, not from the first call's end.
    assert out.record.preemptions == engine.preemptions > 0


@pytest.mark.parametrize("says_which", [True, False])
def test_a_preemption_is_charged_to_the_bucket_whose_row_it_hit(says_which):
    """Two buckets' calls open at once; every preemption hits a row of the short bucket.
    An engine that names its preempted requests has the short bucket back off alone, its
    rows the ones hit; one that only counts charges every call with a window open."""
    engine = PreemptingEngine(fits=8, says_which=says_which, steps_per_request=6)
    policy = BatchSizeController(ControllerSettings(), initial_budget_tokens=2000)  # 20 rows: too many
    feeder = EngineFeeder(engine, policy)
    short = rows(60)
    long = [(100 + i, [2] * 200) for i in range(6)]  # 6 rows of 204 tokens: they fit
    a, b = serve_together(feeder, [("le128", short), ("le256", long)])
    assert sorted(a.completions) == list(range(60)) and sorted(b.completions) == list(range(100, 106))
    assert policy.backoffs("le128")
    assert engine.preemptions > 0
    if says_which:
        assert policy.backoffs("le256") == []  # its rows were never the ones preempted


def test_a_row_that_fails_alone_gets_an_error_and_the_rest_go_on():
    engine = FakeEngine(oom_when_in_flight=1)  # nothing fits, not even one row
    policy = BatchSizeController(ControllerSettings(), initial_budget_tokens=100)
    out = EngineFeeder(engine, policy).serve("le128", rows(3), SAMPLING)
    assert sorted(out.completions) == [0, 1, 2]
    assert all("out of memory with this row alone" in c.error for c in out.completions.values())


def test_a_refused_prompt_is_an_error_row():
    engine = FakeEngine()
    batch = rows(3) + [(3, [1] * 2000)]
    out = EngineFeeder(engine, FixedBatchPolicy(4)).serve("le128", batch, SAMPLING)
    assert out.completions[3].error.startswith("ValueError: prompt too long")
    assert [out.completions[i].error for i in range(3)] == [None] * 3
    assert out.record.rejected == 1


class PoisonEngine(FakeEngine):
    """Every step fails while the poisoned prompt (token 666) is in flight."""

    def step(self):
        if any(ids[0] == 666 for _, _, ids, _ in self.live.values()):
            raise RuntimeError("sampler produced NaN")
        return super().step()


def test_a_poisoned_request_is_bisected_out_and_its_neighbours_finish():
    engine = PoisonEngine()
    batch = rows(16)
    batch[11] = (11, [666] * 96)
    feeder = EngineFeeder(engine, FixedBatchPolicy(16))
    out = feeder.serve("le128", batch, SAMPLING)
    assert sorted(out.completions) == list(range(16))
    assert out.completions[11].error == "the engine failed on this row alone: RuntimeError: sampler produced NaN"
    assert all(out.completions[i].error is None for i in range(16) if i != 11)
    assert 1 <= feeder.totals.bisections <= 5  # log2(16) + 1


def test_the_engines_own_queue_is_kept_stocked_only_when_its_row_limit_binds():
    """Rows past max_num_seqs wait inside the engine, so a wave of completions is
    replaced there at once; the policy's budget and smaller row counts still hold."""
    engine = FakeEngine()
    engine.max_num_seqs = 8
    result = EngineFeeder(engine, FixedBatchPolicy(8)).serve("le128", rows(40), SAMPLING)
    assert engine.max_seen == 16 and len(result.completions) == 40  # 8 running + 8 queued
    assert result.record.fill <= 1.0

    engine = FakeEngine()
    engine.max_num_seqs = 8
    EngineFeeder(engine, FixedBatchPolicy(4)).serve("le128", rows(40), SAMPLING)
    assert engine.max_seen == 4  # the policy's own limit binds: nothing extra

    engine = FakeEngine()
    engine.max_num_seqs = 8
    EngineFeeder(engine, FixedBatchPolicy(8), feed="drain").serve("le128", rows(40), SAMPLING)
    assert engine.max_seen == 8  # classic batches stay classic


def test_measuring_keeps_exactly_the_policys_rows_and_stops_at_the_first_oom():
    """What `pipeline tune` asks of the feeder: no extra rows stocked in the engine's queue,
    and an out-of-memory as a result (the engine left usable) rather than a retry."""
    import pytest

    from pipeline.generation.feeder import CallOutOfMemory

    engine = FakeEngine()
    engine.max_num_seqs = 8
    EngineFeeder(engine, FixedBatchPolicy(8), stock_engine_queue=False).serve("le128", rows(40), SAMPLING)
    assert engine.max_seen == 8
    engine = FakeEngine(oom_when_in_flight=8)
    with pytest.raises(CallOutOfMemory, match="CUDA out of memory"):
        EngineFeeder(engine, FixedBatchPolicy(8), stop_on_oom=True).serve("le128", rows(40), SAMPLING)
    assert len(engine.aborted) == 8 and not engine.live
    done = EngineFeeder(engine, FixedBatchPolicy(4), stop_on_oom=True).serve("le128", rows(8), SAMPLING)
    assert all(c.finished_at is not None and c.error is None for c in done.completions.values())


class SlowEngine(FakeEngine):
    """Steps take a moment, and each records the prompt lengths it ran: which calls shared it."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.lengths_per_step: list[set[int]] = []

    def step(self):
        import time

        time.sleep(0.002)
        self.lengths_per_step.append({len(ids) for _, _, ids, _ in self.live.values()})
        return super().step()


def serve_together(feeder, calls, in_order=False):
    """Each (bucket, rows) served from its own thread, the way Ray Data runs an actor's
    concurrent batches; the results in the order given. `in_order`: the calls open one
    after another, in the order given, and the engine's first step waits until all are
    open, however loaded the machine."""
    import threading

    results, errors = [None] * len(calls), []
    gate, engine = threading.Event(), feeder.engine
    step = engine.step
    if in_order:
        def held_step():
            gate.wait(5)
            return step()

        engine.step = held_step

    def run(k, bucket, batch):
        try:
            results[k] = feeder.serve(bucket, batch, SAMPLING)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k, b, r)) for k, (b, r) in enumerate(calls)]
    for t in threads:
        t.start()
        if in_order:
            time.sleep(0.1)
    deadline = time.monotonic() + 5
    while in_order and len(feeder.open_calls()) < len(calls) and time.monotonic() < deadline:
        time.sleep(0.01)
    gate.set()
    for t in threads:
        t.join(timeout=30)
    engine.step = step
    assert not errors and all(r is not None for r in results)
    return results


def test_concurrent_calls_share_the_engine_and_each_gets_only_its_rows():
    """The next block's rows (another bucket here) fill the room the last wave of the one
    before leaves: some step runs rows of both, and no call sees the other's rows."""
    engine = SlowEngine(vary=True)
    feeder = EngineFeeder(engine, FixedBatchPolicy(8))
    short = [(i, [1] * 96) for i in range(40)]
    long = [(100 + i, [2] * 200) for i in range(40)]
    a, b = serve_together(feeder, [("le128", short), ("le256", long)])
    assert sorted(a.completions) == list(range(40)) and sorted(b.completions) == list(range(100, 140))
    assert all(c.error is None for c in [*a.completions.values(), *b.completions.values()])
    assert a.record.bucket == "le128" and b.record.bucket == "le256"
    assert any(lengths == {96, 200} for lengths in engine.lengths_per_step)  # no drain between them
    assert engine.max_seen <= 8  # the policy's rows in flight hold across calls
    t = feeder.totals
    assert t.calls == 2 and t.requests == 80 and t.output_tokens == 320
    assert 0 < t.serving_s and t.busy_s >= t.step_s > 0


def test_one_failure_among_concurrent_calls_is_bisected_to_its_row():
    engine = PoisonEngine()
    feeder = EngineFeeder(engine, FixedBatchPolicy(16))
    first = rows(12)
    second = [(100 + i, [1] * 96) for i in range(12)]
    second[5] = (105, [666] * 96)
    a, b = serve_together(feeder, [("le128", first), ("le128", second)])
    assert sorted(a.completions) == list(range(12)) and sorted(b.completions) == list(range(100, 112))
    assert b.completions[105].error == "the engine failed on this row alone: RuntimeError: sampler produced NaN"
    others = [c for p, c in [*a.completions.items(), *b.completions.items()] if p != 105]
    assert all(c.error is None for c in others)


@pytest.mark.parametrize("memory", [True, False])
def test_an_engine_that_cannot_recover_fails_every_open_call(memory):
    """Dead of memory and not rebuildable, or crashed (the actor is started afresh): either
    way every open call fails with the reason, and no thread waits for a driver that is gone."""
    from pipeline.generation.engine import EngineDead

    class Broken(SlowEngine):
        def step(self):
            raise EngineDead("core gone", memory=memory)

        def rebuild(self, reason):
            raise RuntimeError("cannot rebuild: no memory")

    feeder = EngineFeeder(Broken(), FixedBatchPolicy(4))
    import threading

    errors = []

    def run(bucket):
        try:
            feeder.serve(bucket, rows(4), SAMPLING)
        except RuntimeError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=run, args=(b,)) for b in ("le128", "le256")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)  # nobody waits for a driver that is gone
    reason = "cannot rebuild" if memory else "the engine core died (core gone), not of memory"
    assert len(errors) == 2 and all(reason in e for e in errors)
    with pytest.raises(RuntimeError):
        feeder.serve("le128", rows(2), SAMPLING)


@pytest.mark.parametrize("memory", [False, True])
def test_a_core_that_dies_between_steps_is_the_engines_death_not_its_rows_errors(memory):
    """The core dies while the engine waits for rows (vLLM then refuses every request): the
    next call's rows are not given the error one by one. A crash ends the call for the
    actor's restart, every row still to do; a death of memory rebuilds the engine, and
    every row completes."""
    engine = FakeEngine()
    feeder = EngineFeeder(engine, FixedBatchPolicy(4))
    first = feeder.serve("le128", rows(4), SAMPLING)
    assert all(c.error is None for c in first.completions.values())
    engine.kill_core(memory=memory)  # between calls: nothing in flight, no step to fail
    if not memory:
        with pytest.raises(EngineCrashed, match="not of memory"):
            feeder.serve("le128", rows(6), SAMPLING)
        assert engine.rebuilds == []
        return
    done = feeder.serve("le128", rows(6), SAMPLING)
    assert sorted(done.completions) == list(range(6))
    assert all(c.error is None for c in done.completions.values())
    assert len(engine.rebuilds) == 1 and feeder.totals.oom_retries == 1


def test_time_between_calls_is_not_busy_time():
    import time

    feeder = EngineFeeder(SlowEngine(), FixedBatchPolicy(8))
    feeder.serve("le128", rows(8), SAMPLING)
    time.sleep(0.3)  # waiting for the next block: idle, not busy
    feeder.serve("le128", rows(8), SAMPLING)
    t = feeder.totals
    assert t.busy_s < 0.25 and t.busy_fraction() < 0.5
    assert t.busy_s >= t.step_s > 0


def test_open_calls_of_the_running_bucket_go_first():
    """Blocks of two buckets open at once, in the order le128, le256, le128: the engine
    finishes admitting le128 (both of its calls) before it switches to le256."""
    engine = SlowEngine()
    feeder = EngineFeeder(engine, FixedBatchPolicy(8))
    order = [("le128", [(i, [1] * 96) for i in range(16)]), ("le256", [(100 + i, [2] * 200) for i in range(16)]),
             ("le128", [(200 + i, [1] * 96) for i in range(16)])]
    serve_together(feeder, order, in_order=True)
    first_long = next(k for k, (ids, _) in enumerate(engine.submitted) if len(ids) == 200)
    assert all(len(ids) == 96 for ids, _ in engine.submitted[:first_long])
    assert first_long == 32  # both le128 calls were admitted before any le256 row


def test_a_mixed_feed_spreads_a_long_buckets_rows_among_the_short_ones():
    """The same three calls fed `mixed` over a span of 2 calls: rows go in a row at a time,
    row i of the k-th call opened at k + 2i/rows, so the le256 rows reach the engine one
    between two le128 rows instead of as a burst, the oldest call's rows all go in before
    the youngest's begin, and each call still gets only its rows."""
    engine = SlowEngine()
    feeder = EngineFeeder(engine, FixedBatchPolicy(8), feed="mixed", mix_span=2)
    order = [("le128", [(i, [1] * 96) for i in range(16)]), ("le256", [(100 + i, [2] * 200) for i in range(16)]),
             ("le128", [(200 + i, [3] * 96) for i in range(16)])]
    results = serve_together(feeder, order, in_order=True)
    lengths = [len(ids) for ids, _ in engine.submitted]
    assert lengths.count(200) == 16 and lengths.count(96) == 32
    longest_run = max(len(run) for run in "".join("L" if n == 200 else "s" for n in lengths).split("s"))
    assert longest_run == 1  # never two long rows in a row
    calls = [ids[0] for ids, _ in engine.submitted]  # 1, 2, 3: the oldest call's rows, the long, the youngest's
    assert max(k for k, c in enumerate(calls) if c == 1) < calls.index(3)
    assert [sorted(results[k].completions) for k in range(3)] == [[p for p, _ in batch] for _, batch in order]
    assert engine.max_seen <= 8


class TokenBudget(FixedBatchPolicy):
    """A budget of 10,000 tokens for every bucket, and its rows as many as fit: a long
    bucket's row cap is a few rows, a short one's a hundred."""

    def budget(self, bucket, tokens_per_row):
        return 10_000

    def rows_for(self, bucket, tokens_per_row):
        return max(1, int(10_000 // tokens_per_row))


class CountingEngine(FakeEngine):
    """Records, per step, the rows running and whether a long one is among them."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.per_step: list[tuple[int, bool]] = []

    def step(self):
        time.sleep(0.001)
        self.per_step.append((len(self.live), any(len(ids) > 500 for _, _, ids, _ in self.live.values())))
        return super().step()


def test_a_mixed_feed_shares_the_engine_between_a_long_buckets_few_rows_and_a_short_ones_many():
    """Fed `mixed`, a long bucket's row cap (9 rows of 1,004 tokens) is not a cap on every
    bucket's rows: each row in flight takes 1/cap of the engine by its own bucket's cap,
    so short rows keep the engine near its 10,000-token budget while long ones are in it
    (every row counted against the long bucket's cap, it stopped at the long bucket's few
    and held about 40 rows, 4,000 tokens)."""
    engine = CountingEngine(capacity_tokens=20_000)
    feeder = EngineFeeder(engine, TokenBudget(1), feed="mixed")
    short = [(i, [1] * 96) for i in range(300)]
    long = [(1000 + i, [2] * 1000) for i in range(9)]
    a, b = serve_together(feeder, [("le128", short), ("le1024", long)], in_order=True)
    assert sorted(a.completions) == list(range(300))
    assert sorted(b.completions) == list(range(1000, 1009))
    with_long = [n for n, has_long in engine.per_step if has_long]
    assert with_long and max(with_long) >= 60, engine.per_step


def test_a_mixed_feed_counts_rows_of_equal_caps_as_rows_whatever_their_tokens():
    """Every bucket's cap 64 rows (a fixed policy, no token budget): fed `mixed`, long rows
    in flight do not hold short ones back by their tokens, and the engine holds 64 rows,
    long and short together. (Counted as tokens in rows of the short bucket, 9 rows of 900
    tokens filled its cap of 64 and the engine held the long rows alone; the same rule held
    vLLM at 196 rows with none waiting: bench/README.md, engine steps.)"""
    engine = CountingEngine()
    feeder = EngineFeeder(engine, FixedBatchPolicy(64), feed="mixed")
    long = [(1000 + i, [2] * 900) for i in range(9)]
    short = [(i, [1] * 96) for i in range(300)]
    b, a = serve_together(feeder, [("le1024", long), ("le128", short)], in_order=True)
    assert sorted(a.completions) == list(range(300))
    assert sorted(b.completions) == list(range(1000, 1009))
    with_long = [n for n, has_long in engine.per_step if has_long]
    assert with_long and max(with_long) == 64, engine.per_step
    assert engine.max_seen == 64
