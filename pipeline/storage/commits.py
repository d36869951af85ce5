"""Commit markers: which output rows a run has written for good, so a resumed run skips them.

A part is committed once its marker is there. The write task writes the part
into `<staging>/output/`, then the marker `<staging>/commits/<part name>`: a
small Parquet file holding the part's row keys, with the part's report stats in
its metadata. A run killed between the two leaves a part with no marker; the run
that resumes deletes it (it is in that staging, so the pipeline wrote it) and
generates its rows again.

The key is the output row's: the id, and with passages (`kb_ingest`) the id and
the passage index, since one document's passages can land in different parts.

Why not Ray Data's `CheckpointConfig` (README, "Reliability"): it keys rows by the
input id, which is not unique in the output of a passages job; it switches itself
off with a log line when an input does not start with a Read operation
(`datasets` inputs); and its checkpoint lives apart from the staging, outside the
lease and ownership rules that publishing relies on.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.storage.fs import is_local, replace_local

COMMITS = "commits"
STATS_KEY = b"pipeline.part_stats"
PASSAGE_KEY = "passage_index"


def key_columns(id_column: str, passages: bool) -> list[str]:
    """The columns that name one output row."""
    return [id_column, PASSAGE_KEY] if passages else [id_column]


def row_keys(table: pa.Table, columns: list[str]) -> pa.Array:
    """One comparable key per row. A single id column is its own key; with passages,
    `id <US> passage index` as a string (a null index, a failed document, as empty)."""
    if len(columns) == 1:
        return table.column(columns[0]).combine_chunks()
    parts = [pc.fill_null(pc.cast(table.column(c), pa.string()), "") for c in columns]
    return pc.binary_join_element_wise(*parts, "\x1f")


def without(batch: pa.Table, committed: pa.Array, columns: list[str]) -> pa.Table:
    """The rows of `batch` whose key is not among `committed` (keys as `row_keys` makes them)."""
    return batch.filter(pc.invert(pc.is_in(row_keys(batch, columns), value_set=committed)))


def commit_part(fs: pafs.FileSystem, staging_root: str, part: str, keys: pa.Table, stats: dict[str, Any]) -> None:
    """Mark `part` committed: written after the part itself, whole or not at all."""
    meta = {STATS_KEY: json.dumps(stats).encode()}
    table = keys.replace_schema_metadata(meta)
    path = f"{staging_root}/{COMMITS}/{part}"
    if is_local(fs):
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        fs.create_dir(f"{staging_root}/{COMMITS}", recursive=True)
        replace_local(path, sink.getvalue().to_pybytes())
    else:  # an object appears only once its upload completes
        pq.write_table(table, path, filesystem=fs)


@dataclass
class Committed:
    """What a staging holds for good: its committed parts' stats and row keys."""

    parts: list[dict[str, Any]] = field(default_factory=list)  # each part's stats, as the sink returned them
    keys: pa.Table | None = None
    seconds: float = 0.0  # what reading them took

    @property
    def rows(self) -> int:
        return sum(p["rows"] for p in self.parts)

    @property
    def files(self) -> set[str]:
        return {p["file"] for p in self.parts}

    def documents(self) -> int:
        """Input rows with at least one committed output row (the id is the key's first column)."""
        return 0 if self.keys is None else len(pc.unique(self.keys.column(0)))


def _stats(raw: bytes) -> dict[str, Any]:
    stats = json.loads(raw)
    # JSON turned the prompt-length counters' int keys into strings.
    stats["prompt_tokens_by_bucket"] = {b: {int(k): v for k, v in c.items()}
                                        for b, c in stats["prompt_tokens_by_bucket"].items()}
    return stats


def load_commits(fs: pafs.FileSystem, staging_root: str) -> Committed:
    """Every committed part of a staging (none if it has no commits yet)."""
    started = time.monotonic()
    infos = fs.get_file_info(pafs.FileSelector(f"{staging_root}/{COMMITS}", allow_not_found=True))
    names = sorted(i.path for i in infos if i.is_file and not i.base_name.startswith("."))
    found = Committed()
    tables = []
    for path in names:
        table = pq.read_table(path, filesystem=fs)
        found.parts.append(_stats(table.schema.metadata[STATS_KEY]))
        tables.append(table.replace_schema_metadata(None))
    if tables:
        found.keys = pa.concat_tables(tables, promote_options="default")
    found.seconds = time.monotonic() - started
    return found


def drop_uncommitted(fs: pafs.FileSystem, data: str, committed: Committed) -> list[str]:
    """Delete what a stopped run left in its staging's output folder that no commit names:
    parts cut off mid-write, a report and plot of a publish that failed. All of it is in
    that run's staging, so the pipeline wrote it. Returns the names deleted."""
    keep = committed.files
    gone = []
    for info in fs.get_file_info(pafs.FileSelector(data, allow_not_found=True)):
        if info.is_file and info.base_name not in keep:
            fs.delete_file(info.path)
            gone.append(info.base_name)
    return sorted(gone)
