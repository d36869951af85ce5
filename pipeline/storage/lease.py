"""One run at a time per output: a lease file beside the output, renewed while the run goes on.

`.<name>.lock` beside the output folder says who is writing it (run id, job,
host, pid and that process's start time) and until when (`expires_at`). The
holder renews it every `lease_s / 3` seconds from a background thread, so a
live run's lease never runs out, and a dead run's does within `lease_s`.

Taking the lease:
- none there: it is created exclusively (locally, a hard link of a complete
  temporary file: the lock appears whole or not at all, and only one of two
  racing runs gets it);
- a live lease of another run: refused (`OutputBusy`), naming that run;
- a lease past its expiry: taken over, with a warning;
- a lock file that is not a readable lease: refused, never removed;
- on the holder's own host, a lease whose process is gone (no such pid, or a
  pid whose start time differs, i.e. reused) is taken over at once: that is
  proof the holder died. A pid is no proof across hosts, nor on its own, so
  there only the expiry counts.

On S3 (and S3-compatible stores such as MinIO) every change to the lock is a
conditional write (`pipeline.storage.objectstore`): created with `If-None-Match: *`,
taken over, renewed and removed with `If-Match` on the ETag this run read, so
of two racing runs exactly one wins, as with the local hard link. Other object
stores (pyarrow has no conditional write for them) fall back to check, write
and read back: that narrows the race between two runs starting in the same
second but does not close it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

import pyarrow.fs as pafs

from pipeline.storage.fs import is_local, read_bytes, sibling, split, write_bytes
from pipeline.storage.objectstore import S3Store, is_s3

log = logging.getLogger(__name__)

LEASE_S = 120.0


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class Owner:
    """A run, and the process that runs it: what a lease and a staging marker name."""

    run_id: str
    job: str
    host: str
    pid: int
    process_started: float  # the process's start time (epoch seconds), which tells a reused pid apart

    @classmethod
    def this_process(cls, run_id: str, job: str) -> Owner:
        import psutil

        return cls(run_id, job, socket.gethostname(), os.getpid(), psutil.Process().create_time())

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Owner:
        return cls(str(data["run_id"]), str(data["job"]), str(data["host"]), int(data["pid"]),
                   float(data["process_started"]))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def gone(self) -> bool:
        """True only when this host can prove the process has ended: never for another host."""
        if self.host != socket.gethostname():
            return False
        import psutil

        try:
            started = psutil.Process(self.pid).create_time()
        except psutil.NoSuchProcess:
            return True
        except psutil.Error:
            return False  # exists, but we may not look: not proof
        return abs(started - self.process_started) > 1.0  # the pid was reused

    def describe(self) -> str:
        return f"run {self.run_id} (pid {self.pid} on host {self.host}, started {_iso(self.process_started)})"


class OutputBusy(ValueError):
    """Another live run holds the output's lease."""


class LeaseLost(RuntimeError):
    """This run's lease was taken over or removed while it ran."""


def lock_path(output: str) -> str:
    return sibling(output, f".{split(output)[1]}.lock")


@dataclass(frozen=True)
class Lease:
    owner: Owner
    expires_at: float

    def to_bytes(self) -> bytes:
        return json.dumps({**self.owner.to_json(), "expires_at": self.expires_at,
                           "expires": _iso(self.expires_at)}, indent=2).encode()

    @classmethod
    def parse(cls, data: bytes) -> Lease:
        raw = json.loads(data)
        return cls(Owner.from_json(raw), float(raw["expires_at"]))


class OutputLease:
    """Hold the lease of one output for one run: `acquire`, then `release`."""

    def __init__(self, fs: pafs.FileSystem, output: str, owner: Owner, lease_s: float = LEASE_S):
        self.fs, self.output, self.owner, self.lease_s = fs, output, owner, lease_s
        self.path = lock_path(output)
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._s3 = S3Store(fs) if is_s3(fs) else None  # conditional writes
        self._etag: str | None = None  # on S3: the ETag of the lock as this run last wrote it

    # --- taking it ------------------------------------------------------------

    def acquire(self) -> str | None:
        """Take the lease and start renewing it. Returns a warning if a stale one was taken
        over; raises OutputBusy if a live run holds it."""
        warning = None
        for _ in range(3):  # a race with another run taking over: look again
            if self._create():
                break
            found = self._read()
            if found is None:
                continue  # it went away between our two looks
            current, raw, etag = found
            if isinstance(current, str):
                # Not a lease this pipeline wrote (ours appear whole): not ours to remove.
                raise OutputBusy(f"{self.output}: the lock {self.path} is not a lease this pipeline can read "
                                 f"({current}); if no run is writing this output, delete it by hand")
            if current.owner.run_id == self.owner.run_id:
                self._etag = etag
                break  # already ours
            if current.owner.gone():
                stale_why = f"{current.owner.describe()} is no longer running"
            elif current.expires_at < time.time():
                stale_why = f"{current.owner.describe()} let it expire at {_iso(current.expires_at)}"
            else:
                raise OutputBusy(
                    f"{self.output}: {current.owner.describe()} is writing this output "
                    f"(its lease {self.path} runs to {_iso(current.expires_at)}, renewed while it runs); "
                    "wait for it to finish, or choose another --output"
                )
            if self._take_over(raw, etag):
                warning = f"{self.output}: took over the lock {self.path}: {stale_why}"
                log.warning(warning)
                break
        else:
            raise OutputBusy(f"{self.output}: could not take the lock {self.path}: other runs keep taking it")
        self._thread = threading.Thread(target=self._renew_loop, name="output-lease", daemon=True)
        self._thread.start()
        return warning

    def _lease(self) -> Lease:
        return Lease(self.owner, time.time() + self.lease_s)

    def _read(self) -> tuple[Lease | str, bytes, str | None] | None:
        """The lease there (or why it can't be read), its bytes and (on S3) its ETag;
        None if there is none."""
        etag = None
        if self._s3 is not None:
            found = self._s3.read(self.path)
            data, etag = found if found else (None, None)
        else:
            data = read_bytes(self.fs, self.path)
        if data is None:
            return None
        try:
            return Lease.parse(data), data, etag
        except (ValueError, KeyError, TypeError) as e:
            return f"{type(e).__name__}: {e}", data, etag

    def _create(self) -> bool:
        """Create the lock if there is none; True if this run now holds it."""
        data = self._lease().to_bytes()
        if self._s3 is not None:
            self._etag = self._s3.create(self.path, data)
            return self._etag is not None
        if not is_local(self.fs):
            if read_bytes(self.fs, self.path) is not None:
                return False
            write_bytes(self.fs, self.path, data)
            return read_bytes(self.fs, self.path) == data
        head = os.path.dirname(self.path)
        os.makedirs(head, exist_ok=True)
        tmp = f"{self.path}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, self.path)  # atomic, and fails if the lock exists
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def _take_over(self, stale: bytes, etag: str | None) -> bool:
        """Replace a stale lock with ours; False if another run got there first."""
        if self._s3 is not None and etag is not None:
            self._etag = self._s3.replace(self.path, self._lease().to_bytes(), etag)
            return self._etag is not None
        if not is_local(self.fs):
            write_bytes(self.fs, self.path, self._lease().to_bytes())
            return self._holds()
        # Move the stale lock aside (one of two racing runs can), check that what we
        # moved is the lock we judged stale, and only then create ours.
        aside = f"{self.path}.{uuid.uuid4().hex}.stale"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        if read_bytes(self.fs, aside) != stale:
            # A fresh lock another run had just taken: put it back.
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
            os.unlink(aside)
            return False
        os.unlink(aside)  # the stale lock, a file of this pipeline's
        return self._create()

    def holder(self) -> Lease | None:
        """The lease there now, if it can be read."""
        found = self._read()
        return found[0] if found and isinstance(found[0], Lease) else None

    def _holds(self) -> bool:
        current = self.holder()
        return current is not None and current.owner.run_id == self.owner.run_id

    # --- keeping it -------------------------------------------------------------

    def renew(self) -> None:
        if self._s3 is not None and self._etag is not None:
            etag = self._s3.replace(self.path, self._lease().to_bytes(), self._etag)
            if etag is None:  # someone else wrote the lock since we did
                current = self.holder()
                raise LeaseLost(f"{self.output}: this run's lock {self.path} is now held by "
                                f"{current.owner.describe() if current else 'nobody'}")
            self._etag = etag
            return
        if not self._holds():
            current = self.holder()
            who = current.owner.describe() if current else "nobody"
            raise LeaseLost(f"{self.output}: this run's lock {self.path} is now held by {who}")
        write_bytes(self.fs, self.path, self._lease().to_bytes())

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                self.renew()
            except LeaseLost as e:
                self.lost = str(e)
                log.error("%s", e)
                return
            except Exception as e:  # a storage hiccup (OSError, botocore's): again next time, well before expiry
                log.warning("could not renew the lock %s: %s", self.path, e)

    def check(self) -> None:
        """Raise LeaseLost unless this run still holds the lease (call before publishing)."""
        if self.lost:
            raise LeaseLost(self.lost)
        if not self._holds():
            raise LeaseLost(f"{self.output}: this run no longer holds the lock {self.path}")

    # --- giving it back ---------------------------------------------------------

    def abandon(self) -> None:
        """Stop renewing, and leave the lock to run out (its store does not answer)."""
        self._stop.set()
        self._thread = None

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        try:
            if self._s3 is not None and self._etag is not None:
                self._s3.delete(self.path, self._etag)  # only the lock as we last wrote it
            elif self._holds():
                self.fs.delete_file(self.path)
        except OSError as e:
            log.warning("could not remove the lock %s: %s (it expires by itself)", self.path, e)
