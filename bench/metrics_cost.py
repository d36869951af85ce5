"""What the live metrics cost an engine, against its step time; and the scrape size per engine.

With one real vLLM engine on the tiny model (`make bench-metrics`):
1. the engine step time, from a batch of prompts fed through the feeder as a run does;
2. one update of each kind the engine actor makes, timed many times:
   - `count`: once per block (the block's rows by status and bucket, and tokens);
   - `snapshot`: every 2 s and after every block: the feeder's and policy's state, KV
     usage, and vLLM's own metrics read from its registry;
   - the snapshot's size, sent to the pool's log actor;
3. their cost per step: count / steps per block + snapshot x (snapshots per step), as a
   share of the step time. The goal is under 1%. End-to-end runs can't show this:
   their run-to-run noise here is larger than 1%.
4. the scrape size per engine: the exposition with one engine and with two.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time
from pathlib import Path


def timed(fn, repeats: int) -> float:
    """Median seconds of one call, over `repeats` batches of calls."""
    per = []
    for _ in range(repeats):
        n, t = 0, time.perf_counter()
        while time.perf_counter() - t < 0.2:
            fn()
            n += 1
        per.append((time.perf_counter() - t) / n)
    return statistics.median(per)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=64, help="prompts in the timed batch")
    ap.add_argument("--out", default="bench/results/metrics_cost.json")
    args = ap.parse_args()

    from pipeline.models.source import resolve_model
    from pipeline.generation.engine import Sampling
    from pipeline.generation.feeder import EngineFeeder
    from pipeline.generation.policy import FixedBatchPolicy
    from pipeline.config import EngineConfig
    from pipeline.generation.vllm import VLLMEngine
    from pipeline.observe.machine import describe
    from pipeline.observe.metrics import SNAPSHOT_INTERVAL_S, EngineMeter, MeterSources, RunLabels, RunMetrics
    from pipeline.run.plan import vllm_settings

    model = resolve_model("tiny").path  # built in the pipeline's cache on first use
    engine = VLLMEngine(vllm_settings(model, EngineConfig(max_model_len=2048, gpu_memory_utilization=0.2, enforce_eager=True), seed=0))
    feeder = EngineFeeder(engine, FixedBatchPolicy(32))
    sampling = Sampling(max_new_tokens=32, temperature=0.0, seed=0)
    prompts = [(i, list(range(5, 5 + 200 + i % 50))) for i in range(args.rows)]
    feeder.serve("le256", prompts[:8], sampling)  # warm up
    t = time.perf_counter()
    record = feeder.serve("le256", prompts, sampling).record
    wall = time.perf_counter() - t
    steps = record.steps
    mean_step = record.step_s / max(steps, 1)

    sent = []
    meter = EngineMeter("e0", "i0", "node", lambda who, snap: sent.append(snap),
                        MeterSources(feeder, feeder.policy, engine))
    status, buckets = ["ok"] * 128, ["le256"] * 128
    count_s = timed(lambda: meter.count(status, buckets, 25_000, 4_000), 5)
    snapshot_s = timed(meter.snapshot, 5)
    snap = meter.snapshot()
    snapshot_bytes = len(pickle.dumps(snap))

    steps_per_block = steps * 128 / args.rows  # a 128-row block takes about this many steps
    snapshots_per_step = mean_step / SNAPSHOT_INTERVAL_S + 1 / steps_per_block  # timer + once per block
    cost_per_step = count_s / steps_per_block + snapshot_s * snapshots_per_step

    def scrape(engines: int) -> int:
        m = RunMetrics(RunLabels("bench", "run", "out", "tiny"))
        m.state.engines = [{**snap, "engine": f"e{k}"} for k in range(engines)]
        return len(m.exposition())

    one, two = scrape(1), scrape(2)
    result = {
        "machine": describe(),
        "engine": {"rows": args.rows, "wall_s": round(wall, 3), "steps": steps, "mean_step_ms": round(mean_step * 1e3, 3)},
        "updates": {"count_us": round(count_s * 1e6, 2), "snapshot_us": round(snapshot_s * 1e6, 2),
                    "snapshot_bytes": snapshot_bytes, "vllm_families": len(snap["vllm"])},
        "per_step": {"steps_per_128_row_block": round(steps_per_block, 1),
                     "snapshots_per_step": round(snapshots_per_step, 5),
                     "cost_us": round(cost_per_step * 1e6, 3),
                     "share_of_step": round(cost_per_step / mean_step, 6)},
        "scrape_bytes": {"one_engine": one, "two_engines": two, "per_engine": two - one, "run_only": 2 * one - two},
    }
    engine.close()
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
