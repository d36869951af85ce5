"""`pipeline tune` end to end: check, sample, sweep, choose, write."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig
from pipeline.storage.inputs import InputError
from pipeline.observe.machine import describe
from pipeline.tools.tune.choice import SweepPoint
from pipeline.tools.tune.outputs import TUNE_OUT, write_outputs
from pipeline.tools.tune.sweep import BucketResult, collect_sample, run_sweep, tuning_engine


@dataclass(frozen=True)
class TuneRequest:
    """What `pipeline tune` was asked: where its files go, prompts per bucket, the buckets
    (none: every one the sample has), the largest batch to try, and a P99 latency target."""

    out: Path
    sample: int = 64
    buckets: tuple[str, ...] = ()
    max_batch: int | None = None
    latency_slo_p99_ms: float | None = None


def tune_job(config: RunConfig, request: TuneRequest, on_point: Callable[[str, SweepPoint], None] | None = None,
             on_stage: Callable[[str], None] | None = None) -> tuple[dict[str, BucketResult], dict[str, Any]]:
    """Sweep the job's buckets on a sample of its input; (results, {meta, paths})."""
    from pipeline.run.job import job_inputs, resolve_model
    from pipeline.run.plan import prepare_settings, resolve_dtype
    from pipeline.stages.prepare import context_limit
    from pipeline.text.bucketing import LengthBucketer

    say = on_stage or (lambda _msg: None)
    config, dtype = resolve_dtype(config)
    if dtype is not None:
        say(f"engine.dtype auto: {dtype['dtype']} ({dtype['why']})")
    job, profile = config.job, config.profile
    buckets, sample = request.buckets, request.sample
    TUNE_OUT.check(request.out)  # before the sweep, and again when it writes
    names = LengthBucketer(profile.bucketing.boundaries).names
    unknown = sorted(set(buckets) - set(names))
    if unknown:
        raise InputError(f"--bucket {', '.join(unknown)}: no such bucket (buckets: {', '.join(names)})")
    inputs = job_inputs(config)
    started = time.monotonic()
    model_path = resolve_model(config)
    prepare = prepare_settings(config, model_path, context_limit(model_path, profile.engine.max_model_len))
    say(f"sampling up to {sample} prompts per bucket from {job.input.path}")
    prompts = collect_sample(prepare, inputs, sample, set(buckets) or None)
    if not prompts:
        raise InputError(f"{job.input.path}: no row could be prompted"
                         + (f" in buckets {', '.join(buckets)}" if buckets else ""))
    missing = sorted(set(buckets) - set(prompts))
    say(", ".join(f"{b}: {len(p)}" for b, p in prompts.items())
        + (f" (none in {', '.join(missing)})" if missing else "") + "; starting the engine")
    engine = tuning_engine(config, model_path)
    try:
        results = run_sweep(config, engine, prompts, request.max_batch, request.latency_slo_p99_ms, on_point)
    finally:
        engine.close()
    meta = {
        "tuned_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "job_file": config.job_file,
        "profile_file": config.profile_file,
        "model": profile.model.name,
        "input": job.input.path,
        "sample_per_bucket": sample,
        "sample_rows": sum(len(p) for p in prompts.values()),
        "max_new_tokens": job.sampling.max_new_tokens,
        "latency_slo_p99_ms": request.latency_slo_p99_ms,
        "engine": {"startup_s": round(engine.startup_s, 2), "max_num_seqs": engine.max_num_seqs,
                   "kv_cache_tokens": engine.kv_cache_tokens, "max_model_len": engine.max_model_len,
                   "prefix_caching": False, "dtype": profile.engine.dtype},
        "wall_s": round(time.monotonic() - started, 2),
        "machine": {**describe(), "accelerator": profile.hardware.accelerator},
        "skipped_buckets": missing,
    }
    paths = write_outputs(request.out, config, results, meta)
    return results, {"meta": meta, "paths": paths}
