"""A model's identity by content, not by name: a name can point at new weights.

`model_digest(path)` hashes every file of a model folder (or the one file of a
single-file model): weights, config, tokenizer, chat template, everything but dot
files. A 140 GB model must not be hashed every night, so the digest is kept in the
pipeline's cache (never in the model's folder, which is the user's) with each
file's size and modification time; while they are all as they were, the kept
digest is used. A file added, removed, resized or touched hashes the folder again.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from pipeline.models.tiny import cache_dir

DIGEST_VERSION = 1
CHUNK_BYTES = 8 << 20


def _files(path: Path) -> dict[str, list[int]]:
    """Each file that makes the model, relative to `path`: [size, mtime in ns]."""
    if path.is_file():
        st = path.stat()
        return {path.name: [st.st_size, st.st_mtime_ns]}
    out = {}
    for root, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            if name.startswith("."):
                continue
            full = Path(root) / name
            st = full.stat()
            out[full.relative_to(path).as_posix()] = [st.st_size, st.st_mtime_ns]
    return out


def _hash(path: Path, files: dict[str, list[int]]) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"model-digest-v{DIGEST_VERSION}".encode())
    for rel in sorted(files):
        h.update(b"\0" + rel.encode() + b"\0" + str(files[rel][0]).encode() + b"\0")
        with open(path / rel if path.is_dir() else path, "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                h.update(chunk)
    return h.hexdigest()


def _record(path: Path) -> Path:
    key = hashlib.blake2b(str(path).encode(), digest_size=12).hexdigest()
    return cache_dir() / "model-digests" / f"{key}.json"


def model_digest(path: str | Path) -> str:
    """The content digest of the model at `path` (a folder or a file), from the cache
    while its files' sizes and times are unchanged."""
    path = Path(path).resolve()
    files = _files(path)
    record = _record(path)
    try:
        kept = json.loads(record.read_text())
        if kept.get("version") == DIGEST_VERSION and kept.get("path") == str(path) and kept.get("files") == files:
            return str(kept["digest"])
    except (OSError, ValueError, KeyError):
        pass
    digest = _hash(path, files)
    if _files(path) != files:  # changed while it was read: not kept, and hashed again next time
        return digest
    record.parent.mkdir(parents=True, exist_ok=True)
    tmp = record.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"version": DIGEST_VERSION, "path": str(path), "files": files, "digest": digest}))
    tmp.replace(record)
    return digest
