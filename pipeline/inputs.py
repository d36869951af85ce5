"""Find the input files and check them before any model loads.

A path can be one Parquet file, a folder (searched recursively for
`*.parquet`, skipping hidden and `_`-prefixed names) or a glob, on the local
disk or behind a URI that pyarrow has a filesystem for (s3://, gs://, ...).
The check reads only Parquet footers: schema and row counts.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import pyarrow as pa
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


def check_inputs(path: str, id_column: str, text_column: str, template_fields: set[str]) -> InputFiles:
    """List the files, read their footers, and check the columns the job needs."""
    fs, files = list_files(path)
    schema: pa.Schema | None = None  # set by the first file
    rows = 0
    for f in files:
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
        if not (pa.types.is_string(text_type) or pa.types.is_large_string(text_type)):
            raise InputError(f"{f}: text column {text_column!r} is {text_type}, expected string")
        missing = sorted(template_fields - set(file_schema.names))
        if missing:
            raise InputError(
                f"{f}: the prompt template names {missing}, which are not columns "
                f"(columns: {', '.join(file_schema.names)})"
            )
        if schema is None:
            schema = file_schema
        elif not schema.equals(file_schema):
            # unify_schemas raises on incompatible types, naming the field.
            try:
                schema = pa.unify_schemas([schema, file_schema])
            except pa.ArrowException as e:
                raise InputError(f"{f}: schema differs from {files[0]}: {e}") from None
        rows += meta.num_rows
    return InputFiles(fs, files, schema, rows)  # type: ignore[arg-type]  # files is never empty
