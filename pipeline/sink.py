"""Write output rows as Parquet parts, each whole or not at all, and collect stats.

Each write task writes one file named by run id and task index, so parallel
writers never collide. Locally a part is written under a dot-name and renamed
into place; object stores publish an object only once its upload completes,
so there it is written directly. Each task returns the stats the report needs
(counts per status, prompt lengths per bucket, engine calls), so the report is
built from what was written without reading the output back.
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from ray.data import Datasink
from ray.data.block import Block, BlockAccessor
from ray.data.datasource.datasink import WriteResult

from pipeline import schema
from pipeline.stages.generate import ENGINE_CALL_STATS

PART_PREFIX = "part-"


def resolve(path: str) -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem and the path within it; local paths made absolute."""
    if "://" in path:
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), os.path.abspath(path)


class ParquetPartsSink(Datasink[dict[str, Any]]):
    def __init__(self, output: str, run_id: str, output_schema: pa.Schema):
        self.output = output
        self.run_id = run_id
        self.schema = output_schema
        self.summary: dict[str, Any] | None = None

    def get_name(self) -> str:
        return "ParquetParts"

    def on_write_start(self, schema: pa.Schema | None = None) -> None:
        fs, root = resolve(self.output)
        fs.create_dir(root, recursive=True)

    def write(self, blocks: Iterable[Block], ctx: Any) -> dict[str, Any]:
        tables = [BlockAccessor.for_block(b).to_arrow() for b in blocks]
        tables = [t for t in tables if t.num_rows]
        if not tables:
            return {"file": None, "rows": 0}
        table = pa.concat_tables(tables, promote_options="default")
        stats = _block_stats(table)
        out = schema.conform(table, self.schema)

        fs, root = resolve(self.output)
        name = f"{PART_PREFIX}{self.run_id}-{ctx.task_idx:05d}.parquet"
        final = f"{root}/{name}"
        if isinstance(fs, pafs.LocalFileSystem):
            tmp = f"{root}/.{name}.tmp"
            pq.write_table(out, tmp, filesystem=fs)
            os.replace(tmp, final)
        else:
            pq.write_table(out, final, filesystem=fs)
        return {"file": name, **stats}

    def on_write_complete(self, write_result: WriteResult[dict[str, Any]]) -> None:
        self.summary = merge_stats(write_result.write_returns)
        # This run's parts are all in place: only now retire earlier runs' parts,
        # so a failed run leaves the previous output readable.
        fs, root = resolve(self.output)
        mine = set(self.summary["files"])
        for info in fs.get_file_info(pafs.FileSelector(root)):
            base = info.base_name
            if base.startswith(PART_PREFIX) and base.endswith(".parquet") and base not in mine:
                fs.delete_file(info.path)

    def on_write_failed(self, error: Exception) -> None:
        # Parts already renamed stay: they are whole, and the next run retires them.
        fs, root = resolve(self.output)
        if isinstance(fs, pafs.LocalFileSystem) and os.path.isdir(root):
            for name in os.listdir(root):
                if name.startswith(f".{PART_PREFIX}{self.run_id}-") and name.endswith(".tmp"):
                    os.remove(os.path.join(root, name))


def _block_stats(table: pa.Table) -> dict[str, Any]:
    """What one written block contributes to the report."""
    status = table.column("status").to_pylist()
    buckets = table.column("bucket").to_pylist()
    prompt_tokens = table.column("prompt_tokens").to_pylist()
    output_tokens = table.column("output_tokens").to_pylist()
    calls = table.column(schema.ENGINE_CALL).to_pylist()

    per_bucket: dict[str, list[int]] = defaultdict(list)
    call_rows: dict[str, dict[str, Any]] = {}
    for s, b, p, call in zip(status, buckets, prompt_tokens, calls):
        if b is not None:  # rows that failed before tokenizing have no bucket
            per_bucket[b].append(p)
        if call is not None:
            c = call_rows.setdefault(call, {"buckets": [], "min_prompt_tokens": p, "max_prompt_tokens": p, "rows_written": 0})
            if b not in c["buckets"]:
                c["buckets"].append(b)
            c["min_prompt_tokens"] = min(c["min_prompt_tokens"], p)
            c["max_prompt_tokens"] = max(c["max_prompt_tokens"], p)
            c["rows_written"] += 1
    call_records = [r for x in table.column(ENGINE_CALL_STATS).to_pylist() if x for r in json.loads(x)]
    return {
        "rows": table.num_rows,
        "status": dict(Counter(status)),
        "prompt_tokens_by_bucket": dict(per_bucket),
        "prompt_tokens": sum(p or 0 for p in prompt_tokens),
        "truncated": sum(bool(x) for x in table.column("truncated").to_pylist()),
        "chunked": sum(x is not None for x in table.column("chunks").to_pylist()),
        "output_tokens": sum(output_tokens),
        "call_rows": call_rows,
        "call_records": call_records,
    }


def merge_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Fold per-task stats into one: counts add, lists concatenate, calls merge by id."""
    merged: dict[str, Any] = {
        "files": [], "rows": 0, "status": Counter(), "prompt_tokens_by_bucket": defaultdict(list),
        "prompt_tokens": 0, "output_tokens": 0, "truncated": 0, "chunked": 0, "calls": {},
    }
    records: dict[str, dict[str, Any]] = {}
    for part in parts:
        if not part.get("file"):
            continue
        merged["files"].append(part["file"])
        merged["rows"] += part["rows"]
        merged["status"].update(part["status"])
        merged["prompt_tokens"] += part["prompt_tokens"]
        merged["output_tokens"] += part["output_tokens"]
        merged["truncated"] += part["truncated"]
        merged["chunked"] += part["chunked"]
        for b, values in part["prompt_tokens_by_bucket"].items():
            merged["prompt_tokens_by_bucket"][b].extend(values)
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
    merged["status"] = dict(merged["status"])
    merged["prompt_tokens_by_bucket"] = dict(merged["prompt_tokens_by_bucket"])
    return merged
