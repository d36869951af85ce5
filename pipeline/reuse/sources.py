"""Which earlier outputs a run may take results from, found and proven ours before Ray starts.

A reuse path is a folder, a glob of folders, or an object-store prefix (a glob there
too). Every folder it names must be an output this pipeline published: its
`_report.json` readable, its run id and job named, and every Parquet file in it
listed there. A folder holding Parquet without such a report (another tool's, or a
half-copied one) is refused with the run, exit 2, before any cluster starts. Folders
that hold no Parquet at all are passed over.

The nightly job's own default (`reuse.from` in the job, a glob of its earlier
partitions) keeps the latest `reuse.lookback` complete outputs, by when their runs
started; `--reuse PATH` keeps every output it names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

import pyarrow.fs as pafs

from pipeline.storage.fs import read_bytes, resolve
from pipeline.storage.output import REPORT_NAME, _listed


class ReuseError(ValueError):
    """A reuse path names something this pipeline did not write; nothing ran."""


@dataclass(frozen=True)
class EarlierOutput:
    """One earlier output, as its report proves it."""

    path: str  # the folder, as a URI for an object store
    run_id: str
    job: str
    started_at: str
    date: str | None
    files: tuple[str, ...]  # its Parquet parts, full paths within their filesystem
    rows: int
    key_version: int | None  # None: written before rows had result keys
    engine_s: float  # the engine time its run spent
    generated_tokens: int  # every token its engines generated
    # Its rows' engine seconds per output token, reused ones at what they cost when made
    # (its report's reuse.engine_s_per_token); None: it reused nothing, see `seconds_per_token`.
    carried_rate: float | None = None
    input_keys: bool = False  # its rows have input keys (`comparable` reads its footer)

    @property
    def label(self) -> str:
        """What a reused row's `reused_from` says: the run, and its date where it has one."""
        return f"{self.run_id} ({self.date})" if self.date else self.run_id

    def uris(self) -> list[str]:
        """Its files as a reader names them (with the object store's scheme)."""
        return [_uri(self.path, f) for f in self.files]

    def seconds_per_token(self) -> float:
        """What a token of its rows cost an engine when it was made: a run that itself
        reused rows passes on its sources' cost for them, so a chain of nights does not
        price a night-1 row at a small night's rate."""
        if self.carried_rate is not None:
            return self.carried_rate
        return self.engine_s / self.generated_tokens if self.generated_tokens else 0.0


def _uri(path: str, fs_path: str) -> str:
    """`fs_path` (within the filesystem `path` resolved to) as the user would name it."""
    if "://" in path:
        return f"{path.split('://', 1)[0]}://{fs_path}"
    return fs_path


def _folders(fs: pafs.FileSystem, pattern: str) -> list[str]:
    """The folders a path or glob names (a glob's * and ? within one path segment)."""
    if not any(c in pattern for c in "*?["):
        info = fs.get_file_info(pattern)
        if info.type == pafs.FileType.NotFound:
            return []
        if info.type != pafs.FileType.Directory:
            raise ReuseError(f"reuse path {pattern} is a file: a reuse path names output folders of this pipeline")
        return [pattern]
    from fnmatch import fnmatchcase

    segments = pattern.split("/")
    fixed = next(i for i, s in enumerate(segments) if any(c in s for c in "*?["))
    found = ["/".join(segments[:fixed]) or "/"]
    for segment in segments[fixed:]:
        nxt = []
        for base in found:
            try:
                entries = fs.get_file_info(pafs.FileSelector(base))
            except FileNotFoundError:
                continue
            nxt += [e.path for e in entries if e.type == pafs.FileType.Directory and fnmatchcase(e.base_name, segment)]
        found = nxt
    return sorted(found)


def read_output(fs: pafs.FileSystem, folder: str, shown: str) -> EarlierOutput | None:
    """The output in `folder`, proven by its report; None if the folder holds no Parquet.
    Raises ReuseError where it holds Parquet this pipeline did not write."""
    entries = [e for e in fs.get_file_info(pafs.FileSelector(folder)) if e.type == pafs.FileType.File]
    parquet = sorted(e.base_name for e in entries if e.base_name.endswith(".parquet"))
    if not parquet:
        return None
    raw = read_bytes(fs, f"{folder}/{REPORT_NAME}")
    if raw is None:
        raise ReuseError(f"reuse path {shown} holds Parquet files ({', '.join(parquet[:3])}"
                         f"{' ...' if len(parquet) > 3 else ''}) but no {REPORT_NAME}: it is not an output "
                         "this pipeline published, and nothing is taken from it")
    try:
        report = json.loads(raw)
        listed = _listed(report)
        run_id, job = str(report["run_id"]), str(report["job"])
    except (ValueError, KeyError, TypeError) as e:
        raise ReuseError(f"reuse path {shown}: {REPORT_NAME} is not this pipeline's report "
                         f"({type(e).__name__}: {e})") from None
    unlisted = [n for n in parquet if n not in listed]
    if unlisted:
        raise ReuseError(f"reuse path {shown} holds Parquet files its {REPORT_NAME} does not list "
                         f"({', '.join(unlisted[:3])}): not all of it is what this pipeline wrote")
    key = report.get("result_key") or {}
    tokens = report.get("tokens") or {}
    carried = (report.get("reuse") or {}).get("engine_s_per_token")
    return EarlierOutput(
        path=shown, run_id=run_id, job=job, started_at=str(report.get("started_at", "")), date=report.get("date"),
        files=tuple(f"{folder}/{n}" for n in parquet), rows=int(report.get("rows_out") or 0), key_version=key.get("version"),
        engine_s=float(report.get("engine_s") or 0.0), generated_tokens=int(tokens.get("generated") or 0),
        carried_rate=float(carried) if carried is not None else None)


def find_earlier(paths: list[str], lookback: int | None = None, exclude: str | None = None) -> list[EarlierOutput]:
    """The earlier outputs `paths` name, newest run first; with `lookback`, only that many.
    `exclude`: a folder never to take from (a staging of this very run, say)."""
    found: dict[str, EarlierOutput] = {}
    if exclude is not None:
        exclude = _uri(exclude, resolve(exclude)[1])
    for path in paths:
        fs, pattern = resolve(path)
        for folder in _folders(fs, pattern.rstrip("/")):
            shown = _uri(path, folder)
            if exclude is not None and shown.rstrip("/") == exclude.rstrip("/"):
                continue
            out = read_output(fs, folder, shown)
            if out is not None:
                found[shown] = out
    newest = sorted(found.values(), key=lambda o: o.started_at, reverse=True)
    return newest[:lookback] if lookback else newest


def describe(outputs: list[EarlierOutput]) -> list[dict[str, Any]]:
    """The sources, as the report lists them."""
    return [{"path": o.path, "run_id": o.run_id, "date": o.date, "files": len(o.files)} for o in outputs]


def comparable(sources: list[EarlierOutput], columns: list[str]) -> tuple[list[EarlierOutput], list[str]]:
    """The sources whose rows have keys and every one of `columns` (read from one file's
    footer each), and a note for each left out: no row of theirs could match this run's.
    Those kept say whether their rows have input keys too (outputs written before them do not)."""
    import pyarrow.parquet as pq

    keep, notes = [], []
    for src in sources:
        if src.key_version is None:
            notes.append(f"{src.path}: written before rows had result keys; nothing to reuse there")
            continue
        fs, _ = resolve(src.path)
        names = set(pq.read_schema(src.files[0], filesystem=fs).names)
        missing = [c for c in ["result_key", "status", *columns] if c not in names]
        if missing:
            notes.append(f"{src.path}: has no {', '.join(missing)} column: another job's output, whose keys "
                         "cannot match this one's")
            continue
        keep.append(replace(src, input_keys="input_key" in names))
    return keep, notes
