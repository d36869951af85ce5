"""`pipeline tune`: measure each bucket across batch sizes on a sample, choose, write a profile.

The sweep runs one real engine in this process, on prompts the job's own
prepare stage renders and tokenizes from a sample of the corpus, so what is
measured is what `run` will send. For each length bucket and each batch size
on a log2 grid (1, 2, 4, ... up to the engine's `max_num_seqs`), it keeps
exactly that many requests in flight over about three waves of rows, through
the same feeder `run` uses (a fixed policy; one recovery path), and records:

- steady-state throughput (output tokens/s and rows/s) from the first
  completion to the last, counting what finished after the first: the first
  wave's ramp-up is excluded;
- per-request latency (submit to finish), P50 and P99, and time to the first
  token, from the engine's own outputs;
- peak memory pressure (`MemoryProbe`, as the controller sees it) and
  preemptions; an out-of-memory error ends the bucket's sweep and is recorded.

A point is measured at least twice, and again (up to four times) until the
last two windows agree within 10%. The sweep of a bucket stops early by the
rules in `pipeline.tools.tune.choice` (a plateau seen by a point whose windows spread
more than 20% is measured once more before it counts); the choice is made
there too.

Prefix caching is off in the tuning engine: the sample's prompts are reused
across windows, and cached prefills would flatter every point after the first.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from pipeline import schema
from pipeline.config import RunConfig
from pipeline.stages.prepare import PrepareSettings
from pipeline.generation.engine import Engine, Sampling
from pipeline.generation.feeder import CallOutOfMemory, EngineFeeder
from pipeline.generation.policy import FixedBatchPolicy
from pipeline.generation.vllm import VLLMEngine
from pipeline.schema import Status
from pipeline.tools.tune.choice import Choice, SweepPoint, choose, repeats_agree, stop_reason

MIN_REPEATS = 2
MAX_REPEATS = 4
WAVES = 3  # rows per window = WAVES x batch: the first wave is warm-up, the rest is measured
MIN_WINDOW_ROWS = 8
NOISY_SPREAD = 0.20  # a point whose windows spread wider than this is measured again before a plateau stop


@dataclass
class Window:
    """One measurement at one batch size."""

    tokens: int = 0  # output tokens of the completions after the first
    rows: int = 0  # completions after the first
    seconds: float = 0.0  # first completion to last
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    peak_pressure: float = 0.0
    preemptions: int = 0
    oom: str | None = None

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def measure(engine: Engine, sampling: Sampling, prompts: list[list[int]], batch: int, rows: int,
            offset: int = 0) -> Window:
    """Run `rows` prompts (cycling through `prompts` from `offset`) with `batch` in flight,
    through the feeder `run` uses, with a fixed policy: the same admission, stepping,
    pressure readings and recovery. An out-of-memory ends the window as a result."""
    feeder = EngineFeeder(engine, FixedBatchPolicy(batch), stock_engine_queue=False, stop_on_oom=True)
    items = [(i, prompts[(offset + i) % len(prompts)]) for i in range(rows)]
    try:
        served = feeder.serve("tune", items, sampling)
    except CallOutOfMemory as e:
        return Window(oom=str(e))
    done = sorted((c for c in served.completions.values() if c.error is None), key=lambda c: c.finished_at or 0.0)
    w = Window(latencies=[c.latency_s for c in done], ttfts=[c.first_token_s for c in done if c.first_token_s],
               peak_pressure=served.record.peak_pressure, preemptions=served.record.preemptions)
    if done:
        first = done[0].finished_at or 0.0  # the clock starts here: what finished in that step is warm-up
        after = [c for c in done if (c.finished_at or 0.0) > first]
        w.tokens, w.rows = sum(c.output_tokens for c in after), len(after)
        w.seconds = (done[-1].finished_at or first) - first
    return w


def measure_point(engine: Engine, sampling: Sampling, prompts: list[list[int]],
                  batch: int) -> tuple[SweepPoint, list[Window]]:
    rows = max(WAVES * batch, MIN_WINDOW_ROWS)
    windows: list[Window] = []
    while len(windows) < MAX_REPEATS:
        w = measure(engine, sampling, prompts, batch, rows, offset=len(windows) * rows)
        windows.append(w)
        if w.oom:
            break
        if len(windows) >= MIN_REPEATS and repeats_agree([x.throughput for x in windows]):
            break
    if windows[-1].oom:
        return SweepPoint(batch=batch, throughput=0.0, rows_per_s=0.0, p50_ms=0.0, p99_ms=0.0,
                          ttft_p50_ms=None, peak_pressure=1.0, preemptions=0, oom=True,
                          repeats=len(windows)), windows
    tps = [w.throughput for w in windows]
    median = statistics.median(tps)
    latencies = [x for w in windows for x in w.latencies]
    ttfts = [x for w in windows for x in w.ttfts]
    return SweepPoint(
        batch=batch,
        throughput=round(median, 2),
        rows_per_s=round(statistics.median(w.rows / w.seconds if w.seconds > 0 else 0.0 for w in windows), 3),
        p50_ms=round(percentile(latencies, 50) * 1000, 2),
        p99_ms=round(percentile(latencies, 99) * 1000, 2),
        ttft_p50_ms=round(percentile(ttfts, 50) * 1000, 2) if ttfts else None,
        peak_pressure=round(max(w.peak_pressure for w in windows), 4),
        preemptions=sum(w.preemptions for w in windows),
        spread=round((max(tps) - min(tps)) / median, 4) if median > 0 else 0.0,
        repeats=len(windows),
    ), windows


def grid(limit: int) -> list[int]:
    """1, 2, 4, ... up to `limit` (and `limit` itself when it is not a power of two)."""
    sizes = [2 ** k for k in range(int(math.log2(max(limit, 1))) + 1)]
    return sizes if sizes[-1] == limit else [*sizes, limit]


def sweep_bucket(engine: Engine, sampling: Sampling, prompts: list[list[int]],
                 max_batch: int, memory_target: float,
                 on_point: Callable[[SweepPoint], None] | None = None) -> tuple[list[SweepPoint], str | None]:
    """Measure the grid until it ends or a stop rule fires; the points, and why it stopped."""
    points: list[SweepPoint] = []
    for batch in grid(max_batch):
        point, _ = measure_point(engine, sampling, prompts, batch)
        points.append(point)
        reason = stop_reason(points, memory_target)
        if reason is not None and not point.oom and point.peak_pressure < memory_target \
                and point.spread > NOISY_SPREAD:
            # A plateau seen by a point whose windows never agreed may be noise (on a
            # busy 2-core machine one window can run 40% slow): measure it again first.
            point, _ = measure_point(engine, sampling, prompts, batch)
            points[-1] = point
            reason = stop_reason(points, memory_target)
        if on_point is not None:
            on_point(point)
        if reason is not None:
            return points, reason
    return points, None


def iter_batches(inputs: Any, rows: int = 1024) -> Iterator[pa.Table]:
    """The input's rows in Arrow batches, read here (no Ray): the sample is small."""
    import pyarrow.parquet as pq

    if inputs.format == "parquet":
        for path in inputs.paths:
            for batch in pq.ParquetFile(path, filesystem=inputs.filesystem).iter_batches(batch_size=rows):
                yield pa.Table.from_batches([batch])
    else:
        for batch in inputs.dataset.with_format("arrow").iter(batch_size=rows):
            yield batch


def collect_sample(prepare: PrepareSettings, inputs: Any, per_bucket: int, buckets: set[str] | None = None,
                   max_scan_rows: int = 100_000) -> dict[str, list[list[int]]]:
    """Up to `per_bucket` prompts (token ids) per bucket, through the job's own prepare stage."""
    from pipeline.stages.prepare import PrepareStage

    prep = PrepareStage(prepare)
    sample: dict[str, list[list[int]]] = {}
    scanned = 0
    for batch in iter_batches(inputs):
        out = prep(batch)
        for status, bucket, ids in zip(out.column("status").to_pylist(), out.column("bucket").to_pylist(),
                                       out.column(schema.PROMPT_TOKEN_IDS).to_pylist()):
            if status != Status.OK or not ids or (buckets and bucket not in buckets):
                continue
            mine = sample.setdefault(bucket, [])
            if len(mine) < per_bucket:
                mine.append(ids)
        scanned += batch.num_rows
        full = buckets is not None and all(len(sample.get(b, [])) >= per_bucket for b in buckets)
        if full or scanned >= max_scan_rows:
            break
    return sample


def tuning_engine(config: RunConfig, model_path: str) -> VLLMEngine:
    from pipeline.run.plan import vllm_settings
    from pipeline.stages.prepare import context_limit

    engine = config.profile.engine
    extra = {"enable_prefix_caching": False, **engine.extra}
    # The KV cache sized as the run sizes it (on a CPU, no larger than it can fill).
    context = context_limit(model_path, engine.max_model_len) if config.profile.hardware.accelerator == "cpu" else None
    return VLLMEngine(vllm_settings(model_path, engine.model_copy(update={"extra": extra}), config.job.sampling.seed,
                                    context))


@dataclass
class BucketResult:
    points: list[SweepPoint]
    choice: Choice | None
    stopped: str | None
    prompts: int
    mean_prompt_tokens: float
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "points": [p.to_dict() for p in self.points],
            "choice": self.choice.to_dict() if self.choice else None,
            "stopped": self.stopped,
            "prompts": self.prompts,
            "mean_prompt_tokens": round(self.mean_prompt_tokens, 1),
            "error": self.error,
        }


def run_sweep(config: RunConfig, engine: Engine, sample: dict[str, list[list[int]]], max_batch: int | None,
              latency_slo_p99_ms: float | None,
              on_point: Callable[[str, SweepPoint], None] | None = None) -> dict[str, BucketResult]:
    """Sweep every sampled bucket, shortest first, and choose a batch size for each."""
    from pipeline.text.bucketing import LengthBucketer

    order = LengthBucketer(config.profile.bucketing.boundaries).names
    from pipeline.run.plan import sampling_of

    sampling = sampling_of(config.job.sampling)
    limit = min(max_batch or engine.max_num_seqs, engine.max_num_seqs)
    target = config.profile.batching.memory_target
    results: dict[str, BucketResult] = {}
    for bucket in sorted(sample, key=order.index):
        prompts = sample[bucket]
        points, stopped = sweep_bucket(engine, sampling, prompts, limit, target,
                                       None if on_point is None else (lambda p, b=bucket: on_point(b, p)))
        mean_tokens = statistics.mean(len(p) for p in prompts)
        try:
            choice, error = choose(points, latency_slo_p99_ms), None
        except ValueError as e:  # every point ran out of memory
            choice, error = None, str(e)
        results[bucket] = BucketResult(points, choice, stopped, len(prompts), mean_tokens, error)
    return results
