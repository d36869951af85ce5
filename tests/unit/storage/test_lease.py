"""The output lease (`pipeline.storage.lease`): one run at a time per output, held by a live
process the test starts itself (a `sleep`) and stops by its handle."""

import json
import os
import socket
import subprocess
import sys
import time

import psutil
import pyarrow.fs as pafs
import pytest

from pipeline.storage.lease import Lease, LeaseLost, OutputBusy, OutputLease, Owner, lock_path
from tests.helpers import REPO


@pytest.fixture
def sleeper():
    """A live process that is not this one, to hold a lease."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    proc.kill()
    proc.wait()


def held_by(proc: subprocess.Popen, run_id: str = "run-other", expires_in: float = 60.0,
            host: str | None = None) -> Lease:
    owner = Owner(run_id, "nightly_summarize", host or socket.gethostname(), proc.pid,
                  psutil.Process(proc.pid).create_time())
    return Lease(owner, time.time() + expires_in)


def place(output, lease: Lease) -> str:
    path = lock_path(str(output))
    with open(path, "wb") as f:
        f.write(lease.to_bytes())
    return path


def mine(output, run_id="run-me", lease_s=120.0) -> OutputLease:
    return OutputLease(pafs.LocalFileSystem(), str(output), Owner.this_process(run_id, "nightly_summarize"), lease_s)


def test_a_live_lease_refuses_a_second_run_and_names_its_owner(tmp_path, sleeper):
    path = place(tmp_path / "out", held_by(sleeper))
    before = open(path, "rb").read()
    with pytest.raises(OutputBusy) as e:
        mine(tmp_path / "out").acquire()
    message = str(e.value)
    assert f"run run-other (pid {sleeper.pid} on host {socket.gethostname()}, started " in message
    assert "is writing this output" in message
    assert open(path, "rb").read() == before


def test_a_live_lease_on_another_host_is_respected_whatever_its_pid(tmp_path):
    # pid 1 on this machine says nothing about a process on another one.
    lease = Lease(Owner("run-other", "j", "some-other-host", 999999, 1.0), time.time() + 60)
    place(tmp_path / "out", lease)
    with pytest.raises(OutputBusy, match="on host some-other-host"):
        mine(tmp_path / "out").acquire()


def test_an_expired_lease_is_taken_over_with_a_warning(tmp_path, sleeper):
    place(tmp_path / "out", held_by(sleeper, expires_in=-1, host="some-other-host"))
    lease = mine(tmp_path / "out")
    warning = lease.acquire()
    try:
        assert "took over" in warning and "let it expire" in warning
        assert lease.holder().owner.run_id == "run-me"
    finally:
        lease.release()
    assert not os.path.exists(lock_path(str(tmp_path / "out")))
    assert sorted(os.listdir(tmp_path)) == []  # nothing left beside the output


def test_a_dead_owner_on_this_host_is_taken_over_at_once(tmp_path):
    done = subprocess.Popen(["true"])
    started = psutil.Process(done.pid).create_time() if psutil.pid_exists(done.pid) else time.time()
    done.wait()
    owner = Owner("run-dead", "j", socket.gethostname(), done.pid, started)
    place(tmp_path / "out", Lease(owner, time.time() + 600))
    lease = mine(tmp_path / "out")
    assert "no longer running" in lease.acquire()
    lease.release()
    # A reused pid: alive, but started at another time than the lease says.
    reused = Owner("run-old", "j", socket.gethostname(), os.getpid(), 1.0)
    place(tmp_path / "out", Lease(reused, time.time() + 600))
    lease = mine(tmp_path / "out", run_id="run-me-2")
    assert "no longer running" in lease.acquire()
    lease.release()


def test_an_unreadable_lock_is_refused_and_kept(tmp_path):
    path = lock_path(str(tmp_path / "out"))
    with open(path, "w") as f:
        f.write("something else's file")
    with pytest.raises(OutputBusy, match="delete it by hand"):
        mine(tmp_path / "out").acquire()
    assert open(path).read() == "something else's file"


def test_the_lease_is_renewed_while_held_and_loss_is_noticed(tmp_path):
    lease = mine(tmp_path / "out", lease_s=0.6)
    lease.acquire()
    try:
        first = lease.holder().expires_at
        time.sleep(0.5)
        assert lease.holder().expires_at > first  # renewed by the background thread
        lease.check()
        # Someone takes it (as if this run had hung past its expiry).
        with open(lease.path, "wb") as f:
            f.write(Lease(Owner("thief", "j", "h", 1, 1.0), time.time() + 60).to_bytes())
        time.sleep(0.5)
        with pytest.raises(LeaseLost, match="thief"):
            lease.check()
    finally:
        lease.release()
    assert json.loads(open(lease.path).read())["run_id"] == "thief"  # not ours to remove


def test_two_runs_racing_for_one_output_get_one_lease(tmp_path):
    code = (
        "import sys, time, pyarrow.fs as pafs\n"
        "from pipeline.storage.lease import OutputLease, Owner, OutputBusy\n"
        "lease = OutputLease(pafs.LocalFileSystem(), sys.argv[1], Owner.this_process(sys.argv[2], 'j'))\n"
        "time.sleep(max(0, float(sys.argv[3]) - time.time()))\n"
        "try:\n"
        "    lease.acquire(); print('got', flush=True); time.sleep(3); lease.release()\n"
        "except OutputBusy:\n"
        "    print('busy', flush=True)\n"
    )
    for attempt in range(3):
        at = str(time.time() + 3.0)  # both start, import (slow on a busy machine), then ask at once
        procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / f"out{attempt}"), f"r{i}", at],
                                  stdout=subprocess.PIPE, text=True, cwd=REPO) for i in range(2)]
        results = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
        assert results == ["busy", "got"], results


def test_the_cli_refuses_an_output_a_live_run_holds_before_ray_starts(tmp_path, sleeper, tiny_model):
    from pipeline.tools.dev.corpus import write_corpus

    corpus = write_corpus(tmp_path / "c.parquet", rows=5, seed=0)
    place(tmp_path / "out", held_by(sleeper, run_id="20261130T000000Z-abcdef"))
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", "run", "jobs/nightly_summarize.yaml", "--profile", "conf/local.yaml",
         "--input", str(corpus), "--output", str(tmp_path / "out"), "--set", f"model.name={tiny_model}"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and f"run 20261130T000000Z-abcdef (pid {sleeper.pid} on host" in last
    assert time.monotonic() - started < 30 and "Ray instance" not in done.stderr
    assert sorted(os.listdir(tmp_path)) == [".out.lock", "c.parquet"]  # no staging, no output
