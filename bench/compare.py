"""`pipeline bench`: the pipeline against raw vLLM, Ray Data LLM and its own ablations.

Every system runs in its own process on the same synthetic corpus, with the
same model, engine settings, prompts (the job's template and chat template,
rendered and tokenized by the job's own prepare stage) and sampling:

    raw           one `LLM.generate` over all the prompts, outputs written to Parquet:
                  what a user would write instead, and the ceiling
    ray-data-llm  Ray Data LLM (`ray.data.llm`): Parquet read, the job's prepare stage,
                  a vLLM engine processor, Parquet write: the other way to do it on Ray
    pipeline      `pipeline run` as shipped: Ray Data read, buckets, the adaptive actor, the sink
    pipeline-2    the same with `hardware.num_engines: 2`: the engine pool scaling out
    no-bucket     the same with `bucketing.grouping: off`
    NAME          with `--ablation NAME:KEY=VALUE` (repeatable): the pipeline with those
                  `--set`s, after the others, e.g. `core-apart:engine.in_process=false`
    fixed-N       the same with a fixed N rows in flight instead of adaptive sizing

Runs are interleaved (raw, ray-data-llm, pipeline, pipeline-2, no-bucket,
fixed..., then again) so that drift on the machine hits every system alike,
`--repeats` times each; the report gives medians and the spread (min..max).

Two throughputs are reported. *Wall* is output tokens over the whole process,
start-up included (Ray, about 20 s of engine start-up on CPU): what one run
costs. *Steady* is output tokens over the time the engines were generating,
from the first request to the last completion, gaps between batches included:
`LLM.generate` for raw; for the pipeline the pool's active span (the earliest
first request of any engine to the latest last completion); for Ray Data LLM
the engine's own request timestamps (first request queued to last token, from
vLLM's per-request metrics), or its whole execution if those are missing.
Steady is what the pipeline costs per token once started, which is what
millions of rows see. The goals (`GOALS`) are checked on the medians.

Ray Data LLM is set up as its documentation recommends for throughput, with
what this comparison needs on top:

- `batch_size` 32 and `max_concurrent_batches` 8, the documented defaults ("tuned
  for batch sizes >= 32"): 32 x 8 = 256 rows in flight per engine, which is vLLM's
  `max_num_seqs` on CPU. Where `max_num_seqs` is larger (GPUs), more concurrent
  batches, at least `max_num_seqs / batch_size`, as the stage's own warning asks.
- One engine (`concurrency` = `hardware.num_engines`, a fixed pool), like `pipeline`.
- Pre-tokenized prompts: the chat-template and tokenize stages are off and each row
  carries `tokenized_prompt` (the vLLM engine stage accepts it in place of `prompt`
  and hands vLLM a `TokensPrompt`), the token ids of the job's own prepare stage,
  run as a `map_batches` stage before the processor as the pipeline runs it.
- Detokenizing in the engine, as raw and the pipeline do: the detokenize stage is
  off (the documented example instead sets `detokenize=False` and detokenizes in a
  stage of its own, one more actor on a 2-core machine for the same work).
- The engine settings of `pipeline.run.plan.engine_kwargs`, plus `max_num_seqs` and
  `max_num_batched_tokens` pinned to what `vllm.LLM` resolves for them (unless the
  profile sets them): the processor builds its engine as `AsyncLLMEngine`, whose
  defaults are lower (on CPU 128 and 2,048 against `LLM`'s 256 and 4,096).
- `log_engine_metrics` off (on, its actor crashed on this CPU machine), and Ray
  started with a logical `num_gpus=1` on CPU: the engine stage asks Ray for a GPU
  and otherwise waits for one forever.
- `should_continue_on_error`, so a row the prepare stage refused comes out as an
  error row (rows in = rows out, as in the pipeline) instead of failing the job.

Peak resident memory is sampled every 0.2 s: the driver process alone, and
the sum over its descendants (Ray's workers and the engine core; for raw, the
engine core). Descendants still running when a system's process exits (Ray
Data LLM's engine actor and vLLM's workers outlived it by 15-20 s here) are
waited for, and killed after `LINGER_GRACE_S`, before the next run starts;
that wait is reported, not counted in the wall.

`--real` (`make bench-real`) is the same comparison on a real model and real
text (`REAL`): SmolLM2-135M-Instruct (`conf/local-real.yaml`) on the Python
manual's topics, with `make run`'s settings, raw and pipeline only by default.
The model is built or converted into the cache (`warm_model`) before the timed runs.
The goals are not checked there (they are set for the tiny model's synthetic
corpus); raw wall ÷ pipeline wall is recorded as the baseline of a later goal.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable

import psutil

from pipeline.observe.machine import describe
from pipeline.storage.ownership import MARK, NotOurs, OwnedFile, json_mark

REPO = Path(__file__).resolve().parents[1]
JOB = "jobs/nightly_summarize.yaml"
PROFILE = "conf/local.yaml"  # the synthetic variant's; every function takes the profile to run on
OWN_PROCESS = ("raw", "ray-data-llm")  # systems this module runs itself, each in a process of its own
POOL_BASE, POOL = "pipeline", "pipeline-2"  # the pool's speed-up is POOL over POOL_BASE
OURS = ("pipeline", "pipeline-2")  # the systems the goals are checked for
RAY_DATA_LLM_BATCH_SIZE = 32  # ProcessorConfig's default
RAY_DATA_LLM_CONCURRENT_BATCHES = 8  # OfflineProcessorConfig's default
FLAT_TOLERANCE = 0.15  # scaling: within 15% from the smallest row count to the largest is flat
LINGER_GRACE_S = 30.0  # how long a system's leftover processes may take to exit before they are killed


@dataclass(frozen=True)
class Goal:
    """A target on one ratio of medians, at the row counts the issue sets it for."""

    measure: str
    key: str  # the key in a `table_rows` row
    higher_is_better: bool
    targets: dict[int, float | None]  # rows -> target (None: no target at that size)
    strict: bool = False  # beyond the target, not at it

    def target_for(self, rows: int) -> tuple[int, float | None]:
        """The target that applies to a run of `rows`: the largest size at or below it,
        else the smallest (indicative only)."""
        sizes = sorted(self.targets)
        at = max((s for s in sizes if s <= rows), default=sizes[0])
        return at, self.targets[at]

    def met(self, value: float, target: float) -> bool:
        if self.strict:
            return value > target if self.higher_is_better else value < target
        return value >= target if self.higher_is_better else value <= target


GOALS = (
    Goal("wall vs raw (raw wall ÷ ours)", "wall_vs_raw", True, {4000: 0.90, 16000: 0.97}),
    Goal("our wall ÷ Ray Data LLM's wall", "wall_vs_ray_data_llm", False, {4000: 0.80, 16000: 0.80}),
    Goal("steady output tokens/s vs raw", "steady_tok_s_vs_raw", True, {4000: 0.98, 16000: 0.98}),
)
# With 6% of the documents repeated the pipeline generates each once, the script every row:
# at 16,000 rows it is to beat the script outright.
REPEATED_GOALS = (Goal("wall vs raw (raw wall ÷ ours)", "wall_vs_raw", True, {4000: None, 16000: 1.0}, strict=True),)
REPEAT_SHARE = 0.06  # a day of real documents tried here held 6% exact duplicates
GOAL_ROWS = (4000, 16000)


@dataclass(frozen=True)
class Variant:
    """What a bench variant is: the profile and corpus every system runs on, the `--set`s
    every system gets, what runs when the command line does not say, and whether `GOALS`
    (set for the tiny model on the synthetic corpus) are checked."""

    name: str
    title: str
    profile: str
    corpus_kind: str  # `write_corpus`'s kind
    sets: tuple[str, ...] = ()  # before each system's own
    rows: int = 2000
    repeats: int = 3
    systems: tuple[str, ...] | None = None  # None: every system
    out: str = "bench/results/pipeline_vs_raw"
    goals: tuple[Goal, ...] = GOALS  # none: not checked
    baseline_for: float | None = None  # raw wall ÷ pipeline wall is recorded as the baseline of this goal
    repeat_share: float = 0.0  # this share of the corpus's documents repeat others' text under ids of their own


SYNTHETIC = Variant("synthetic", "the pipeline against raw vLLM and Ray Data LLM", PROFILE, "synthetic")
# `make run`'s settings (Makefile RUN_SETS): a real model's two sentences need more than 32 tokens,
# and a context of 1,024 keeps prefill on 2 cores to minutes.
REAL = Variant("real", "raw vLLM against the pipeline, a real model on real text", "conf/local-real.yaml",
               "python-docs", sets=("sampling.max_new_tokens=64", "engine.max_model_len=1024"), rows=40,
               repeats=2, systems=("raw", "pipeline"), out="bench/results/real_model", goals=(),
               baseline_for=0.97)
REPEATED = Variant("repeated", "raw vLLM against the pipeline on a corpus that repeats 6% of its documents",
                   PROFILE, "synthetic", rows=16000, systems=("raw", "pipeline"), out="bench/results/repeated_16k",
                   goals=REPEATED_GOALS, repeat_share=REPEAT_SHARE)
VARIANTS = {v.name: v for v in (SYNTHETIC, REAL, REPEATED)}


def with_repeats(corpus: Any, share: float, seed: int = 0) -> Any:
    """`corpus` (a pyarrow table) with `share` of its rows' text and source replaced by
    another row's, ids kept: documents repeated as a real day's are."""
    import random

    import pyarrow as pa

    rng = random.Random(seed)
    n = corpus.num_rows
    copies = set(rng.sample(range(n), round(share * n)))
    texts, sources = corpus.column("text").to_pylist(), corpus.column("source").to_pylist()
    for i in sorted(copies):
        j = rng.randrange(n)
        while j in copies:
            j = rng.randrange(n)
        texts[i], sources[i] = texts[j], sources[j]
    return corpus.set_column(corpus.schema.get_field_index("text"), "text", pa.array(texts, pa.string())) \
        .set_column(corpus.schema.get_field_index("source"), "source", pa.array(sources, pa.string()))


@dataclass(frozen=True)
class Plan:
    """One `python -m bench`: a variant and what the command line chose on top of it."""

    variant: Variant
    rows: int
    repeats: int
    out: Path
    fixed: tuple[int, ...] = ()
    systems: tuple[str, ...] = ()  # none: the variant's
    ablations: tuple[str, ...] = ()  # "NAME:KEY=VALUE": the pipeline with these sets, run after the systems
    scaling: tuple[int, ...] = ()  # row counts for the full pipeline's scaling runs


@dataclass
class Sampled:
    """Peak RSS of a process and of its descendants, sampled while it runs, and what
    it left running when it exited."""

    driver: int = 0
    workers: int = 0
    samples: int = 0
    descendants: dict[int, psutil.Process] = field(default_factory=dict)  # every one seen
    lingering: int = 0  # descendants still running when the process exited
    lingering_s: float = 0.0  # how long until they were all gone


def watch(proc: subprocess.Popen, peak: Sampled, stop: threading.Event, every: float = 0.2) -> None:
    try:
        root = psutil.Process(proc.pid)
    except psutil.NoSuchProcess:
        return
    while not stop.is_set():
        try:
            driver = root.memory_info().rss
            workers = 0
            for child in root.children(recursive=True):
                peak.descendants.setdefault(child.pid, child)
                try:
                    workers += child.memory_info().rss
                except psutil.Error:
                    continue
        except psutil.Error:
            return
        peak.driver, peak.workers = max(peak.driver, driver), max(peak.workers, workers)
        peak.samples += 1
        stop.wait(every)


def outlived(procs: list[psutil.Process], grace_s: float) -> tuple[int, float]:
    """Wait for the processes a run left behind (Ray's workers and vLLM's engine
    processes can outlive their parents by tens of seconds), so the next run starts on
    an idle machine; kill, by handle, any still there after `grace_s`.
    (how many were left, seconds until all were gone)"""
    def running(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    started = time.monotonic()
    alive = [p for p in procs if running(p)]
    _, still = psutil.wait_procs(alive, timeout=grace_s) if alive else ([], [])
    for p in still:
        try:
            p.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(still, timeout=5.0)
    return len(alive), round(time.monotonic() - started, 2)


def run_process(cmd: list[str], log: Path, grace_s: float = LINGER_GRACE_S) -> tuple[float, Sampled]:
    """Run `cmd`, sampling its memory; (wall seconds until it exits, peaks). Then wait
    for what it left running (`outlived`). Raises with the log's tail on failure."""
    peak, stop = Sampled(), threading.Event()
    started = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        watcher = threading.Thread(target=watch, args=(proc, peak, stop), daemon=True)
        watcher.start()
        code = proc.wait()
    wall = time.monotonic() - started
    stop.set()
    watcher.join()
    peak.lingering, peak.lingering_s = outlived(list(peak.descendants.values()), grace_s)
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {code}:\n{log.read_text()[-3000:]}")
    return wall, peak


def set_args(sets: list[str]) -> list[str]:
    return [arg for s in sets for arg in ("--set", s)]


# --- the raw-vLLM system, run in its own process -------------------------------------


@dataclass(frozen=True)
class SameSetup:
    """What raw vLLM and Ray Data LLM take from the job and profile, as the pipeline does."""

    config: Any
    model: str
    prepare: Any  # the prepare stage's settings: the same prompts, tokenized the same way
    engine_kwargs: dict[str, Any]  # vllm.LLM's keyword arguments, `model` included
    engine_env: dict[str, str]  # the engine's environment (the CPU backend's KV cache size)
    sampling: dict[str, Any]  # vllm.SamplingParams' keyword arguments


def same_setup(corpus: str, output: str, sets: list[str], profile: str = PROFILE) -> SameSetup:
    from pipeline.config import load_run_config
    from pipeline.run.plan import engine_kwargs, prepare_settings, resolve_dtype
    from pipeline.run.job import resolve_model
    from pipeline.stages.prepare import context_limit

    # dtype auto made concrete as a run makes it, so every system runs the same dtype.
    config, _ = resolve_dtype(load_run_config(REPO / JOB, REPO / profile, sets, corpus, output))
    engine, sampling = config.profile.engine, config.job.sampling
    model = resolve_model(config)
    return SameSetup(
        config=config,
        model=model,
        prepare=prepare_settings(config, model, context_limit(model, engine.max_model_len)),
        engine_kwargs=engine_kwargs(model, engine, sampling.seed),
        engine_env={} if engine.cpu_kvcache_space_gib is None else
        {"VLLM_CPU_KVCACHE_SPACE": str(engine.cpu_kvcache_space_gib)},
        sampling={"max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                  "top_p": sampling.top_p, "seed": sampling.seed},
    )


def raw_vllm(corpus: str, output: str, sets: list[str], result: str, profile: str = PROFILE) -> None:
    """What a user would write: render the prompts, one `LLM.generate`, write the outputs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline import schema
    from pipeline.stages.prepare import PrepareStage

    started = time.monotonic()
    same = same_setup(corpus, output, sets, profile)
    table = pq.read_table(corpus)
    prepared = PrepareStage(same.prepare)(table)
    ok = [i for i, s in enumerate(prepared.column("status").to_pylist()) if s == "ok"]
    ids = prepared.column(schema.PROMPT_TOKEN_IDS).to_pylist()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from pipeline.generation.vllm_steps import StepTap, StepTimeline

    os.environ.update(same.engine_env)
    llm = LLM(**same.engine_kwargs)
    params = SamplingParams(**same.sampling)
    timeline = StepTimeline()  # each step timed and read as the pipeline's engine reads its own
    StepTap(llm.llm_engine, timeline)
    gen_started = time.monotonic()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids[i]) for i in ok], params, use_tqdm=False)
    gen_s = time.monotonic() - gen_started
    summaries: list[str | None] = [None] * table.num_rows
    for i, out in zip(ok, outputs):
        summaries[i] = out.outputs[0].text
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    Path(output).mkdir(parents=True, exist_ok=True)
    pq.write_table(table.append_column("summary", pa.array(summaries, pa.string())), f"{output}/part-0.parquet")
    Path(result).write_text(json.dumps({
        "rows_ok": len(ok), "rows_error": table.num_rows - len(ok), "output_tokens": tokens,
        "steady_s": gen_s, "inner_wall_s": time.monotonic() - started, "busy_fraction": None,
        "step_timeline": timeline.take(),
    }))


# --- the Ray Data LLM system, run in its own process -----------------------------------


def llm_batch_defaults(sets: list[str], result: str, profile: str = PROFILE) -> None:
    """Write the `max_num_seqs` and `max_num_batched_tokens` that `vllm.LLM` resolves for
    this profile's engine, as `--set`s, for those the profile leaves unset. Run in a
    process of its own, outside any timed system (it imports vLLM)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    from pipeline.config import load_run_config
    from pipeline.run.plan import engine_kwargs, resolve_dtype
    from pipeline.run.job import resolve_model

    config, _ = resolve_dtype(load_run_config(REPO / JOB, REPO / profile, sets))
    engine = config.profile.engine
    kwargs = engine_kwargs(resolve_model(config), engine, config.job.sampling.seed)
    scheduler = EngineArgs(**kwargs).create_engine_config(UsageContext.LLM_CLASS).scheduler_config
    pinned = []
    if engine.max_num_seqs is None:
        pinned.append(f"engine.max_num_seqs={scheduler.max_num_seqs}")
    if engine.max_num_batched_tokens is None:
        pinned.append(f"engine.max_num_batched_tokens={scheduler.max_num_batched_tokens}")
    Path(result).write_text(json.dumps(pinned))


class PrepareForProcessor:
    """The job's prepare stage as a Ray Data stage in front of the processor: the
    corpus's own columns, the row's status and error, and its token ids as
    `tokenized_prompt` (empty for a row the stage refused, which the engine stage
    then fails: an error row)."""

    def __init__(self, settings: Any, keep: list[str]) -> None:
        from pipeline.stages.prepare import PrepareStage

        self.stage, self.keep = PrepareStage(settings), keep

    def __call__(self, batch: Any) -> Any:
        from pipeline import schema

        prepared = self.stage(batch)
        return (prepared.select([*self.keep, "status"])
                .append_column("prepare_error", prepared.column("error"))
                .append_column("tokenized_prompt", prepared.column(schema.PROMPT_TOKEN_IDS)))


def engine_request(sampling_params: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """The processor's preprocess: the token ids are there already; add the sampling."""
    return {"sampling_params": dict(sampling_params)}


def summary_row(keep: list[str], row: dict[str, Any]) -> dict[str, Any]:
    """The processor's postprocess: the corpus's columns, the summary, and the engine's
    request timestamps (vLLM's monotonic clock) for the steady span."""
    metrics = row.get("metrics") or {}
    return {**{c: row[c] for c in keep}, "status": row["status"], "summary": row["generated_text"],
            "output_tokens": row["num_generated_tokens"],
            "engine_queued_ts": metrics.get("queued_ts") or None,
            "engine_last_token_ts": metrics.get("last_token_ts") or None}


def output_table(out_schema: Any, batch: Any) -> Any:
    """Every block in one schema. Error rows skip the postprocess and carry the
    processor's own columns: `status` stays the prepare stage's when it refused the
    row (with its reason in `error`), else becomes `error` with the engine stage's."""
    import pyarrow as pa

    def column(name: str) -> list[Any]:
        return batch.column(name).to_pylist() if name in batch.column_names else [None] * batch.num_rows

    status, errors = [], []
    for s, prepare_error, inference_error in zip(column("status"), column("prepare_error"),
                                                 column("__inference_error__")):
        refused = s not in (None, "ok")
        status.append(s if refused else "error" if inference_error else "ok")
        errors.append((prepare_error if refused else None) or inference_error or None)
    columns = []
    for f in out_schema:
        if f.name in ("status", "error"):
            columns.append(pa.array(status if f.name == "status" else errors, pa.string()))
        elif f.name in batch.column_names:
            columns.append(batch.column(f.name).cast(f.type))
        else:
            columns.append(pa.nulls(batch.num_rows, f.type))
    return pa.Table.from_arrays(columns, schema=out_schema)


def ray_data_llm(corpus: str, output: str, sets: list[str], result: str, profile: str = PROFILE) -> None:
    """Ray Data LLM as its documentation sets it up (see the module docstring): read,
    prepare, the vLLM engine processor, write."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.run.job import worker_env

    # 1. The same config, model, prompts and sampling as every other system.
    started = time.monotonic()
    same = same_setup(corpus, output, sets, profile)
    config, model, settings, params = same.config, same.model, same.prepare, same.sampling
    conf, hw = config.profile, config.profile.hardware
    kwargs = {k: v for k, v in same.engine_kwargs.items() if k != "model"}
    corpus_schema = pq.read_schema(corpus)
    keep = list(corpus_schema.names)
    out_schema = pa.schema([*corpus_schema, pa.field("summary", pa.string()), pa.field("output_tokens", pa.int32()),
                            pa.field("status", pa.string()), pa.field("error", pa.string()),
                            pa.field("engine_queued_ts", pa.float64()), pa.field("engine_last_token_ts", pa.float64())])

    # 2. Ray, with the engine's environment; on CPU a logical GPU per engine for the engine stage to take.
    import ray
    import ray.data
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    # As its documentation sets Ray up: a cluster's worker environment (Ray's own pool of
    # Parquet footer readers), with the engine's.
    env = {**worker_env(local=False), **same.engine_env}
    ray.init(num_cpus=hw.ray_num_cpus, num_gpus=hw.num_engines if hw.accelerator == "cpu" else None,
             include_dashboard=False, runtime_env={"env_vars": env})

    # 3. The processor: pre-tokenized prompts in, engine-detokenized text out.
    seqs = conf.engine.max_num_seqs or 0  # pinned by `llm_batch_defaults`
    batches = max(RAY_DATA_LLM_CONCURRENT_BATCHES, math.ceil(seqs / RAY_DATA_LLM_BATCH_SIZE))
    processor = build_processor(
        vLLMEngineProcessorConfig(
            model_source=model, engine_kwargs=kwargs, concurrency=(hw.num_engines, hw.num_engines),
            batch_size=RAY_DATA_LLM_BATCH_SIZE, max_concurrent_batches=batches,
            chat_template_stage=False, tokenize_stage=False, detokenize_stage=False,
            should_continue_on_error=True, log_engine_metrics=False,
        ),
        preprocess=partial(engine_request, params),
        postprocess=partial(summary_row, keep),
    )
    ds = ray.data.read_parquet(corpus).map_batches(
        PrepareForProcessor, fn_constructor_kwargs={"settings": settings, "keep": keep},
        batch_size=conf.batching.prepare_batch_rows, batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=hw.prepare_actors), num_cpus=1,
    )
    ds = processor(ds).map_batches(partial(output_table, out_schema), batch_format="pyarrow")

    # 4. Run it all: the write pulls every row through.
    run_started = time.monotonic()
    ds.write_parquet(output)
    execution_s = time.monotonic() - run_started
    ray.shutdown()

    # 5. What came out, read back: rows in must equal rows out.
    written = pq.read_table(output, columns=["output_tokens", "status", "engine_queued_ts", "engine_last_token_ts"])
    rows_in = pq.read_metadata(corpus).num_rows
    if written.num_rows != rows_in:
        raise RuntimeError(f"ray-data-llm: {rows_in} rows in, {written.num_rows} out")
    rows_ok = written.column("status").to_pylist().count("ok")
    queued = [t for t in written.column("engine_queued_ts").to_pylist() if t]
    last = [t for t in written.column("engine_last_token_ts").to_pylist() if t]
    steady_s = max(last) - min(queued) if queued and last else execution_s
    Path(result).write_text(json.dumps({
        "rows_ok": rows_ok, "rows_error": rows_in - rows_ok,
        "output_tokens": sum(n or 0 for n in written.column("output_tokens").to_pylist()),
        "steady_s": steady_s, "steady_from": "engine timestamps" if queued and last else "execution",
        "execution_s": execution_s, "inner_wall_s": time.monotonic() - started, "busy_fraction": None,
    }))


# --- one run of each system -------------------------------------------------------------


def pipeline_systems(fixed: list[int]) -> dict[str, list[str]]:
    systems = {"pipeline": [], POOL: ["hardware.num_engines=2"], "no-bucket": ["bucketing.grouping=off"]}
    for n in fixed:
        systems[f"fixed-{n}"] = [f"batching.policy={{kind: fixed, rows_per_call: {n}}}"]
    return systems


FIXED_SYSTEM = re.compile(r"fixed-[1-9][0-9]*")  # fixed-N: N rows in flight, named without --fixed N


def known_systems(fixed: list[int]) -> dict[str, list[str]]:
    """Every system with its `--set`s: raw vLLM and Ray Data LLM, then the pipeline's."""
    return {**{name: [] for name in OWN_PROCESS}, **pipeline_systems(fixed)}


def is_system(name: str) -> bool:
    """Whether `name` is one of the systems `--system` may name."""
    return name in known_systems([]) or FIXED_SYSTEM.fullmatch(name) is not None


def ablations(specs: tuple[str, ...] | list[str]) -> dict[str, list[str]]:
    """`--ablation NAME:KEY=VALUE`, repeatable: the pipeline with each NAME's sets (a NAME
    given twice gathers both)."""
    out: dict[str, list[str]] = {}
    for spec in specs:
        name, _, setting = spec.partition(":")
        name = name.strip()
        if not name or "=" not in setting or is_system(name):
            raise ValueError(f"--ablation {spec!r}: expected NAME:KEY=VALUE, NAME not a system's "
                             "(e.g. core-apart:engine.in_process=false)")
        out.setdefault(name, []).append(setting.strip())
    return out


def choose_systems(fixed: list[int], systems: list[str] | None = None,
                   default: tuple[str, ...] | None = None) -> dict[str, list[str]]:
    """The systems to run, in interleaving order, each with its `--set`s. `systems`
    names them (repeated or comma-separated); none means `default` and the `fixed`
    ones, or all if `default` is None. `fixed-N` may be named without `--fixed N`."""
    known = known_systems(fixed)
    names = [n.strip() for s in systems or [] for n in s.split(",") if n.strip()]
    if not names and default is None:
        return known
    names = names or [*default, *(f"fixed-{n}" for n in fixed)]
    for n in names:
        if not is_system(n):
            raise ValueError(f"unknown system {n!r} (known: {', '.join(known)}, fixed-N)")
        if n not in known:  # fixed-N named without --fixed N
            known.update(pipeline_systems([int(n.removeprefix("fixed-"))]))
    return {k: v for k, v in known.items() if k in names}


_PINNED_ENGINE_SETS: dict[tuple[str, ...], list[str]] = {}


def pinned_engine_sets(sets: list[str], work: Path, profile: str = PROFILE) -> list[str]:
    """`llm_batch_defaults` for this profile and these `--set`s, once per process (it
    depends only on them and the machine)."""
    key = (profile, *sets)
    if key not in _PINNED_ENGINE_SETS:
        result = work / "llm-batch-defaults.json"
        cmd = [sys.executable, "-m", "bench.compare", "--llm-batch-defaults", str(result), *set_args(sets),
               "--profile", profile]
        run_process(cmd, work / "llm-batch-defaults.log")
        _PINNED_ENGINE_SETS[key] = json.loads(result.read_text())
    return _PINNED_ENGINE_SETS[key]


def engine_stats(engine: dict[str, Any]) -> list[dict[str, Any]]:
    """Each engine's rows, share of the rows, busy fraction, idle and serving time,
    from a run report's `engine` section; the engine with the most rows first."""
    actors = engine.get("actors") or []
    share = (engine.get("pool") or {}).get("share_of_rows") or {}
    total = sum(a.get("rows", 0) for a in actors)
    stats = [{"actor": a["actor"], "rows": a.get("rows", 0),
              "share": share.get(a["actor"], round(a.get("rows", 0) / total, 4) if total else None),
              "busy_fraction": a.get("busy_fraction"), "idle_s": a.get("idle_s"), "serving_s": a.get("serving_s")}
             for a in actors]
    return sorted(stats, key=lambda s: -s["rows"])


def pool_span_s(actors: list[dict[str, Any]]) -> float | None:
    """The pool's generating span: the earliest first request of any engine to the
    latest last completion (`last_end_at` is wall-clock, `active_s` its own span).
    With one engine it is that engine's `active_s`."""
    spans = [(a["last_end_at"] - a["active_s"], a["last_end_at"]) for a in actors
             if a.get("active_s") and a.get("last_end_at")]
    if not spans:
        return max((a.get("active_s") or 0.0 for a in actors), default=0.0) or None
    return round(max(end for _, end in spans) - min(start for start, _ in spans), 4)


def git_commit() -> str:
    """The repository's short HEAD, for a result's header ("unknown" outside git)."""
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def run_system(name: str, sets: list[str], corpus: Path, work: Path, grace_s: float = LINGER_GRACE_S,
               profile: str = PROFILE, timeline: bool = False) -> dict[str, Any]:
    """One run of system `name` on `corpus` with `profile`, in its own process; its measurements.
    `timeline`: with every engine step's timeline (`step_timeline`, raw and the pipeline)."""
    out = work / f"{name}-out"
    shutil.rmtree(out, ignore_errors=True)  # every run writes a fresh output
    if name in OWN_PROCESS:
        result = work / f"{name}.json"
        if name == "ray-data-llm":
            sets = [*pinned_engine_sets(sets, work, profile), *sets]
        cmd = [sys.executable, "-m", "bench.compare", f"--{name}", str(corpus), str(out), str(result),
               *set_args(sets), "--profile", profile]
        wall, peak = run_process(cmd, work / f"{name}.log", grace_s)
        r = json.loads(result.read_text())
        steps = r.pop("step_timeline", None)
        if timeline:
            r["step_timeline"] = [steps]  # one engine, as the pipeline lists one per actor
    else:
        extra = ["debug.step_timeline=true"] if timeline else []
        cmd = [sys.executable, "-m", "pipeline", "run", JOB, "--profile", profile, "--input", str(corpus),
               "--output", str(out), *set_args(["batching.learned_limits=null", *sets, *extra])]
        wall, peak = run_process(cmd, work / f"{name}.log", grace_s)
        report = json.loads((out / "_report.json").read_text())
        r = {
            "rows_ok": report["status"].get("ok", 0),
            "rows_error": report["rows_out"] - report["status"].get("ok", 0),
            "output_tokens": report["tokens"]["output"],
            "steady_s": pool_span_s(report["engine"]["actors"]),
            "inner_wall_s": report["wall_s"],
            "busy_fraction": report["busy_fraction"],
            "engines": engine_stats(report["engine"]),
        }
        if timeline:
            r["step_timeline"] = [a["step_timeline"] for a in report["engine"]["actors"] if "step_timeline" in a]
    r.update(system=name, wall_s=round(wall, 3), peak_driver_rss_mib=round(peak.driver / 2**20, 1),
             peak_workers_rss_mib=round(peak.workers / 2**20, 1), memory_samples=peak.samples,
             lingering_processes=peak.lingering, lingering_s=peak.lingering_s)
    r["wall_tok_s"] = round(r["output_tokens"] / wall, 2)
    r["steady_tok_s"] = round(r["output_tokens"] / r["steady_s"], 2) if r.get("steady_s") else None
    return r


# --- medians, ratios, goals -------------------------------------------------------------


@dataclass
class Summary:
    system: str
    runs: list[dict[str, Any]] = field(default_factory=list)

    def median(self, key: str) -> float | None:
        values = [r[key] for r in self.runs if r.get(key) is not None]
        return statistics.median(values) if values else None

    def spread(self, key: str) -> tuple[float, float] | None:
        values = [r[key] for r in self.runs if r.get(key) is not None]
        return (min(values), max(values)) if values else None

    def engines(self) -> list[dict[str, Any]]:
        """Per engine, ranked by rows within each run: the medians over runs of its
        share, busy fraction, idle and serving time."""
        ranked = [r.get("engines") or [] for r in self.runs]
        out = []
        for rank in range(max((len(e) for e in ranked), default=0)):
            at = [e[rank] for e in ranked if len(e) > rank]
            med = {k: statistics.median(v) if (v := [s[k] for s in at if s.get(k) is not None]) else None
                   for k in ("rows", "share", "busy_fraction", "idle_s", "serving_s")}
            out.append({"engine": rank + 1, **med})
        return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Summary]:
    out: dict[str, Summary] = {}
    for r in runs:
        out.setdefault(r["system"], Summary(r["system"])).runs.append(r)
    return out


KEYS = ("wall_s", "wall_tok_s", "steady_tok_s", "busy_fraction", "peak_driver_rss_mib", "peak_workers_rss_mib",
        "rows_ok", "rows_error", "output_tokens", "lingering_processes", "lingering_s")


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def table_rows(summaries: dict[str, Summary]) -> list[dict[str, Any]]:
    raw, rdl = summaries.get("raw"), summaries.get("ray-data-llm")
    rows = []
    for name, s in summaries.items():
        row: dict[str, Any] = {"system": name, "runs": len(s.runs)}
        for key in KEYS:
            row[key] = s.median(key)
            row[key + "_range"] = s.spread(key)
        for key in ("wall_tok_s", "steady_tok_s"):
            row[key + "_vs_raw"] = _ratio(row[key], raw.median(key) if raw else None)
        row["wall_vs_raw"] = _ratio(raw.median("wall_s") if raw else None, row["wall_s"])
        row["wall_vs_ray_data_llm"] = _ratio(row["wall_s"], rdl.median("wall_s") if rdl else None)
        row["engines"] = s.engines()
        rows.append(row)
    return rows


def pool_speedup(rows: list[dict[str, Any]], base: str = POOL_BASE, pool: str = POOL) -> dict[str, Any] | None:
    """The pool's speed-up over one engine, from medians: wall (base wall ÷ pool wall)
    and steady (pool steady tok/s ÷ base steady tok/s); above 1 is faster."""
    by = {r["system"]: r for r in rows}
    if base not in by or pool not in by:
        return None
    return {"base": base, "pool": pool, "wall": _ratio(by[base]["wall_s"], by[pool]["wall_s"]),
            "steady": _ratio(by[pool]["steady_tok_s"], by[base]["steady_tok_s"])}


def goal_verdicts(rows: list[dict[str, Any]], n_rows: int, goals: tuple[Goal, ...] = GOALS) -> list[dict[str, Any]]:
    """Each goal for each of our systems in `rows`: the measured ratio of medians, the
    target for a run of `n_rows`, and met, missed, or None (no measure or no target)."""
    by = {r["system"]: r for r in rows}
    out = []
    for goal in goals:
        at, target = goal.target_for(n_rows)
        for system in (s for s in OURS if s in by):
            value = by[system].get(goal.key)
            verdict = None if value is None or target is None else ("met" if goal.met(value, target) else "missed")
            out.append({"measure": goal.measure, "system": system, "value": value, "target_rows": at,
                        "target": target, "verdict": verdict})
    return out


def baseline(rows: list[dict[str, Any]], goal: float | None) -> dict[str, Any] | None:
    """Raw wall ÷ pipeline wall from the medians, recorded as the baseline of a later goal
    of `goal` and not checked against it; None without a goal, or without both systems."""
    by = {r["system"]: r for r in rows}
    if goal is None or "raw" not in by or "pipeline" not in by:
        return None
    return {"measure": "raw wall ÷ pipeline wall", "system": "pipeline", "value": by["pipeline"]["wall_vs_raw"],
            "later_goal": goal, "checked": False}


def trend(points: list[tuple[int, float | None]], tolerance: float = FLAT_TOLERANCE
          ) -> tuple[str, float] | None:
    """From the smallest row count to the largest: ('flat' | 'falling' | 'growing', ratio)."""
    known = sorted((n, v) for n, v in points if v)
    if len(known) < 2:
        return None
    ratio = known[-1][1] / known[0][1]
    word = "flat" if abs(ratio - 1) <= tolerance else ("falling" if ratio < 1 else "growing")
    return word, round(ratio, 3)


# --- the report -------------------------------------------------------------------------


def _fmt(v: Any, spec: str = ",.0f") -> str:
    return "-" if v is None else format(v, spec)


def _target(goal: Goal, rows: int) -> str:
    t = goal.targets.get(rows)
    sign = ('>' if goal.strict else '≥') if goal.higher_is_better else ('<' if goal.strict else '≤')
    return "(none)" if t is None else f"{sign} {t:.2f}"


def goals_markdown(result: dict[str, Any]) -> list[str]:
    goals = VARIANTS[result.get("variant", SYNTHETIC.name)].goals
    if not goals:
        return ["", "## Goals", "",
                "Not checked: the goals are set for the tiny model on the synthetic corpus at 4,000 rows and "
                "up, and this run's model, text and sampling are not those, so a verdict would mislead."]
    n = result["rows"]
    verdicts = goal_verdicts(result["systems"], n, goals)
    ours = [s for s in OURS if any(v["system"] == s for v in verdicts)]
    if not ours:
        return []
    at = goals[0].target_for(n)[0]
    scope = (f"this run has {n:,} rows, so the targets at {at:,} rows apply"
             + ("" if n >= min(GOAL_ROWS) else f" (indicative only: they are set for {min(GOAL_ROWS):,} rows and up)"))
    lines = ["", "## Goals", "",
             f"Ratios of medians; {scope}. The first is raw's wall ÷ ours (higher is better), "
             "the second ours ÷ Ray Data LLM's (lower is better).", "",
             "| measure | " + " | ".join(f"target at {r:,} rows" for r in GOAL_ROWS) + " | "
             + " | ".join(ours) + " |",
             "| --- | " + " | ".join(":---:" for _ in GOAL_ROWS) + " | " + " | ".join("---:" for _ in ours) + " |"]
    for goal in goals:
        cells = []
        for system in ours:
            v = next(v for v in verdicts if v["system"] == system and v["measure"] == goal.measure)
            word = {"met": "**met**", "missed": "**missed**", None: "no target" if v["value"] is not None else ""}
            cells.append(f"{_fmt(v['value'], '.3f')} {word[v['verdict']]}".strip())
        lines.append(f"| {goal.measure} | " + " | ".join(_target(goal, r) for r in GOAL_ROWS) + " | "
                     + " | ".join(cells) + " |")
    return lines


def baseline_markdown(result: dict[str, Any]) -> list[str]:
    b = result.get("baseline")
    if not b:
        return []
    return ["", "## Baseline", "",
            f"{b['measure'].capitalize()} (medians): **{_fmt(b['value'], '.3f')}**. The baseline for a later "
            f"performance goal of ≥ {b['later_goal']:.2f}: recorded here, not checked."]


def pool_markdown(result: dict[str, Any]) -> list[str]:
    pools = [r for r in result["systems"] if r.get("engines")]
    if not pools:
        return []
    lines = ["", "## The engine pool", "",
             "Engines ranked by rows served in each run; medians over runs.", "",
             "| system | engine | rows | share of rows | busy fraction | idle s | serving s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in pools:
        for e in r["engines"]:
            lines.append(f"| {r['system']} | {e['engine']} | {_fmt(e['rows'])} | {_fmt(e['share'], '.3f')} | "
                         f"{_fmt(e['busy_fraction'], '.3f')} | {_fmt(e['idle_s'], ',.1f')} | "
                         f"{_fmt(e['serving_s'], ',.1f')} |")
    speedup = result.get("pool_speedup")
    if speedup:
        lines += ["", f"Speed-up of {speedup['pool']} over {speedup['base']}: wall "
                      f"**×{_fmt(speedup['wall'], '.3f')}** ({speedup['base']} wall ÷ {speedup['pool']} wall), "
                      f"steady **×{_fmt(speedup['steady'], '.3f')}** (steady output tokens/s)."]
    return lines


def scaling_markdown(scaling: list[dict[str, Any]]) -> list[str]:
    if not scaling:
        return []
    lines = ["", "## Scaling: the full pipeline at growing row counts", "",
             "| rows | wall s | wall s per 1,000 rows | steady s per 1,000 rows | driver RSS MiB | workers RSS MiB |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in scaling:
        lines.append(f"| {s['rows']:,} | {s['wall_s']:,.1f} | {s['wall_s_per_1k']:,.2f} | "
                     f"{_fmt(s['steady_s_per_1k'], ',.2f')} | {s['peak_driver_rss_mib']:,.0f} | "
                     f"{_fmt(s.get('peak_workers_rss_mib'))} |")
    lines.append("")
    for key, what, spec in (("steady_s_per_1k", "Steady s per 1,000 rows", ",.2f"),
                            ("peak_driver_rss_mib", "Peak driver RSS (MiB)", ",.0f"),
                            ("peak_workers_rss_mib", "Peak workers RSS (MiB)", ",.0f")):
        points = [(s["rows"], s.get(key)) for s in scaling]
        t = trend(points)
        if t is None:
            lines.append(f"- {what}: too few measurements to tell.")
            continue
        known = sorted((n, v) for n, v in points if v)
        (n0, v0), (n1, v1) = known[0], known[-1]
        lines.append(f"- {what}: {format(v0, spec)} at {n0:,} rows, {format(v1, spec)} at {n1:,} rows "
                     f"(×{t[1]:.2f}): **{t[0]}**.")
    lines += ["", f"Flat: the largest row count within ±{FLAT_TOLERANCE:.0%} of the smallest."]
    return lines


def header_markdown(result: dict[str, Any]) -> list[str]:
    """The title, the machine (CPU flags included), the model and dtype, and the setup."""
    m, variant = result["machine"], VARIANTS[result.get("variant", SYNTHETIC.name)]
    dtype = result.get("dtype") or {}
    why = f" ({dtype['why']})" if dtype.get("why") else ""
    at = f" at {result['commit']}" if result.get("commit") else ""
    lines = [
        f"# Benchmark: {variant.title} ({result['rows']:,} rows)",
        "",
        f"{result['finished_at']}{at} · {m['cpu']} ({', '.join(m.get('cpu_flags') or ['no AVX2/AVX-512'])}), "
        f"{m['cores']} cores, {m['memory_gib']} GiB · "
        f"vllm {m['versions'].get('vllm')}, ray {m['versions'].get('ray')}, torch {m['versions'].get('torch')} · "
        f"model {result['model']}, {result['max_new_tokens']} new tokens per row · "
        f"{result['repeats']} interleaved runs per system; medians, with the range (min..max) beneath.",
    ]
    if "profile" in result:
        sets = " ".join(f"`--set {s}`" for s in result.get("sets") or [])
        share = result.get("repeat_share") or 0
        repeated = f" with {share:.0%} of its documents repeated under ids of their own" if share else ""
        lines += ["", f"Profile {result['profile']}, the {result.get('corpus', 'synthetic')} corpus{repeated}"
                      + (f", {sets} on every system" if sets else "") + f"; dtype {dtype.get('dtype', '-')}{why}."]
    return lines


def markdown(result: dict[str, Any]) -> str:
    lines = [
        *header_markdown(result),
        "",
        "| system | wall s | raw wall ÷ wall | wall tok/s | steady tok/s | steady vs raw | busy | rows ok / error "
        "| driver RSS MiB | workers RSS MiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["systems"]:
        def cell(key: str, spec: str = ",.0f") -> str:
            rng = r[key + "_range"]
            span = "" if not rng or rng[0] == rng[1] else f"<br>{_fmt(rng[0], spec)}..{_fmt(rng[1], spec)}"
            return _fmt(r[key], spec) + span
        lines.append(
            f"| {r['system']} | {cell('wall_s', ',.1f')} | {_fmt(r.get('wall_vs_raw'), '.3f')} | "
            f"{cell('wall_tok_s')} | {cell('steady_tok_s')} | "
            f"{_fmt(r['steady_tok_s_vs_raw'], '.3f')} | {cell('busy_fraction', '.3f')} | "
            f"{_fmt(r['rows_ok'], ',.0f')} / {_fmt(r['rows_error'], ',.0f')} | {cell('peak_driver_rss_mib')} | "
            f"{cell('peak_workers_rss_mib')} |"
        )
    left = [r for r in result["systems"] if r.get("lingering_processes")]
    if left:
        lines += ["", "Processes that outlived their system's process (waited for, then killed after "
                      f"{LINGER_GRACE_S:.0f} s, before the next run; not in its wall): "
                  + ", ".join(f"{r['system']} {r['lingering_processes']:.0f}, gone after {r['lingering_s']:.1f} s"
                              for r in left) + " (medians)."]
    lines += goals_markdown(result)
    lines += baseline_markdown(result)
    lines += pool_markdown(result)
    lines += scaling_markdown(result.get("scaling") or [])
    lines += ["", "Wall: the whole process, start-up included. Steady: output tokens over the engines' "
              "generating span (first request to last completion, gaps between batches included). "
              "Written by `python -m bench`; see bench/compare.py for what each system runs.", ""]
    return "\n".join(lines)


def check_plan(plan: Plan) -> dict[str, list[str]]:
    """The systems to run, in interleaving order, each with its `--set`s (the variant's
    first); ValueError or NotOurs before minutes of runs if the plan can't be run or its
    result files are not ours to replace."""
    if plan.scaling and plan.variant.corpus_kind != "synthetic":
        raise ValueError(f"--scaling runs the synthetic corpus; the {plan.variant.name} variant has none")
    chosen = {**choose_systems(list(plan.fixed), list(plan.systems), plan.variant.systems),
              **ablations(plan.ablations)}
    for path, owned in result_files(plan.out).items():
        owned.check(path)
    return {name: [*plan.variant.sets, *sets] for name, sets in chosen.items()}


def warm_model(profile: str, sets: list[str], work: Path) -> None:
    """Build or convert the profile's model into the cache (the tiny model; SmolLM2 from the
    registry, `pipeline.models.packaged`) before the timed runs, in a process of its own, so
    no system's wall pays for a first use. A check of the cache when it is there already."""
    code = ("import sys; from pipeline.config import load_run_config; from pipeline.run.job import resolve_model; "
            "print(resolve_model(load_run_config(sys.argv[1], sys.argv[2], sys.argv[3:])))")
    run_process([sys.executable, "-c", code, str(REPO / JOB), str(REPO / profile), *sets], work / "model.log")


def run_interleaved(plan: Plan, chosen: dict[str, list[str]], corpus: Path, work: Path,
                    log: Callable[[str], None]) -> list[dict[str, Any]]:
    runs = []
    for rep in range(plan.repeats):
        for name, sets in chosen.items():
            r = run_system(name, sets, corpus, work, profile=plan.variant.profile)
            r["repeat"] = rep
            runs.append(r)
            log(f"  {rep + 1}/{plan.repeats} {name:>12}: wall {r['wall_s']:6.1f} s · steady "
                f"{_fmt(r['steady_tok_s'])} tok/s · wall {r['wall_tok_s']:,.0f} tok/s · "
                f"driver {r['peak_driver_rss_mib']:,.0f} MiB")
    return runs


def run_scaling(plan: Plan, work: Path, log: Callable[[str], None]) -> list[dict[str, Any]]:
    from pipeline.tools.dev.corpus import write_corpus

    scale = []
    for n in plan.scaling:
        corpus_n = write_corpus(work / f"corpus-{n}.parquet", rows=n, seed=0)
        r = run_system("pipeline", list(plan.variant.sets), corpus_n, work, profile=plan.variant.profile)
        scale.append({"rows": n, "wall_s": r["wall_s"], "wall_s_per_1k": round(r["wall_s"] / n * 1000, 3),
                      "steady_s_per_1k": round(r["steady_s"] / n * 1000, 3) if r.get("steady_s") else None,
                      "peak_driver_rss_mib": r["peak_driver_rss_mib"],
                      "peak_workers_rss_mib": r["peak_workers_rss_mib"], "output_tokens": r["output_tokens"]})
        log(f"  scaling {n:>6} rows: wall {r['wall_s']:.1f} s · driver {r['peak_driver_rss_mib']:,.0f} MiB · "
            f"workers {r['peak_workers_rss_mib']:,.0f} MiB")
    return scale


def bench_result(plan: Plan, config: Any, dtype: dict[str, str] | None, rows: int,
                 runs: list[dict[str, Any]], scale: list[dict[str, Any]]) -> dict[str, Any]:
    """The result: the setup (profile, corpus, `--set`s, the dtype resolved), the machine,
    the medians, the goals (where the variant checks them) and the baseline."""
    table, v = table_rows(summarize(runs)), plan.variant
    return {
        "variant": v.name, "rows": rows, "repeats": plan.repeats, "model": config.profile.model.name,
        "max_new_tokens": config.job.sampling.max_new_tokens, "job": JOB, "profile": v.profile,
        "corpus": v.corpus_kind, "sets": list(v.sets),
        "dtype": dtype or {"dtype": config.profile.engine.dtype, "why": None},
        "finished_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": git_commit(),
        "machine": describe(),
        "systems": table, "goals": goal_verdicts(table, rows, v.goals), "goals_checked": bool(v.goals),
        "repeat_share": v.repeat_share,
        "baseline": baseline(table, v.baseline_for), "pool_speedup": pool_speedup(table),
        "runs": runs, "scaling": scale,
    }


def bench(plan: Plan, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the plan: its corpus, every chosen system `plan.repeats` times interleaved, the
    scaling runs; write OUT.md and OUT.json and return the result."""
    import click
    import pyarrow.parquet as pq

    from pipeline.config import load_run_config
    from pipeline.run.plan import resolve_dtype
    from pipeline.tools.dev.corpus import write_corpus

    # The dtype as every system resolves it (`same_setup`, `pipeline run`), for the result.
    config, dtype = resolve_dtype(load_run_config(REPO / JOB, REPO / plan.variant.profile, list(plan.variant.sets)))
    try:
        chosen = check_plan(plan)
    except (ValueError, NotOurs) as e:
        raise click.UsageError(str(e)) from e
    with tempfile.TemporaryDirectory(prefix="pipeline-bench-") as tmp:
        work = Path(tmp)
        corpus = write_corpus(work / "corpus.parquet", rows=plan.rows, seed=0, kind=plan.variant.corpus_kind)
        if plan.variant.repeat_share:
            pq.write_table(with_repeats(pq.read_table(corpus), plan.variant.repeat_share), corpus)
        rows = pq.read_metadata(corpus).num_rows  # python-docs has 79 documents at most
        warm_model(plan.variant.profile, list(plan.variant.sets), work)
        runs = run_interleaved(plan, chosen, corpus, work, log)
        scale = run_scaling(plan, work, log)
    result = bench_result(plan, config, dtype, rows, runs, scale)
    data = {plan.out.with_suffix(".md"): markdown(result).encode(),  # first: it is ours by the JSON beside it
            plan.out.with_suffix(".json"): json.dumps({"written_by": MARK, **result}, indent=2).encode()}
    for path, owned in result_files(plan.out).items():
        owned.write(path, data[path])
    return result


def _is_result(path: Path) -> bool:
    """A JSON result of `pipeline bench`: marked, or (from before the mark) of its shape."""
    mark = json_mark(path.read_bytes()) if path.is_file() else None
    return mark is not None and (mark.get("written_by") == MARK or {"systems", "goals", "machine"} <= set(mark))


def result_files(out: Path) -> dict[Path, OwnedFile]:
    """OUT.json and OUT.md, each replaced only if `pipeline bench` wrote it: the JSON by its
    mark, the Markdown by the JSON result beside it."""
    instead = "Choose another --out."
    json_path = out.with_suffix(".json")
    return {out.with_suffix(".md"): OwnedFile("a `pipeline bench` table", lambda _p: _is_result(json_path), instead),
            json_path: OwnedFile("a `pipeline bench` result", _is_result, instead)}


def _main(argv: list[str]) -> None:
    """The own-process entries, each with optional `--set K=V` and `--profile P` after its paths:
    python -m bench.compare --raw|--ray-data-llm CORPUS OUTPUT RESULT
    python -m bench.compare --llm-batch-defaults RESULT"""
    usage = ("usage: python -m bench.compare --raw|--ray-data-llm CORPUS OUTPUT RESULT [--set K=V ...] "
             "[--profile P] | --llm-batch-defaults RESULT [--set K=V ...] [--profile P] (use `python -m bench`)")
    if not argv:
        raise SystemExit(usage)
    kind = argv[0]
    paths = 3 if kind in ("--raw", "--ray-data-llm") else 1 if kind == "--llm-batch-defaults" else None
    if paths is None or len(argv) < 1 + paths:
        raise SystemExit(usage)
    rest = argv[1 + paths:]
    if len(rest) % 2 or any(flag not in ("--set", "--profile") for flag in rest[::2]):
        raise SystemExit(usage)
    pairs = list(zip(rest[::2], rest[1::2]))
    sets = [value for flag, value in pairs if flag == "--set"]
    profile = next((value for flag, value in reversed(pairs) if flag == "--profile"), PROFILE)
    if kind == "--llm-batch-defaults":
        llm_batch_defaults(sets, argv[1], profile)
    else:
        (raw_vllm if kind == "--raw" else ray_data_llm)(argv[1], argv[2], sets, argv[3], profile)


if __name__ == "__main__":
    # Through the package's module, not __main__, so Ray pickles the processor's
    # functions and the prepare class by reference and every worker imports them.
    from bench.compare import _main as main

    main(sys.argv[1:])
