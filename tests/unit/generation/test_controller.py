"""BatchSizeController against a simulated engine.

The simulation: a KV cache of `capacity` tokens; pressure is the share of it a
budget fills; a budget past `capacity` runs out of memory (hard), one past
`preempt_at` x capacity preempts (soft); throughput saturates with the budget.
"""

from __future__ import annotations

import math

import pytest

from pipeline.generation.policy import BatchSizeController, ControllerSettings, Observation


class SimEngine:
    def __init__(self, capacity=100_000, preempt_at=0.97, t_max=5000.0, half=20_000):
        self.capacity, self.preempt_at, self.t_max, self.half = capacity, preempt_at, t_max, half

    def run(self, budget: int, rows: int) -> Observation:
        pressure = budget / self.capacity
        if pressure > 1.0:
            return Observation(pressure=1.0, throughput=0.0, rows=0, oom=True)
        preemptions = int(pressure > self.preempt_at)
        throughput = self.t_max * budget / (budget + self.half)
        return Observation(pressure=pressure, throughput=throughput, rows=rows, preemptions=preemptions)


def drive(ctrl, sim, bucket="le256", tokens_per_row=200.0, windows=40):
    budgets = []
    for _ in range(windows):
        rows = ctrl.rows_for(bucket, tokens_per_row)
        assert rows >= 1
        budget = ctrl.budget(bucket, tokens_per_row)
        budgets.append(budget)
        ctrl.observe(bucket, sim.run(budget, rows))
    return budgets


def test_converges_near_the_target_from_a_small_start():
    ctrl = BatchSizeController(ControllerSettings(target=0.9))
    sim = SimEngine()
    budgets = drive(ctrl, sim)
    actions = [s.action for s in ctrl.buckets["le256"].steps]
    assert actions.count("grow") >= 3
    final = budgets[-10:]
    assert all(0.80 * sim.capacity <= b <= 0.97 * sim.capacity for b in final), final


def test_starts_from_kv_capacity_when_the_engine_reports_it():
    ctrl = BatchSizeController(kv_capacity_tokens=100_000)
    assert ctrl.budget("le128", 150) == 90_000
    assert ctrl.rows_for("le128", 150) == 600
    capped = BatchSizeController(ControllerSettings(max_rows=256), kv_capacity_tokens=100_000)
    assert capped.rows_for("le128", 150) == 256


def test_recovers_from_out_of_memory_and_learns_a_ceiling_with_margin():
    # A learned start that no longer fits (the cache shrank since last run).
    ctrl = BatchSizeController(learned={"le256": 180_000})
    sim = SimEngine(capacity=100_000)
    budgets = drive(ctrl, sim, windows=30)
    s = ctrl.buckets["le256"]
    assert s.backoffs[0]["reason"] == "oom" and s.backoffs[0]["to"] == 90_000
    assert all(b <= sim.capacity for b in budgets[2:])
    assert s.ceiling == int(180_000 * 0.95)  # what it learned: the failed budget less the margin
    assert budgets[-1] >= 0.8 * sim.capacity  # it regrew after the halving
    whole = ctrl.trajectory("le256")
    assert ctrl.trajectory("le256", steps_from=10)["steps"] == whole["steps"][10:]  # a call's unreported steps
    assert ctrl.backoffs("le256") == whole["backoffs"] == s.backoffs


def test_preemption_backs_off_by_ten_percent():
    ctrl = BatchSizeController(ControllerSettings(target=0.98), initial_budget_tokens=99_000)
    ctrl.rows_for("le512", 400)
    ctrl.observe("le512", Observation(pressure=0.99, throughput=100, rows=10, preemptions=3))
    s = ctrl.buckets["le512"]
    assert s.budget == pytest.approx(0.9 * 99_000, abs=1)
    assert s.ceiling == int(99_000 * 0.95)
    assert s.backoffs[-1]["reason"] == "preemption"


def test_never_starves_a_bucket():
    ctrl = BatchSizeController(initial_budget_tokens=1_000)
    # A row costlier than the whole budget still gets admitted alone.
    assert ctrl.rows_for("gt8192", 20_000) == 1
    for _ in range(20):
        ctrl.observe("gt8192", Observation(pressure=1.0, throughput=0, rows=0, oom=True))
        assert ctrl.rows_for("gt8192", 20_000) == 1
    # Buckets are independent: one bucket's failures leave the others alone.
    assert ctrl.rows_for("le128", 100) == 10


def test_oscillation_stays_within_the_stated_bound():
    ctrl = BatchSizeController(ControllerSettings(target=0.95))
    sim = SimEngine(preempt_at=0.9)  # preempts below the target: back-offs keep happening
    budgets = drive(ctrl, sim, windows=80)
    s = ctrl.buckets["le256"]
    assert s.backoffs, "the simulation should force back-offs"
    first = next(i for i, st in enumerate(s.steps) if st.action == "backoff")
    settled = budgets[first + 1 :]
    # Docstring bound: within [0.9, 1] x the ceiling, and the ceiling below what preempts.
    assert min(settled) >= 0.9 * s.ceiling * 0.95
    assert max(settled) <= s.ceiling / 0.95
    assert max(budgets[-20:]) / min(budgets[-20:]) <= 1.12


def test_plateau_holds_instead_of_growing():
    ctrl = BatchSizeController(initial_budget_tokens=10_000)
    ctrl.rows_for("le128", 100)
    ctrl.observe("le128", Observation(pressure=0.1, throughput=1000, rows=100))  # grows to 20k
    assert ctrl.budget("le128", 100) == 20_000
    ctrl.observe("le128", Observation(pressure=0.2, throughput=1010, rows=100))  # +1%: plateau
    assert ctrl.budget("le128", 100) == 20_000
    assert ctrl.buckets["le128"].steps[-1].action == "plateau"


def test_near_the_target_it_creeps_rather_than_doubles():
    ctrl = BatchSizeController(initial_budget_tokens=60_000)
    ctrl.rows_for("le128", 100)
    ctrl.observe("le128", Observation(pressure=0.85, throughput=1000, rows=600))
    assert ctrl.budget("le128", 100) == 66_000  # creep_fraction of 60k: more than half the way
    assert ctrl.buckets["le128"].steps[-1].action == "creep"


def test_further_from_the_target_it_creeps_half_the_way_and_never_aims_past_it():
    ctrl = BatchSizeController(initial_budget_tokens=60_000)
    ctrl.rows_for("le128", 100)
    ctrl.observe("le128", Observation(pressure=0.6, throughput=1000, rows=600))
    assert ctrl.budget("le128", 100) == 75_000  # half of 60k x (0.9 / 0.6 - 1) more
    # Pressure with a fixed part (weights 0.2 of memory): from 0.6 the band in 4 windows,
    # none past the target (creeping by 10% of 60k took 7).
    budgets, pressure = [], 0.6
    for _ in range(4):
        budgets.append(ctrl.budget("le128", 100))
        pressure = 0.2 + 0.4 * budgets[-1] / 60_000
        ctrl.observe("le128", Observation(pressure=pressure, throughput=1000, rows=600))
    assert 0.85 <= pressure <= 0.9
    assert [s.action for s in ctrl.buckets["le128"].steps[1:]] == ["creep"] * 5


@pytest.mark.parametrize("target", [0.49, 0.99])
def test_target_range_is_checked(target):
    with pytest.raises(ValueError, match="target"):
        ControllerSettings(target=target)


def test_learned_limits_are_ceilings_else_budgets():
    ctrl = BatchSizeController(initial_budget_tokens=50_000)
    ctrl.rows_for("a", 100)
    ctrl.rows_for("b", 100)
    ctrl.observe("b", Observation(pressure=0.8, throughput=1, rows=1, preemptions=1))
    assert ctrl.learned_limits() == {"a": 50_000, "b": 47_500}


def test_a_drained_window_does_not_move_the_budget():
    ctrl = BatchSizeController(initial_budget_tokens=10_000)
    ctrl.rows_for("le128", 100)
    ctrl.observe("le128", Observation(pressure=0.05, throughput=10, rows=3, drained=True))
    assert ctrl.budget("le128", 100) == 10_000
    assert ctrl.buckets["le128"].steps[-1].reason == "drain"
    # ...but a failure during a drain still backs off.
    ctrl.observe("le128", Observation(pressure=1.0, throughput=0, rows=0, oom=True, drained=True))
    assert ctrl.budget("le128", 100) == 5_000


def test_gain_between_near_equal_budgets_is_not_asked_and_never_overflows():
    ctrl = BatchSizeController(learned={"le256": 100_000})
    ctrl.budget("le256", 300)  # the bucket's state, started from what was learned
    s = ctrl.buckets["le256"]
    s.throughput = {99_999: (1.0, 1)}
    s.budget = 100_000
    assert ctrl._gain(s, 1e6) is None  # a budget 0.001% larger: no gain per doubling to speak of
    s.throughput = {50_000: (1.0, 1)}
    assert ctrl._gain(s, 4.0) == pytest.approx(3.0)  # 4x the throughput for one doubling
    s.throughput = {90_000: (1e-300, 1)}
    assert math.isfinite(ctrl._gain(s, 1e300))  # clamped, where the power overflowed a float
    assert ctrl._gain(s, 0.0) == -1.0
