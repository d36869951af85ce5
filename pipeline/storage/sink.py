"""Write output rows as Parquet parts into a run's staging folder, and collect stats.

Each write task writes one file named by run id and task index, so parallel
writers never collide. Each task returns the stats the report needs (counts
per status, prompt lengths per bucket, engine calls), so the report is built
from what was written without reading the output back.

The sink writes only into the folder it is given: the run's staging
(`pipeline.storage.output`), which the runner publishes once the report is there too.
Publishing, and what may be replaced or deleted, is not the sink's business.

After each part, its commit marker (`pipeline.storage.commits`): from then on a resumed
run skips that part's rows. The parts a resumed run found committed come in as
`previous`, so the report covers every row of the output, whichever run wrote it.
"""

from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from ray.data import Datasink
from ray.data.block import Block, BlockAccessor
from ray.data.datasource.datasink import WriteResult

from pipeline import schema
from pipeline.storage.commits import commit_part
from pipeline.text.quality import (add_annotation_counts, annotation_counts, copies_opening, extracted_strings,
                                   found_in_text)

PART_PREFIX = "part-"


class ParquetPartsSink(Datasink[dict[str, Any]]):
    def __init__(self, staging: Any, run_id: str, output_schema: pa.Schema, keys: list[str],
                 previous: list[dict[str, Any]] | None = None, text_column: str = "text",
                 min_rows: int | None = None):
        self.fs = staging.fs
        self.root = staging.data  # the run's staging folder: the parts go here, and nowhere else
        self.staging_root = staging.root  # and their commit markers under here
        self.run_id = run_id
        self.schema = output_schema
        self.keys = keys  # the columns that name an output row
        self.previous = list(previous or [])
        self.text_column = text_column  # the rows' source text, for the quality counts
        self.summary: dict[str, Any] | None = None
        self.generated_rows = 0  # rows this run itself wrote (the rest came in as `previous`)
        self.min_rows = min_rows  # the fewest rows a part holds but the last (None: one per block)

    @property
    def min_rows_per_write(self) -> int | None:
        """What Ray Data bundles blocks up to before each `write` (a part each)."""
        return self.min_rows

    def get_name(self) -> str:
        return "ParquetParts"

    def on_write_start(self, schema: pa.Schema | None = None) -> None:
        self.fs.create_dir(self.root, recursive=True)

    def write(self, blocks: Iterable[Block], ctx: Any) -> dict[str, Any]:
        tables = [BlockAccessor.for_block(b).to_arrow() for b in blocks]
        tables = [t for t in tables if t.num_rows]
        if not tables:
            return {"file": None, "rows": 0}
        table = pa.concat_tables(tables, promote_options="default")
        stats = _block_stats(table, self.text_column)
        out = schema.conform(table, self.schema)

        name = f"{PART_PREFIX}{self.run_id}-{ctx.task_idx:05d}.parquet"
        pq.write_table(out, f"{self.root}/{name}", filesystem=self.fs)
        result = {"file": name, **stats, "written_at": time.time()}
        commit_part(self.fs, self.staging_root, name, out.select(self.keys), result)
        return result

    def on_write_complete(self, write_result: WriteResult[dict[str, Any]]) -> None:
        self.generated_rows = sum(r.get("rows", 0) for r in write_result.write_returns)
        self.summary = merge_stats(self.previous + list(write_result.write_returns))


def _quality(table: pa.Table, text_column: str) -> dict[str, dict[str, Any]]:
    """Per bucket, of the rows an engine call finished: how many were cut at the limit,
    came out empty, or copy their document's opening (`pipeline.text.quality`), and their
    output tokens as counts per length (bounded by max_new_tokens, as prompt lengths are)."""
    texts = table.column(text_column).to_pylist() if text_column in table.column_names else [None] * table.num_rows
    finished = table.column("finish_reason").to_pylist()
    # Cut at the limit is the summary's (sampling.max_new_tokens); an annotation cut off
    # fails to validate and is counted as invalid_output.
    summary_finish = (table.column(schema.SUMMARY_FINISH.name).to_pylist()
                      if schema.SUMMARY_FINISH.name in table.column_names else finished)
    out: dict[str, dict[str, Any]] = {}
    for b, last, finish, status, tokens, summary, text in zip(
            table.column("bucket").to_pylist(), finished, summary_finish,
            table.column("status").to_pylist(), table.column("output_tokens").to_pylist(),
            table.column("summary").to_pylist(), texts):
        if b is None or last is None:
            continue
        q = out.setdefault(b, {"rows": 0, "cut_at_limit": 0, "empty_output": 0, "copies_opening": 0,
                               "output_tokens": Counter()})
        q["rows"] += 1
        q["cut_at_limit"] += finish == "length"
        q["empty_output"] += status == schema.Status.EMPTY_OUTPUT
        q["copies_opening"] += copies_opening(summary, text)
        q["output_tokens"][tokens] += 1
    if schema.ANNOTATION_TRIES.name in table.column_names:
        _annotation_quality(table, texts, out)
    return {b: {**q, "output_tokens": dict(q["output_tokens"])} for b, q in out.items()}


def _annotation_quality(table: pa.Table, texts: list[str | None], out: dict[str, dict[str, Any]]) -> None:
    """Per bucket, of the rows with an annotation call: valid at the first try, valid after
    the retry, or `invalid_output`; and per list column of the annotations (keywords, entity
    names), how many values it extracted and how many of them occur in the row's text."""
    names = table.column_names
    columns = [n for n in names[names.index("summary") + 1:names.index(schema.RAW_OUTPUT.name)]
               if pa.types.is_list(table.schema.field(n).type)]
    values = {n: table.column(n).to_pylist() for n in columns}
    for k, (b, status, tries) in enumerate(zip(table.column("bucket").to_pylist(), table.column("status").to_pylist(),
                                               table.column(schema.ANNOTATION_TRIES.name).to_pylist())):
        if b not in out or tries is None:
            continue
        a = out[b].setdefault("annotations", annotation_counts())
        valid = status == schema.Status.OK
        a["first_try"] += valid and tries == 1
        a["after_retry"] += valid and tries == 2
        a["invalid_output"] += status == schema.Status.INVALID_OUTPUT
        for n in columns:
            strings = extracted_strings(values[n][k])
            f = a["found"].setdefault(n, {"values": 0, "in_text": 0})
            f["values"] += len(strings)
            f["in_text"] += found_in_text(strings, texts[k])


def _block_stats(table: pa.Table, text_column: str = "text") -> dict[str, Any]:
    """What one written block contributes to the report."""
    status = table.column("status").to_pylist()
    buckets = table.column("bucket").to_pylist()
    prompt_tokens = table.column("prompt_tokens").to_pylist()
    output_tokens = table.column("output_tokens").to_pylist()
    calls = table.column(schema.ENGINE_CALL).to_pylist()

    # Counts per prompt length, not a list per row: the driver merges these, and
    # its memory must not grow with the corpus (lengths are bounded by the context).
    per_bucket: dict[str, Counter[int]] = defaultdict(Counter)
    call_rows: dict[str, dict[str, Any]] = {}
    for s, b, p, call in zip(status, buckets, prompt_tokens, calls):
        if b is not None:  # rows that failed before tokenizing have no bucket
            per_bucket[b][p] += 1
        if call is not None:
            c = call_rows.setdefault(call, {"buckets": [], "min_prompt_tokens": p, "max_prompt_tokens": p, "rows_written": 0})
            if b not in c["buckets"]:
                c["buckets"].append(b)
            c["min_prompt_tokens"] = min(c["min_prompt_tokens"], p)
            c["max_prompt_tokens"] = max(c["max_prompt_tokens"], p)
            c["rows_written"] += 1
    call_records = [r for x in table.column(schema.ENGINE_CALL_STATS).to_pylist() if x for r in json.loads(x)]
    reused: dict[str, dict[str, int]] = {}  # by the run each reused row's results came from
    if "reused_from" in table.column_names:
        for source, tokens in zip(table.column("reused_from").to_pylist(), output_tokens):
            if source is not None:
                r = reused.setdefault(source, {"rows": 0, "output_tokens": 0})
                r["rows"] += 1
                r["output_tokens"] += tokens or 0
    prepared = pc.min_max(table.column(schema.PREPARED_AT)) if schema.PREPARED_AT in table.column_names else None
    return {
        "prepared_at": None if prepared is None else [prepared["min"].as_py(), prepared["max"].as_py()],
        "rows": table.num_rows,
        "status": dict(Counter(status)),
        "prompt_tokens_by_bucket": {b: dict(c) for b, c in per_bucket.items()},
        "prompt_tokens": sum(p or 0 for p in prompt_tokens),
        "truncated": sum(bool(x) for x in table.column("truncated").to_pylist()),
        "chunked": sum(x is not None for x in table.column("chunks").to_pylist()),
        "output_tokens": sum(output_tokens),
        "call_rows": call_rows,
        "call_records": call_records,
        "reused": reused,
        "quality": _quality(table, text_column),
    }


def merge_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Fold per-task stats into one: counts add, lists concatenate, calls merge by id."""
    merged: dict[str, Any] = {
        "files": [], "rows": 0, "status": Counter(), "prompt_tokens_by_bucket": defaultdict(Counter),
        "prompt_tokens": 0, "output_tokens": 0, "truncated": 0, "chunked": 0, "calls": {}, "quality": {}, "reused": {},
        "timeline": {"first_row_prepared_at": None, "last_row_prepared_at": None,
                     "first_part_written_at": None, "last_part_written_at": None},
    }
    timeline = merged["timeline"]

    def widen(key_min: str, key_max: str, lo: float | None, hi: float | None) -> None:
        if lo is not None:
            timeline[key_min] = lo if timeline[key_min] is None else min(timeline[key_min], lo)
        if hi is not None:
            timeline[key_max] = hi if timeline[key_max] is None else max(timeline[key_max], hi)

    records: dict[str, dict[str, Any]] = {}
    for part in parts:
        if not part.get("file"):
            continue
        merged["files"].append(part["file"])
        merged["rows"] += part["rows"]
        widen("first_part_written_at", "last_part_written_at", part.get("written_at"), part.get("written_at"))
        widen("first_row_prepared_at", "last_row_prepared_at", *(part.get("prepared_at") or (None, None)))
        merged["status"].update(part["status"])
        merged["prompt_tokens"] += part["prompt_tokens"]
        merged["output_tokens"] += part["output_tokens"]
        merged["truncated"] += part["truncated"]
        merged["chunked"] += part["chunked"]
        for b, counts in part["prompt_tokens_by_bucket"].items():
            merged["prompt_tokens_by_bucket"][b].update(counts)
        for b, q in part.get("quality", {}).items():  # parts committed before it was counted have none
            m = merged["quality"].setdefault(b, {"rows": 0, "cut_at_limit": 0, "empty_output": 0,
                                                 "copies_opening": 0, "output_tokens": Counter()})
            for k in ("rows", "cut_at_limit", "empty_output", "copies_opening"):
                m[k] += q[k]
            m["output_tokens"].update({int(n): c for n, c in q["output_tokens"].items()})
            if "annotations" in q:
                add_annotation_counts(m.setdefault("annotations", annotation_counts()), q["annotations"])
        for source, r in part.get("reused", {}).items():  # parts committed before reuse have none
            m = merged["reused"].setdefault(source, {"rows": 0, "output_tokens": 0})
            m["rows"] += r["rows"]
            m["output_tokens"] += r["output_tokens"]
        for r in part["call_records"]:
            records[r["call"]] = r
        # A call's rows may land in several blocks: widen its observed range.
        for call, c in part["call_rows"].items():
            m = merged["calls"].setdefault(call, {"buckets": [], "min_prompt_tokens": c["min_prompt_tokens"],
                                                  "max_prompt_tokens": c["max_prompt_tokens"], "rows_written": 0})
            m["buckets"] = sorted(set(m["buckets"]) | set(c["buckets"]))
            m["min_prompt_tokens"] = min(m["min_prompt_tokens"], c["min_prompt_tokens"])
            m["max_prompt_tokens"] = max(m["max_prompt_tokens"], c["max_prompt_tokens"])
            m["rows_written"] += c["rows_written"]
    for call, m in merged["calls"].items():
        m.update(records.get(call, {}))
    # Calls no output row points at (annotations, retries, chunk levels) still cost engine time.
    for call, r in records.items():
        if call not in merged["calls"]:
            merged["calls"][call] = {"buckets": [r.get("bucket")], "rows_written": 0, **r}
    merged["status"] = dict(merged["status"])
    merged["prompt_tokens_by_bucket"] = {b: dict(c) for b, c in merged["prompt_tokens_by_bucket"].items()}
    merged["quality"] = {b: {**q, "output_tokens": dict(q["output_tokens"])} for b, q in merged["quality"].items()}
    return merged
