"""Wire the stages onto Ray Data and run one job: read, prepare, group, generate, write, report.

    read (Parquet, or `datasets`) -> PrepareStage (actors) -> window ordered by bucket ->
    GenerateStage (one engine per actor, a few blocks at once) -> ParquetPartsSink ->
    _report.json -> publish

Everything that can be checked without a model (config, input files, columns,
template fields, annotation schema, what is at the output path and whether
another run holds it) is checked before Ray starts. The output appears
whole, report included, or not at all, and replaces only what the pipeline
itself wrote there (see `pipeline.storage.output`).

Each part is committed as it is written (`pipeline.storage.commits`). A run that stops
keeps its staging; `--resume` continues it: the committed rows are filtered out
right after the read (with passages, after prepare, by id and passage), and the
report covers every row of the output, with the runs that wrote them (lineage).
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import datetime, timezone
from functools import partial
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc

from pipeline import schema
from pipeline.models import source as model_source
from pipeline.run import limits as limits_store
from pipeline.text.bucketing import LengthBucketer, window_order
from pipeline.storage.commits import COMMITS, key_columns, row_keys, without
from pipeline.config import AdaptivePolicy, RunConfig
from pipeline.config.models import STORE_ATTEMPTS, StoreConfig
from pipeline.storage.inputs import InputError, check_inputs, duplicate_ids
from pipeline.observe.metrics import RunLabels, RunMetrics, Watch
from pipeline.storage.fs import store_env
from pipeline.storage.output import OutputTarget, PublishError
from pipeline.run.plan import (StoreFit, engine_description, fit_to_store, generate_settings,
                               keeps_engine_cpus_apart, prepare_settings, resolve_dtype, result_keys)
from pipeline.run.affinity import EngineCpuGuard
from pipeline.run.pool import EnginePool, end_engine_processes, runtime_env
from pipeline.observe.progress import progress_for
from pipeline.observe.report import (RunContext, RunReport, actor_summaries, batching_section, build_report,
                                     engine_calls, servers, write_beside, write_report)
from pipeline.observe.report_plot import plot_trajectories
from pipeline.reuse.index import REUSED_FROM, ReuseIndex, keyed_look_up, result_columns
from pipeline.reuse.sources import EarlierOutput, comparable, find_earlier
from pipeline.stages.prepare import PrepareSettings, context_limit

log = logging.getLogger(__name__)

PLOT_NAME = "_batching.png"
SETTLE_S = 5.0  # the most a finished run waits for the engines' last metrics snapshots

# Quiet by default: vLLM logs every engine start at INFO, once per actor.
WORKER_ENV_DEFAULTS = {"VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "true"}
# On a local Ray only. Ray Data's Parquet reader (Ray 2.60) reads the input's footers on a
# pool of 32 actors, each a Python worker to start: on 2 cores their starts held both
# cores for about 4 s at every run's start, ahead of the engine's build and the first
# tokenized rows (bench/README.md, "Incremental nightly runs"). One actor, with its 128
# I/O threads, reads a machine's own corpus; a cluster keeps Ray's pool.
LOCAL_WORKER_ENV_DEFAULTS = {"RAY_DATA_PARQUET_FOOTER_NUM_ACTORS": "1"}


def worker_env(local: bool, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the run gives Ray's workers: the defaults above, where `environ`
    (this process's) does not set them already."""
    environ = os.environ if environ is None else environ
    defaults = WORKER_ENV_DEFAULTS | (LOCAL_WORKER_ENV_DEFAULTS if local else {})
    return {k: environ.get(k, v) for k, v in defaults.items()}


def new_run_id() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]


def resolve_model(config: RunConfig) -> str:
    """What the engine loads for `model.name`: your folder (checked, only ever read), the
    tiny model in the cache (built there on first use), or a hub id (`pipeline.models.source`);
    `engine.max_model_len` checked against the model's positions."""
    model = config.profile.model
    path = model_source.resolve_model(model.name, model.tiny_model_seed).path
    model_source.check_context(path, config.profile.engine.max_model_len)
    return path


def job_inputs(config: RunConfig) -> Any:
    """The job's input, found and checked (schema, columns, template fields) without a model."""
    return check_inputs(config.job.input, config.job.template_fields(), job_file=config.job_file)


def init_ray(config: RunConfig) -> None:
    import ray

    if ray.is_initialized():
        return
    hw = config.profile.hardware
    env_vars = worker_env(local=not hw.ray_address)
    env_vars |= store_env(config.profile.store.request_timeout_s, config.profile.store.connect_timeout_s)
    if hw.ray_address:
        # ray.init uploads the working_dir; the folder is not needed after it.
        with tempfile.TemporaryDirectory(prefix="pipeline-empty-") as empty:
            ray.init(address=hw.ray_address, runtime_env=runtime_env(hw, env_vars, empty), log_to_driver=True)
    else:
        # A local instance's workers inherit this process's environment: no runtime_env,
        # whose every worker starts through Ray's setup_worker (a second interpreter) and
        # its agent. Measured on 2 cores: the engine ready about 5 s sooner.
        os.environ.update(env_vars)
        store = hw.object_store_mb * 2**20 if hw.object_store_mb else None
        ray.init(num_cpus=hw.ray_num_cpus, object_store_memory=store, include_dashboard=False)


def group_window(batch: pa.Table, block_rows: int | None = None, bounds: list[int] | None = None) -> pa.Table:
    """One window of prepared rows, grouped by bucket (see `bucketing.window_order`). With
    reuse, the rows to generate come first and the reused ones after: blocks then hold
    one kind, and an engine gets full blocks of work, not a few rows in each."""
    buckets = batch.column(schema.BUCKET_INDEX).to_pylist()
    if REUSED_FROM not in batch.column_names:
        order = window_order(buckets, block_rows, bounds)
    else:
        found = batch.column(REUSED_FROM).is_valid().to_pylist()
        fresh = [i for i, f in enumerate(found) if not f]
        order = [fresh[k] for k in window_order([buckets[i] for i in fresh], block_rows, bounds)]
        order += [i for i, f in enumerate(found) if f]
    return batch.take(pa.array(order, pa.int64()))


_COMMITTED: dict[str, Any] = {}  # per worker process: the committed keys, fetched once


def skip_committed(batch: pa.Table, committed: list[Any], columns: list[str]) -> pa.Table:
    """The rows of `batch` whose output key is not committed. `committed`: [an ObjectRef
    of the keys], in a list so that Ray hands it over unresolved and each worker
    fetches it once."""
    import ray

    ref = committed[0]
    keys = _COMMITTED.get(ref.hex())
    if keys is None:
        keys = _COMMITTED[ref.hex()] = ray.get(ref)
    return without(batch, keys, columns)


def read_and_prepare(config: RunConfig, inputs: Any, settings: PrepareSettings,
                     skip: tuple[Any, list[str]] | None = None, shards: list[Any] | None = None,
                     look_up: Callable[[pa.Table], pa.Table] | None = None) -> Any:
    """The input read and run through the prepare stage (lazy: nothing runs yet). `skip`:
    (ObjectRef of committed keys, key columns) of a resumed run. `shards`: the reuse
    index's, where rows may be found by their input key before they are tokenized.
    `look_up`: each prepared batch's result keys looked up, in the prepare actor."""
    from ray.data import ActorPoolStrategy

    from pipeline.stages.prepare import PrepareStage

    def skipping(ds: Any, **options: Any) -> Any:
        assert skip is not None
        return ds.map_batches(skip_committed, fn_kwargs={"committed": [skip[0]], "columns": skip[1]},
                              batch_format="pyarrow", **options)

    ds = inputs.read()
    passages = skip is not None and len(skip[1]) > 1
    if skip and not passages:  # whole documents: skipped before they are tokenized
        ds = skipping(ds)
    # Blocks of one tokenizing batch: a read block (a file, a row group, up to 128 MiB)
    # would otherwise come out of prepare whole, and nothing downstream could start
    # before its last row was tokenized.
    rows = config.profile.batching.prepare_batch_rows
    ds = ds.repartition(target_num_rows_per_block=rows).map_batches(
        PrepareStage,
        fn_constructor_kwargs={"settings": settings, "shards": shards, "look_up": look_up},
        batch_size=rows,
        batch_format="pyarrow",
        compute=ActorPoolStrategy(size=config.profile.hardware.prepare_actors),
        num_cpus=1,
    )
    if skip and passages:  # a document's passages exist once it is cut: skipped by id and passage
        ds = skipping(ds, num_cpus=0.1, concurrency=1)
    return ds


def corpus_percentile_cap(config: RunConfig, inputs: Any, prepare: PrepareSettings) -> int:
    """The prompt-token cap at `length.outlier_percentile` of the corpus's prompt
    lengths, from a tokenizing pass over it, so one giant document does not
    set a bucket's shape."""
    import numpy as np
    import ray

    ds = read_and_prepare(config, inputs, prepare).select_columns(["prompt_tokens", "original_tokens"])
    table = pa.concat_tables(ray.get(ds.to_arrow_refs()))
    measured = pc.if_else(pc.is_null(table.column("original_tokens")), table.column("prompt_tokens"),
                          table.column("original_tokens")).drop_null().to_numpy()
    if len(measured) == 0:
        raise InputError(f"{config.job.input.path}: no row could be tokenized to take a percentile of")
    return max(1, int(np.percentile(measured, config.job.length.outlier_percentile)))


class RunStopped(RuntimeError):
    """The run failed with rows committed: its staging is kept, and `--resume` continues it."""


def _causes(e: BaseException | None) -> Iterator[BaseException]:
    """`e` and what caused it, in turn (a Ray task's error names the worker's as `cause`)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__ or getattr(e, "cause", None)


def _no_space(e: BaseException) -> bool:
    """Whether a disk ran full: ENOSPC anywhere in the chain, or in a Ray task's error,
    which carries the worker's exception as text."""
    return any(isinstance(c, OSError) and c.errno == errno.ENOSPC or "No space left on device" in str(c)
               for c in _causes(e))


# What pyarrow (curl) and botocore say of a store that does not answer.
_UNANSWERED = ("AWS Error NETWORK_CONNECTION", "curlCode: 28", "Timeout was reached", "ConnectTimeoutError",
               "ReadTimeoutError", "EndpointConnectionError", "Could not connect to the endpoint",
               "Read timeout on endpoint", "Connect timeout on endpoint")


def store_unanswered(e: BaseException) -> str | None:
    """The line that says an object store stopped answering, if that is why `e` was raised
    (Ray tasks' errors carry the worker's exception as text); None otherwise."""
    for c in _causes(e):
        for line in str(c).splitlines():
            if any(mark in line for mark in _UNANSWERED):
                return line.strip()[:300]
    return None


def why_stopped(e: BaseException, target: OutputTarget, store: StoreConfig) -> str:
    """The one-line reason a run stopped, naming the path where the fault was ours to see."""
    if _no_space(e):
        return (f"no space left on the device of {target.staging.root} while writing the output's parts; free "
                "space there")
    unanswered = store_unanswered(e)
    if unanswered is not None:
        return (f"an object store stopped answering ({STORE_ATTEMPTS} tries of store.request_timeout_s "
                f"{store.request_timeout_s:g} s, {store.bound_s:g} s in all): {unanswered}")
    return f"{type(e).__name__}: {e}"


def run_job(config: RunConfig, run_id: str | None = None,
            stopped: Literal["refuse", "resume", "restart"] = "refuse", watch: Watch | None = None) -> RunReport:
    """Run the job end to end and return its report (also written as `_report.json`).
    `stopped`: what to do with a stopped run of this output: refuse, resume or restart.
    `watch`: live metrics and progress (`pipeline.observe.metrics`, `pipeline.observe.progress`)."""
    run_id = run_id or new_run_id()
    watch = watch or Watch()
    metrics = RunMetrics(RunLabels(config.job.name, run_id, config.job.output.path, config.profile.model.name),
                         watch)
    progress = progress_for(config.job.name, watch.progress, watch.progress_interval_s, watch.out)
    if progress is not None:
        metrics.watchers.append(progress)
    try:
        metrics.start()
    except OSError as e:  # the port is taken: the run goes on, and says so
        log.warning("no metrics endpoint on port %s: %s", watch.metrics_port, e)
        metrics.port = None
        metrics.start()
    from ray.data import DataContext

    # Ray's own progress bars (or, off a terminal, a block of lines every few seconds): only
    # with --verbose; the run's progress (`pipeline.observe.progress`) says what matters.
    DataContext.get_current().enable_progress_bars = watch.verbose
    # Object-store requests: the profile's timeouts and STORE_ATTEMPTS bound each one, in this
    # process and (init_ray) the workers. Ray Data's own retries of reads that failed so (10,
    # with back-off) would multiply that bound by ten.
    DataContext.get_current().retried_io_errors = []
    os.environ.update(store_env(config.profile.store.request_timeout_s, config.profile.store.connect_timeout_s))
    success = False
    try:
        report = _run(config, run_id, stopped, metrics, watch.verbose)
        success = True
        return report
    finally:
        metrics.finish(success)
        if progress is not None:
            progress.close()


def _run(config: RunConfig, run_id: str, stopped: Literal["refuse", "resume", "restart"],
         metrics: RunMetrics, verbose: bool = False) -> RunReport:
    ctx = checked(config, run_id)
    # 2. The output: this run's lease on it, a check of what is there, and the staging.
    job = config.job
    target = OutputTarget(job.output.path, job.name, run_id, backup_existing=job.output.backup_existing,
                          stopped=stopped, kill_publish_at=config.profile.debug.kill_publish_at)
    target.open(rows_in=ctx.inputs.rows)
    store = config.profile.store
    unanswered = False  # an object store stopped answering: nothing more is asked of it
    try:
        try:
            generate(ctx, target, metrics, verbose)
            report = finish(ctx, target)
        except PublishError:
            raise  # every row is written: the staging holds the complete output, and stays
        except BaseException as e:
            if not target.local and store_unanswered(e) is not None:
                unanswered = True  # the staging stays as it is; its committed parts are for --resume
                raise RunStopped(f"{why_stopped(e, target, store)}. The staging {target.staging.root} is kept as "
                                 "it is: run again with --resume once the store answers") from e
            kept = target.stop()
            if isinstance(e, (ValueError, KeyboardInterrupt)):
                raise
            if kept is None:
                if _no_space(e):
                    raise RunStopped(f"{why_stopped(e, target, store)}. No row was committed") from e
                raise
            raise RunStopped(f"{why_stopped(e, target, store)}. {kept}, kept in {target.staging.root}: "
                             "run again with --resume to continue it") from e
        # 5. Publish; a failure here keeps the staging, which holds the complete output.
        if hold := config.profile.debug.hold_before_publish_s:
            log.warning("debug.hold_before_publish_s=%g: publishing %s in %g s", hold, job.output.path, hold)
            time.sleep(hold)
        try:
            report.warnings += target.publish()
        except PublishError as e:
            unanswered = not target.local and store_unanswered(e) is not None
            if unanswered:
                raise PublishError(f"{e} The object store stopped answering: run again with --resume once it "
                                   "answers, to publish it") from e
            raise
        report.publish.update(target.published)
    finally:
        target.close(release=not unanswered)  # an unanswered lease runs out by itself (LEASE_S)
    return report


def checked(config: RunConfig, run_id: str) -> RunContext:
    """1. What can be checked before any cluster: the input, the model (the tiny one built
    if asked for), every path the run writes besides its output, the output's schema."""
    config, dtype = resolve_dtype(config)
    job = config.job
    ctx = RunContext(config, run_id)
    if dtype is not None:
        ctx.checks["dtype"] = dtype
    ctx.inputs = job_inputs(config)
    ctx.model_path = resolve_model(config)
    learned = config.profile.batching.learned_limits
    if learned and isinstance(config.profile.batching.policy, AdaptivePolicy):
        limits_store.LIMITS_FILE.check(learned)
    annotation_fields = job.annotations.fields() if job.annotations else []
    try:
        ctx.out_schema = schema.output_schema(ctx.inputs.schema, job.input.id_column, job.input.text_column,
                                              passages=job.passages is not None, annotation_fields=annotation_fields)
    except ValueError as e:
        raise InputError(f"{config.job_file}: {job.input.path}: {e}") from None
    ctx.reuse_sources, ctx.reuse_notes = earlier_outputs(config, ctx.out_schema)
    return ctx


def earlier_outputs(config: RunConfig, out_schema: pa.Schema) -> tuple[list[EarlierOutput], list[str]]:
    """The earlier outputs this run may take results from (`reuse:` in the job, or
    --reuse), proven this pipeline's (else ReuseError, exit 2), and those left out, why."""
    reuse = config.job.reuse
    if not reuse.enabled or not reuse.paths:
        return [], []
    found = find_earlier(list(reuse.paths), reuse.lookback, exclude=config.job.output.path)
    return comparable(found, result_columns(out_schema))


def generate(ctx: RunContext, target: OutputTarget, metrics: RunMetrics, verbose: bool = False) -> None:
    """3. Every row generated into the staging: the dataset built, then pulled through the
    engine pool by the write."""
    profile = ctx.config.profile
    ctx.max_model_len = context_limit(ctx.model_path, profile.engine.max_model_len)
    ctx.bucket_order = LengthBucketer(profile.bucketing.boundaries).names
    ctx.limits_key = limits_store.limits_key(
        profile.model.name, limits_store.hardware_id(profile.hardware.accelerator), ctx.max_model_len,
        profile.engine.dtype, profile.engine.backend,
    )
    ctx.start_limits = limits_store.load_limits(
        profile.batching.learned_limits, ctx.limits_key, profile.batching.learned_max_age_days
    )
    init_ray(ctx.config)
    from ray.data import DataContext

    data = DataContext.get_current()
    ray_block_bytes = data.target_max_block_size
    ctx.store_fit = store_fit(ctx, ray_block_bytes)
    # The pool first: its gate is what the reuse lookup tells of rows to generate.
    pool = EnginePool(profile.hardware, profile.engine.tensor_parallel_size)
    pool.open()
    try:
        if ctx.store_fit.fitted:  # for this run; Ray Data's tasks take the driver's context
            data.target_max_block_size = ctx.store_fit.block_bytes
        ds, prepare = build_dataset(ctx, target, pool.gate)
        run_dataset(ctx, ds, prepare, target, metrics, pool, verbose)
    finally:
        data.target_max_block_size = ray_block_bytes
        pool.close()
        if ctx.reuse_index is not None:
            ctx.reuse_index.close()


def build_dataset(ctx: RunContext, target: OutputTarget, gate: Any = None) -> tuple[Any, PrepareSettings]:
    """The dataset, lazily: read, skip what a resumed run committed, prepare, group by
    bucket. Nothing runs until the write pulls it (but the percentile pass, if asked)."""
    config = ctx.config
    job, profile = config.job, config.profile
    committed = target.committed
    keys = key_columns(job.input.id_column, job.passages is not None)
    skip = None
    if committed.keys is not None:  # a resumed run's
        import ray

        skip = (ray.put(row_keys(committed.keys, keys)), keys)
    config = ctx.store_fit.applied_to(config)  # windows and tokenizing batches the object store holds
    profile = config.profile
    prepare = prepare_settings(config, ctx.model_path, ctx.max_model_len)
    if job.length.outlier_percentile is not None:
        t = time.monotonic()
        ctx.percentile_cap = corpus_percentile_cap(config, ctx.inputs, prepare)
        prepare = replace(prepare, cap_tokens=ctx.percentile_cap)
        ctx.checks["outlier_percentile"] = {"pass": "read and tokenize every row",
                                            "seconds": round(time.monotonic() - t, 3)}
    if profile.debug.hold_input_until_output_s and target.local:
        prepare = replace(prepare, hold_until=f"{target.staging.root}/{COMMITS}",
                          hold_s=profile.debug.hold_input_until_output_s, hold_after_rows=profile.bucketing.window_rows)
    ctx.result_key = result_keys(config, prepare)
    if job.passages is None:  # a document's passages have no input key: they are found by their result keys
        prepare = replace(prepare, input_key_base=ctx.result_key["input_base"])
    ctx.reuse_index = reuse_index(ctx)
    index = ctx.reuse_index
    before = index is not None and index.inputs and job.reuse.before_tokenizing
    # Each row's result key looked up as it streams by: in the prepare actor, as each batch
    # is made. As a stage of its own it was a Ray task per batch, each task in flight a
    # worker process, and on 2 cores a worker started mid-run took 7-10 s to its first
    # task while the engine waited (night 2 of `bench.nightly_week` 2.9 s sooner at the
    # median of 8 pairs, bench/README.md). A resumed run's passages are skipped after
    # prepare, before they are looked up: they keep the stage.
    look_up = None if index is None else partial(keyed_look_up, base=ctx.result_key["base"],
                                                 shards=index.shards, columns=index.columns, gate=gate)
    in_prepare = look_up is not None and not (skip and job.passages is not None)
    ds = read_and_prepare(config, ctx.inputs, prepare, skip, shards=index.shards if before else None,
                          look_up=look_up if in_prepare else None)
    if look_up is not None and not in_prepare:
        # Two at a time: light tasks (a shard's round trip), and each one more in flight is
        # a Ray worker process (Ray Data ran ~20 at once, and their idle threads took most
        # of a core, bench/README).
        ds = ds.map_batches(look_up, batch_format="pyarrow", num_cpus=0.1, concurrency=2)
    if profile.bucketing.grouping == "window":
        # Streaming: each window of prepared rows ordered by bucket, nothing waits for the corpus.
        # Then cut into blocks of an engine's batch: Ray Data hands out blocks, not
        # batches, so a window left whole would go to one engine (streaming, no shuffle).
        # Interleaving helps an engine fed continuously (`ProfileConfig.window_order`); static
        # batches (transformers) are one call's rows each, so they keep the buckets in order.
        interleaved = profile.window_order() == "interleaved"
        ds = (ds.map_batches(group_window, batch_size=profile.bucketing.window_rows, batch_format="pyarrow",
                             fn_kwargs={"block_rows": profile.batching.generate_batch_rows if interleaved else None,
                                        "bounds": list(profile.bucketing.boundaries) if interleaved else None},
                             num_cpus=0.1, concurrency=1)
              .repartition(target_num_rows_per_block=profile.batching.generate_batch_rows))
    elif profile.bucketing.grouping == "global":
        # One range partition per bucket, after every row is read (an all-to-all barrier).
        ds = ds.sort(schema.BUCKET_INDEX, boundaries=list(range(1, len(ctx.bucket_order))))
    return ds, prepare


def store_fit(ctx: RunContext, ray_block_bytes: int) -> StoreFit:
    """Windows, tokenizing batches and Ray Data's blocks against the cluster's object store
    (`pipeline.run.plan.fit_to_store`). `ray_block_bytes`: Ray Data's target block size now."""
    import ray

    batching = ctx.config.profile.batching
    store = ray.cluster_resources().get("object_store_memory")
    fit = fit_to_store(ctx.config.profile.bucketing.window_rows, batching.prepare_batch_rows,
                       batching.generate_batch_rows, ctx.inputs.row_bytes(), int(store) if store else None,
                       ray_block_bytes)
    if fit.fitted:
        log.info("rows of %s bytes against a %s-byte object store: windows of %s rows, blocks of at most %s bytes",
                 fit.row_bytes, fit.store_bytes, fit.window_rows, fit.block_bytes)
    return fit


def reuse_index(ctx: RunContext) -> ReuseIndex | None:
    """The index of the earlier outputs' keys on the cluster; None where there is nothing
    to look up (no sources, no keys in them, or this run's results have no keys)."""
    if not ctx.reuse_sources:
        return None
    if ctx.result_key["base"] is None:
        ctx.reuse_notes.append(f"reuse is off: {ctx.result_key['off']}")
        return None
    # Its shards load in their own processes while the run goes on starting.
    return ReuseIndex(ctx.reuse_sources, result_columns(ctx.out_schema))


def run_dataset(ctx: RunContext, ds: Any, prepare: PrepareSettings, target: OutputTarget, metrics: RunMetrics,
                pool: EnginePool, verbose: bool) -> None:
    """Pull the dataset through the engine pool into the staging's parts, with the unique-id
    check beside the engines' start; what the write says goes into `ctx`."""
    from pipeline.storage.sink import ParquetPartsSink

    config = ctx.config
    job, engine = config.job, config.profile.engine
    committed = target.committed
    metrics.expect(ctx.inputs.rows, committed.documents() if job.passages is not None else committed.rows)
    hw = config.profile.hardware
    metrics.attach(pool.gate.metrics)
    guard = None
    if keeps_engine_cpus_apart(config.profile):
        guard = EngineCpuGuard(pool.gate.worker_cpus, engines=hw.num_engines)
        guard.start()
    try:
        # Each engine warning once per run, unless --verbose.
        settings = replace(generate_settings(config, prepare, ctx.run_id, quiet_warnings=not verbose),
                           pool_gate=pool.gate, result_key_base=ctx.result_key["base"],
                           engine_on_demand=ctx.reuse_index is not None)
        ds = with_engines(ds, config, settings, ctx.start_limits, pool)
        sink = ParquetPartsSink(target.staging, ctx.run_id, ctx.out_schema,
                                key_columns(job.input.id_column, job.passages is not None), previous=committed.parts,
                                text_column="passage" if job.passages is not None else job.input.text_column,
                                min_rows=write_rows(ctx))
        # Unique ids are checked on the cluster while the engines start; they take no
        # block until it has passed.
        check = BesideStartup(lambda: check_unique_ids(ctx.inputs, job.input.id_column, job.input.path), pool.gate)
        try:
            # Write tasks ask for a tenth of a CPU: they wait on storage, and at a whole
            # CPU Ray Data's resource budget held every part back until the input was read.
            # And at most one more at once than there are engines: each running task is a
            # worker process, and a tenth of a CPU each let Ray start more than a small machine
            # has cores (it warned of it).
            ds.write_datasink(sink, ray_remote_args={"num_cpus": 0.1},
                              concurrency=config.profile.hardware.num_engines + 1)
        except Exception as e:
            check.raise_if_refused()
            raise engines_failed(e, pool.incidents(), engine.max_restarts) from e
        ctx.checks["duplicate_ids"] = check.result()
        ctx.incidents = pool.incidents()
        ctx.written, ctx.generated_rows = sink.summary, sink.generated_rows
        metrics.detach(settle_s=SETTLE_S)  # every row is written: the metrics say so before the pool goes
        if not hw.ray_address and ctx.written is not None:
            # Every row is written: the engines end now, by the pids their actors recorded.
            end_engine_processes({a["pid"] for a in actor_summaries(engine_calls(ctx.written)) if "pid" in a})
    finally:
        if guard is not None:
            guard.stop()
            ctx.engine_cpus = guard.summary()
        metrics.detach()


def write_rows(ctx: RunContext) -> int | None:
    """The fewest rows of a part (but the last), or None for a part per engine block, its
    rows committed as soon as they are generated. With reuse on, a part per tokenizing
    batch: most rows are found, need no engine, and would otherwise be a write task every
    128 rows on the cores the engine leaves (night 2 of `make bench-nightly` 1.6 s sooner,
    bench/README.md). A part then waits for a batch's worth of rows, most of them found."""
    return ctx.store_fit.prepare_batch_rows if ctx.reuse_index is not None else None


def with_engines(ds: Any, config: RunConfig, settings: Any, learned: dict[str, int], pool: EnginePool) -> Any:
    """The generate stage on the dataset: one engine per actor of the pool, each serving a
    few blocks at once, restarted a bounded number of times."""
    from ray.data import ActorPoolStrategy

    from pipeline.stages.generate import GenerateStage

    hw, batching, engine = config.profile.hardware, config.profile.batching, config.profile.engine
    # Engines that fail to start: the same bound, counted in a row (Ray Data's default: none).
    ds.context.max_consecutive_actor_init_deaths = engine.max_restarts
    with warnings.catch_warnings():
        # Ray 2.60 deprecates passing remote options through **kwargs in favour of named
        # ones, and names none for max_restarts, max_task_retries or a placement group.
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
        return ds.map_batches(
            GenerateStage,
            fn_constructor_kwargs={"settings": settings, "learned": learned},
            batch_size=batching.generate_batch_rows,
            batch_format="pyarrow",
            # A few blocks per engine at once, served by one feeder: the next block's
            # rows fill the engine while the last one's finish.
            compute=ActorPoolStrategy(size=hw.num_engines,
                                      max_concurrent_calls_per_actor=batching.concurrent_batches,
                                      max_tasks_in_flight_per_actor=batching.concurrent_batches,
                                      enable_true_multi_threading=True),
            # An actor whose process or engine core dies, or hangs, is started afresh
            # and its blocks retried, a bounded number of times (Ray Data's default: forever).
            max_restarts=engine.max_restarts,
            max_task_retries=engine.max_restarts,
            **pool.actor_options(),
        )


def engines_failed(error: Exception, incidents: list[dict[str, Any]], bound: int) -> Exception:
    """The error a failed write ends the run with: the engines' own story, when they
    failed past `engine.max_restarts`, else the write's error as it was."""
    ends = [i for i in incidents if i["kind"] in ("stall", "engine_died", "start_failed")]
    restarts = [i for i in incidents if i["kind"] == "restart"]
    if not ends and not restarts:
        return error
    last = ends[-1] if ends else restarts[-1]
    return RuntimeError(
        f"the engine actors failed {len(ends)} times and were restarted {len(restarts)} times "
        f"(engine.max_restarts={bound} per actor) before the run gave up; the last failure: "
        f"{last['kind']}: {last['cause']} (Ray: {type(error).__name__}: {str(error).splitlines()[0][:300]})"
    )


class BesideStartup:
    """A check that runs in a thread while the engines start, and tells the pool's gate
    whether they may take work."""

    def __init__(self, check: Callable[[], dict[str, Any]], gate: Any):
        self._result: dict[str, Any] | None = None
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self._result = check()
            except BaseException as e:
                self._error = e
                gate.decide(False, f"{type(e).__name__}: {e}")
                return
            gate.decide(True)

        self._thread = threading.Thread(target=run, name="check-beside-startup", daemon=True)
        self._thread.start()

    def raise_if_refused(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error

    def result(self) -> dict[str, Any]:
        self.raise_if_refused()
        assert self._result is not None
        return self._result


def check_unique_ids(inputs: Any, id_column: str, where: str) -> dict[str, Any]:
    """Ids must be unique for every row to be accounted for: checked on the cluster, one
    column read, while the engines start. What it cost goes to the report."""
    t = time.monotonic()
    repeated, examples = duplicate_ids(inputs, id_column)
    if repeated:
        raise InputError(
            f"{where}: {repeated} ids occur more than once in column {id_column!r}, "
            f"e.g. {', '.join(map(repr, examples))}; ids must be unique so every row can be accounted for"
        )
    checks: dict[str, Any] = {"pass": f"read column {id_column!r} on the cluster",
                              "seconds": round(time.monotonic() - t, 3)}
    if inputs.format == "hub":
        checks["pass"] = "skipped: a streamed hub dataset would be read twice"
    return checks


def _side_step(warnings: list[str], what: str, step: Callable[[], Any]) -> Any:
    """Run a step that the output does not depend on: its failure is a warning in the
    report, never the loss of a run whose rows are all written. None if it failed."""
    try:
        return step()
    except Exception as e:
        message = f"{what} failed: {type(e).__name__}: {e}"
        log.warning("%s (the output is published regardless)", message)
        warnings.append(message)
        return None


def finish(ctx: RunContext, target: OutputTarget) -> RunReport:
    """4. The report, with its side steps (the learned limits, the plot), written last into
    the staging beside the parts: its presence means the output is complete."""
    config = ctx.config
    profile = config.profile
    if target.resumed is not None:
        committed = target.committed
        ctx.resume = {"lineage": [*target.lineage, ctx.run_id], "resumed": target.resumed.owner.run_id,
                      "rows_committed_before": committed.rows,
                      "rows_generated": ctx.generated_rows,
                      "read_commits_s": round(committed.seconds, 3)}
        wall_start = time.time() - ctx.wall_s()
        ctx.incidents.insert(0, {"at": round(wall_start, 3), "kind": "resume", "cause": target.resumed.progress(),
                                 "rows": committed.rows})
    ctx.warnings = list(target.warnings)  # a lock taken over, staging left by a killed run
    if ctx.written is None:
        raise RuntimeError("the write finished without reporting what it wrote")
    calls = engine_calls(ctx.written)
    actors = actor_summaries(calls)
    if profile.batching.learned_limits and isinstance(profile.batching.policy, AdaptivePolicy):
        limits = limits_store.merge_limits([a["learned"] for a in actors])
        if limits:
            def save() -> dict[str, int]:
                limits_store.save_limits(profile.batching.learned_limits, ctx.limits_key, limits)
                return limits

            ctx.learned["saved"] = _side_step(ctx.warnings, f"saving learned limits to "
                                              f"{profile.batching.learned_limits}", save)

    def draw() -> bool:
        png = plot_trajectories({"job": config.job.name, "run_id": ctx.run_id,
                                 "batching": batching_section(ctx, calls, actors),
                                 "server": servers(actors)})
        if png:
            write_beside(target.fs, target.staging.data, PLOT_NAME, png)
        return png is not None

    final = config.job.output.path.rstrip("/")
    ctx.plot_path = f"{final}/{PLOT_NAME}" if _side_step(ctx.warnings, "drawing the batching plot", draw) else None
    # The output may have changed during the run: check again, and say what publishing replaces.
    ctx.publish = target.plan()
    if ctx.publish["backup"]:
        ctx.warnings.append(f"{final} holds files this pipeline did not write: moved aside to "
                            f"{ctx.publish['backup']} (--backup-existing)")
    report = build_report(ctx, engine_description(ctx.model_path, profile.engine, config.job.sampling.seed))
    write_report(target.fs, target.staging.data, report)
    return report
