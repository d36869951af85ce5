"""What the generate stage asks of an engine, as functions over a feeder.

- `EngineCalls` numbers the calls one engine actor makes; `BatchCalls` keeps the
  records of one batch's calls (rows, times, pressure, the policy's trajectory) for
  the report. `CallKind` names what a call served.
- `summarize`: each bucket's rows, one call per bucket.
- `annotate`: structured output constrained to a JSON Schema, parsed and
  validated; rows whose output did not validate get one retry with more room
  (max tokens cutting the JSON off is the usual cause).
- `map_reduce`: documents too long for one prompt, summarized window by window,
  then the joined summaries, level by level, until one summary is left.

They take token ids and callables for what needs a tokenizer or a schema, so
they run against the fake engine in the unit tests as they do against vLLM.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pipeline.generation.engine import Completion, Sampling
from pipeline.generation.feeder import CallRecord, EngineFeeder
from pipeline.generation.merge import IdenticalPrompts

MAX_REDUCE_LEVELS = 8


class CallKind(StrEnum):
    """What an engine call served, as the report names it (`chunk-level-N` for the Nth level
    of a map-reduce: `CallKind.chunk_level(n)`)."""

    ROWS = "rows"
    ANNOTATIONS = "annotations"
    ANNOTATIONS_RETRY = "annotations-retry"

    @staticmethod
    def chunk_level(depth: int) -> str:
        return f"chunk-level-{depth}"


@dataclass(frozen=True)
class EngineCall:
    """One engine call as the report lists it: its id and kind, what the feeder measured,
    the actor's running totals after it, and (on an actor's first call) the engine."""

    call: str
    kind: str  # a CallKind, or CallKind.chunk_level(n)
    record: CallRecord
    actor: dict[str, Any]
    engine: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"call": self.call, "kind": self.kind, **self.record.to_json(), "actor": self.actor}
        if self.engine is not None:
            out["engine"] = self.engine
        return out


class EngineCalls:
    """One actor's engine calls over its feeder, numbered across its batches (which run in
    several threads at once). `batch()` gives one batch its own log of the calls it made."""

    def __init__(self, feeder: EngineFeeder, actor: str, totals: Callable[[], dict[str, Any]],
                 engine_info: Callable[[], dict[str, Any]], merge: IdenticalPrompts | None = None):
        self.feeder, self.actor = feeder, actor
        self.totals, self.engine_info = totals, engine_info
        self.merge = merge  # identical prompts generated once (None: every item its own request)
        self.merged: dict[str, int] = {}  # by call kind: items served by another item's request
        self.count = 0
        self._numbering = threading.Lock()

    def batch(self) -> BatchCalls:
        return BatchCalls(self)

    def serve(self, bucket: str, items: list[tuple[int, list[int]]], sampling: Sampling,
              kind: str) -> tuple[EngineCall, dict[int, Completion]]:
        if self.merge is None:
            served = self.feeder.serve(bucket, items, sampling)
            completions = served.completions
        else:
            plan = self.merge.plan(items, sampling)
            if plan.merged:
                with self._numbering:
                    self.merged[kind] = self.merged.get(kind, 0) + plan.merged
            try:
                served = self.feeder.serve(bucket, plan.fresh, sampling)
            except BaseException as e:
                self.merge.fail(plan, e)  # the calls waiting on these raise it too
                raise
            completions = self.merge.finish(plan, served.completions)
        with self._numbering:
            number = self.count
            self.count += 1
            call = EngineCall(f"{self.actor}-{number:05d}", kind, served.record, self.totals(),
                              self.engine_info() if number == 0 else None)
        return call, completions


class BatchCalls:
    """The engine calls one batch makes, and their records for the report (`records`)."""

    def __init__(self, calls: EngineCalls):
        self.calls = calls
        self.records: list[dict[str, Any]] = []

    @property
    def max_model_len(self) -> int:
        return self.calls.feeder.engine.max_model_len

    def call(self, bucket: str, items: list[tuple[int, list[int]]], sampling: Sampling,
             kind: str = CallKind.ROWS) -> tuple[str, dict[int, Completion]]:
        """Serve `items` (position, token ids) of one bucket; (call id, completions by position)."""
        call, completions = self.calls.serve(bucket, items, sampling, kind)
        self.records.append(call.to_json())
        return call.call, completions


def summarize(calls: BatchCalls, runs: list[tuple[str, list[int]]], token_ids: list[list[int] | None],
              sampling: Sampling) -> dict[int, tuple[str, Completion]]:
    """One call per (bucket, positions) run; each position's call id and completion."""
    out: dict[int, tuple[str, Completion]] = {}
    for bucket, members in runs:
        call_id, completions = calls.call(bucket, [(i, token_ids[i]) for i in members], sampling)
        for i in members:
            out[i] = (call_id, completions[i])
    return out


@dataclass(frozen=True)
class Annotation:
    """One row's annotation: the last completion (tokens and latency of both tries), the
    parsed value, and why the output is invalid when it is."""

    completion: Completion
    value: dict[str, Any] | None
    invalid: str | None
    tries: int = 1  # 2: the first output did not validate, this is the retry's


@dataclass(frozen=True)
class AnnotationTask:
    """How to annotate: `sampling` carries the JSON Schema; `parse(text)` gives (value,
    why it is invalid); a row that does not validate is retried once with
    `retry_max_new_tokens` (default twice the first room), within the context."""

    sampling: Sampling
    parse: Callable[[str | None], tuple[dict[str, Any] | None, str | None]]
    retry_max_new_tokens: int | None = None


def annotate(calls: BatchCalls, bucket: str, members: list[int], token_ids: list[list[int] | None],
             task: AnnotationTask) -> dict[int, Annotation]:
    """Structured annotations for `members`, with one retry for what does not validate."""
    if not members:  # every summary in the run failed: no engine call for nothing
        return {}
    first, parse = task.sampling.max_new_tokens, task.parse
    _, done = calls.call(bucket, [(i, token_ids[i]) for i in members], task.sampling, CallKind.ANNOTATIONS)
    out = {i: Annotation(c, *parse(c.text)) for i, c in done.items() if c.error is None}
    failed = {i: c for i, c in done.items() if c.error is not None}

    # One retry with more room for the outputs that did not validate.
    retry = [i for i, a in out.items() if a.value is None]
    if retry:
        longest = max(len(token_ids[i] or ()) for i in retry)
        room = min(task.retry_max_new_tokens or 2 * first, calls.max_model_len - longest)
        if room > first:
            _, again = calls.call(bucket, [(i, token_ids[i]) for i in retry], task.sampling.with_room(room),
                                  CallKind.ANNOTATIONS_RETRY)
            for i, c in again.items():
                spent = out[i].completion
                merged = Completion(c.text, c.output_tokens + spent.output_tokens, c.latency_s + spent.latency_s,
                                    c.finish_reason, c.error)
                out[i] = Annotation(merged, None, c.error, 2) if c.error else Annotation(merged, *parse(c.text), 2)
    for i, c in failed.items():
        out[i] = Annotation(c, None, None)
    return out


@dataclass(frozen=True)
class ChunkText:
    """What map-reduce needs of the text: `encode(row, text)`, the prompt's token ids for a
    piece of row's text; `split(row, text)`, the joined summaries back as one piece if they
    fit the context, else as windows again; `bucket_of(tokens)`, a length bucket's name."""

    encode: Callable[[int, str], list[int]]
    split: Callable[[int, str], list[str]]
    bucket_of: Callable[[int], str]


def map_reduce(calls: BatchCalls, pieces: dict[int, list[str]], text: ChunkText, sampling: Sampling,
               max_levels: int = MAX_REDUCE_LEVELS) -> dict[int, Completion]:
    """Summarize each row's pieces, then the joined summaries, for all rows at once, level
    by level, until each row has one summary."""
    done: dict[int, Completion] = {}
    level = dict(pieces)
    for depth in range(1, max_levels + 1):
        owners, items = [], []
        for i, texts in level.items():
            for piece in texts:
                owners.append(i)
                items.append(text.encode(i, piece))
        bucket = text.bucket_of(max(len(x) for x in items))
        _, completions = calls.call(bucket, list(enumerate(items)), sampling, CallKind.chunk_level(depth))
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
                level[i] = text.split(i, "\n\n".join(c.text or "" for c in parts))
        if not level:
            return done
    for i in level:
        done[i] = Completion(None, 0, 0.0, error=f"chunk summaries did not converge in {max_levels} levels")
    return done
