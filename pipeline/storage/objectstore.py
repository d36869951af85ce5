"""What pyarrow's S3 client can't do: conditional writes, and many copies or deletes at once.

The output's lease needs a write that only one of two runs can win. pyarrow's
S3 filesystem has none; S3 (since 2024), MinIO and other S3-compatible stores
do: `PUT` with `If-None-Match: *` creates an object only if there is none, and
`If-Match: <etag>` replaces (or deletes) it only if nobody wrote it since we
read it. boto3 sends both. The client is built from the pyarrow filesystem's own
settings (endpoint, region, keys), so both talk to the same store.

Publishing copies a run's parts in and deletes the previous run's: here many at
a time (server-side copies in a thread pool, deletes 1,000 keys per request),
so the publish window grows with parts / threads, not with parts.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow.fs as pafs

from pipeline.config.models import STORE_ATTEMPTS
from pipeline.storage.fs import store_limits

COPY_THREADS = 32
DELETE_BATCH = 1000  # S3's limit per DeleteObjects request


def is_s3(fs: pafs.FileSystem) -> bool:
    return isinstance(fs, pafs.S3FileSystem)


def _split(path: str) -> tuple[str, str]:
    bucket, _, key = path.partition("/")
    return bucket, key


def _failed(e: Exception, *codes: str) -> bool:
    """True if `e` is the S3 error response with one of these codes (or HTTP statuses)."""
    response = getattr(e, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    return code in codes or status in codes


class _Reached:
    """boto3's client, whose failures to reach the store (refused, timed out, cut off)
    are OSErrors, as pyarrow's are: callers handle both kinds of store alike."""

    def __init__(self, client: Any):
        self._client = client

    def __getattr__(self, name: str) -> Any:
        from botocore.exceptions import ConnectionError, HTTPClientError

        method = getattr(self._client, name)
        if not callable(method):
            return method

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            except (ConnectionError, HTTPClientError) as e:
                if isinstance(e, OSError):
                    raise
                raise OSError(f"{self._client.meta.endpoint_url}: {e}") from e
        return call


class S3Store:
    """Conditional writes and bulk operations on the S3 store behind a pyarrow S3FileSystem.
    Paths are pyarrow's: `bucket/key`."""

    def __init__(self, fs: pafs.S3FileSystem):
        import boto3
        from botocore.config import Config

        _, (options,) = fs.__reduce__()  # the settings pyarrow resolved (URI, environment, defaults)
        endpoint = options.get("endpoint_override") or None
        if endpoint and "://" not in endpoint:
            endpoint = f"{options.get('scheme') or 'https'}://{endpoint}"
        limits = store_limits()
        keys = {}
        if options.get("access_key"):
            keys = {"aws_access_key_id": options["access_key"], "aws_secret_access_key": options["secret_key"],
                    "aws_session_token": options.get("session_token") or None}
        self.client = _Reached(boto3.client("s3", endpoint_url=endpoint, region_name=options.get("region") or None,
                                   config=Config(max_pool_connections=COPY_THREADS, connect_timeout=limits["connect_timeout_s"],
                                                 read_timeout=limits["request_timeout_s"],
                                                 retries={"mode": "standard", "total_max_attempts": STORE_ATTEMPTS}),
                                   **keys))

    # --- conditional writes: the lease ---------------------------------------------

    def read(self, path: str) -> tuple[bytes, str] | None:
        """The object's bytes and its ETag; None if there is none."""
        bucket, key = _split(path)
        try:
            got = self.client.get_object(Bucket=bucket, Key=key)
        except Exception as e:
            if _failed(e, "NoSuchKey", "404"):
                return None
            raise
        return got["Body"].read(), got["ETag"]

    def create(self, path: str, data: bytes) -> str | None:
        """Write the object only if there is none; its ETag, or None if one exists."""
        return self._put(path, data, IfNoneMatch="*")

    def replace(self, path: str, data: bytes, etag: str) -> str | None:
        """Replace the object only if it is still the one with this ETag; the new ETag, or None."""
        return self._put(path, data, IfMatch=etag)

    def _put(self, path: str, data: bytes, **condition: str) -> str | None:
        bucket, key = _split(path)
        try:
            return self.client.put_object(Bucket=bucket, Key=key, Body=data, **condition)["ETag"]
        except Exception as e:
            # 412: the condition failed; 409: another conditional write to this key is under way.
            if _failed(e, "PreconditionFailed", "ConditionalRequestConflict", "412", "409"):
                return None
            raise

    def delete(self, path: str, etag: str) -> bool:
        """Delete the object only if it is still the one with this ETag."""
        bucket, key = _split(path)
        try:
            self.client.delete_object(Bucket=bucket, Key=key, IfMatch=etag)
        except Exception as e:
            if _failed(e, "PreconditionFailed", "NoSuchKey", "412", "404"):
                return False
            raise
        return True

    # --- many at once: publishing ------------------------------------------------

    def copy_many(self, pairs: Iterable[tuple[str, str]]) -> int:
        """Server-side copies (source, target), COPY_THREADS at a time; how many were made."""
        def copy(pair: tuple[str, str]) -> None:
            (sb, sk), (tb, tk) = _split(pair[0]), _split(pair[1])
            self.client.copy_object(Bucket=tb, Key=tk, CopySource={"Bucket": sb, "Key": sk})

        pairs = list(pairs)
        with ThreadPoolExecutor(COPY_THREADS) as pool:
            list(pool.map(copy, pairs))  # raises the first failure
        return len(pairs)

    def delete_many(self, paths: Iterable[str]) -> int:
        """Delete objects, up to 1,000 per request; how many requests that took."""
        by_bucket: dict[str, list[str]] = {}
        for p in paths:
            bucket, key = _split(p)
            by_bucket.setdefault(bucket, []).append(key)
        requests = 0
        for bucket, keys in by_bucket.items():
            for i in range(0, len(keys), DELETE_BATCH):
                batch = [{"Key": k} for k in keys[i:i + DELETE_BATCH]]
                got: dict[str, Any] = self.client.delete_objects(Bucket=bucket, Delete={"Objects": batch,
                                                                                        "Quiet": True})
                requests += 1
                if got.get("Errors"):
                    first = got["Errors"][0]
                    raise OSError(f"could not delete {bucket}/{first.get('Key')}: {first.get('Code')} "
                                  f"{first.get('Message')} ({len(got['Errors'])} objects failed)")
        return requests
