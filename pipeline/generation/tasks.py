"""What the generate stage asks of an engine, as functions over a feeder.

- `EngineCalls` numbers the calls one engine actor makes and keeps each call's
  record (rows, times, pressure, the policy's trajectory) for the report.
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
from typing import Any

from pipeline.generation.engine import Completion, Sampling
from pipeline.generation.feeder import CallRecord, EngineFeeder

MAX_REDUCE_LEVELS = 8


@dataclass(frozen=True)
class EngineCall:
    """One engine call as the report lists it: its id and kind, what the feeder measured,
    the actor's running totals after it, and (on an actor's first call) the engine."""

    call: str
    kind: str  # rows | annotations | annotations-retry | chunk-level-N
    record: CallRecord
    actor: dict[str, Any]
    engine: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"call": self.call, "kind": self.kind, **self.record.to_json(), "actor": self.actor}
        if self.engine is not None:
            out["engine"] = self.engine
        return out


class EngineCalls:
    """One actor's engine calls over its feeder: numbered, each with a record."""

    def __init__(self, feeder: EngineFeeder, actor: str, totals: Callable[[], dict[str, Any]],
                 engine_info: Callable[[], dict[str, Any]]):
        self.feeder, self.actor = feeder, actor
        self.totals, self.engine_info = totals, engine_info
        self.count = 0
        self._numbering = threading.Lock()  # batches call from several threads at once

    def call(self, bucket: str, items: list[tuple[int, list[int]]], sampling: Sampling,
             records: list[dict[str, Any]], kind: str = "rows") -> tuple[str, dict[int, Completion]]:
        """Serve `items` (position, token ids) of one bucket; (call id, completions by position)."""
        served = self.feeder.serve(bucket, items, sampling)
        with self._numbering:
            number = self.count
            self.count += 1
            call = EngineCall(f"{self.actor}-{number:05d}", kind, served.record, self.totals(),
                              self.engine_info() if number == 0 else None)
        records.append(call.to_json())
        return call.call, served.completions


def summarize(calls: EngineCalls, runs: list[tuple[str, list[int]]], token_ids: list[list[int] | None],
              sampling: Sampling, records: list[dict[str, Any]]) -> dict[int, tuple[str, Completion]]:
    """One call per (bucket, positions) run; each position's call id and completion."""
    out: dict[int, tuple[str, Completion]] = {}
    for bucket, members in runs:
        call_id, completions = calls.call(bucket, [(i, token_ids[i]) for i in members], sampling, records)
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


def annotate(calls: EngineCalls, bucket: str, members: list[int], token_ids: list[list[int] | None],
             sampling: Sampling, parse: Callable[[str | None], tuple[dict[str, Any] | None, str | None]],
             retry_max_new_tokens: int | None, max_model_len: int,
             records: list[dict[str, Any]]) -> dict[int, Annotation]:
    """Structured annotations for `members` with `sampling` (which carries the schema)."""
    if not members:  # every summary in the run failed: no engine call for nothing
        return {}
    first = sampling.max_new_tokens
    _, done = calls.call(bucket, [(i, token_ids[i]) for i in members], sampling, records, "annotations")
    out = {i: Annotation(c, *parse(c.text)) for i, c in done.items() if c.error is None}
    failed = {i: c for i, c in done.items() if c.error is not None}

    # One retry with more room for the outputs that did not validate.
    retry = [i for i, a in out.items() if a.value is None]
    if retry:
        longest = max(len(token_ids[i] or ()) for i in retry)
        room = min(retry_max_new_tokens or 2 * first, max_model_len - longest)
        if room > first:
            _, again = calls.call(bucket, [(i, token_ids[i]) for i in retry], sampling.with_room(room), records,
                                  "annotations-retry")
            for i, c in again.items():
                spent = out[i].completion
                merged = Completion(c.text, c.output_tokens + spent.output_tokens, c.latency_s + spent.latency_s,
                                    c.finish_reason, c.error)
                out[i] = Annotation(merged, None, c.error) if c.error else Annotation(merged, *parse(c.text))
    for i, c in failed.items():
        out[i] = Annotation(c, None, None)
    return out


def map_reduce(calls: EngineCalls, pieces: dict[int, list[str]], encode: Callable[[int, str], list[int]],
               split: Callable[[int, str], list[str]], bucket_of: Callable[[int], str], sampling: Sampling,
               records: list[dict[str, Any]], max_levels: int = MAX_REDUCE_LEVELS) -> dict[int, Completion]:
    """Summarize each row's pieces, then the joined summaries, for all rows at once, level
    by level, until each row has one summary.

    `encode(row, text)` is the prompt's token ids for a piece of row's text;
    `split(row, text)` gives the joined summaries back as one piece if they fit
    the context, else as windows again; `bucket_of(tokens)` names a length bucket.
    """
    done: dict[int, Completion] = {}
    level = dict(pieces)
    for depth in range(1, max_levels + 1):
        owners, items = [], []
        for i, texts in level.items():
            for text in texts:
                owners.append(i)
                items.append(encode(i, text))
        bucket = bucket_of(max(len(x) for x in items))
        _, completions = calls.call(bucket, list(enumerate(items)), sampling, records, f"chunk-level-{depth}")
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
                level[i] = split(i, "\n\n".join(c.text or "" for c in parts))
        if not level:
            return done
    for i in level:
        done[i] = Completion(None, 0, 0.0, error=f"chunk summaries did not converge in {max_levels} levels")
    return done
