"""Crash safety on real Ray and real vLLM (the tiny model), with real kills, by pid.

One corpus, two runs, shared by the assertions (engine starts are the slow part):
1. a run killed outright, driver and every process of its Ray instance, once a
   third of its rows are committed (the whole run would take over a minute);
2. `--resume`, during which the test kills the engine actor, then its engine
   core, then stops (SIGSTOP) the next engine core: each a restart, the last
   one found by the stall watchdog.
The resumed run must account for every input id exactly once, generate only
the rows that were not committed, and report each incident. A third, cheap run
shows the restart bound ending an engine that never starts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from pipeline.tools.dev.corpus import write_corpus
from tests.helpers import REPO
from tests.helpers.runs import committed_rows, end_all, run_processes, start, wait_for

# The module's fixture makes two runs, one killed and one with three engine restarts: about
# 370 s on a quiet Intel machine, past the suite's 900 s per test beside another load on a
# 2-core AMD EPYC (avx2), where an engine's start takes 2-3 minutes (2026-12-07: the fixture
# timed out there at 03b699f as after it). The bound only ends a run that hangs.
pytestmark = pytest.mark.timeout(1800)

FILES, ROWS_PER_FILE = 30, 20  # 600 rows, one tokenizing batch per file
STALL_TIMEOUT_S = 20  # a stopped core is hung; a real step on a loaded machine may pass 6 s


@dataclass
class Resumed:
    corpus_ids: list[str]
    committed_at_kill: int
    refused: subprocess.CompletedProcess
    result: subprocess.CompletedProcess
    report: dict
    output: Path
    killed: dict[str, int]  # what the test killed or stopped in the resumed run: kind -> pid


def command(tmp: Path, tiny_model: Path, *extra: str, slow_s: float = 9.0) -> list[str]:
    return [
        sys.executable, "-m", "pipeline", "run", str(REPO / "jobs/nightly_summarize.yaml"),
        "--profile", str(REPO / "conf/local.yaml"),
        "--input", str(tmp / "in"), "--output", str(tmp / "out"),
        "--set", f"model.name={tiny_model}", "--set", "sampling.max_new_tokens=16",
        "--set", "batching.learned_limits=null", "--set", "engine.max_model_len=8192",
        "--set", f"batching.prepare_batch_rows={ROWS_PER_FILE}", "--set", "batching.generate_batch_rows=16",
        "--set", "bucketing.window_rows=40",
        # The engine core in a process of its own (on a CPU it runs in the actor's by
        # default): the resumed run kills and stops cores as well as actors.
        "--set", "engine.in_process=false",
        # Input that arrives slowly (`slow_s` per file): the run lasts long enough to be killed
        # mid-way (30 files, 1.5 s each: over a minute with the engine's start), and the resumed
        # run has rows waiting through its three restarts (20 files, 9 s each: at 3 s, a loaded
        # CI machine once saw the run end before the third; at 5 s, so did the slower AMD one).
        "--set", f"debug.slow_prepare_s={slow_s}",
        *extra,
    ]


class EngineCores:
    """The engine cores of one run's live engine actors, looked for among the driver's
    descendants and among the processes of its Ray instance (found by its temp dir), so
    that a Ray process reparented away from the driver still counts. A core whose actor
    just died may outlive it for a moment: not one of these. Keeps every process it saw,
    with each title it had and when, and how long its searches took, so that a wait that
    never finds one says what there was."""

    def __init__(self, driver: psutil.Process, ray_tmp: str):
        self.driver, self.ray_tmp = driver, ray_tmp
        self.began = time.monotonic()
        self.seen: dict[int, list[str]] = {}  # pid -> "at T s (parent P): title", as it changed
        self.searches, self.longest = 0, 0.0  # searches made, and the longest one's seconds

    def __call__(self) -> list[psutil.Process]:
        began, cores = time.monotonic(), []
        for p in run_processes(self.driver, self.ray_tmp):
            try:
                title = f"{' '.join(p.cmdline())} [{p.name()}]"
                parent = p.parent()
                self.saw(p.pid, f"(parent {p.ppid()}): {title[:120]}")
                if "EngineCor" in title and parent is not None and self.engine_actor(parent):
                    cores.append(p)
            except psutil.Error:
                pass
        self.searches, self.longest = self.searches + 1, max(self.longest, time.monotonic() - began)
        return cores

    def saw(self, pid: int, line: str) -> None:
        titles = self.seen.setdefault(pid, [])
        if not any(t.endswith(line) for t in titles):
            titles.append(f"at {time.monotonic() - self.began:.0f} s {line}")

    def account(self, report: Path) -> str:
        """Every process the search saw, the engine pids the run's report recorded (when it
        wrote one), and how long the searches took: whether a core ran, and what it looked
        like to a search that was not slower than the core's life."""
        lines = [f"{pid} {' | '.join(titles)}" for pid, titles in sorted(self.seen.items())]
        if report.exists():
            actors = json.loads(report.read_text()).get("engine", {}).get("actors", [])
            lines.append(f"the report's engine pids: {[a.get('pids') for a in actors]}")
        lines.append(f"{self.searches} searches from driver {self.driver.pid}, the longest {self.longest:.1f} s")
        return "the run's processes seen:\n" + "\n".join(lines)

    @staticmethod
    def engine_actor(p: psutil.Process) -> bool:
        """Whether `p` is an engine actor: its title names GenerateStage, or it is a Ray
        worker of this run, the only kind that starts an engine core. Under a loaded CI the
        resumed run's core went unfound for all its 213 s (cause not seen; `ps` showed a
        MapWorker whose command line read empty then), so the title is not relied on alone."""
        return "GenerateStage" in " ".join(p.cmdline()) or p.name().startswith("ray::")

    def fresh(self, killed: dict[str, int]) -> list[psutil.Process]:
        """Cores that none of the `killed` pids is, or is the parent of."""
        found = []
        for c in self():
            try:
                if c.pid not in killed.values() and c.ppid() not in killed.values():
                    found.append(c)
            except psutil.Error:
                pass
        return found


@pytest.fixture(scope="module")
def resumed(tiny_model, tmp_path_factory, ray_tmp) -> Iterator[Resumed]:
    tmp = tmp_path_factory.mktemp("resume")
    whole = pq.read_table(write_corpus(tmp / "whole.parquet", rows=FILES * ROWS_PER_FILE, seed=21))
    (tmp / "in").mkdir()
    for k in range(FILES):
        pq.write_table(whole.slice(k * ROWS_PER_FILE, ROWS_PER_FILE), tmp / "in" / f"part-{k:02d}.parquet")
    ids = whole.column("id").to_pylist()
    started: list[psutil.Process] = []
    runs: list[tuple[subprocess.Popen, psutil.Process]] = []  # each run's process and driver, ended if left
    try:
        # Each run's Ray under a temp dir of its own: the second run's search for engine cores
        # can find nothing of the first.
        first_tmp, second_tmp = os.path.join(ray_tmp, "1"), os.path.join(ray_tmp, "2")
        os.makedirs(first_tmp)
        os.makedirs(second_tmp)
        # 1. Killed outright, driver first, once a third of the rows are committed.
        proc, driver = start(command(tmp, tiny_model, slow_s=1.5), first_tmp, tmp / "killed.log")
        runs.append((proc, driver))
        wait_for("a third of the rows committed", lambda: committed_rows(tmp / "out") >= len(ids) // 3, proc)
        everything = run_processes(driver, first_tmp)
        started += everything
        driver.kill()
        proc.wait(30)
        end_all(everything)
        end_all(run_processes(driver, first_tmp))  # any of its Ray's that started after the list
        at_kill = committed_rows(tmp / "out")

        # Without --resume the next run stops, naming the stopped run and its progress.
        refused = subprocess.run(command(tmp, tiny_model), cwd=REPO, capture_output=True, text=True, timeout=120)

        # 2. --resume, with the engine actor killed, then its engine core, then a core stopped.
        proc, driver = start(command(tmp, tiny_model, "--resume", "--set", "engine.max_restarts=4",
                                     "--set", f"engine.stall_timeout_s={STALL_TIMEOUT_S}"), second_tmp,
                             tmp / "resumed.log")
        runs.append((proc, driver))
        killed: dict[str, int] = {}
        cores = EngineCores(driver, second_tmp)
        for kind in ("actor", "core", "stop"):
            # An engine serving rows: a core none of the kills so far touched, and parts
            # committed since it was first seen (so its start-up is over).
            fresh = wait_for(f"a fresh engine core to {kind}", lambda: cores.fresh(killed), proc,
                             explain=lambda: f"killed so far: {killed}; {cores.account(tmp / 'out' / '_report.json')}")
            core, base = fresh[0], committed_rows(tmp / "out")
            wait_for(f"rows committed by engine core {core.pid}", lambda: committed_rows(tmp / "out") > base, proc)
            started += run_processes(driver, second_tmp)
            if kind == "actor":
                killed[kind] = core.ppid()  # the engine actor's process: the core's parent
                os.kill(killed[kind], signal.SIGKILL)
            elif kind == "core":
                killed[kind] = core.pid
                os.kill(core.pid, signal.SIGKILL)
            else:
                killed[kind] = core.pid
                os.kill(core.pid, signal.SIGSTOP)
        proc.wait(timeout=600)
        result = subprocess.CompletedProcess(proc.args, proc.returncode, "", (tmp / "resumed.log").read_text())
        report = json.loads((tmp / "out" / "_report.json").read_text()) if proc.returncode == 0 else {}
        yield Resumed(ids, at_kill, refused, result, report, tmp / "out", killed)
    finally:
        for proc, driver in runs:  # a run a failed wait left going: it and its Ray, by pid
            if proc.poll() is None:
                started += run_processes(driver, ray_tmp)
                driver.kill()
                proc.wait(30)
        end_all([p for p in started if p.is_running()])


def test_a_stopped_run_stops_the_next_one_with_its_progress(resumed):
    assert resumed.refused.returncode == 2
    last = resumed.refused.stderr.strip().splitlines()[-1]
    assert "stopped at" in last and "rows committed" in last and "--resume" in last and "--restart" in last


def test_the_resumed_run_holds_every_id_once_and_generated_only_what_was_missing(resumed):
    assert resumed.result.returncode == 0, resumed.result.stderr[-4000:]
    written = pq.read_table(resumed.output)
    assert sorted(written.column("id").to_pylist()) == sorted(resumed.corpus_ids)
    assert set(written.column("status").to_pylist()) == {"ok"}
    assert pc.min(pc.utf8_length(written.column("summary"))).as_py() > 0
    resume = resumed.report["resume"]
    assert resume["rows_committed_before"] >= resumed.committed_at_kill >= len(resumed.corpus_ids) // 3
    assert resume["rows_generated"] == len(resumed.corpus_ids) - resume["rows_committed_before"]
    # Each row names the run that generated it; the report names both.
    assert resume["lineage"] == sorted(set(written.column("run_id").to_pylist()))
    assert len(resume["lineage"]) == 2 and resume["lineage"][-1] == resumed.report["run_id"]
    # The staging was published, the lock released: nothing else is left beside the output.
    left = sorted(p.name for p in resumed.output.parent.iterdir() if not p.name.endswith(".log"))
    assert left == ["in", "out", "whole.parquet"]


def test_every_kill_and_the_stall_are_restarts_in_the_report(resumed):
    assert resumed.result.returncode == 0, resumed.result.stderr[-4000:]
    incidents = resumed.report["incidents"]
    kinds = [i["kind"] for i in incidents]
    assert kinds[0] == "resume"
    assert kinds.count("restart") == 3, incidents
    died = [i for i in incidents if i["kind"] == "engine_died"]
    assert len(died) == 1 and "not of memory" in died[0]["cause"]
    stall = [i for i in incidents if i["kind"] == "stall"]
    assert len(stall) == 1 and f"engine.stall_timeout_s {STALL_TIMEOUT_S}" in stall[0]["cause"]
    # The watchdog ended the stopped core.
    assert not psutil.pid_exists(resumed.killed["stop"]) or psutil.Process(resumed.killed["stop"]).status() == "zombie"


def test_an_engine_that_never_starts_ends_the_run_within_the_bound(tiny_model, tmp_path, ray_tmp):
    corpus = write_corpus(tmp_path / "in" / "c.parquet", rows=20, seed=3)
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", "run", str(REPO / "jobs/nightly_summarize.yaml"),
         "--profile", str(REPO / "conf/local.yaml"), "--input", str(corpus), "--output", str(tmp_path / "out"),
         "--set", f"model.name={tiny_model}", "--set", "batching.learned_limits=null",
         "--set", "engine.max_restarts=1", "--set", "debug.engine_fails_on_start=true"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "RAY_TMPDIR": ray_tmp},
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert "engine.max_restarts=1" in last and "debug.engine_fails_on_start" in last, result.stderr[-3000:]
    assert not (tmp_path / "out").exists()
