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
buckets in one call.

Annotations are a second call per bucket, constrained by vLLM structured
outputs to the job's JSON Schema. Each output is parsed and validated; the
rows that fail are retried once with more room (max tokens cutting the JSON
off is the usual cause), and a row that fails again gets status
`invalid_output` with its text kept in `raw_output`.
"""

from __future__ import annotations

import json
import uuid
from itertools import groupby
from typing import Any

import pyarrow as pa

from pipeline import schema
from pipeline.annotations import AnnotationParser
from pipeline.batching import BatchPolicy, FixedBatchPolicy
from pipeline.bucketing import LengthBucketer
from pipeline.config import RunConfig
from pipeline.controller import BatchSizeController, ControllerSettings
from pipeline.engine import Completion, VLLMEngine
from pipeline.feeder import EngineFeeder
from pipeline.length import char_span, windows
from pipeline.stages.prepare import PrepareStage
from pipeline.schema import Status

ENGINE_CALL_STATS = "_engine_call_stats"
MAX_REDUCE_LEVELS = 8


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


def make_policy(config: RunConfig, engine: VLLMEngine, learned: dict[str, int] | None) -> BatchPolicy:
    b = config.profile.batching
    if b.policy in ("fixed", "tuned"):
        return FixedBatchPolicy(b.rows_per_call, b.tuned_rows if b.policy == "tuned" else None)
    return BatchSizeController(
        ControllerSettings(target=b.memory_target, max_rows=engine.max_num_seqs),
        kv_capacity_tokens=engine.kv_cache_tokens,
        learned=learned,
        initial_budget_tokens=b.initial_budget_tokens,
    )


class GenerateStage:
    """Engine actor: the engine is built once, here, and reused for every batch."""

    def __init__(self, config: RunConfig, model_path: str, run_id: str,
                 learned: dict[str, int] | None = None):
        self.grouping = config.profile.batching.bucket_grouping
        self.model_name = config.profile.model.name
        self.run_id = run_id
        self.bucket_names = LengthBucketer(config.profile.batching.bucket_boundaries).names
        self.engine = VLLMEngine(model_path, config.profile.engine, seed=config.job.sampling.seed)
        self.policy = make_policy(config, self.engine, learned)
        self.feeder = EngineFeeder(
            self.engine, self.policy, config.job.sampling,
            feed=config.profile.batching.feed, debug=config.profile.debug,
        )
        self.actor = uuid.uuid4().hex[:8]
        self.calls = 0
        self.config = config
        self.model_path = model_path
        self.bucketer = LengthBucketer(config.profile.batching.bucket_boundaries)
        self.prep: PrepareStage | None = None  # tokenizer for map-reduce prompts, loaded on first need
        self.annotations = config.job.annotations
        self.parser = None if self.annotations is None else AnnotationParser(self.annotations.json_schema)

    def engine_info(self) -> dict[str, Any]:
        return {
            "actor": self.actor,
            "startup_s": round(self.engine.startup_s, 3),
            "startup_attempts": self.engine.startup_attempts,
            "kv_cache_tokens": self.engine.kv_cache_tokens,
            "max_model_len": self.engine.max_model_len,
            "max_num_seqs": self.engine.max_num_seqs,
        }

    def actor_totals(self) -> dict[str, Any]:
        t = self.feeder.totals
        return {
            "actor": self.actor,
            "busy_s": round(t.busy_s, 4),
            "step_s": round(t.step_s, 4),
            "active_s": round((t.last_end or 0) - (t.first_start or 0), 4),
            "busy_fraction": t.busy_fraction(),
            "windows": t.windows,
            "oom_retries": t.oom_retries,
            "bisections": t.bisections,
            "rebuilds": self.engine.rebuilds,
            "learned": self.policy.learned_limits(),
        }

    def _serve(self, bucket: str, items: list[tuple[int, list[int]]], records: list[dict[str, Any]],
               kind: str = "rows", params: Any = None, max_new_tokens: int | None = None
               ) -> tuple[str, dict[int, Any]]:
        served = self.feeder.serve(bucket, items, params, max_new_tokens)
        call_id = f"{self.actor}-{self.calls:05d}"
        record = {"call": call_id, "kind": kind, **served.record, "actor": self.actor_totals()}
        if self.calls == 0:
            record["engine"] = self.engine_info()
        self.calls += 1
        records.append(record)
        return call_id, served.completions

    def _summarize_chunked(self, rows: dict[int, dict[str, Any]], pieces: dict[int, list[str]],
                           records: list[dict[str, Any]]) -> dict[int, Completion]:
        """Map-reduce: summarize every window, then the joined summaries, level by
        level for all chunked rows of the batch at once, until one summary is left."""
        if self.prep is None:
            self.prep = PrepareStage(self.config, self.model_path, self.engine.max_model_len)
        prep = self.prep
        done: dict[int, Completion] = {}
        level = dict(pieces)
        for depth in range(1, MAX_REDUCE_LEVELS + 1):
            owners, items = [], []
            for i, texts in level.items():
                for text in texts:
                    owners.append(i)
                    items.append(prep.encode([prep.render(rows[i], text)])[0])
            bucket = self.bucket_names[self.bucketer.index(max(len(x) for x in items))]
            _, completions = self._serve(bucket, list(enumerate(items)), records, kind=f"chunk-level-{depth}")
            summaries: dict[int, list[Completion]] = {}
            for k, i in enumerate(owners):
                summaries.setdefault(i, []).append(completions[k])
            level = {}
            for i, parts in summaries.items():
                failed = next((c for c in parts if c.error is not None), None)
                if failed is not None:
                    done[i] = failed
                elif len(parts) == 1:
                    done[i] = parts[0]
                else:
                    combined = "\n\n".join(c.text or "" for c in parts)
                    level[i] = self._pieces(prep, rows[i], combined)
            if not level:
                return done
        for i in level:
            done[i] = Completion(None, 0, 0.0, error=f"chunk summaries did not converge in {MAX_REDUCE_LEVELS} levels")
        return done

    def _pieces(self, prep: PrepareStage, row: dict[str, Any], text: str) -> list[str]:
        """The joined summaries as one piece if they fit the context, else windows again."""
        room = prep.max_prompt_tokens - len(prep.encode([prep.render(row, "")])[0])
        ids, offsets = prep.text_tokens(text)
        if len(ids) <= room:
            return [text]
        spans = windows(offsets, text, room, min(self.config.job.length.chunk_overlap, room // 4))
        return [text[a:b] for a, b in (char_span(offsets, s, e) for s, e in spans)]

    def _annotate(self, bucket: str, members: list[int], token_ids: list[list[int] | None],
                  records: list[dict[str, Any]]) -> dict[int, tuple[Completion, dict[str, Any] | None, str | None]]:
        """Structured annotations for `members`: (last completion, parsed value, why it is invalid)."""
        assert self.annotations is not None and self.parser is not None
        if not members:  # every summary in the run failed: no engine call for nothing
            return {}
        sampling = self.config.job.sampling
        first = self.annotations.max_new_tokens
        params = self.engine.sampling_params(sampling, max_tokens=first, json_schema=self.annotations.json_schema)
        _, done = self._serve(bucket, [(i, token_ids[i]) for i in members], records, "annotations", params, first)
        out = {i: (c, *self.parser.parse(c.text)) for i, c in done.items() if c.error is None}
        failed = {i: c for i, c in done.items() if c.error is not None}

        # One retry with more room for the outputs that did not validate.
        retry = [i for i, (_, value, _) in out.items() if value is None]
        if retry:
            longest = max(len(token_ids[i]) for i in retry)
            room = min(self.annotations.retry_max_new_tokens or 2 * first, self.engine.max_model_len - longest)
            if room > first:
                params = self.engine.sampling_params(sampling, max_tokens=room,
                                                     json_schema=self.annotations.json_schema)
                _, again = self._serve(bucket, [(i, token_ids[i]) for i in retry], records,
                                       "annotations-retry", params, room)
                for i, c in again.items():
                    spent = out[i][0].output_tokens
                    merged = Completion(c.text, c.output_tokens + spent, c.latency_s + out[i][0].latency_s,
                                        c.finish_reason, c.error)
                    out[i] = (merged, None, c.error) if c.error else (merged, *self.parser.parse(c.text))
        for i, c in failed.items():
            out[i] = (c, None, None)
        return out

    def __call__(self, batch: pa.Table) -> pa.Table:
        n = batch.num_rows
        status = batch.column("status").to_pylist()
        token_ids = batch.column(schema.PROMPT_TOKEN_IDS).to_pylist()
        chunk_texts = batch.column(schema.CHUNK_TEXTS).to_pylist()
        buckets = batch.column(schema.BUCKET_INDEX).to_pylist()
        error: list[str | None] = batch.column("error").to_pylist()
        summary: list[str | None] = [None] * n
        output_tokens = [0] * n
        latency: list[float | None] = [None] * n
        call_of: list[str | None] = [None] * n
        records: list[dict[str, Any]] = []
        annotating = self.annotations is not None
        annotation_ids = batch.column(schema.ANNOTATION_TOKEN_IDS).to_pylist() if annotating else []
        values: list[dict[str, Any] | None] = [None] * n
        raw: list[str | None] = [None] * n

        def settle(i: int, c: Completion) -> None:
            latency[i], output_tokens[i] = c.latency_s, c.output_tokens
            if c.error is None:
                summary[i] = c.text
            else:
                status[i], error[i] = Status.ERROR.value, c.error

        # 1. Whole documents, one engine call per bucket.
        whole = [i for i in range(n) if status[i] == Status.OK and chunk_texts[i] is None]
        for bucket, members in bucket_runs(whole, buckets, self.grouping, self.bucket_names):
            call_id, completions = self._serve(bucket, [(i, token_ids[i]) for i in members], records)
            for i in members:
                call_of[i] = call_id
                settle(i, completions[i])
            if not annotating:
                continue
            todo = [i for i in members if status[i] == Status.OK and annotation_ids[i] is not None]
            for i, (c, value, invalid) in self._annotate(bucket, todo, annotation_ids, records).items():
                output_tokens[i] += c.output_tokens
                latency[i] = (latency[i] or 0.0) + c.latency_s
                if c.error is not None:
                    status[i], error[i] = Status.ERROR.value, f"annotations: {c.error}"
                elif value is None:
                    status[i], error[i], raw[i] = Status.INVALID_OUTPUT.value, invalid, c.text
                else:
                    values[i] = value

        # 2. Documents too long for one prompt, under `length.policy: chunk`.
        chunked = [i for i in range(n) if status[i] == Status.OK and chunk_texts[i] is not None]
        if chunked:
            rows = {i: batch.slice(i, 1).to_pylist()[0] for i in chunked}
            for i, c in self._summarize_chunked(rows, {i: chunk_texts[i] for i in chunked}, records).items():
                settle(i, c)

        # The calls' records ride on the batch's first row, for the report.
        call_stats: list[str | None] = [None] * n
        if records and n:
            call_stats[0] = json.dumps(records)
        out = batch.drop_columns([schema.PROMPT_TOKEN_IDS, schema.CHUNK_TEXTS, "status", "error",
                                  *([schema.ANNOTATION_TOKEN_IDS] if annotating else [])])
        columns = {
            "summary": pa.array(summary, pa.string()),
            **(self.parser.columns(values, self.annotations.column_prefix) if annotating else {}),
            **({schema.RAW_OUTPUT.name: pa.array(raw, pa.string())} if annotating else {}),
            "output_tokens": pa.array(output_tokens, pa.int32()),
            "status": pa.array(status, pa.string()),
            "error": pa.array(error, pa.string()),
            "latency_s": pa.array(latency, pa.float64()),
            "model": pa.array([self.model_name] * n, pa.string()),
            "run_id": pa.array([self.run_id] * n, pa.string()),
            schema.ENGINE_CALL: pa.array(call_of, pa.string()),
            ENGINE_CALL_STATS: pa.array(call_stats, pa.string()),
        }
        for name, values in columns.items():
            out = out.append_column(name, values)
        return out

    def __del__(self) -> None:
        # Ray Data's teardown hook for actor stages: on graceful shutdown it drops
        # the UDF after the last task and before the actor exits. Closing here
        # stops the engine core with the actor rather than on a parent-death signal.
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
