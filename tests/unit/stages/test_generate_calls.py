"""How the generate stage cuts a batch into engine calls (no engine needed)."""

from pipeline.stages.generate import bucket_runs

NAMES = ("le128", "le256", "le512", "gt512")


def test_calls_never_mix_buckets_and_cover_every_row_once():
    buckets = [0, 2, 0, 1, 2, 2, 0, 3, 1, 0]
    rows = list(range(len(buckets)))
    calls = bucket_runs(rows, buckets, "global", NAMES)
    seen = [i for _, members in calls for i in members]
    assert sorted(seen) == rows
    for name, members in calls:
        assert {NAMES[buckets[i]] for i in members} == {name}
    assert [name for name, _ in calls] == ["le128", "le256", "le512", "gt512"]
    # Within a bucket, arrival order is kept.
    assert calls[0] == ("le128", [0, 2, 6, 9])


def test_grouping_off_takes_arrival_order():
    assert bucket_runs([0, 1, 2], [0, 3, 1], "off", NAMES) == [("mixed", [0, 1, 2])]


def test_only_eligible_rows_are_called():
    assert bucket_runs([1, 3], [0, 0, 0, 0], "global", NAMES) == [("le128", [1, 3])]
    assert bucket_runs([], [], "global", NAMES) == []


def test_both_policies_trajectories_plot():
    """Fixed and adaptive trajectories have the same shape for the report and plot."""
    from pipeline.generation.policy import BatchSizeController, FixedBatchPolicy, Observation
    from pipeline.observe.report_plot import plot_trajectories
    from tests.helpers import drawn

    for policy in (FixedBatchPolicy(8), BatchSizeController(initial_budget_tokens=1000)):
        policy.rows_for("le128", 100)
        policy.observe("le128", Observation(pressure=0.3, throughput=50.0, rows=8))
        policy.observe("le128", Observation(pressure=0.1, throughput=20.0, rows=3, drained=True))
        traj = policy.trajectory("le128")
        report = {"job": "j", "run_id": "r", "batching": {
            "policy": "x", "memory_target": 0.9,
            "per_bucket": {"le128": {"trajectory": traj["steps"], "backoffs": traj["backoffs"]}}}}
        width, height, ink = drawn(plot_trajectories(report))
        assert width > height > 0 and ink > 0.03  # it drew the curves: empty axes ink 0.019
