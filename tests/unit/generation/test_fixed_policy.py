"""The fixed (and tuned) batch policy backs off on out-of-memory: it halves a bucket's rows
in flight, down to one, and keeps the halved size for the rest of the run."""

from __future__ import annotations

from pipeline.generation.engine import Sampling
from pipeline.generation.feeder import EngineFeeder
from pipeline.generation.policy import FixedBatchPolicy, Observation
from tests.helpers.fake_engine import FakeEngine

SAMPLING = Sampling(max_new_tokens=4)
OOM = Observation(pressure=1.0, throughput=0.0, rows=0, oom=True)
FINE = Observation(pressure=0.5, throughput=10.0, rows=8)


def rows(n, length=96):
    return [(i, [1] * length) for i in range(n)]


class Runaway(BaseException):
    """Not an Exception: the feeder's recovery does not catch it, so `serve` raises it."""


class BoundedEngine(FakeEngine):
    """A fake engine that gives up after `max_steps` steps, so a policy that retries the
    same rows forever fails the test instead of hanging it."""

    def __init__(self, max_steps=1000, **kw):
        super().__init__(**kw)
        self.max_steps, self.steps = max_steps, 0

    def step(self):
        self.steps += 1
        if self.steps > self.max_steps:
            raise Runaway(f"still stepping after {self.max_steps} steps")
        return super().step()


def test_an_oom_halves_the_buckets_rows_down_to_one_and_the_size_holds():
    policy = FixedBatchPolicy(16, per_bucket={"le256": 6})
    assert policy.rows_for("le128", 100) == 16 and policy.budget("le128", 100) == float("inf")
    sizes = []
    for _ in range(6):
        policy.observe("le128", OOM)
        sizes.append(policy.rows_for("le128", 100))
    assert sizes == [8, 4, 2, 1, 1, 1]  # the floor is one row
    policy.observe("le128", FINE)
    assert policy.rows_for("le128", 100) == 1  # a ceiling learned from a failure: it never regrows

    # Per bucket: the other buckets keep their own sizes, tuned ones halve from theirs.
    assert policy.rows_for("le512", 100) == 16
    assert policy.rows_for("le256", 100) == 6
    policy.observe("le256", OOM)
    assert policy.rows_for("le256", 100) == 3 and policy.rows_for("le512", 100) == 16

    traj = policy.trajectory("le128")
    assert [(b["reason"], b["from"], b["to"]) for b in traj["backoffs"]] == [
        ("oom", 16, 8), ("oom", 8, 4), ("oom", 4, 2), ("oom", 2, 1), ("oom", 1, 1), ("oom", 1, 1)]
    assert set(traj["backoffs"][0]) >= {"t", "reason", "from", "to", "ceiling", "pressure", "preemptions"}
    assert [s["rows"] for s in traj["steps"]] == [8, 4, 2, 1, 1, 1, 1]
    assert [s["action"] for s in traj["steps"]] == ["backoff"] * 6 + ["fixed"]
    assert policy.trajectory("le128", steps_from=5)["steps"] == traj["steps"][5:]  # what a call has not reported
    assert policy.backoffs("le128") == traj["backoffs"]
    assert [(b["from"], b["to"]) for b in policy.trajectory("le256")["backoffs"]] == [(6, 3)]
    assert policy.trajectory("le512")["backoffs"] == []
    assert policy.learned_limits() == {}


def test_a_fixed_batch_too_big_for_memory_converges_instead_of_retrying_forever():
    engine = BoundedEngine(oom_when_in_flight=9)  # out of memory whenever more than 8 rows are in flight
    policy = FixedBatchPolicy(16)
    feeder = EngineFeeder(engine, policy)
    out = feeder.serve("le128", rows(40), SAMPLING)
    assert sorted(out.completions) == list(range(40))
    assert all(c.error is None and c.text == "x" for c in out.completions.values())
    assert 1 <= feeder.totals.oom_retries <= 2
    assert [(b["reason"], b["from"], b["to"]) for b in out.record.backoffs] == [("oom", 16, 8)]
    assert policy.rows_for("le128", 100) == 8
    assert out.record.trajectory[0]["rows"] == 8 and out.record.trajectory[0]["action"] == "backoff"


def test_at_one_row_an_oom_fails_the_row_alone_and_the_rest_go_on():
    engine = BoundedEngine(oom_when_in_flight=1)  # nothing fits, not even one row
    feeder = EngineFeeder(engine, FixedBatchPolicy(4))
    out = feeder.serve("le128", rows(3), SAMPLING)
    assert sorted(out.completions) == [0, 1, 2]
    assert all("out of memory with this row alone" in c.error for c in out.completions.values())
    assert [(b["from"], b["to"]) for b in out.record.backoffs][:2] == [(4, 2), (2, 1)]
