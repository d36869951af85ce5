"""Runs as the tests make them: the CLI in a subprocess (`run_cli`, `read_run`), a stopped
run's staging built by hand (`killed_run`), and the processes a run starts, found and
ended by pid (`start`, `run_processes`, `wait_for`, `end_all`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import schema
from pipeline.storage.output import OutputTarget
from pipeline.storage.sink import ParquetPartsSink
from tests.helpers import REPO
from tests.helpers.parts import JOB, Ctx, block


OUT_SCHEMA = schema.output_schema(pa.schema([("id", pa.string()), ("text", pa.string())]), "id", "text")



@dataclass
class JobRun:
    corpus: pa.Table
    output: Path
    result: subprocess.CompletedProcess
    report: dict
    written: pa.Table
    profile: Path = REPO / "conf/local.yaml"
    sets: tuple[str, ...] = ()  # the run's --set arguments, to repeat it
    engines_left: list[int] | None = None  # engine processes alive ENGINE_GRACE_S after the CLI exited


def run_cli(job: Path, profile: Path, *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", "run", str(job), "--profile", str(profile), *args],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )
    result.ended_at = time.monotonic()  # type: ignore[attr-defined]
    return result


ENGINE_GRACE_S = 5.0


def read_run(output: Path, corpus_path: Path, result: subprocess.CompletedProcess) -> JobRun:
    """The run's output and report, and which of its engine processes outlived the CLI."""
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((output / "_report.json").read_text())
    return JobRun(pq.read_table(corpus_path), output, result, report, pq.read_table(output),
                  engines_left=engines_left(report, getattr(result, "ended_at", time.monotonic())))


def engines_left(report: dict, ended_at: float, grace_s: float = ENGINE_GRACE_S) -> list[int]:
    """Of the engine processes the report records (each actor's, its engine core's and
    workers'), those still alive `grace_s` after the CLI exited at `ended_at`: found by
    pid, not by name. Returns as soon as none is left."""
    pids = {pid for a in report["engine"]["actors"] for pid in a["pids"]}

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    while True:
        left = sorted(p for p in pids if alive(p))
        if not left or time.monotonic() >= ended_at + grace_s:
            return left
        time.sleep(0.1)


def run_processes(driver: psutil.Process, ray_tmp: str) -> list[psutil.Process]:
    """The driver's process tree, and every process of its Ray instance (their command
    lines name its own temp dir): all of this run's processes, none of anyone else's."""
    try:
        found = {p.pid: p for p in driver.children(recursive=True)}
    except psutil.NoSuchProcess:  # the driver has exited: what its Ray left is found by its temp dir
        found = {}
    for p in psutil.process_iter(["cmdline"]):
        if any(ray_tmp in part for part in p.info["cmdline"] or []):
            found.setdefault(p.pid, p)
            try:
                for child in p.children(recursive=True):
                    found.setdefault(child.pid, child)
            except psutil.NoSuchProcess:
                continue
    found.pop(driver.pid, None)
    return list(found.values())


def committed_rows(out: Path) -> int:
    """Rows in the commit markers of any staging of the local output `out` (a staging lies
    beside its output, named after it)."""
    total = 0
    for marker in out.parent.glob(f".{out.name}.*.staging/commits/*.parquet"):
        try:
            total += pq.read_metadata(marker).num_rows
        except (OSError, ValueError):
            pass  # being written
    return total


def wait_for(what: str, check: Callable[[], object], proc: subprocess.Popen, timeout_s: float = 600,
             explain: Callable[[], str] | None = None) -> object:
    """`check()`'s first true answer, polled while the run lives; a failure says why, with
    `explain()`'s account of what the check last saw where one is given. The limit only
    bounds a run that neither gets there nor ends: 240 s was passed on 2026-12-06, a slow
    day, by a run whose engine took 3.5 minutes to start beside the suite's other worker."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before {what}: "
                                 f"{proc.log.read_text()[-4000:]}"  # type: ignore[attr-defined]
                                 + (f"\n{explain()}" if explain else ""))
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}" + (f"\n{explain()}" if explain else ""))


def end_all(processes: list[psutil.Process]) -> None:
    for p in processes:
        try:
            p.send_signal(signal.SIGCONT)  # a stopped process cannot act on anything else
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=10)


def start(cmd: list[str], ray_tmp: str, log: Path, env: dict[str, str] | None = None,
          ) -> tuple[subprocess.Popen, psutil.Process]:
    """The run in the background, its output to `log` (a pipe nobody reads would fill up
    and stop it)."""
    env = {**os.environ, **(env or {}), "RAY_TMPDIR": ray_tmp}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    proc.log = log  # type: ignore[attr-defined]
    return proc, psutil.Process(proc.pid)


def killed_run(out: Path, run_id: str = "run1", parts=(["a", "b"], ["c"])) -> OutputTarget:
    """A run that committed `parts`, was cut off writing one more, and died (its lease let go)."""
    target = OutputTarget(str(out), JOB, run_id)
    target.open(rows_in=6)
    sink = ParquetPartsSink(target.staging, run_id, OUT_SCHEMA, ["id"])
    for i, ids in enumerate(parts):
        sink.write([block(ids, "le128", f"c{i}")], Ctx(i))
    Path(target.staging.data, f"part-{run_id}-00099.parquet").write_bytes(b"PAR1 cut off")  # no commit
    target.close()
    return target
