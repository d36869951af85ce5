"""Batch-size choice for `pipeline tune` on synthetic sweeps: no engine, no GPU."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.tools.tune.choice import Choice, SweepPoint, choose, find_knee, repeats_agree, stop_reason
from pipeline.tools.tune.plot import plot_sweep

GRID = [1, 2, 4, 8, 16, 32, 64]
# The issue's case: steep up to 8; from 8 to 16 throughput grows 5% but P99 grows 200 ms.
SHARP = [110.0, 220.0, 430.0, 800.0, 840.0, 838.0, 841.0]
SHARP_P99 = [120.0, 130.0, 150.0, 200.0, 400.0, 800.0, 1600.0]


def sweep(throughput, batches=GRID, p99=None, pressure=None, oom=()) -> list[SweepPoint]:
    p99 = p99 or [100.0 * b for b in batches]
    pressure = pressure or [min(1.0, b / 80) for b in batches]
    return [SweepPoint(batch=b, throughput=t, rows_per_s=t / 100, p50_ms=q / 2, p99_ms=q, ttft_p50_ms=None,
                       peak_pressure=pr, preemptions=0, oom=b in oom, spread=0.05, repeats=2)
            for b, t, q, pr in zip(batches, throughput, p99, pressure)]


def assert_keeps_throughput(c: Choice) -> None:
    assert c.throughput >= 0.95 * c.best_throughput


# (a) The issue's example.

def test_issue_case_chooses_the_knee_at_8():
    c = choose(sweep(SHARP, p99=SHARP_P99))
    assert (c.batch, c.rule, c.knee) == (8, "knee", 8)
    assert (c.best_batch, c.best_throughput, c.throughput, c.p99_ms) == (64, 841.0, 800.0, 200.0)
    assert_keeps_throughput(c)
    assert "knee" in c.reason and "batch 8" in c.reason and "841 tok/s at batch 64" in c.reason


def test_knee_below_95_percent_moves_up_and_says_so():
    c = choose(sweep([110.0, 220.0, 430.0, 760.0, 840.0, 700.0, 841.0]))
    assert (c.knee, c.batch, c.rule) == (8, 16, "within-95%-of-max")
    assert_keeps_throughput(c)
    assert "moved up to batch 16" in c.reason and "760 tok/s" in c.reason


# (b) No knee.

def test_straight_line_in_log2_batch_falls_back_to_95_percent_rule():
    c = choose(sweep([1000.0 + 10 * i for i in range(len(GRID))]))  # 1000 .. 1060
    assert c.knee is None and c.rule == "within-95%-of-max"
    assert c.batch == 2  # 1010 >= 0.95 x 1060; batch 1's 1000 is not
    assert_keeps_throughput(c)
    assert "no knee" in c.reason and "smallest within 95%" in c.reason


def test_flat_curve_takes_the_smallest_batch():
    c = choose(sweep([500.0] * len(GRID)))
    assert (c.batch, c.knee, c.best_batch) == (1, None, 1)


# (c) Noise.

@pytest.mark.parametrize("seed", range(20))
def test_noisy_curve_still_finds_the_knee_and_keeps_95_percent(seed):
    rng = np.random.default_rng(seed)
    c = choose(sweep([t * (1 + rng.uniform(-0.04, 0.04)) for t in SHARP]))
    assert c.knee == 8
    assert 8 <= c.batch <= 32
    assert_keeps_throughput(c)


def test_a_dip_does_not_fake_a_knee():
    # Raw Kneedle calls batch 8 a knee here; the running maximum sees a straight line with a dip.
    points = sweep([100.0, 200.0, 300.0, 400.0, 300.0, 600.0, 700.0])
    assert find_knee(points) is None
    c = choose(points)
    assert c.batch == 64 and c.rule == "within-95%-of-max"


# (d) Short sweeps.

def test_only_three_points():
    c = choose(sweep([100.0, 190.0, 200.0], batches=[1, 2, 4]))
    assert c.batch == 2 and c.rule == "within-95%-of-max" and c.knee is None
    assert_keeps_throughput(c)


def test_two_points_use_the_95_percent_rule():
    c = choose(sweep([100.0, 300.0], batches=[1, 2]))
    assert c.batch == 2 and c.rule == "within-95%-of-max"
    assert "fewer than three points" in c.reason.lower()


def test_one_point():
    c = choose(sweep([100.0], batches=[4]))
    assert (c.batch, c.rule, c.best_batch) == (4, "only-point", 4)


# (e) Out of memory.

def test_sweep_cut_short_by_oom_never_chooses_the_oom_point():
    # The OOM window reports the highest throughput (a partial window): it must not count.
    points = sweep([300.0, 560.0, 1000.0, 1500.0, 1700.0, 5000.0], batches=GRID[:6], oom={32})
    c = choose(points)
    assert c.batch != 32 and c.best_batch == 16 and c.best_throughput == 1700.0
    assert_keeps_throughput(c)
    assert "batch 32" in c.reason and "excluded" in c.reason


def test_oom_points_are_excluded_from_the_knee_too():
    c = choose(sweep(SHARP + [9000.0], batches=GRID + [128], oom={128}))
    assert (c.batch, c.knee, c.best_batch) == (8, 8, 64)


def test_all_oom_raises():
    with pytest.raises(ValueError, match="without out-of-memory"):
        choose(sweep([100.0, 200.0], batches=[1, 2], oom={1, 2}))
    with pytest.raises(ValueError):
        choose([])


# (f) Latency objective.

@pytest.mark.parametrize("slo, batch", [(450.0, 16), (400.0, 16), (399.0, 8), (5000.0, 64)])
def test_slo_picks_the_largest_batch_meeting_it(slo, batch):
    c = choose(sweep(SHARP, p99=SHARP_P99), latency_slo_p99_ms=slo)
    assert (c.batch, c.rule) == (batch, "latency-slo")
    assert c.p99_ms <= slo and f"{slo:.0f} ms" in c.reason


def test_slo_ignores_oom_points():
    c = choose(sweep(SHARP, p99=SHARP_P99[:6] + [10.0], oom={64}), latency_slo_p99_ms=450.0)
    assert c.batch == 16


def test_slo_met_by_none_takes_the_smallest_batch_and_says_so():
    c = choose(sweep(SHARP, p99=SHARP_P99), latency_slo_p99_ms=100.0)
    assert (c.batch, c.rule) == (1, "slo-unmet")
    assert "No batch meets" in c.reason and "120 ms" in c.reason


# (g) Early stopping and repeats.

def test_stop_on_oom():
    points = sweep([100.0, 200.0, 0.0], batches=[1, 2, 4], pressure=[0.1, 0.2, 1.0], oom={4})
    assert "Batch 4 ran out of memory" in stop_reason(points, memory_target=0.9)


def test_stop_when_pressure_reaches_the_target():
    points = sweep([100.0, 200.0, 400.0], batches=[1, 2, 4], pressure=[0.2, 0.5, 0.9])
    assert "reached the memory target 0.90" in stop_reason(points, memory_target=0.9)
    assert stop_reason(points, memory_target=0.91) is None


def test_stop_when_throughput_plateaus_while_pressure_rises():
    rising = [0.05, 0.1, 0.2, 0.3, 0.4]
    points = sweep([100.0, 200.0, 400.0, 800.0, 830.0], batches=GRID[:5], pressure=rising)
    reason = stop_reason(points, memory_target=0.9)
    assert reason is not None and "+3.8%" in reason and "batch 8" in reason
    # Same plateau, pressure not rising: go on.
    flat = sweep([100.0, 200.0, 400.0, 800.0, 830.0], batches=GRID[:5], pressure=[0.05, 0.1, 0.2, 0.4, 0.4])
    assert stop_reason(flat, memory_target=0.9) is None
    # Still growing by 5% or more: go on.
    growing = sweep([100.0, 200.0, 400.0, 800.0, 840.0], batches=GRID[:5], pressure=rising)
    assert stop_reason(growing, memory_target=0.9) is None


def test_plateau_rule_waits_for_three_earlier_points():
    points = sweep([100.0, 101.0, 102.0], batches=[1, 2, 4], pressure=[0.1, 0.2, 0.3])
    assert stop_reason(points, memory_target=0.9) is None
    assert stop_reason([], memory_target=0.9) is None


def test_repeats_agree():
    assert repeats_agree([100.0, 109.0])
    assert not repeats_agree([100.0, 112.0])
    assert repeats_agree([50.0, 100.0, 105.0])  # only the last two windows count
    assert not repeats_agree([100.0])
    assert repeats_agree([100.0, 104.0], tolerance=0.05) and not repeats_agree([100.0, 106.0], tolerance=0.05)


def test_records_serialize_and_validate():
    c = choose(sweep(SHARP))
    assert json.loads(json.dumps(c.to_dict()))["batch"] == c.batch
    assert sweep([1.0])[0].to_dict()["ttft_p50_ms"] is None
    with pytest.raises(ValueError, match="batch"):
        SweepPoint(0, 1.0, 1.0, 1.0, 1.0, None, 0.1, 0)
    with pytest.raises(ValueError, match="rule"):
        Choice(1, "biggest", "", None, 1, 1.0, 1.0, 1.0)


# (h) Plot.

def test_plot_sweep_two_buckets_with_an_oom():
    import matplotlib.pyplot as plt

    short = sweep(SHARP, p99=SHARP_P99)
    cut = sweep([300.0, 560.0, 1000.0, 1500.0, 1700.0, 0.0], batches=GRID[:6], oom={32})
    figures = plt.get_fignums()
    png = plot_sweep({
        "le256": {"points": short, "choice": choose(short), "memory_target": 0.9},
        "le2048": {"points": cut, "choice": choose(cut), "memory_target": 0.85},
    })
    from tests.helpers import drawn

    width, height, ink = drawn(png)
    assert width == 1210 and height > 1000 and ink > 0.04  # two buckets, two panels each; one bucket: 0.074
    assert plt.get_fignums() == figures  # no global figure left behind


def test_a_curve_still_bending_upwards_has_no_knee():
    """Measured on CPU (le128, tiny model): throughput more than doubles early on, and
    Kneedle answers with the first point; that is no knee, and the fallback decides."""
    tps = [354, 900, 2000, 3900, 7400, 9600, 10800, 15600, 17047]
    points = [SweepPoint(batch=2 ** i, throughput=t, rows_per_s=t / 32, p50_ms=70 + 5 * i, p99_ms=90 + 40 * i,
                         ttft_p50_ms=None, peak_pressure=0.01 * i, preemptions=0) for i, t in enumerate(tps)]
    assert find_knee(points) is None
    c = choose(points)
    assert c.rule == "within-95%-of-max" and c.batch == 256 and "no knee" in c.reason
