"""Find the input and check it before any model loads.

Parquet: a path can be one file, a folder (searched recursively for
`*.parquet`, skipping files and folders with hidden or `_`-prefixed names,
such as a run's staging) or a glob, on the local
disk or behind a URI that pyarrow has a filesystem for (s3://, gs://, ...).
The check reads each file's footer (schema, row counts), then decodes every page
once, so a file that cannot be read fails the check (or is skipped) before Ray
starts, instead of failing the run midway.

Anything `datasets` loads: JSON/JSONL and CSV files (its `json` and `csv`
builders), a folder written by `Dataset.save_to_disk`, or a hub dataset name.
Local ones are converted once into `datasets`' memory-mapped Arrow cache and
handed to Ray Data as Arrow blocks; a hub dataset is streamed through
`ray.data.from_huggingface`, which reads its Parquet files in parallel.
"""

from __future__ import annotations

import fnmatch
import glob
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.config.models import InputConfig
from pipeline.storage.fs import resolve

_WILDCARDS = "*?["


class InputError(ValueError):
    """The input cannot be read as configured; the message names file and column."""


@dataclass(frozen=True)
class InputFiles:
    filesystem: pafs.FileSystem | None
    paths: list[str]
    schema: pa.Schema
    rows: int | None  # unknown for a streamed hub dataset
    skipped: list[dict[str, str]] = field(default_factory=list)
    format: str = "parquet"
    dataset: Any = None  # the `datasets` object, for every format but parquet
    bytes: int | None = None  # the rows' size decoded (Parquet footers' row groups); None where unknown

    def row_bytes(self) -> int | None:
        """The mean decoded size of a row, where known."""
        return self.bytes // self.rows if self.bytes and self.rows else None

    def read(self, blocks: int | None = None) -> Any:
        """The rows as a Ray Dataset (lazy)."""
        import ray.data

        if self.format == "parquet":
            return ray.data.read_parquet(self.paths, filesystem=self.filesystem)
        if self.format == "hub":
            return ray.data.from_huggingface(self.dataset)
        # The memory-mapped Arrow table, in slices. (from_huggingface would do the
        # same after first trying to reload the dataset by name and asking the hub
        # for Parquet files: a network call, and a stray re-read of local files.)
        table = self.dataset.with_format("arrow")[:]
        n = blocks or max(1, min(64, table.num_rows // 2048))
        step = -(-table.num_rows // n) if table.num_rows else 1
        return ray.data.from_arrow([table.slice(i, step) for i in range(0, max(table.num_rows, 1), step)])


TEXT_TYPES = (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary, pa.types.is_large_binary)


def _visible(path: str, root: str) -> bool:
    """A Parquet file under `root` with no hidden or `_`-prefixed name on the way down: a
    run's staging (`.NAME.RUN.staging/`), `_temporary/` folders of other tools, `_SUCCESS`."""
    names = path[len(root):].strip("/").split("/")
    return names[-1].endswith(".parquet") and not any(n.startswith((".", "_")) for n in names)


def _glob_match(path: str, pattern: str, base: str) -> bool:
    """Shell-style: `*` stays within one folder level unless the pattern has `**`."""
    if not _visible(path, base) or not fnmatch.fnmatch(path, pattern):
        return False
    return "**" in pattern or path.count("/") == pattern.count("/")


def list_files(path: str) -> tuple[pafs.FileSystem, list[str]]:
    fs, p = resolve(path)
    if any(ch in p for ch in _WILDCARDS):
        cut = min(p.index(ch) for ch in _WILDCARDS if ch in p)
        base = p[:cut].rsplit("/", 1)[0] or "/"
        infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        files = sorted(i.path for i in infos if i.is_file and _glob_match(i.path, p, base))
    else:
        info = fs.get_file_info(p)
        if info.type == pafs.FileType.NotFound:
            raise InputError(f"{path}: no such file or folder")
        if info.type == pafs.FileType.Directory:
            infos = fs.get_file_info(pafs.FileSelector(p, recursive=True))
            files = sorted(i.path for i in infos if i.is_file and _visible(i.path, p))
        else:
            files = [p]
    if not files:
        raise InputError(f"{path}: matches no Parquet files")
    return fs, files


def _check_columns(f: str, file_schema: pa.Schema, id_column: str, text_column: str,
                   template_fields: dict[str, set[str]], job_file: str | None) -> None:
    for column, role in ((id_column, "id"), (text_column, "text")):
        if column not in file_schema.names:
            raise InputError(
                f"{f}: {role} column {column!r} is missing (columns: {', '.join(file_schema.names)})"
            )
    text_type = file_schema.field(text_column).type
    if not any(check(text_type) for check in TEXT_TYPES):
        raise InputError(f"{f}: text column {text_column!r} is {text_type}, expected string (or binary)")
    id_type = file_schema.field(id_column).type
    if pa.types.is_nested(id_type) or pa.types.is_floating(id_type):
        raise InputError(f"{f}: id column {id_column!r} is {id_type}, expected strings or integers")
    for key, names in template_fields.items():
        where = f"{job_file + ': ' if job_file else ''}{key}"
        missing = sorted(n for n in names if n.split(".")[0] not in file_schema.names)
        if missing:
            raise InputError(
                f"{where} names {missing}, which are not columns of {f} "
                f"(columns: {', '.join(file_schema.names)})"
            )
        for name in sorted(n for n in names if "." in n):
            column, sub = name.split(".", 1)
            column_type = file_schema.field(column).type
            if not pa.types.is_struct(column_type):
                raise InputError(f"{where} names {{{name}}}, but column {column!r} of {f} is {column_type}, "
                                 "not a struct")
            fields = [column_type.field(k).name for k in range(column_type.num_fields)]
            if sub not in fields:
                raise InputError(f"{where} names {{{name}}}, but struct column {column!r} of {f} has no field "
                                 f"{sub!r} (fields: {', '.join(fields)})")


def _check_file(fs: pafs.FileSystem, f: str, id_column: str, text_column: str,
                template_fields: dict[str, set[str]], job_file: str | None) -> tuple[pa.Schema, int, int]:
    """Schema, row count and decoded bytes from the footer, then every page; InputError
    naming the file and column."""
    try:
        # Page checksums, where the writer wrote them, catch bytes that still decode.
        parquet = pq.ParquetFile(f, filesystem=fs, page_checksum_verification=True)
        meta = parquet.metadata
        file_schema = meta.schema.to_arrow_schema()
    except (OSError, pa.ArrowException) as e:
        raise InputError(f"{f}: not a readable Parquet file: {e}") from None
    with parquet:
        _check_columns(f, file_schema, id_column, text_column, template_fields, job_file)
        _check_pages(parquet, f, id_column)
    decoded = sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups))
    return file_schema, meta.num_rows, decoded


def _check_pages(parquet: pq.ParquetFile, f: str, id_column: str) -> None:
    """Decode every page, a batch at a time; InputError naming the row group and column.

    A page that cannot be decoded has no rows to flag: read by Ray, it would fail the
    run midway. This costs one read of the input, beside hours of generation. String
    ids must be valid UTF-8: they name the output rows, and a repaired id would name a
    row the input does not have.
    """
    id_type = parquet.schema_arrow.field(id_column).type
    check_ids = pa.types.is_string(id_type) or pa.types.is_large_string(id_type)
    row = 0
    for group in range(parquet.num_row_groups):
        try:
            for batch in _decode(parquet, group):
                if check_ids:
                    _check_ids(batch.column(id_column), f, id_column, row, group)
                row += batch.num_rows
        except (OSError, pa.ArrowException) as e:
            # Which column: decoded one at a time (only a bad file pays for this).
            for name in parquet.schema_arrow.names:
                try:
                    for _ in _decode(parquet, group, [name]):
                        pass
                except (OSError, pa.ArrowException) as column_error:
                    raise InputError(f"{f}: row group {group}, column {name!r} cannot be decoded: "
                                     f"{column_error}") from None
            raise InputError(f"{f}: row group {group} cannot be decoded: {e}") from None


def _decode(parquet: pq.ParquetFile, group: int, columns: list[str] | None = None) -> Any:
    # Small batches: a row group of long documents need not be held decoded at once.
    return parquet.iter_batches(batch_size=4096, row_groups=[group], columns=columns)


def _check_ids(ids: pa.Array, f: str, id_column: str, row: int, group: int) -> None:
    """InputError naming the first id that is not valid UTF-8, by its row in the file."""
    try:
        ids.validate(full=True)
        return
    except pa.ArrowInvalid:
        pass
    raw = ids.view(pa.large_binary() if pa.types.is_large_string(ids.type) else pa.binary()).to_pylist()
    for k, value in enumerate(raw):
        try:
            if value is not None:
                value.decode("utf-8")
        except UnicodeDecodeError:
            raise InputError(f"{f}: id column {id_column!r} is not valid UTF-8 at row {row + k} "
                             f"(row group {group}): {value!r}; ids name the output rows") from None


_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv"}


def detect_format(path: str) -> str:
    """parquet, json, csv, saved (a save_to_disk folder) or hub, from the path alone."""
    base = path.rstrip("/").rsplit("/", 1)[-1].lower()
    for ext, builder in _BUILDERS.items():
        if base.endswith(ext) or base.endswith(ext + ".gz"):
            return builder
    if "://" not in path:
        local = Path(path)
        if local.is_dir() and any((local / n).exists() for n in ("dataset_info.json", "dataset_dict.json")):
            return "saved"
        if not local.exists() and not any(ch in path for ch in _WILDCARDS) and \
                path.count("/") == 1 and not path.startswith((".", "/")):
            return "hub"  # owner/name, and no such local path
    return "parquet"


def _load_dataset(path: str, fmt: str, split: str, subset: str | None) -> Any:
    """The `datasets` object for a non-Parquet input; InputError naming the path."""
    try:
        import datasets
    except ImportError:  # pragma: no cover - a dependency
        raise InputError(f"{path}: reading {fmt} input needs the `datasets` package") from None
    datasets.disable_progress_bars()
    try:
        if fmt == "saved":
            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise InputError(f"{path}: no split {split!r} (splits: {', '.join(ds)}); set input.split")
                ds = ds[split]
            return ds
        if fmt == "hub":
            return datasets.load_dataset(path, subset, split=split, streaming=True)
        if "://" in path:
            files: Any = path
        else:
            if any(ch in path for ch in _WILDCARDS):
                files = sorted(glob.glob(path, recursive=True))
            elif Path(path).is_dir():
                files = sorted(str(p) for p in Path(path).rglob("*")
                               if p.suffix.lower() in _BUILDERS and not p.name.startswith((".", "_")))
            else:
                files = [path] if Path(path).exists() else []
            if not files:
                raise InputError(f"{path}: no such file or folder, or no {fmt} files in it")
        return datasets.load_dataset(fmt, data_files=files, split=split)
    except InputError:
        raise
    except Exception as e:  # datasets raises many kinds; all mean "cannot read this input"
        hint = " (is the network reachable? hub datasets need it)" if fmt == "hub" else ""
        raise InputError(f"{path}: cannot load as {fmt}{hint}: {type(e).__name__}: {e}") from None


def _dataset_schema(ds: Any) -> pa.Schema:
    if ds.features is None:  # a streamed dataset whose schema is known only once read
        return next(iter(ds.take(1).with_format("arrow").iter(batch_size=1))).schema
    return ds.features.arrow_schema


def check_inputs(source: InputConfig, template_fields: dict[str, set[str]] | set[str],
                 job_file: str | None = None) -> InputFiles:
    """Find the input, read its schema, and check the columns the job needs.

    `template_fields`: what each template names, by job key: a column (`text`) or a
    struct column's field (`meta.title`, which must be a field of a struct column).
    Parquet: with `on_bad_file: skip` a file that fails a check is left out
    and listed in `skipped`; otherwise the first one stops the run.
    """
    if isinstance(template_fields, set):
        template_fields = {"prompt.template": template_fields}
    path, id_column, text_column = source.path, source.id_column, source.text_column
    on_bad_file, split, subset = source.on_bad_file, source.split, source.subset
    fmt = detect_format(path) if source.format == "auto" else source.format
    if fmt != "parquet":
        ds = _load_dataset(path, fmt, split, subset)
        ds_schema = _dataset_schema(ds)
        _check_columns(path, ds_schema, id_column, text_column, template_fields, job_file)
        rows = len(ds) if hasattr(ds, "__len__") else None
        size = getattr(getattr(ds, "data", None), "nbytes", None)  # a memory-mapped table's; a stream has none
        return InputFiles(None, [path], ds_schema, rows, format=fmt, dataset=ds, bytes=size)
    fs, files = list_files(path)
    schema: pa.Schema | None = None  # set by the first good file
    rows = decoded = 0
    good: list[str] = []
    skipped: list[dict[str, str]] = []
    for f in files:
        try:
            file_schema, n, size = _check_file(fs, f, id_column, text_column, template_fields, job_file)
            if schema is not None and not schema.equals(file_schema):
                try:  # unify_schemas raises on incompatible types, naming the field
                    file_schema = pa.unify_schemas([schema, file_schema])
                except pa.ArrowException as e:
                    raise InputError(f"{f}: schema differs from {good[0]}: {e}") from None
        except InputError as e:
            if on_bad_file != "skip":
                raise
            skipped.append({"file": f, "reason": str(e)})
            continue
        schema = file_schema
        rows += n
        decoded += size
        good.append(f)
    if not good:
        raise InputError(f"{path}: no readable input files ({len(skipped)} skipped)")
    return InputFiles(fs, good, schema, rows, skipped, bytes=decoded)  # type: ignore[arg-type]  # set with good


def duplicate_ids(inputs: InputFiles, id_column: str, show: int = 5) -> tuple[int, list[Any]]:
    """How many ids occur more than once (nulls aside), and a few of them.

    Ids must be unique for output to be checked against input and for runs to be
    resumed. Parquet is checked on the Ray cluster, so the driver never holds the
    corpus's ids: one task per file reads the id column and splits it by a hash of the
    id, one task per split counts it (a shuffle of plain tasks; Ray Data's groupby took
    17 s for 1,000 ids beside engine start-up on 2 cores, these take about 1 s). A
    `datasets` table is memory-mapped and counted in place; a streamed hub dataset is
    not checked here (it would mean reading it twice).
    """
    if inputs.format == "hub":
        return 0, []
    if inputs.format != "parquet":
        return _repeated_ids(inputs.dataset.with_format("arrow")[:][id_column], show=show)
    import ray

    splits = max(1, min(len(inputs.paths), MAX_ID_SPLITS))
    # A quarter of a CPU per task: they run beside the job's reads and engine start-up.
    read = ray.remote(num_cpus=0.25, num_returns=splits)(_split_ids)
    count = ray.remote(num_cpus=0.25)(_repeated_ids)
    # At most ID_CHECK_TASKS at once: each running task is a worker process, and a task per
    # file at once started more workers than a small machine has cores (Ray warned of it).
    per_file, running = [], []
    for path in inputs.paths:
        if len(running) >= ID_CHECK_TASKS:
            _, running = ray.wait(running, num_returns=1, fetch_local=False)
        refs = read.remote(path, inputs.filesystem, id_column, splits)
        per_file.append(refs if splits > 1 else [refs])
        running.append(per_file[-1][0])
    found = []
    for k in range(0, splits, ID_CHECK_TASKS):
        found += ray.get([count.remote(*(refs[j] for refs in per_file), show=show)
                          for j in range(k, min(k + ID_CHECK_TASKS, splits))])
    return sum(n for n, _ in found), [x for _, examples in found for x in examples][:show]


MAX_ID_SPLITS = 64
ID_CHECK_TASKS = 2


def _split_ids(path: str, filesystem: Any, column: str, splits: int) -> Any:
    """One file's ids (nulls aside), split by a hash of the id: equal ids land in one split."""
    import numpy as np
    import pandas as pd

    ids = pq.read_table(path, columns=[column], filesystem=filesystem).column(0).drop_null()
    if splits == 1:
        return ids
    which = pd.util.hash_array(np.asarray(ids.to_pandas(), dtype=object)) % splits
    return tuple(ids.filter(pa.array(which == k)) for k in range(splits))


def _repeated_ids(*parts: Any, show: int = 5) -> tuple[int, list[Any]]:
    """Ids occurring more than once across `parts` (chunked arrays of one type), and a few."""
    ids = pa.chunked_array([c for p in parts for c in p.chunks], type=parts[0].type)
    counts = pc.value_counts(ids.drop_null())
    repeated = counts.filter(pc.greater(counts.field("counts"), 1))
    return len(repeated), repeated.field("values").to_pylist()[:show]
