"""Find the input files and check them before any model loads.

A path can be one Parquet file, a folder (searched recursively for
`*.parquet`, skipping hidden and `_`-prefixed names) or a glob, on the local
disk or behind a URI that pyarrow has a filesystem for (s3://, gs://, ...).
The check reads only Parquet footers: schema and row counts.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.sink import resolve

_WILDCARDS = "*?["


class InputError(ValueError):
    """The input cannot be read as configured; the message names file and column."""


@dataclass(frozen=True)
class InputFiles:
    filesystem: pafs.FileSystem
    paths: list[str]
    schema: pa.Schema
    rows: int
    skipped: list[dict[str, str]] = field(default_factory=list)


TEXT_TYPES = (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary, pa.types.is_large_binary)


def _visible(path: str) -> bool:
    base = path.rsplit("/", 1)[-1]
    return base.endswith(".parquet") and not base.startswith((".", "_"))


def _glob_match(path: str, pattern: str) -> bool:
    """Shell-style: `*` stays within one folder level unless the pattern has `**`."""
    if not _visible(path) or not fnmatch.fnmatch(path, pattern):
        return False
    return "**" in pattern or path.count("/") == pattern.count("/")


def list_files(path: str) -> tuple[pafs.FileSystem, list[str]]:
    fs, p = resolve(path)
    if any(ch in p for ch in _WILDCARDS):
        cut = min(p.index(ch) for ch in _WILDCARDS if ch in p)
        base = p[:cut].rsplit("/", 1)[0] or "/"
        infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        files = sorted(i.path for i in infos if i.is_file and _glob_match(i.path, p))
    else:
        info = fs.get_file_info(p)
        if info.type == pafs.FileType.NotFound:
            raise InputError(f"{path}: no such file or folder")
        if info.type == pafs.FileType.Directory:
            infos = fs.get_file_info(pafs.FileSelector(p, recursive=True))
            files = sorted(i.path for i in infos if i.is_file and _visible(i.path))
        else:
            files = [p]
    if not files:
        raise InputError(f"{path}: matches no Parquet files")
    return fs, files


def _check_file(fs: pafs.FileSystem, f: str, id_column: str, text_column: str,
                template_fields: set[str]) -> tuple[pa.Schema, int]:
    """Schema and row count from the footer; InputError naming the file and column."""
    try:
        meta = pq.ParquetFile(f, filesystem=fs).metadata
        file_schema = meta.schema.to_arrow_schema()
    except (OSError, pa.ArrowException) as e:
        raise InputError(f"{f}: not a readable Parquet file: {e}") from None
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
    missing = sorted(template_fields - set(file_schema.names))
    if missing:
        raise InputError(
            f"{f}: the prompt template names {missing}, which are not columns "
            f"(columns: {', '.join(file_schema.names)})"
        )
    return file_schema, meta.num_rows


def check_inputs(path: str, id_column: str, text_column: str, template_fields: set[str],
                 on_bad_file: str = "fail") -> InputFiles:
    """List the files, read their footers, and check the columns the job needs.

    With `on_bad_file="skip"` a file that fails a check is left out and listed
    in `skipped`; otherwise the first one stops the run.
    """
    fs, files = list_files(path)
    schema: pa.Schema | None = None  # set by the first good file
    rows = 0
    good: list[str] = []
    skipped: list[dict[str, str]] = []
    for f in files:
        try:
            file_schema, n = _check_file(fs, f, id_column, text_column, template_fields)
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
        good.append(f)
    if not good:
        raise InputError(f"{path}: no readable input files ({len(skipped)} skipped)")
    return InputFiles(fs, good, schema, rows, skipped)  # type: ignore[arg-type]  # set with good


def duplicate_ids(inputs: InputFiles, id_column: str, show: int = 5) -> tuple[int, list[Any]]:
    """How many ids occur more than once (nulls aside), and a few of them.

    Reads only the id column. Ids must be unique for output to be checked
    against input and for runs to be resumed.
    """
    ids = pa.chunked_array(
        [pq.read_table(f, columns=[id_column], filesystem=inputs.filesystem).column(0) for f in inputs.paths]
    )
    counts = pc.value_counts(ids.drop_null())
    repeated = counts.filter(pc.greater(counts.field("counts"), 1))
    return len(repeated), repeated.field("values").to_pylist()[:show]
