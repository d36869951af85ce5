"""What a run may write, replace and delete at its output path, and how its output goes live.

One rule, for local folders and object stores alike: the pipeline deletes or
replaces only what it can prove it wrote.
- The files that an earlier `_report.json` of the same job at that output
  lists: its parts (`files`), the report itself and its plot (`plot_path`).
- Its own staging: `.<name>.<run_id>.staging` beside the output, holding a
  marker `_staging.json` that names the job, run id, host, pid and process
  start time. Only staging whose marker names this run is ever deleted.

Anything else at the output path (a foreign file or folder, another job's
output, an unreadable report, a file where the folder should be) stops the
run before Ray starts, and again at publish time if it appeared during the
run. With `output.backup_existing` (`--backup-existing`) such an output is
moved aside to `<path>.backup-<UTC time>` when the run publishes, and the
report says where. Nothing is deleted that the pipeline did not write.

The staging life cycle (README, "What the pipeline may delete"):
1. `open`: take the output's lease (`pipeline.storage.lease`), check the output,
   create the staging folder and its marker. All before Ray starts.
2. The write tasks put the parts into `<staging>/output/`; the report and the
   plot follow once every part is there.
3. `publish`: check again and write a journal into the staging (`Publishing`), so
   that a publish cut short at any step is finished by the next run of the output
   before it does anything else. Then, locally, swap `<staging>/output` into place
   in one step (Linux `renameat2(RENAME_EXCHANGE)`, else two renames), delete the
   earlier run's listed files from what was swapped out, and remove the staging.
   On object stores (no folder rename): delete the earlier report, copy the
   parts in, delete the earlier run's listed parts, write the report last.
4. `stop` (a failed run): its staging stays if any part is committed
   (`pipeline.storage.commits`), for `--resume`; a run that committed nothing removes
   it. A run killed outright leaves it too.
5. The next run of the output finds a stopped run's staging (its lease is gone):
   without `--resume` or `--restart` it stops with exit 2, naming the run and
   its progress; `--resume` adopts it (its marker is rewritten to name the new
   run and the runs before it, the lineage; parts with no commit are deleted);
   `--restart` removes it. `pipeline gc` lists and removes stopped runs' staging.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal

import pyarrow.fs as pafs

from pipeline.storage.commits import Committed, drop_uncommitted, load_commits
from pipeline.storage.fs import is_local, read_bytes, resolve, sibling, split, write_bytes
from pipeline.storage.lease import Owner, OutputLease
from pipeline.storage.objectstore import S3Store, is_s3

log = logging.getLogger(__name__)

REPORT_NAME = "_report.json"  # its presence means the output is complete; it lists what the run wrote
STAGING_MARKER = "_staging.json"
PUBLISHING_MARKER = "_publishing.json"
STAGING_SUFFIX = ".staging"
SHOWN_ENTRIES = 5


class OutputError(ValueError):
    """The output path holds something this run may not replace; nothing ran."""


class PublishError(RuntimeError):
    """The run finished but could not publish; its complete output stays in its staging."""


# --- what is at the output path ------------------------------------------------


@dataclass(frozen=True)
class Survey:
    """What the output path holds, judged against the rule above."""

    path: str
    state: Literal["absent", "empty", "ours", "foreign"]
    owned: tuple[str, ...] = ()  # names an earlier run of this job listed, present now
    previous_run: str | None = None
    foreign: tuple[str, ...] = ()  # entries it can't prove it wrote; folders end in "/"
    why: str = ""

    def refusal(self) -> str:
        shown = ", ".join(self.foreign[:SHOWN_ENTRIES])
        if len(self.foreign) > SHOWN_ENTRIES:
            shown += f" and {len(self.foreign) - SHOWN_ENTRIES} more"
        return (f"{self.path} {self.why}: {shown}. Nothing was changed. Choose a new or empty folder, or pass "
                f"--backup-existing to move it aside to {self.path}.backup-<UTC time> when the run publishes.")


def _listed(report: dict[str, Any]) -> set[str]:
    """The names a report says its run wrote into the output folder."""
    files = report["files"]
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise TypeError("files is not a list of names")
    names = {REPORT_NAME, *files}
    if report.get("plot_path"):
        names.add(split(str(report["plot_path"]))[1])
    return {n for n in names if n and "/" not in n}


def survey(fs: pafs.FileSystem, path: str, job: str) -> Survey:
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        return Survey(path, "absent")
    if info.type != pafs.FileType.Directory:
        return Survey(path, "foreign", foreign=(split(path)[1],), why="is a file, not a folder")
    entries = {e.base_name + ("/" if e.type == pafs.FileType.Directory else ""): e
               for e in fs.get_file_info(pafs.FileSelector(path))}
    if not entries:
        return Survey(path, "empty")
    owned: set[str] = set()
    previous = None
    why = "holds files this pipeline did not write"
    if REPORT_NAME in entries:
        try:
            report = json.loads(read_bytes(fs, f"{path}/{REPORT_NAME}") or b"")
            their_job, previous = report["job"], str(report["run_id"])
            listed = _listed(report)
        except (ValueError, KeyError, TypeError) as e:
            why = f"holds files this pipeline did not write ({REPORT_NAME} is unreadable: {type(e).__name__}: {e})"
        else:
            if their_job != job:
                return Survey(path, "foreign", previous_run=previous, foreign=tuple(sorted(entries)),
                              why=f"holds the output of job {their_job!r} (run {previous}), not of {job!r}")
            owned = {n for n in entries if n in listed}
    foreign = tuple(sorted(n for n in entries if n not in owned))
    if foreign:
        return Survey(path, "foreign", tuple(sorted(owned)), previous, foreign, why)
    return Survey(path, "ours", tuple(sorted(owned)), previous)


# --- staging ---------------------------------------------------------------------


def staging_root(output: str, run_id: str) -> str:
    return sibling(output, f".{split(output)[1]}.{run_id}{STAGING_SUFFIX}")


@dataclass(frozen=True)
class Staging:
    fs: pafs.FileSystem
    root: str
    owner: Owner

    @property
    def data(self) -> str:
        """Where the output is assembled: parts, report, plot."""
        return f"{self.root}/output"

    def create(self, rows_in: int | None = None, lineage: tuple[str, ...] = ()) -> None:
        """Create it, or (resuming) take it over: the marker names this run from now on,
        with the runs that wrote into it before (`lineage`, oldest first)."""
        self.fs.create_dir(self.data, recursive=True)
        marker = {**self.owner.to_json(), "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "rows_in": rows_in, "lineage": list(lineage)}
        write_bytes(self.fs, f"{self.root}/{STAGING_MARKER}", json.dumps(marker, indent=2).encode())

    def remove(self) -> bool:
        """Delete the staging if its marker names this run; False (and nothing deleted) otherwise."""
        mark = read_marker(self.fs, self.root)
        if mark is None or mark[0].run_id != self.owner.run_id:
            log.warning("not removing %s: its marker does not name run %s", self.root, self.owner.run_id)
            return False
        self.fs.delete_dir(self.root)
        return True


def read_marker(fs: pafs.FileSystem, root: str) -> tuple[Owner, dict[str, Any]] | None:
    """The run a staging's marker names, and the whole marker; None if it has no readable one."""
    data = read_bytes(fs, f"{root}/{STAGING_MARKER}")
    if data is None:
        return None
    try:
        marker = json.loads(data)
        return Owner.from_json(marker), marker
    except (ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class Stopped:
    """A staging beside the output whose run is not running: killed, or failed with rows committed."""

    root: str
    owner: Owner  # the run that last wrote into it
    created_at: str
    rows_in: int | None
    lineage: tuple[str, ...]  # the runs before it, oldest first
    committed: Committed

    def progress(self) -> str:
        docs = self.committed.documents()
        share = f"{docs / self.rows_in:.0%}" if self.rows_in else "an unknown share"
        return f"run {self.owner.run_id} stopped at {share} ({self.committed.rows:,} rows committed)"


def stopped_runs(fs: pafs.FileSystem, output: str, exclude: str = "") -> list[Stopped]:
    """Marked staging beside the output, other than `exclude`, oldest first. Only the
    holder of the output's lease may call this: then none of these runs is running."""
    head, base = split(output)
    found = []
    for e in fs.get_file_info(pafs.FileSelector(head, allow_not_found=True)):
        name = e.base_name
        if (e.type == pafs.FileType.Directory and name.startswith(f".{base}.") and name.endswith(STAGING_SUFFIX)
                and e.path != exclude):
            mark = read_marker(fs, e.path)
            if mark is None:
                continue  # not marked by this pipeline: not ours to judge
            owner, marker = mark
            found.append(Stopped(e.path, owner, str(marker.get("created_at", "")), marker.get("rows_in"),
                                 tuple(marker.get("lineage") or ()), load_commits(fs, e.path)))
    return sorted(found, key=lambda s: s.created_at)


# --- moving folders ---------------------------------------------------------------

_RENAME_EXCHANGE = 2


def _exchange(a: str, b: str) -> bool:
    """Swap two local paths atomically (Linux renameat2); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    return renameat2(at_fdcwd, a.encode(), at_fdcwd, b.encode(), _RENAME_EXCHANGE) == 0


def _move_tree(fs: pafs.FileSystem, src: str, dst: str) -> None:
    """Move a folder (or a file) whole on an object store: copy, then delete (locally a
    rename does it, a step of `OutputTarget._publish_local`)."""
    info = fs.get_file_info(src)
    if info.type == pafs.FileType.File:
        fs.copy_file(src, dst)
        fs.delete_file(src)
        return
    files = [e for e in fs.get_file_info(pafs.FileSelector(src, recursive=True)) if e.type == pafs.FileType.File]
    for e in files:
        target = dst + e.path[len(src):]
        fs.create_dir(split(target)[0], recursive=True)
        fs.copy_file(e.path, target)
    for e in files:  # only once every copy is there
        fs.delete_file(e.path)


def _report_run(fs: pafs.FileSystem, folder: str) -> str | None:
    """The run id in `folder`'s `_report.json`; None if there is no readable one."""
    try:
        return str(json.loads(read_bytes(fs, f"{folder}/{REPORT_NAME}") or b"")["run_id"])
    except (ValueError, KeyError, TypeError, OSError):
        return None


def backup_path(fs: pafs.FileSystem, path: str) -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    candidate, n = f"{path}.backup-{stamp}", 1
    while fs.get_file_info(candidate).type != pafs.FileType.NotFound:
        n += 1
        candidate = f"{path}.backup-{stamp}-{n}"
    return candidate


# --- publishing on object stores ---------------------------------------------------


@dataclass(frozen=True)
class Publishing:
    """The journal of a publish, written into the staging before the first step, so
    that a run killed at any step leaves the old output or the new one, and the next
    run of the output finishes the publish before anything else (`OutputTarget.open`).

    Locally (`mode` "swap", see `OutputTarget._publish_local`) the steps are: move a
    foreign output aside (`--backup-existing`), swap the staged output into place,
    delete the earlier run's listed files (`replaces`) from what was swapped out,
    remove the staging. Which side of the swap a kill fell on is read from the
    output's `_report.json`: it names this run once the swap is done.

    An object store has no folder rename, so a run's output goes live by copies:
    1. the earlier run's `_report.json` is deleted: from here until step 4 the output
       has no report, which tells readers a publish is under way;
    2. this run's parts (and plot) are copied in, server-side, many at a time;
    3. the earlier run's parts that this run did not replace are deleted;
    4. this run's `_report.json` is written, with what publishing took (`publish`).
    A reader that lists the output while a report is there sees one run's complete
    set of parts; the window (steps 1 to 4) is measured in the report.

    If the run dies during the window, the next run finishes the publish: every step
    can be done again."""

    run_id: str
    files: tuple[str, ...]  # this run's, in the staging
    replaces: tuple[str, ...]  # the earlier run's, to delete
    mode: Literal["copy", "swap"] = "copy"

    def to_bytes(self) -> bytes:
        return json.dumps({"run_id": self.run_id, "mode": self.mode, "files": list(self.files),
                           "replaces": list(self.replaces)}, indent=2).encode()

    @classmethod
    def read(cls, fs: pafs.FileSystem, staging_root: str) -> Publishing | None:
        data = read_bytes(fs, f"{staging_root}/{PUBLISHING_MARKER}")
        if data is None:
            return None
        raw = json.loads(data)
        return cls(str(raw["run_id"]), tuple(raw["files"]), tuple(raw["replaces"]), raw.get("mode", "copy"))

    def write(self, fs: pafs.FileSystem, staging_root: str) -> None:
        write_bytes(fs, f"{staging_root}/{PUBLISHING_MARKER}", self.to_bytes())

    def carry_out(self, fs: pafs.FileSystem, data: str, final: str, report: dict[str, Any],
                  had_report: bool = True) -> dict[str, Any]:
        started = time.monotonic()
        s3 = S3Store(fs) if is_s3(fs) else None
        requests = 0
        if had_report:
            if s3 is not None:  # (pyarrow's delete_file would leave a folder marker object behind)
                s3.delete_many([f"{final}/{REPORT_NAME}"])
            else:
                try:
                    fs.delete_file(f"{final}/{REPORT_NAME}")
                except FileNotFoundError:
                    pass
            requests += 1
        pairs = [(f"{data}/{n}", f"{final}/{n}") for n in self.files]
        if s3 is not None:
            requests += s3.copy_many(pairs)
            requests += s3.delete_many(f"{final}/{n}" for n in self.replaces) if self.replaces else 0
        else:
            fs.create_dir(final, recursive=True)
            for src, dst in pairs:
                fs.copy_file(src, dst)
            for n in self.replaces:
                try:
                    fs.delete_file(f"{final}/{n}")
                except FileNotFoundError:
                    pass
            requests += len(pairs) + len(self.replaces)
        measured = {"window_s": round(time.monotonic() - started, 3), "copied": len(pairs),
                    "deleted": len(self.replaces), "requests": requests + 1}  # + the report's PUT
        report["publish"] = {**report.get("publish", {}), **measured}
        write_bytes(fs, f"{final}/{REPORT_NAME}", json.dumps(report, indent=2).encode())
        return measured


# --- publishing locally --------------------------------------------------------------

# The steps of a local publish, in order; `debug.kill_publish_at` kills the run after one.
LOCAL_PUBLISH_STEPS = ("journal", "backup", "swap", "clear", "cleared")


def _swap_in(data: str, final: str, root: str, state: str) -> None:
    """Put the staged output `data` at `final` in one step. What was there ends up at
    `data` (renameat2), or at `<root>/previous` where that is missing."""
    if state in ("absent", "foreign"):  # nothing there: a foreign output was moved aside already
        os.makedirs(split(final)[0] or "/", exist_ok=True)
        os.rename(data, final)
    elif not _exchange(data, final):
        os.rename(final, f"{root}/previous")
        os.rename(data, final)


def _swapped_out(root: str) -> str | None:
    """Where the swap left the earlier output, if anywhere."""
    for old in (f"{root}/output", f"{root}/previous"):
        if os.path.isdir(old):
            return old
    return None


# --- one run's output ------------------------------------------------------------------


class OutputTarget:
    """One run's output: its lease, its staging and publishing. Use `open` before Ray
    starts, write into `staging.data`, then `plan` and `publish` (or `discard`), and
    always `close`."""

    def __init__(self, output: str, job: str, run_id: str, *, backup_existing: bool = False,
                 stopped: Literal["refuse", "resume", "restart"] = "refuse",
                 filesystem: pafs.FileSystem | None = None, kill_publish_at: str | None = None):
        if filesystem is None:
            self.fs, self.path = resolve(output)
        else:
            self.fs, self.path = filesystem, output
        self.path = self.path.rstrip("/") or "/"
        self.output, self.job, self.backup_existing = output, job, backup_existing
        self.local = is_local(self.fs)
        base = split(self.path)[1]
        if not base or base in (".", ".."):
            raise OutputError(f"{output}: an output needs a folder of its own, not the root of a filesystem")
        self.owner = Owner.this_process(run_id, job)
        self.lease = OutputLease(self.fs, self.path, self.owner)
        self.staging = Staging(self.fs, staging_root(self.path, run_id), self.owner)
        self.warnings: list[str] = []
        self._planned: tuple[Survey, str | None] | None = None
        self.on_stopped = stopped
        self.resumed: Stopped | None = None  # the stopped run this one continues
        self.committed = Committed()  # what this run's staging already holds for good
        self.lineage: tuple[str, ...] = ()  # the runs whose rows this output holds, before this one
        self.rows_in: int | None = None  # the input's rows, as `open` was told
        self.published: dict[str, Any] = {}  # what publishing took, on object stores (`Publishing`)
        self.kill_publish_at = kill_publish_at  # fault drills: one of LOCAL_PUBLISH_STEPS

    def survey(self) -> Survey:
        return survey(self.fs, self.path, self.job)

    def open(self, rows_in: int | None = None) -> Survey:
        """Take the lease, check the output, deal with stopped runs, create (or adopt) the
        staging. OutputError or OutputBusy (both ValueErrors: exit 2) if this run may not
        write here."""
        self.rows_in = rows_in
        taken = self.lease.acquire()
        try:
            if taken:
                self.warnings.append(taken)
            self._finish_interrupted()
            found = self.survey()
            if found.state == "foreign" and not self.backup_existing:
                raise OutputError(found.refusal())
            self._handle_stopped(rows_in)
        except BaseException:
            self.lease.release()
            raise
        return found

    def _finish_interrupted(self) -> None:
        """A run of this job that died while publishing: finish its publish (`Publishing`),
        so the output is one run's whole output again."""
        for s in stopped_runs(self.fs, self.path, exclude=self.staging.root):
            journal = Publishing.read(self.fs, s.root) if s.owner.job == self.job else None
            if journal is None:
                continue
            if journal.mode == "swap":
                if not self._finish_local(s.root, journal):
                    continue
            else:
                report = json.loads(read_bytes(self.fs, f"{s.root}/output/{REPORT_NAME}") or b"{}")
                journal.carry_out(self.fs, f"{s.root}/output", self.path, report)  # each step again: harmless
            self.fs.delete_dir(s.root)
            self._warn(f"{self.path}: run {journal.run_id} died while publishing; its publish was finished now")

    def _finish_local(self, root: str, journal: Publishing) -> bool:
        """A local publish cut short: swap the staged output in if the kill came before
        the swap, then clear what was swapped out. False where it can't be finished (the
        output changed since): the journal is dropped and the staging stays, a stopped
        run whose output is complete (`--resume` publishes it)."""
        names = journal.replaces
        if _report_run(self.fs, self.path) != journal.run_id:  # the kill came before the swap
            found = self.survey()
            if found.state == "foreign" or _report_run(self.fs, f"{root}/output") != journal.run_id:
                self.fs.delete_file(f"{root}/{PUBLISHING_MARKER}")
                self._warn(f"{self.path}: run {journal.run_id} died while publishing, before its output went "
                           f"live, and the output is not what it replaced; left as it is. {root} holds that run's "
                           "complete output: --resume publishes it")
                return False
            _swap_in(f"{root}/output", self.path, root, found.state)
            names = found.owned
        self._clear(root, names)
        return True

    def _clear(self, root: str, names: tuple[str, ...]) -> None:
        """Delete the earlier run's listed files from what the swap moved out, then the
        folder; one that holds anything else is moved aside whole."""
        old = _swapped_out(root)
        if old is None:
            return
        for i, name in enumerate(names):
            try:
                os.remove(f"{old}/{name}")
            except FileNotFoundError:
                pass
            if i == 0:
                self._reached("clear")
        try:
            os.rmdir(old)
        except OSError:  # something appeared in the old output in the last moment: keep it
            keep = backup_path(self.fs, self.path)
            os.rename(old, keep)
            self._warn(f"{self.path}: entries that appeared while publishing were moved aside to {keep}")
        self._reached("cleared")

    def _reached(self, step: str) -> None:
        """Fault drills (`debug.kill_publish_at`): die after this step as a kill -9 would."""
        if step == self.kill_publish_at:
            log.warning("debug.kill_publish_at=%s: killing this process (pid %d)", step, os.getpid())
            os.kill(os.getpid(), signal.SIGKILL)

    def _handle_stopped(self, rows_in: int | None) -> None:
        stopped = stopped_runs(self.fs, self.path, exclude=self.staging.root)
        mine = [s for s in stopped if s.owner.job == self.job]
        for s in stopped:
            if s.owner.job != self.job:  # another job's staging at this path: not ours to judge
                self._warn(f"{s.root}: staging left by {s.owner.describe()} of job {s.owner.job!r}; kept as it is")
        if mine and self.on_stopped == "refuse":
            latest = mine[-1]
            raise OutputError(f"{self.path}: {latest.progress()} (staging {latest.root}); "
                              "--resume to continue, --restart to discard it")
        if self.on_stopped == "restart":
            for s in mine:
                self.fs.delete_dir(s.root)  # marked by a run of this job at this output: ours
                self._warn(f"{s.root}: discarded (--restart): {s.progress()}")
            mine = []
        if not mine:
            self.staging.create(rows_in)
            return
        for s in mine[:-1]:
            self._warn(f"{s.root}: an older stopped run, kept as it is ({s.progress()}); pipeline gc removes it")
        self.resumed = s = mine[-1]
        self.staging = Staging(self.fs, s.root, self.owner)
        self.lineage = (*s.lineage, s.owner.run_id)
        self.staging.create(rows_in, self.lineage)
        self.committed = s.committed
        dropped = drop_uncommitted(self.fs, self.staging.data, s.committed)
        log.info("resuming %s; %d uncommitted files deleted from its staging", s.progress(), len(dropped))

    def _warn(self, note: str) -> None:
        log.warning(note)
        self.warnings.append(note)

    def plan(self) -> dict[str, Any]:
        """Check the output again at the end of the run and say what publishing will do
        (for the report, written before `publish`)."""
        found = self.survey()
        if found.state == "foreign" and not self.backup_existing:
            raise PublishError(f"{found.refusal()} It changed during the run. {self._kept()}")
        backup = backup_path(self.fs, self.path) if found.state == "foreign" else None
        self._planned = (found, backup)
        return {"replaces_run": found.previous_run, "replaces_files": len(found.owned), "backup": backup,
                "mode": "swap" if self.local else "copy"}

    def _kept(self) -> str:
        return f"This run's complete output is kept in {self.staging.data}."

    def publish(self) -> list[str]:
        """Make the staged output the output; returns warnings of its own. On PublishError
        the staging is kept."""
        if self._planned is None:
            raise RuntimeError("publish() before plan()")
        planned, backup = self._planned
        try:
            self.lease.check()
            found = self.survey()
        except OSError as e:
            raise PublishError(f"{self.path}: publishing failed ({e}). {self._kept()}") from e
        if (found.state, found.owned, found.foreign) != (planned.state, planned.owned, planned.foreign):
            raise PublishError(f"{self.path} changed while publishing ({planned.state} -> {found.state}). "
                               f"{self._kept()}")
        warned = len(self.warnings)
        try:
            if self.local:
                self._publish_local(found, backup)
            else:
                if backup is not None:  # a foreign output, and --backup-existing
                    _move_tree(self.fs, self.path, backup)
                self.published = self._publish_object_store(Survey(self.path, "absent") if backup else found)
        except OSError as e:
            raise PublishError(f"{self.path}: publishing failed ({e}). {self._kept()}") from e
        self.staging.remove()
        return self.warnings[warned:]

    def _publish_local(self, found: Survey, backup: str | None) -> None:
        """The journal first; then a foreign output moved aside (`--backup-existing`), the
        swap, and the earlier run's listed files cleared from what was swapped out.
        A kill at any step leaves the old output or the new (`_finish_local`)."""
        root = self.staging.root
        Publishing(self.owner.run_id, (), found.owned, "swap").write(self.fs, root)
        self._reached("journal")
        if backup is not None:
            os.rename(self.path, backup)
            self._reached("backup")
        _swap_in(self.staging.data, self.path, root, found.state)
        self._reached("swap")
        self._clear(root, found.owned)

    def _publish_object_store(self, found: Survey) -> dict[str, Any]:
        """Copy the parts in, delete the earlier run's, the report last (see `Publishing`)."""
        fs, data, final = self.fs, self.staging.data, self.path
        files = sorted(e.base_name for e in fs.get_file_info(pafs.FileSelector(data))
                       if e.type == pafs.FileType.File and e.base_name != REPORT_NAME)
        report = json.loads(read_bytes(fs, f"{data}/{REPORT_NAME}") or b"{}")
        journal = Publishing(self.owner.run_id, tuple(files),
                             tuple(n for n in found.owned if n not in files and n != REPORT_NAME))
        journal.write(fs, self.staging.root)
        return journal.carry_out(fs, data, final, report, had_report=REPORT_NAME in found.owned)

    def stop(self) -> str | None:
        """A failed run: the output stays as it was. Its staging stays if it holds
        committed rows, and this says so (the run and its progress); else it is removed."""
        try:
            committed = load_commits(self.fs, self.staging.root)
            if committed.rows:
                return Stopped(self.staging.root, self.owner, "", self.rows_in, self.lineage, committed).progress()
            self.staging.remove()
        except OSError as e:
            log.warning("could not look at or remove %s: %s", self.staging.root, e)
        return None

    def close(self, release: bool = True) -> None:
        """Stop renewing the lease, and remove it (`release`); an unreleased lease runs out."""
        if release:
            self.lease.release()
        else:
            self.lease.abandon()


def collect_garbage(output: str, delete: bool = False) -> list[Stopped]:
    """The staging that stopped runs left beside `output` (any job's), removed with
    `delete`. It takes the output's lease first, so no run is writing there meanwhile
    (OutputBusy if one is); only folders with this pipeline's marker are touched."""
    import uuid

    fs, path = resolve(output)
    path = path.rstrip("/") or "/"
    lease = OutputLease(fs, path, Owner.this_process(f"gc-{uuid.uuid4().hex[:6]}", "pipeline gc"))
    lease.acquire()
    try:
        found = stopped_runs(fs, path)
        if delete:
            for s in found:
                fs.delete_dir(s.root)
    finally:
        lease.release()
    return found
