"""The rule every write of this pipeline follows: it creates, replaces or deletes only what
it can prove it wrote.

The output folder has its own form of the rule (`pipeline.storage.output`: an earlier report of
the same job lists its files). Everything else a command writes takes one of two shapes:

- **A file that carries its writer's mark inside it**: the learned limits (a YAML key),
  the sample corpus (Parquet key-value metadata), a result JSON (`written_by`). It may be
  created where nothing is, or replaced where the mark is there (`OwnedFile`).
- **A folder of several files, one of which lists the others**: `pipeline tune --out`
  (sweep.json), the tiny model (tiny_model.json). It may be written into where nothing
  is, where an empty folder is, or where every entry is one the list names (`OwnedFolder`).

Anything else at the path stops the command with `NotOurs` (exit 2) before any expensive
work, naming the path and a few of the entries there, and saying what to do instead.
Nothing is changed. Only the standard library and `pipeline.storage.fs` are imported here, so
`pipeline.tools.gpucheck` can use it on a machine with nothing else installed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pipeline.storage.fs import replace_local

# The value of `written_by` in what this pipeline writes, and its Parquet metadata key.
MARK = "llm-corpus-pipeline"
SHOWN = 5


class NotOurs(ValueError):
    """A path this pipeline would write holds something it can't prove it wrote; nothing changed."""


def entries(folder: Path) -> list[str]:
    """The folder's entries, sorted; sub-folders end in "/"."""
    return sorted(e.name + ("/" if e.is_dir() else "") for e in os.scandir(folder))


def folder_entries(folder: Path, refuse: Callable[[str], NotOurs], what: str) -> list[str]:
    """What a folder this pipeline would build holds: [] where nothing is (or an empty
    folder); a file in its place raises `refuse("is a file, not WHAT")`."""
    if not folder.exists():
        return []
    if not folder.is_dir():
        raise refuse(f"is a file, not {what}")
    return entries(folder)


def shown(names: list[str] | tuple[str, ...], limit: int = SHOWN) -> str:
    """`a, b, c and 4 more`."""
    names = list(names)
    text = ", ".join(names[:limit])
    return text + (f" and {len(names) - limit} more" if len(names) > limit else "")


def json_mark(data: bytes) -> dict | None:
    """The JSON object in `data`, or None when it is not one."""
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


@dataclass(frozen=True)
class OwnedFile:
    """One file this pipeline writes at a path someone else chose. `is_ours(path)` proves
    that an existing file is one of ours (it must not raise); `what` names the file for
    messages, and `instead` says what to do when the path holds someone else's."""

    what: str
    is_ours: Callable[[Path], bool]
    instead: str

    def check(self, path: str | os.PathLike) -> None:
        """Raise `NotOurs` unless `path` is free or holds a file of ours."""
        p = Path(path)
        if p.is_dir():
            raise NotOurs(f"{p} is a folder ({shown(entries(p)) or 'empty'}), not {self.what}. "
                          f"Nothing was changed. {self.instead}")
        if p.exists() and not self.is_ours(p):
            raise NotOurs(f"{p} holds a file this pipeline did not write (it is not {self.what}). "
                          f"Nothing was changed. {self.instead}")

    def write(self, path: str | os.PathLike, data: bytes) -> None:
        """Check, then write the whole file (a reader sees the old one or the new one)."""
        self.check(path)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        replace_local(str(path), data)


@dataclass(frozen=True)
class OwnedFolder:
    """A folder of files this pipeline writes, the last of them `manifest`, which lists
    them all. `listed(data)` reads a manifest: the names it proves ours, or None when it
    is not one of ours."""

    what: str
    manifest: str
    listed: Callable[[bytes], set[str] | None]
    instead: str

    def check(self, folder: str | os.PathLike) -> set[str]:
        """The entries of ours that are there now; `NotOurs` if anything else is."""
        p = Path(folder)
        if not p.exists():
            return set()
        if not p.is_dir():
            raise NotOurs(f"{p} is a file, not a folder for {self.what}. Nothing was changed. {self.instead}")
        found = entries(p)
        if not found:
            return set()
        mark = p / self.manifest
        names = self.listed(mark.read_bytes()) if mark.is_file() else None
        if names is None:
            raise NotOurs(f"{p} holds files this pipeline did not write: {shown(found)} (no {self.manifest} of "
                          f"{self.what} lists them). Nothing was changed. {self.instead}")
        ours = names | {self.manifest}
        foreign = [n for n in found if n not in ours]
        if foreign:
            raise NotOurs(f"{p} holds files this pipeline did not write: {shown(foreign)} ({self.manifest} does "
                          f"not list them). Nothing was changed. {self.instead}")
        return set(found)

    def write(self, folder: str | os.PathLike, files: Mapping[str, bytes]) -> list[str]:
        """Check, then write `files` (the manifest among them, written last) and remove the
        files of ours from an earlier write that this one no longer has. The paths written."""
        p = Path(folder)
        before = self.check(p)
        if self.manifest not in files:
            raise ValueError(f"{self.what}: the files to write must include {self.manifest}")
        p.mkdir(parents=True, exist_ok=True)
        order = [n for n in files if n != self.manifest] + [self.manifest]
        for name in order:
            replace_local(str(p / name), files[name])
        for name in sorted(before - set(files)):
            if not name.endswith("/"):
                (p / name).unlink(missing_ok=True)  # listed by our own earlier manifest
        return [str(p / n) for n in order]


def png_software(path: Path) -> str | None:
    """A PNG's `Software` text chunk (matplotlib's `savefig(metadata=...)` writes it), or None."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        return None
    at = 8
    while at + 8 <= len(data):
        length, kind = int.from_bytes(data[at:at + 4], "big"), data[at + 4:at + 8]
        if kind == b"tEXt":
            key, _, value = data[at + 8:at + 8 + length].partition(b"\0")
            if key == b"Software":
                return value.decode("latin-1")
        if kind == b"IDAT":  # text chunks that matter come before the image data
            return None
        at += 12 + length
    return None


def marked_json(path: Path) -> bool:
    """A JSON object whose `written_by` is ours."""
    try:
        mark = json_mark(path.read_bytes())
    except OSError:
        return False
    return mark is not None and mark.get("written_by") == MARK
