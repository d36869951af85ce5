"""Paths to pyarrow filesystems: the one place that tells a local path from an object store.

Nothing here imports Ray, so the CLI's checks can use it before a cluster starts.
"""

from __future__ import annotations

import os
import uuid

import pyarrow.fs as pafs


# Requests to object stores: given up after a time with no byte moving, and tried
# STORE_ATTEMPTS times in all: pyarrow's standard retry strategy, the one a filesystem
# keeps when it is pickled to a Ray worker. The timeouts are the profile's `store`
# (`pipeline.config.models.StoreConfig`), passed as environment variables so that every
# process of a run (Ray workers too) resolves paths alike. The constants are imported where
# they are used: the GPU check imports this module on machines with no pydantic or yaml.
STORE_ENV = {"request_timeout_s": "PIPELINE_STORE_REQUEST_TIMEOUT_S",
             "connect_timeout_s": "PIPELINE_STORE_CONNECT_TIMEOUT_S"}


def store_limits() -> dict[str, float]:
    """This process's timeouts for object-store requests (`STORE_ENV`, else the defaults)."""
    from pipeline.config.models import STORE_DEFAULTS
    return {k: float(os.environ.get(STORE_ENV[k], v)) for k, v in STORE_DEFAULTS.items()}


def store_env(request_timeout_s: float, connect_timeout_s: float) -> dict[str, str]:
    """The variables that set those timeouts, for this process and the run's workers."""
    return {STORE_ENV["request_timeout_s"]: str(request_timeout_s),
            STORE_ENV["connect_timeout_s"]: str(connect_timeout_s)}


def resolve(path: str) -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem and the path within it; local paths made absolute. An S3
    filesystem gets this process's `store_limits`."""
    if "://" not in path:
        return pafs.LocalFileSystem(), os.path.abspath(path)
    fs, inner = pafs.FileSystem.from_uri(path)
    if isinstance(fs, pafs.S3FileSystem):
        from pipeline.config.models import STORE_ATTEMPTS
        _, (options,) = fs.__reduce__()  # what pyarrow resolved from the URI and the environment
        limits = store_limits()
        fs = pafs.S3FileSystem(**{**options, "request_timeout": limits["request_timeout_s"],
                                  "connect_timeout": limits["connect_timeout_s"],
                                  "retry_strategy": pafs.AwsStandardS3RetryStrategy(STORE_ATTEMPTS)})
    return fs, inner


def is_local(fs: pafs.FileSystem) -> bool:
    """True where folders rename in one step and files can be created exclusively."""
    return isinstance(fs, pafs.LocalFileSystem)


def split(path: str) -> tuple[str, str]:
    """(parent, name) of a path on any filesystem, ignoring a trailing slash."""
    head, _, base = path.rstrip("/").rpartition("/")
    return head, base


def sibling(path: str, name: str) -> str:
    """`name` in the folder that holds `path`."""
    head, _ = split(path)
    return f"{head}/{name}" if head else name


def read_bytes(fs: pafs.FileSystem, path: str) -> bytes | None:
    """The file's bytes, or None if there is no such file."""
    try:
        with fs.open_input_stream(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def write_bytes(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    """Write a whole file that readers see whole: locally via `replace_local`; an object
    store shows an object only once its upload completes."""
    if is_local(fs):
        replace_local(path, data)
        return
    with fs.open_output_stream(path) as f:
        f.write(data)


def replace_local(path: str, data: bytes) -> None:
    """Write a local file through a temporary name of its own, then rename it into place:
    writers that race each leave a whole file, and the last rename wins."""
    head, base = os.path.split(path)
    tmp = os.path.join(head, f".{base}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for any file
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)  # our own temporary file
        raise
