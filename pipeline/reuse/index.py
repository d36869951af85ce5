"""The lookup of result keys in earlier outputs, on the cluster, streaming.

    earlier outputs --each shard reads, keeps its keys--> KeyShard actors (key -> results)
    prepared rows --look_up (map_batches)--> + _reused_from, _reused.<column>

The earlier `ok` rows' keys and result columns are hashed into shards, each a Ray actor
holding at most `KEYS_PER_SHARD` keys: no process holds the whole index, and the
driver holds none of it. The lookup is a map over the prepared rows as they stream by:
each batch asks each shard for its own keys, so the first rows to generate reach the
engines while the rest of the corpus is still being read and looked up (a join would
hold every row back until both sides were shuffled).

A key found in several earlier outputs takes the newest's row (equal keys, equal
results: what differs is which run it names). Rows that were not `ok` are not indexed:
they are generated again.

Earlier rows are also indexed by their input key (`pipeline.generation.result_key`),
in the shard of that key, with what the prepare stage made of them (their prompt's
tokens, truncation, chunks, bucket and result key). The prepare stage looks each row's
input key up before tokenizing it (`look_up_inputs`): a row found there is not
tokenized at all, and the lookup after prepare asks only for the others' result keys.
"""

from __future__ import annotations

import math
import time
import zlib
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pipeline import schema
from pipeline.generation.result_key import keys_of_rows
from pipeline.reuse.sources import EarlierOutput

KEYS_PER_SHARD = 500_000
REUSED_FROM = "_reused_from"  # the earlier run a row's results come from (null: not found)
REUSED_PREFIX = "_reused."  # the earlier row's result columns, travelling to the generate stage

# What a reused row takes from its earlier one; the rest is this run's (prepare computes
# the same prompt tokens, truncation, chunks and bucket for the same key).
BASE_RESULTS = ("summary", "output_tokens", "finish_reason", "latency_s")
# What a row found by its input key takes besides: what prepare would compute again.
PREPARED = ("prompt_tokens", "truncated", "original_tokens", "chunks", "bucket", "result_key")
INPUT_KEY = "input_key"
ANNOTATION_RESULTS = (schema.RAW_OUTPUT.name, schema.ANNOTATION_TRIES.name, schema.SUMMARY_FINISH.name)


def result_columns(out_schema: pa.Schema) -> list[str]:
    """The columns a reused row takes from its earlier row, in `out_schema`: the summary,
    the annotation columns (between the summary and `raw_output`), and how they ended."""
    names = out_schema.names
    annotations = (names[names.index("summary") + 1:names.index(schema.RAW_OUTPUT.name)]
                   if schema.RAW_OUTPUT.name in names else [])
    return [*BASE_RESULTS, *annotations, *(n for n in ANNOTATION_RESULTS if n in names)]


def shard_of(key: str, shards: int) -> int:
    return zlib.crc32(key.encode()) % shards


def shard_count(rows: int) -> int:
    return max(1, math.ceil(rows / KEYS_PER_SHARD))


class KeyShard:
    """One shard of the index (a Ray actor): its keys, each with its row of results. A row
    is held once, for its result key, its input key, or both where both are this shard's."""

    def __init__(self) -> None:
        self._tables: list[pa.Table] = []
        self._rows = 0
        self._index: dict[str, tuple[int, int]] = {}  # result key -> (rank of its source, row)
        self._inputs: dict[str, tuple[int, int]] = {}  # input key -> (rank of its source, row)
        self._table: pa.Table | None = None
        self._asked = 0  # keys looked up here (a resumed run asks none of its committed rows')
        self._inputs_asked = 0
        self._inputs_found = 0

    def add(self, table: pa.Table, rank: int) -> int:
        """Rows of one source (`rank` 0 is the newest): `result_key` (null for a row held
        only for its input key), `input_key` where the source has them, and the results."""
        inputs = table.column(INPUT_KEY).to_pylist() if INPUT_KEY in table.column_names else []
        for index, keys in ((self._index, table.column("result_key").to_pylist()), (self._inputs, inputs)):
            for row, key in enumerate(keys, self._rows):
                if key is None:
                    continue
                have = index.get(key)
                if have is None or rank < have[0]:
                    index[key] = (rank, row)
        self._tables.append(table.drop_columns([c for c in ("result_key", INPUT_KEY) if c in table.column_names]))
        self._rows += table.num_rows
        self._table = None
        return table.num_rows

    def size(self) -> int:
        return len(self._index)

    def asked(self) -> int:
        return self._asked

    def inputs_asked(self) -> tuple[int, int]:
        """(input keys looked up here, of them found)."""
        return self._inputs_asked, self._inputs_found

    def load(self, files: list[tuple[str, int, str, bool]], number: int, shards: int,
             columns: list[str]) -> tuple[int, float]:
        """Read the earlier outputs' files, one at a time, keeping this shard's keyed `ok`
        rows (each file: its URI, its source's rank, its source's label, whether its rows
        have input keys). (result keys held, seconds)."""
        import pyarrow.parquet as pq

        from pipeline.storage.fs import resolve

        t = time.monotonic()
        for uri, rank, label, inputs in files:
            fs, path = resolve(uri)
            wanted = ["result_key", "status", *columns]
            if inputs:
                wanted += [INPUT_KEY, *(c for c in PREPARED if c not in wanted)]
            table = _ok_keyed(pq.read_table(path, columns=wanted, filesystem=fs))
            mine = [shard_of(k, shards) == number for k in table.column("result_key").to_pylist()]
            by_input = ([k is not None and shard_of(k, shards) == number for k in table.column(INPUT_KEY).to_pylist()]
                        if inputs else [False] * len(mine))
            keep = [i for i, (a, b) in enumerate(zip(mine, by_input)) if a or b]
            table = table.take(pa.array(keep, pa.int64()))
            held = {"result_key": pa.array([k if mine[i] else None for i, k in
                                            zip(keep, table.column("result_key").to_pylist())], pa.string()),
                    REUSED_FROM: pa.array([label] * table.num_rows, pa.string()),
                    **{REUSED_PREFIX + c: table.column(c) for c in columns}}
            if inputs:
                held[INPUT_KEY] = pa.array([k if by_input[i] else None for i, k in
                                            zip(keep, table.column(INPUT_KEY).to_pylist())], pa.string())
                held |= {REUSED_PREFIX + c: table.column(c) for c in PREPARED if c not in columns}
            self.add(pa.table(held), rank)
        return self.size(), time.monotonic() - t

    def _rows_of(self, index: dict[str, tuple[int, int]], keys: list[str]) -> pa.Table:
        if self._table is None and self._tables:
            # One chunk per column: a take from a table of many chunks (a source file each)
            # costs time with the whole table's size, at every lookup.
            self._table = pa.concat_tables(self._tables, promote_options="permissive").combine_chunks()
            self._tables = [self._table]
        if self._table is None:
            return pa.table({REUSED_FROM: pa.nulls(len(keys), pa.string())})
        rows = [index.get(k, (0, None))[1] for k in keys]
        return self._table.take(pa.array(rows, pa.int64()))

    def look_up(self, keys: list[str]) -> pa.Table:
        """The results of each result key's earlier row, in order; a row of nulls where none."""
        self._asked += len(keys)
        return self._rows_of(self._index, keys)

    def look_up_inputs(self, keys: list[str]) -> pa.Table:
        """The results and prepared columns of each input key's earlier row, in order; a
        row of nulls where none."""
        out = self._rows_of(self._inputs, keys)
        self._inputs_asked += len(keys)
        self._inputs_found += len(keys) - out.column(REUSED_FROM).null_count
        return out


def _ok_keyed(batch: pa.Table) -> pa.Table:
    keep = pc.and_(pc.equal(batch.column("status"), schema.Status.OK.value), pc.is_valid(batch.column("result_key")))
    return batch.filter(pc.fill_null(keep, False))


class ReuseIndex:
    """The shards of one run's index, loading from its earlier outputs.

    Each shard reads every file and keeps its own keys (a file at a time: it holds no
    more than its shard and one file), in its own process, from the moment the index is
    made: the run goes on starting meanwhile, and a lookup that reaches a shard still
    loading waits for it (an actor runs its calls in order). Read once per shard: for a
    few shards (500,000 keys each) that costs less than a shuffle's start."""

    def __init__(self, sources: list[EarlierOutput], columns: list[str]):
        import ray

        self.sources = [s for s in sources if s.key_version is not None]
        self.columns = columns
        rows = sum(s.rows for s in self.sources)
        self.shard_count = shard_count(rows)
        files = [(uri, rank, s.label, s.input_keys) for rank, s in enumerate(self.sources) for uri in s.uris()]
        self.inputs = any(s.input_keys for s in self.sources)  # rows can be found before they are tokenized
        self.shards = [ray.remote(num_cpus=0)(KeyShard).remote() for _ in range(self.shard_count)]
        self._loads = [s.load.remote(files, k, self.shard_count, columns) for k, s in enumerate(self.shards)]
        self._loaded: list[tuple[int, float]] | None = None
        self.looked_up: int | None = None  # keys the run looked up, counted by the shards as they end
        self.inputs_looked_up: tuple[int, int] | None = None  # input keys looked up, found

    def _wait(self) -> list[tuple[int, float]]:
        import ray

        if self._loaded is None:
            self._loaded = ray.get(self._loads)
        return self._loaded

    @property
    def keys(self) -> int:
        """Keys indexed (waits for the shards to finish loading)."""
        return sum(n for n, _ in self._wait())

    @property
    def seconds(self) -> float:
        """How long the slowest shard took to load."""
        return max((s for _, s in self._wait()), default=0.0)

    def close(self) -> None:
        """End the shard actors, by their handles (their counts kept for the report)."""
        import ray

        if self.shards and self._loaded is None:
            try:
                self._wait()
            except Exception:  # a shard that failed: the run says so elsewhere
                self._loaded = []
        if self.shards:
            try:
                inputs = ray.get([s.inputs_asked.remote() for s in self.shards])
                self.inputs_looked_up = (sum(a for a, _ in inputs), sum(f for _, f in inputs))
                # Rows asked about: by result key, or found by their input key (never asked after).
                self.looked_up = sum(ray.get([s.asked.remote() for s in self.shards])) + self.inputs_looked_up[1]
            except Exception:  # a shard that failed: its count is lost with it
                self.looked_up = self.inputs_looked_up = None
        for s in self.shards:
            ray.kill(s)
        self.shards = []


def batch_keys(batch: pa.Table, base: str | None) -> pa.Array:
    """Every row's result key of a prepared batch, from its prompt's working columns."""
    n = batch.num_rows
    if base is None:
        return pa.nulls(n, pa.string())
    annotation = (batch.column(schema.ANNOTATION_TOKEN_IDS).to_pylist()
                  if schema.ANNOTATION_TOKEN_IDS in batch.column_names else [None] * n)
    return pa.array(keys_of_rows(base, batch.column(schema.PROMPT_TOKEN_IDS).to_pylist(), annotation,
                                 batch.column(schema.CHUNK_TEXTS).to_pylist()), pa.string())


def ok_rows(batch: pa.Table, found: bool) -> pa.Array:
    """Which rows are ok after prepare and were (`found`) or were not found by the lookup."""
    ok = pc.fill_null(pc.equal(batch.column("status"), schema.Status.OK.value), False)
    if REUSED_FROM not in batch.column_names:
        return ok if not found else pa.array([False] * batch.num_rows)
    return pc.and_(ok, batch.column(REUSED_FROM).is_valid() if found else batch.column(REUSED_FROM).is_null())


def rows_to_generate(batch: pa.Table) -> bool:
    """Whether a row of `batch` is to be generated: ok after prepare, and not found."""
    return bool(pc.any(ok_rows(batch, found=False)).as_py())


def keyed_look_up(batch: pa.Table, base: str, shards: list[Any], columns: list[str], gate: Any = None) -> pa.Table:
    """A prepared batch with its rows' result keys (`result_key`), then looked up. Rows the
    prepare stage found by their input key keep what it found (and the result key it
    brought); only the others are keyed and looked up. A batch with a row to generate
    tells the engine pool's `gate` (one message, not awaited), so the engines start while
    the rest of the corpus is read."""
    if REUSED_FROM not in batch.column_names:
        out = look_up(batch.append_column("result_key", batch_keys(batch, base)), shards, columns)
    else:
        found = pc.fill_null(batch.column(REUSED_FROM).is_valid(), False)
        done = batch.filter(found)
        done = done.append_column("result_key", done.column(REUSED_PREFIX + "result_key").cast(pa.string()))
        rest = batch.filter(pc.invert(found)).drop_columns(
            [c for c in batch.column_names if c.startswith(REUSED_PREFIX) or c == REUSED_FROM])
        rest = look_up(rest.append_column("result_key", batch_keys(rest, base)), shards, columns)
        done = done.select([c for c in rest.column_names if c in done.column_names])
        out = pa.concat_tables([done, rest], promote_options="permissive")
        # Back in the batch's order: `out` holds the found rows first, then the rest; where
        # each row went is the inverse of that order.
        order = pa.concat_arrays([pc.indices_nonzero(found.combine_chunks()),
                                  pc.indices_nonzero(pc.invert(found).combine_chunks())])
        out = out.take(pc.sort_indices(order))
    if gate is not None and rows_to_generate(out):
        gate.work_found()
    return out


def look_up_inputs(keys: list[str | None], shards: list[Any]) -> pa.Table | None:
    """Each input key's earlier row (`_reused_from`, `_reused.<column>`, the prepared
    columns among them), aligned with `keys`; nulls where none. None where no key was found."""
    import ray

    rows = by_shard(keys, len(shards))
    if not rows:
        return None
    found = ray.get([shards[s].look_up_inputs.remote([keys[i] for i in members]) for s, members in rows.items()])
    if all(t.column(REUSED_FROM).null_count == t.num_rows for t in found):
        return None
    names = dict.fromkeys(n[len(REUSED_PREFIX):] for t in found for n in t.column_names if n.startswith(REUSED_PREFIX))
    keyed = with_found(pa.table({INPUT_KEY: pa.array(keys, pa.string())}), list(rows.values()), found, list(names))
    return keyed.drop_columns([INPUT_KEY])


def by_shard(keys: list[str | None], shards: int) -> dict[int, list[int]]:
    """The rows of each shard, by their keys (rows without a key are in none)."""
    out: dict[int, list[int]] = {}
    for i, k in enumerate(keys):
        if k is not None:
            out.setdefault(shard_of(k, shards), []).append(i)
    return out


def look_up(batch: pa.Table, shards: list[Any], columns: list[str]) -> pa.Table:
    """`batch` with each row's earlier results where its key is indexed: `_reused_from`
    names the run, `_reused.<column>` hold the values (nulls where it was not found)."""
    import ray

    keys = batch.column("result_key").to_pylist()
    rows = by_shard(keys, len(shards))
    found = ray.get([shards[s].look_up.remote([keys[i] for i in members]) for s, members in rows.items()])
    return with_found(batch, list(rows.values()), found, columns)


def with_found(batch: pa.Table, rows: list[list[int]], found: list[pa.Table], columns: list[str]) -> pa.Table:
    """`batch` with the shards' answers (`found[k]` for the rows `rows[k]`, in order) as
    columns aligned with its rows."""
    position: list[int | None] = [None] * batch.num_rows
    for at, i in enumerate(i for members in rows for i in members):
        position[i] = at
    take = pa.array(position, pa.int64())
    types = {f.name: f.type for t in reversed(found) for f in t.schema}
    for name in [REUSED_FROM, *(REUSED_PREFIX + c for c in columns)]:
        kind = types.get(name, pa.string() if name == REUSED_FROM else pa.null())
        if not found:
            batch = batch.append_column(name, pa.nulls(batch.num_rows, kind))
            continue
        # A shard with nothing indexed answers with no result columns: nulls of their type.
        chunks = [c for t in found
                  for c in (t.column(name) if name in t.column_names else pa.chunked_array([pa.nulls(t.num_rows, kind)])).chunks]
        batch = batch.append_column(name, pa.chunked_array(chunks, kind).take(take))
    return batch
