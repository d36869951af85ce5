"""Generate: one vLLM engine per actor, fed one length bucket at a time.

Input: prepared rows (see `prepare`). Output: the same rows with `summary`,
`output_tokens`, `latency_s`, `model` and `run_id` filled in (and, when the job
annotates, one typed column per annotation property and `raw_output`), and two working
columns for the report: `_engine_call` (which engine call served the row) and
`_engine_call_stats` (the batch's engine-call records as a JSON list, on its
first row). Rows that arrive with another status than `ok` pass through
untouched. Rows that arrive as windows (`length.policy: chunk`) are
summarized map-reduce: each window, then the joined summaries, recursively.

An *engine call* is one bucket's run of rows within a batch: the feeder keeps
the engine full with them, admitting rows as others finish, and never mixes
buckets in one call. This stage is the adapter between Arrow batches and the
generation core (`pipeline.generation`): it derives the engine's and the
policy's settings from the config, turns rows into requests and completions
into columns; what is generated, and how, is `pipeline.generation.tasks`.

Crashes: an engine core that dies of something other than memory, or a step
that hangs past `engine.stall_timeout_s`, ends the actor (`pipeline.stages.lifeline`),
and Ray starts it afresh with the blocks it held.

Annotations are a second call per bucket, constrained by vLLM structured
outputs to the job's JSON Schema. Each output is parsed and validated; the
rows that fail are retried once with more room (max tokens cutting the JSON
off is the usual cause), and a row that fails again gets status
`invalid_output` with its text kept in `raw_output`.

A summary or annotation that is empty or only whitespace is not a success: the row
gets status `empty_output`, its text kept, and `error` says so.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, replace
from itertools import groupby
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pipeline import schema
from pipeline.text.annotations import AnnotationParser
from pipeline.text.bucketing import LengthBucketer
from pipeline.config import AdaptivePolicy, FixedPolicy, TunedPolicy
from pipeline.config.models import BatchPolicyConfig
from pipeline.generation.engine import Completion, Engine, EngineCrashed, Sampling
from pipeline.generation.feeder import MIX_SPAN, EngineFeeder, FaultInjector
from pipeline.generation.memory import HeapTrim
from pipeline.generation.merge import IdenticalPrompts
from pipeline.generation.result_key import keys_of_rows
from pipeline.generation.policy import (BatchPolicy, BatchSizeController, ControllerSettings, FixedBatchPolicy,
                                        static_batch_settings)
from pipeline.generation.tasks import (Annotation, AnnotationTask, BatchCalls, ChunkText, EngineCalls, annotate,
                                       map_reduce, summarize)
from pipeline.generation.hf import HFSettings, TransformersEngine
from pipeline.generation.server import ServerEngine, ServerSettings
from pipeline.generation.vllm import VLLMEngine, VLLMSettings, bind_process, preload
from pipeline.generation.vllm_logs import python_warnings_once
from pipeline.text.length import char_span, windows
from pipeline.observe.metrics import EngineMeter, MeterSources, engine_name
from pipeline.reuse.index import REUSED_FROM, REUSED_PREFIX, ok_rows, rows_to_generate
from pipeline.schema import Status
from pipeline.stages.lifeline import Lifeline
from pipeline.stages.prepare import PrepareSettings, PrepareStage, load_tokenizer


def bucket_runs(rows: list[int], buckets: list[int], grouping: str,
                names: tuple[str, ...]) -> list[tuple[str, list[int]]]:
    """Split row positions into engine calls: (bucket name, positions) each.

    With grouping on, each bucket's rows form one call, in arrival order, so no
    call mixes buckets. With grouping off, one call takes every row as it came.
    """
    if not rows:
        return []
    if grouping == "off":
        return [("mixed", list(rows))]
    ordered = sorted(rows, key=lambda i: buckets[i])  # stable: arrival order within a bucket
    return [(names[k], list(g)) for k, g in groupby(ordered, key=lambda i: buckets[i])]


def at_once(serve: Callable[[str, list[int]], None], runs: list[tuple[str, list[int]]]) -> None:
    """`serve` each (bucket, positions) run of a block, all at once: the engine then has
    every bucket's rows to choose from, not only the first's while the others wait (a
    block gathering several buckets' last rows starved vLLM's queue, `bench/README.md`).
    Each run writes only its own positions. The first error, once every run has ended."""
    if len(runs) <= 1:
        for bucket, members in runs:
            serve(bucket, members)
        return
    with ThreadPoolExecutor(max_workers=len(runs), thread_name_prefix="bucket-call") as pool:
        futures = [pool.submit(serve, bucket, members) for bucket, members in runs]
    for f in futures:
        f.result()


REUSED = "reused"  # a row's working status while its batch is generated: its results are an earlier run's


def with_earlier_results(out: pa.Table, batch: pa.Table, mask: pa.Array) -> pa.Table:
    """`out` with each reused row's (`mask`) result columns taken from its earlier row, as
    the lookup brought them (`_reused.<column>`), in the output's types."""
    if not pc.any(mask).as_py():
        return out
    for name in batch.column_names:
        if not name.startswith(REUSED_PREFIX):
            continue
        column = name[len(REUSED_PREFIX):]
        if column not in out.column_names:
            continue
        at = out.column_names.index(column)
        kind = out.schema.field(column).type
        out = out.set_column(at, column, pc.if_else(mask, batch.column(name).cast(kind), out.column(at).cast(kind)))
    return out


@dataclass(frozen=True)
class AnnotationSettings:
    json_schema: dict[str, Any]
    max_new_tokens: int
    retry_max_new_tokens: int | None = None
    column_prefix: str = ""


@dataclass(frozen=True)
class GenerateSettings:
    """What the generate stage needs, and nothing more (the runner derives it from the config)."""

    run_id: str
    model_name: str  # as the job names it, for the `model` column
    engine: VLLMSettings
    sampling: Sampling
    prepare: PrepareSettings  # map-reduce renders and tokenizes its prompts with it
    policy: BatchPolicyConfig = AdaptivePolicy()
    memory_target: float = 0.90
    feed: str = "continuous"
    mix_span: float = MIX_SPAN  # fed `mixed`: the blocks each call's rows spread over (batching.concurrent_batches)
    grouping: str = "global"
    merge_identical_prompts: bool = True
    result_key_base: str | None = None  # the run's share of each row's result key; None: no keys
    # Reuse is on: the engine starts with the first batch that has a row to generate, so a
    # night whose every row is reused starts none.
    engine_on_demand: bool = False
    heap_trim_s: float | None = None  # engine.heap_trim_s: freed heap given back at most this often
    annotations: AnnotationSettings | None = None
    chunk_overlap: int = 64
    inject_faults: tuple[tuple[int, str], ...] = ()  # drills: (window, kind) each, once each
    pool_gate: Any = None  # an object whose wait() returns once every engine of the pool is up
    stall_timeout_s: float | None = None  # a step running longer is a hung engine
    fail_on_start: bool = False  # drills: the engine fails to start
    backend: str = "vllm"  # or "transformers": `hf` then builds the engine; or "server": `server` does
    hf: HFSettings | None = None
    server: ServerSettings | None = None
    quiet_warnings: bool = True  # each vLLM warning once per run (the pool gate's `first_time`); off with --verbose


class RunRefused(RuntimeError):
    """The driver's checks, run while the engines started, refused the run."""


def where_am_i() -> dict[str, Any]:
    """The node and process this actor runs in, and where it imported this package from
    (on a cluster: the copy the runtime_env shipped)."""
    import pipeline

    node = None
    try:
        import ray

        if ray.is_initialized():
            node = ray.get_runtime_context().get_node_id()
    except ImportError:
        pass
    return {"host": socket.gethostname(), "node": node, "pid": os.getpid(),
            "package_path": os.path.dirname(os.path.abspath(pipeline.__file__))}



def make_policy(settings: GenerateSettings, engine: Engine, learned: dict[str, int] | None) -> BatchPolicy:
    """The batch policy the settings name, built for this engine."""
    if settings.backend == "server":
        # The server engine keeps its own limit in flight (`InFlightController`) and queues
        # the rest: the feeder only keeps it stocked.
        return FixedBatchPolicy(engine.max_num_seqs)
    match settings.policy:
        case FixedPolicy(rows_per_call=rows):
            return FixedBatchPolicy(rows)
        case TunedPolicy(rows=per_bucket, rows_per_call=rows):
            return FixedBatchPolicy(rows, per_bucket)
        case AdaptivePolicy(initial_budget_tokens=start):
            controller = (static_batch_settings(settings.memory_target, engine.max_num_seqs)
                          if settings.backend == "transformers"
                          else ControllerSettings(target=settings.memory_target, max_rows=engine.max_num_seqs))
            return BatchSizeController(
                controller,
                kv_capacity_tokens=lambda: engine.kv_cache_tokens,  # learned as it runs, for transformers
                learned=learned,
                initial_budget_tokens=start,
            )
    raise TypeError(f"unknown batch policy {settings.policy!r}")


def empty_output(what: str, c: Completion) -> str:
    """The `error` of a row whose output is empty or only whitespace."""
    return (f"the {what} is empty or only whitespace ({c.output_tokens} tokens, finish reason "
            f"{c.finish_reason or 'unknown'}); the model wrote nothing usable")


@dataclass
class RowOutcomes:
    """What one batch's rows came to, row by row, as the engine calls complete them."""

    status: list[str]
    error: list[str | None]
    summary: list[str | None]
    output_tokens: list[int]
    finish: list[str | None]  # the row's last call's finish reason: the reduce, or the annotation
    latency: list[float | None]
    call_of: list[str | None]
    values: list[dict[str, Any] | None] | None  # the annotations, parsed (None: the job does not annotate)
    raw: list[str | None] | None
    tries: list[int | None] | None  # annotation calls: 1, or 2 after the retry
    summary_finish: list[str | None] | None  # the summary call's finish reason, where annotations follow

    @classmethod
    def of(cls, batch: pa.Table, annotating: bool) -> RowOutcomes:
        n = batch.num_rows
        annotation = (lambda: [None] * n) if annotating else (lambda: None)
        return cls(batch.column("status").to_pylist(), batch.column("error").to_pylist(), [None] * n, [0] * n,
                   [None] * n, [None] * n, [None] * n, values=annotation(), raw=annotation(), tries=annotation(),
                   summary_finish=annotation())

    def completed(self, i: int, c: Completion) -> None:
        """A summary: ok, an error, or empty (only whitespace)."""
        self.latency[i], self.output_tokens[i], self.finish[i] = c.latency_s, c.output_tokens, c.finish_reason
        if self.summary_finish is not None:
            self.summary_finish[i] = c.finish_reason
        if c.error is not None:
            self.status[i], self.error[i] = Status.ERROR.value, c.error
            return
        self.summary[i] = c.text
        if schema.is_empty(c.text):
            self.status[i], self.error[i] = Status.EMPTY_OUTPUT.value, empty_output("summary", c)

    def annotated(self, i: int, a: Annotation) -> None:
        """An annotation: its tokens and time add to the summary's; it fails the row when it
        errs, is empty or does not validate (its text kept in `raw_output`)."""
        assert self.values is not None and self.raw is not None and self.tries is not None
        c = a.completion
        self.tries[i] = a.tries
        self.output_tokens[i] += c.output_tokens
        self.finish[i] = c.finish_reason
        self.latency[i] = (self.latency[i] or 0.0) + c.latency_s
        if c.error is not None:
            self.status[i], self.error[i] = Status.ERROR.value, f"annotations: {c.error}"
        elif a.value is None and schema.is_empty(c.text):
            self.status[i], self.error[i], self.raw[i] = Status.EMPTY_OUTPUT.value, empty_output("annotation", c), c.text
        elif a.value is None:
            self.status[i], self.error[i], self.raw[i] = Status.INVALID_OUTPUT.value, a.invalid, c.text
        else:
            self.values[i] = a.value

    def columns(self, parser: AnnotationParser | None, prefix: str) -> dict[str, pa.Array]:
        """The generated columns, in output order (the annotation columns after the summary)."""
        annotations = {}
        if self.values is not None and parser is not None:
            annotations = {**parser.columns(self.values, prefix), schema.RAW_OUTPUT.name: pa.array(self.raw, pa.string()),
                           schema.ANNOTATION_TRIES.name: pa.array(self.tries, pa.int8()),
                           schema.SUMMARY_FINISH.name: pa.array(self.summary_finish, pa.string())}
        return {"summary": pa.array(self.summary, pa.string()), **annotations,
                "output_tokens": pa.array(self.output_tokens, pa.int32()),
                "finish_reason": pa.array(self.finish, pa.string()),
                "status": pa.array(self.status, pa.string()), "error": pa.array(self.error, pa.string()),
                "latency_s": pa.array(self.latency, pa.float64())}


class GenerateStage:
    """Engine actor: the engine is built once, here, and reused for every batch.
    `engine` replaces vLLM (the unit tests pass a fake with the same interface)."""

    def __init__(self, settings: GenerateSettings, learned: dict[str, int] | None = None,
                 engine: Engine | None = None, exit_process: Callable[[int], Any] = os._exit):
        # When this actor began, and with an engine on demand, when vLLM's import ended
        # and when the lookup found work (Unix times; the report's engine actors).
        self.born_at = round(time.time(), 3)
        self.imported_at: float | None = None
        self.work_found_at: float | None = None
        self.settings = settings
        self.grouping = settings.grouping
        self.model_name = settings.model_name
        self.run_id = settings.run_id
        self.result_key_base = settings.result_key_base
        self.bucketer = LengthBucketer(settings.prepare.bucket_boundaries)
        self.life = Lifeline(settings.pool_gate, exit_process)
        self.actor = self.life.incarnation
        self.sampling = settings.sampling
        self.prep: PrepareStage | None = None  # tokenizer for map-reduce prompts, loaded on first need
        self._prep_lock = threading.Lock()
        self.annotations = settings.annotations
        self.parser = None if self.annotations is None else AnnotationParser(self.annotations.json_schema)
        self.annotation_task = None if self.annotations is None or self.parser is None else AnnotationTask(
            self.sampling.with_room(self.annotations.max_new_tokens, self.annotations.json_schema),
            self.parser.parse, self.annotations.retry_max_new_tokens)
        self.placement = where_am_i()
        if hasattr(settings.pool_gate, "place"):  # so that a node lost can be named with what it held
            settings.pool_gate.place(self.life.key, {**self.placement, "incarnation": self.actor})
        self._pids = {os.getpid()}
        self.engine: Engine | None = None
        self.feeder: EngineFeeder | None = None
        self.calls: EngineCalls | None = None
        self.policy: BatchPolicy | None = None
        self._learned = learned
        self._starting = threading.Lock()
        self._start_error: BaseException | None = None
        self.meter: EngineMeter | None = None
        self.ready_at = round(time.time(), 3)
        if not settings.engine_on_demand or engine is not None:
            self._start_engine(engine)
        elif hasattr(settings.pool_gate, "await_work"):
            # The engine starts once the reuse lookup finds a row to generate anywhere,
            # not when this actor's first such block arrives.
            threading.Thread(target=self._start_on_work, name="engine-on-demand", daemon=True).start()
        self.meter = self._meter(settings.pool_gate)
        self.heap = HeapTrim(settings.heap_trim_s)
        # Wait for the other engines, and for the driver's checks (None: go ahead).
        self.refused = settings.pool_gate.wait() if settings.pool_gate is not None else None

    def _start_engine(self, engine: Engine | None = None) -> None:
        """Build the engine, its batch policy and feeder; at the actor's start, or with the
        first batch that has a row to generate (`engine_on_demand`)."""
        settings = self.settings
        try:
            if settings.fail_on_start:
                raise RuntimeError("debug.engine_fails_on_start: the engine failed to start")
            if engine is None:
                self._bind_early()
            warn_once = self._warn_once()
            if warn_once is not None and engine is None:
                python_warnings_once(warn_once)
            built = engine or self._build_engine(settings, warn_once)
        except Exception as e:
            self.life.start_failed(e)
            raise
        self.policy = make_policy(settings, built, self._learned)
        self.feeder = EngineFeeder(built, self.policy, feed=settings.feed, mix_span=settings.mix_span,
                                   faults=FaultInjector(then=settings.inject_faults))
        self.calls = EngineCalls(self.feeder, self.actor, self.actor_totals, self.engine_info,
                                 IdenticalPrompts() if settings.merge_identical_prompts else None)
        self.engine = built
        self.ready_at = round(time.time(), 3)
        if self.meter is not None:  # started before the engine: it reads the engine from now on
            self.meter.attach(MeterSources(self.feeder, self.policy, built))
        if settings.pool_gate is not None and hasattr(settings.pool_gate, "engine_cpus"):
            # Where vLLM bound its workers: the driver keeps the run's other processes off them.
            settings.pool_gate.engine_cpus(self.actor, built.worker_cpus())
        if settings.stall_timeout_s:
            self.life.watch(self.feeder.stalled_s, settings.stall_timeout_s, self._kill_core())

    def _warn_once(self) -> Any:
        """What judges vLLM's warnings while it starts: the pool gate's `first_time` (each
        once per run), or None to show them all (--verbose)."""
        gate = self.settings.pool_gate
        return gate.first_time if self.settings.quiet_warnings and hasattr(gate, "first_time") else None

    def _start_on_work(self) -> None:
        settings = self.settings
        try:
            # vLLM's import is no engine: done while the lookup runs (about 10 s sooner to the
            # first call of a night with few rows to generate), under the lock a batch that
            # needs the engine first builds it under, so that their log tees do not overlap.
            with self._starting:
                if settings.backend == "vllm" and self.engine is None:
                    # Bound now, and the pool told: the run's other processes leave these
                    # CPUs to the import (bench/README: night 2's median 2.3 s sooner). If it
                    # ends before the lookup has found a row to generate, they are given
                    # back until it does: a night whose every row is reused builds no
                    # engine, and then keeps every CPU for its reading and writes.
                    cpus = self._bind_early()
                    preload(self._warn_once())
                    if cpus and not settings.pool_gate.has_work():
                        settings.pool_gate.engine_cpus(self.actor, {})
                        threading.Thread(target=self._report_on_work, args=(cpus,), name="cpus-on-work",
                                         daemon=True).start()
            self.imported_at = round(time.time(), 3)
            settings.pool_gate.await_work()
            self.work_found_at = round(time.time(), 3)
            with self._starting:
                if self.engine is None:
                    self._start_engine()
        except BaseException as e:  # the next batch to need the engine raises it
            self._start_error = e

    def _report_on_work(self, cpus: list[int]) -> None:
        try:
            self.settings.pool_gate.await_work()
            self.settings.pool_gate.engine_cpus(self.actor, {os.getpid(): cpus})
        except Exception:  # the pool gone with the run: nothing left to keep apart
            pass

    def _bind_early(self, report: bool = True) -> list[int]:
        """An engine whose model will run in this process on CPUs of its own
        (`VLLMSettings.bind_cpus`) binds the process to them now, before vLLM's import and
        build, and tells the pool: the driver's guard (`pipeline.run.affinity`) then keeps
        the run's other processes off them while the engine starts, instead of from its
        first step on. Unbound, a night with an engine on demand imported vLLM in 36-52 s
        beside the reused rows' reading, lookups and writes on 2 cores (bench/README)."""
        engine = self.settings.engine
        if self.settings.backend != "vllm" or not (engine.in_process and engine.bind_cpus):
            return []
        cpus = bind_process(engine.bind_cpus)
        gate = self.settings.pool_gate
        if not (cpus and gate is not None and hasattr(gate, "engine_cpus")):
            return []
        if report:
            gate.engine_cpus(self.actor, {os.getpid(): cpus})
        return cpus

    def _build_engine(self, settings: GenerateSettings, warn_once: Any) -> Engine:
        if settings.backend == "transformers" and settings.hf is not None:
            return TransformersEngine(settings.hf)
        if settings.backend == "server" and settings.server is not None:
            tokenizer = load_tokenizer(settings.server.tokenizer_path) if settings.server.tokenizer_path else None
            return ServerEngine(settings.server, tokenizer)
        return VLLMEngine(settings.engine, warn_once=warn_once)

    def _meter(self, gate: Any) -> EngineMeter | None:
        """This engine's live metrics (`pipeline.observe.metrics`), sent to the pool's log."""
        if gate is None or not hasattr(gate, "meter"):
            return None
        meter = EngineMeter(engine_name(self.life.key), self.actor, self.placement["host"], gate.meter,
                            MeterSources(self.feeder, self.policy, self.engine))
        meter.start()
        return meter

    def _kill_core(self) -> Callable[[], object]:
        return self.engine.kill_core if self.engine is not None else (lambda: False)

    def engine_info(self) -> dict[str, Any]:
        return {
            "actor": self.actor,
            "startup_s": round(self.engine.startup_s, 3),
            "startup_attempts": self.engine.startup_attempts,
            "kv_cache_tokens": self.engine.kv_cache_tokens,
            "max_model_len": self.engine.max_model_len,
            "max_num_seqs": self.engine.max_num_seqs,
        }

    def engine_pids(self) -> list[int]:
        """This actor's process and every one under it (vLLM's engine core and its workers),
        each one seen since the actor began, rebuilt engines' too (read after every call):
        the report lists them, so that whoever ran the job can check that none outlives it."""
        import psutil

        try:
            self._pids.update(p.pid for p in psutil.Process().children(recursive=True))
        except psutil.Error:  # a child that ended while being listed: the next call sees the rest
            pass
        return sorted(self._pids)

    def actor_totals(self) -> dict[str, Any]:
        t = self.feeder.totals
        return {
            "actor": self.actor,
            **self.placement,
            "born_at": self.born_at,
            "imported_at": self.imported_at,
            "work_found_at": self.work_found_at,
            "ready_at": self.ready_at,
            "last_end_at": round(time.time(), 3),
            "calls": t.calls,
            "requests": t.requests,
            "output_tokens": t.output_tokens,
            "serving_s": round(t.serving_s, 4),
            "busy_s": round(t.busy_s, 4),
            "step_s": round(t.step_s, 4),
            "active_s": round((t.last_end or 0) - (t.first_start or 0), 4),
            "busy_fraction": t.busy_fraction(),
            "windows": t.windows,
            "oom_retries": t.oom_retries,
            "bisections": t.bisections,
            "rebuilds": self.engine.rebuilds,
            "merged": dict(self.calls.merged),  # by call kind: items another's request served
            "prefix_cache": self.engine.prefix_cache() if hasattr(self.engine, "prefix_cache") else None,
            "pids": self.engine_pids(),
            "heap_trims": {"count": self.heap.trims, "returned_mib": round(self.heap.returned_bytes / 2**20, 1)},
            **({"step_timeline": timeline} if (timeline := self.engine.step_timeline()) is not None else {}),
            # A drill's faults as they fired (debug.inject_oom_*): none fired is not a recovery.
            **({"faults_fired": faults.fired} if (faults := self.feeder.faults).fired or faults.pending else {}),
            "learned": self.policy.learned_limits(),
            **({"server": self.engine.report()} if isinstance(self.engine, ServerEngine) else {}),
            # Padding by the bucket of each batch: the feeder's record (it knows the buckets).
            **({"padding": t.padding.to_json()} if self.engine.pads_batches else {}),
        }

    def _summarize_chunked(self, rows: dict[int, dict[str, Any]], pieces: dict[int, list[str]],
                           calls: BatchCalls) -> dict[int, Completion]:
        """Map-reduce over the batch's chunked rows, with this model's tokenizer and template."""
        with self._prep_lock:  # batches run in several threads at once
            if self.prep is None:
                self.prep = PrepareStage(replace(self.settings.prepare, max_model_len=self.engine.max_model_len))
        prep = self.prep

        def encode(i: int, text: str) -> list[int]:
            return prep.encode([prep.render(rows[i], text)])[0]

        def split(i: int, text: str) -> list[str]:
            """The joined summaries as one piece if they fit the context, else windows again."""
            room = prep.max_prompt_tokens - len(encode(i, ""))
            ids, offsets = prep.text_tokens(text)
            if len(ids) <= room:
                return [text]
            spans = windows(offsets, text, room, min(self.settings.chunk_overlap, room // 4))
            return [text[a:b] for a, b in (char_span(offsets, s, e) for s, e in spans)]

        return map_reduce(calls, pieces, ChunkText(encode, split, self.bucketer.name), self.sampling)

    def __call__(self, batch: pa.Table) -> pa.Table:
        if self.refused is not None:
            raise RunRefused(self.refused)
        generating = rows_to_generate(batch)
        if self.engine is None and generating:
            with self._starting:
                if self._start_error is not None:
                    raise self._start_error
                if self.engine is None:
                    self._start_engine()
        with self.life.serving(batch.num_rows, generating):
            try:
                out = self._generate(batch)
            except EngineCrashed as e:
                self.life.end("engine_died", str(e), self._kill_core())
        if self.meter is not None:
            self._count(out)
        self.heap.maybe()
        return out

    def _count(self, out: pa.Table) -> None:
        """The batch's rows for the live metrics: by status and bucket (in a passages job, a
        document counts once, with its first passage), and their tokens."""
        rows = out
        if "passage_index" in out.column_names:
            rows = out.filter(pc.fill_null(pc.equal(out.column("passage_index"), 0), True))
        self.meter.count(rows.column("status").to_pylist(), rows.column("bucket").to_pylist(),
                         int(pc.sum(out.column("prompt_tokens")).as_py() or 0),
                         int(pc.sum(out.column("output_tokens")).as_py() or 0))
        self.meter.send()

    def _generate(self, batch: pa.Table) -> pa.Table:
        rows = RowOutcomes.of(batch, annotating=self.annotations is not None)
        reused_mask = ok_rows(batch, found=True)
        reused = [i for i, r in enumerate(reused_mask.to_pylist()) if r]
        for i in reused:
            rows.status[i] = REUSED  # not generated: its results are an earlier run's
        calls = BatchCalls(self.calls)  # makes no call unless a row is generated, and then has an engine
        # The prompts' columns as Python lists once per batch: the calls and the keys read them.
        token_ids = batch.column(schema.PROMPT_TOKEN_IDS).to_pylist()
        chunk_texts = batch.column(schema.CHUNK_TEXTS).to_pylist()
        annotation_ids = (batch.column(schema.ANNOTATION_TOKEN_IDS).to_pylist()
                          if schema.ANNOTATION_TOKEN_IDS in batch.column_names else [None] * batch.num_rows)
        self._whole_documents(batch, rows, calls, token_ids, chunk_texts, annotation_ids)
        self._chunked_documents(batch, rows, calls, chunk_texts)
        if "result_key" in batch.column_names:  # keyed for the lookup (`pipeline.reuse.index`)
            keys = batch.column("result_key")
        else:
            keys = pa.array(keys_of_rows(self.result_key_base, token_ids, annotation_ids, chunk_texts), pa.string())
        for i in reused:
            rows.status[i] = Status.OK.value
        out = batch.drop_columns([c for c in (schema.PROMPT_TOKEN_IDS, schema.CHUNK_TEXTS, "status", "error",
                                              schema.ANNOTATION_TOKEN_IDS, "result_key", "input_key")
                                    if c in batch.column_names])
        columns = rows.columns(self.parser, self.annotations.column_prefix if self.annotations else "")
        columns |= {
            "model": pa.array([self.model_name] * batch.num_rows, pa.string()),
            "run_id": pa.array([self.run_id] * batch.num_rows, pa.string()),
            "result_key": keys,
            "input_key": (batch.column("input_key") if "input_key" in batch.column_names
                          else pa.nulls(batch.num_rows, pa.string())),
            "reused_from": (batch.column(REUSED_FROM) if REUSED_FROM in batch.column_names
                            else pa.nulls(batch.num_rows, pa.string())),
            schema.ENGINE_CALL: pa.array(rows.call_of, pa.string()),
            # The calls' records ride on the batch's first row, for the report.
            schema.ENGINE_CALL_STATS: pa.array([json.dumps(calls.records) if calls.records else None]
                                               + [None] * (batch.num_rows - 1), pa.string())
            if batch.num_rows else pa.array([], pa.string()),
        }
        for name, values in columns.items():
            out = out.append_column(name, values)
        return with_earlier_results(out, batch, reused_mask)

    def _whole_documents(self, batch: pa.Table, rows: RowOutcomes, calls: BatchCalls, token_ids: list[Any],
                         chunk_texts: list[Any], annotation_ids: list[Any]) -> None:
        """1. Whole documents, one engine call per bucket, then (if the job annotates) one
        annotation call per bucket."""
        buckets = batch.column(schema.BUCKET_INDEX).to_pylist()
        whole = [i for i in range(batch.num_rows) if rows.status[i] == Status.OK and chunk_texts[i] is None]

        def serve(bucket: str, members: list[int]) -> None:
            for i, (call_id, c) in summarize(calls, [(bucket, members)], token_ids, self.sampling).items():
                rows.call_of[i] = call_id
                rows.completed(i, c)
            if self.annotation_task is None:
                return
            todo = [i for i in members if rows.status[i] == Status.OK and annotation_ids[i] is not None]
            for i, a in annotate(calls, bucket, todo, annotation_ids, self.annotation_task).items():
                rows.annotated(i, a)

        at_once(serve, bucket_runs(whole, buckets, self.grouping, self.bucketer.names))

    def _chunked_documents(self, batch: pa.Table, rows: RowOutcomes, calls: BatchCalls,
                           chunk_texts: list[Any]) -> None:
        """2. Documents too long for one prompt, under `length.policy: chunk`: map-reduce."""
        chunked = [i for i in range(batch.num_rows) if rows.status[i] == Status.OK and chunk_texts[i] is not None]
        if chunked:
            texts = {i: batch.slice(i, 1).to_pylist()[0] for i in chunked}
            with self.meter.mapping(len(chunked)) if self.meter is not None else nullcontext():
                summaries = self._summarize_chunked(texts, {i: chunk_texts[i] for i in chunked}, calls)
            for i, c in summaries.items():
                rows.completed(i, c)

    def __del__(self) -> None:
        # Ray Data's teardown hook for actor stages: on graceful shutdown it drops
        # the UDF after the last task and before the actor exits. Closing here
        # stops the engine core with the actor rather than on a parent-death signal.
        meter = getattr(self, "meter", None)
        if meter is not None:
            meter.stop()
        close = getattr(getattr(self, "engine", None), "close", None)
        if close is not None:
            close()
