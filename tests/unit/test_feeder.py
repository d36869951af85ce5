"""The feeder's admission and recovery logic, against a fake engine.

The real engine runs the same feeder in tests/integration/test_adaptive.py;
this fake only makes the edge cases deterministic: when completions happen,
when an out-of-memory strikes.
"""

from __future__ import annotations

from pipeline.batching import FixedBatchPolicy
from pipeline.config import SamplingConfig
from pipeline.controller import BatchSizeController, ControllerSettings
from pipeline.engine import Completion
from pipeline.feeder import EngineFeeder


class FakeEngine:
    """Each request finishes `steps_per_request` steps after it is submitted.
    `oom_when_in_flight` raises torch-style OOM when that many rows run at once."""

    max_num_seqs = 256

    def __init__(self, steps_per_request=3, oom_when_in_flight=None, capacity_tokens=10_000, vary=False):
        self.steps_per_request = steps_per_request
        self.vary = vary  # rows of uneven length: 3, 4, 5, 6 steps
        self.oom_when_in_flight = oom_when_in_flight
        self.capacity = capacity_tokens
        self.live: dict[str, list] = {}
        self.max_seen = 0
        self.aborted: list[str] = []
        self.n = 0

    def sampling_params(self, sampling):
        return sampling

    def submit(self, ids, params):
        if len(ids) > 1000:
            raise ValueError("prompt too long")
        self.n += 1
        rid = f"r{self.n}"
        steps = self.steps_per_request + (self.n % 4 if self.vary else 0)
        self.live[rid] = [steps, len(ids) + params.max_new_tokens]
        return rid

    def step(self):
        self.max_seen = max(self.max_seen, len(self.live))
        if self.oom_when_in_flight is not None and len(self.live) >= self.oom_when_in_flight:
            raise MemoryError("CUDA out of memory")
        done = []
        for rid in list(self.live):
            self.live[rid][0] -= 1
            if self.live[rid][0] == 0:
                del self.live[rid]
                done.append((rid, Completion("x", 4, 0.0, "length")))
        return done

    def abort(self, ids):
        self.aborted += ids
        for rid in ids:
            self.live.pop(rid, None)

    def kv_gauges(self):
        used = sum(v[1] for v in self.live.values())
        return min(1.0, used / self.capacity), 0

    def core_pids(self):
        return []


SAMPLING = SamplingConfig(max_new_tokens=4)


def rows(n, length=96):
    return [(i, [1] * length) for i in range(n)]


def test_admits_up_to_the_budget_and_keeps_the_engine_full():
    # 10 rows of 100 tokens fill the fake KV cache to 0.9, the target: the budget holds.
    engine = FakeEngine(capacity_tokens=1112)
    policy = BatchSizeController(ControllerSettings(), initial_budget_tokens=1000)
    out = EngineFeeder(engine, policy, SAMPLING).serve("le128", rows(50))
    assert sorted(out.completions) == list(range(50))
    # Never more in flight than the largest budget admitted, and the engine kept full.
    assert 10 <= engine.max_seen <= max(step.budget for step in policy.buckets["le128"].steps) // 100
    assert out.record["rows"] == 50 and out.record["output_tokens"] == 200
    assert out.record["busy_s"] >= out.record["step_s"] > 0


def test_drain_feed_waits_for_the_whole_batch():
    engine = FakeEngine(vary=True)
    feeder = EngineFeeder(engine, FixedBatchPolicy(8), SAMPLING, feed="drain")
    sizes = []
    original = engine.submit

    def submit(ids, params):
        sizes.append(len(engine.live))
        return original(ids, params)

    engine.submit = submit
    out = feeder.serve("le128", rows(20))
    # New rows are only admitted into an empty engine: 8, 8, then 4.
    assert [s for s in sizes if s == 0] == [0, 0, 0]
    # Stragglers leave a drained batch part-empty; continuous feeding refills it.
    continuous = EngineFeeder(FakeEngine(vary=True), FixedBatchPolicy(8), SAMPLING).serve("le128", rows(20))
    assert out.record["fill"] < 0.9 and continuous.record["fill"] > out.record["fill"]


def test_oom_requeues_the_rows_in_flight_and_halves_the_budget():
    engine = FakeEngine(oom_when_in_flight=16)
    policy = BatchSizeController(ControllerSettings(), initial_budget_tokens=2000)  # 20 rows: too many
    feeder = EngineFeeder(engine, policy, SAMPLING)
    out = feeder.serve("le128", rows(40))
    assert all(c.error is None for c in out.completions.values())
    assert sorted(out.completions) == list(range(40))
    first = out.record["backoffs"][0]
    assert (first["reason"], first["from"], first["to"]) == ("oom", 2000, 1000)
    assert first["ceiling"] == 1900  # 5% under what failed
    assert feeder.totals.oom_retries == len(out.record["backoffs"]) and len(engine.aborted) >= 16


def test_a_row_that_fails_alone_gets_an_error_and_the_rest_go_on():
    engine = FakeEngine(oom_when_in_flight=1)  # nothing fits, not even one row
    policy = BatchSizeController(ControllerSettings(), initial_budget_tokens=100)
    out = EngineFeeder(engine, policy, SAMPLING).serve("le128", rows(3))
    assert sorted(out.completions) == [0, 1, 2]
    assert all("out of memory with this row alone" in c.error for c in out.completions.values())


def test_a_refused_prompt_is_an_error_row():
    engine = FakeEngine()
    batch = rows(3) + [(3, [1] * 2000)]
    out = EngineFeeder(engine, FixedBatchPolicy(4), SAMPLING).serve("le128", batch)
    assert out.completions[3].error.startswith("ValueError: prompt too long")
    assert [out.completions[i].error for i in range(3)] == [None] * 3
    assert out.record["rejected"] == 1


class PoisonEngine(FakeEngine):
    """Every step fails while the poisoned prompt (token 666) is in flight."""

    def submit(self, ids, params):
        rid = super().submit(ids, params)
        self.live[rid].append(ids[0] == 666)
        return rid

    def step(self):
        if any(len(v) > 2 and v[2] for v in self.live.values()):
            raise RuntimeError("sampler produced NaN")
        return super().step()


def test_a_poisoned_request_is_bisected_out_and_its_neighbours_finish():
    engine = PoisonEngine()
    batch = rows(16)
    batch[11] = (11, [666] * 96)
    feeder = EngineFeeder(engine, FixedBatchPolicy(16), SAMPLING)
    out = feeder.serve("le128", batch)
    assert sorted(out.completions) == list(range(16))
    assert out.completions[11].error == "the engine failed on this row alone: RuntimeError: sampler produced NaN"
    assert all(out.completions[i].error is None for i in range(16) if i != 11)
    assert 1 <= feeder.totals.bisections <= 5  # log2(16) + 1


def test_the_engines_own_queue_is_kept_stocked_only_when_its_row_limit_binds():
    """Rows past max_num_seqs wait inside the engine, so a wave of completions is
    replaced there at once; the policy's budget and smaller row counts still hold."""
    engine = FakeEngine()
    engine.max_num_seqs = 8
    result = EngineFeeder(engine, FixedBatchPolicy(8), SAMPLING).serve("le128", rows(40))
    assert engine.max_seen == 16 and len(result.completions) == 40  # 8 running + 8 queued
    assert result.record["fill"] <= 1.0

    engine = FakeEngine()
    engine.max_num_seqs = 8
    EngineFeeder(engine, FixedBatchPolicy(4), SAMPLING).serve("le128", rows(40))
    assert engine.max_seen == 4  # the policy's own limit binds: nothing extra

    engine = FakeEngine()
    engine.max_num_seqs = 8
    EngineFeeder(engine, FixedBatchPolicy(8), SAMPLING, feed="drain").serve("le128", rows(40))
    assert engine.max_seen == 8  # classic batches stay classic
