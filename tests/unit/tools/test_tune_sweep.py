"""The sweep's measuring loop against a fake engine (real vLLM: tests/integration/tools/test_tune.py)."""

import time

import pytest

from pipeline.generation.engine import Completion, Sampling
from pipeline.tools.tune.sweep import grid, measure, percentile, sweep_bucket


class FakeEngine:
    """Each step finishes every request in flight with 4 tokens; out of memory past `oom_at` in flight."""

    pads_batches = False
    padding = None

    def __init__(self, oom_at=None):
        self.oom_at = oom_at
        self.in_flight: list[str] = []
        self.n = 0
        self.aborted: list[str] = []
        self.max_num_seqs = 64
        self.last_step = 0

    def kv_gauges(self):
        return self.last_step / 100, 0

    def preempted(self):
        return []

    def submit(self, ids, params):
        self.n += 1
        self.in_flight.append(f"r{self.n}")
        return f"r{self.n}"

    def step(self):
        if self.oom_at is not None and len(self.in_flight) >= self.oom_at:
            raise RuntimeError("CUDA out of memory (fake)")
        time.sleep(0.002)  # a step costs the same at any batch size: throughput grows with it
        done, self.in_flight = self.in_flight, []
        self.last_step = len(done)
        return [(rid, Completion("x", 4, 0.0, "length", first_token_s=0.001)) for rid in done]

    def abort(self, rids):
        self.aborted += rids
        self.in_flight = [r for r in self.in_flight if r not in rids]


def test_grid_and_percentile():
    assert grid(64) == [1, 2, 4, 8, 16, 32, 64]
    assert grid(48) == [1, 2, 4, 8, 16, 32, 48]
    assert grid(1) == [1]
    assert percentile([1, 2, 3, 4], 50) == 2 and percentile(list(range(1, 101)), 99) == 99


def test_a_window_excludes_the_first_completion_and_counts_the_rest():
    engine = FakeEngine()
    w = measure(engine, Sampling(4), [[1, 2]], batch=4, rows=12)
    # Three waves of four: the first wave's completions start the clock; 8 rows after it.
    assert w.rows == 8 and w.tokens == 32 and len(w.latencies) == 12 and w.oom is None
    assert w.peak_pressure == pytest.approx(0.04)


def test_out_of_memory_ends_the_sweep_and_is_recorded():
    engine = FakeEngine(oom_at=16)
    points, stopped = sweep_bucket(engine, Sampling(4), [[1]], max_batch=64, memory_target=0.9)
    assert [p.batch for p in points] == [1, 2, 4, 8, 16]
    assert points[-1].oom and not any(p.oom for p in points[:-1])
    assert "out of memory" in stopped.lower() and engine.aborted
    assert all(p.repeats >= 2 for p in points[:-1])


def test_a_noisy_plateau_is_measured_again_before_it_stops_the_sweep(monkeypatch):
    """Seen on CPU: one slow window made batch 32 look 16% slower than 16 and ended the sweep."""
    from pipeline.tools.tune import sweep
    from pipeline.tools.tune.choice import SweepPoint

    calls = []

    def fake_point(engine, sampling, prompts, batch):
        calls.append(batch)
        noisy = batch == 32 and calls.count(32) == 1
        tps = 600.0 if noisy else 100.0 * batch
        return SweepPoint(batch=batch, throughput=tps, rows_per_s=1.0, p50_ms=1.0, p99_ms=2.0, ttft_p50_ms=None,
                          peak_pressure=0.01 * batch, preemptions=0, spread=0.6 if noisy else 0.02), []

    monkeypatch.setattr(sweep, "measure_point", fake_point)
    points, stopped = sweep.sweep_bucket(None, None, [[1]], max_batch=64, memory_target=0.9)
    assert calls == [1, 2, 4, 8, 16, 32, 32, 64] and stopped is None
    assert points[-2].throughput == 3200.0
