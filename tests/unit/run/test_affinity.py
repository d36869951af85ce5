"""The run's other processes kept off the engines' cores, on real processes: a driver of its
own (a subprocess, so that this test process is never narrowed) with a "worker" bound to
CPU 0, as vLLM binds its CPU worker, and another child that is not."""

import json
import os
import subprocess
import sys

import pytest

from pipeline.run.affinity import EngineCpuGuard

# Linux's CPU affinity and two CPUs to keep apart (CI's machines have both; a 1-CPU box has
# nothing to keep apart, and the guard does nothing there by design: `plan.engine_cpus`).
TWO_CPUS = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                              reason="needs CPU affinity and two CPUs to keep apart")

DRIVER = r"""
import json, os, subprocess, sys, time
from pipeline.run.affinity import EngineCpuGuard
sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
worker = subprocess.Popen(sleep)
os.sched_setaffinity(worker.pid, {0})  # bound, as vLLM binds its worker
other = subprocess.Popen(sleep)
reported = {}
guard = EngineCpuGuard(lambda: reported)
guard.once()  # nothing reported yet: nothing moves
before = sorted(os.sched_getaffinity(other.pid))
reported = {"engine-1": {worker.pid: [0]}}
guard.once()
during = {"other": sorted(os.sched_getaffinity(other.pid)), "worker": sorted(os.sched_getaffinity(worker.pid)),
          "driver": sorted(os.sched_getaffinity(0))}
late = subprocess.Popen(sleep)  # started since: inherits the narrowed CPUs, or the next pass narrows it
guard.once()
during["late"] = sorted(os.sched_getaffinity(late.pid))
guard.stop()
after = sorted(os.sched_getaffinity(0))
for p in (worker, other, late):
    p.kill()
print(json.dumps({"before": before, "during": during, "after": after, "summary": guard.summary()}))
"""


@TWO_CPUS
def test_every_other_process_leaves_the_engines_cores_and_the_driver_gets_its_own_back():
    cpus = sorted(os.sched_getaffinity(0))
    done = subprocess.run([sys.executable, "-c", DRIVER], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    rest = [c for c in cpus if c != 0]
    assert out["before"] == cpus  # before any engine reports, everything runs everywhere
    assert out["during"] == {"other": rest, "worker": [0], "driver": rest, "late": rest}
    assert out["after"] == cpus
    assert out["summary"] == {"engine": [0], "others": rest, "processes": 2}  # the other child and the driver


def test_nothing_moves_before_every_engine_has_reported():
    guard = EngineCpuGuard(lambda: {"engine-1": {12345: [0]}}, engines=2)
    guard.once()
    assert guard.summary() is None and guard.moved == set()


def test_nothing_moves_when_the_workers_leave_no_cpu_free():
    everything = sorted(os.sched_getaffinity(0))
    guard = EngineCpuGuard(lambda: {"engine-1": {12345: everything}})
    guard.once()
    assert guard.summary() is None and guard.moved == set()


WIDEN = r"""
import json, os, subprocess, sys
from pipeline.run.affinity import EngineCpuGuard
sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
engine = subprocess.Popen(sleep)
os.sched_setaffinity(engine.pid, {0})  # an engine on demand, bound before vLLM's import
other = subprocess.Popen(sleep)
reported = {"engine-1": {engine.pid: [0]}}
guard = EngineCpuGuard(lambda: reported)
guard.once()
late = subprocess.Popen(sleep)  # started since from a narrowed process: narrowed by inheritance
narrowed = {"other": sorted(os.sched_getaffinity(other.pid)), "late": sorted(os.sched_getaffinity(late.pid))}
reported = {"engine-1": {}}  # imported, no work found yet: the CPUs given back
guard.once()
widened = {"other": sorted(os.sched_getaffinity(other.pid)), "late": sorted(os.sched_getaffinity(late.pid)),
           "driver": sorted(os.sched_getaffinity(0)), "engine": sorted(os.sched_getaffinity(engine.pid))}
summary = guard.summary()
reported = {"engine-1": {engine.pid: [0]}}  # work found: reported again
guard.once()
again = {"other": sorted(os.sched_getaffinity(other.pid)), "late": sorted(os.sched_getaffinity(late.pid))}
guard.stop()
for p in (engine, other, late):
    p.kill()
print(json.dumps({"narrowed": narrowed, "widened": widened, "summary": summary, "again": again}))
"""


@TWO_CPUS
def test_an_engine_that_gives_its_cpus_back_gets_every_process_widened_and_narrowed_again_when_it_reports():
    """An engine on demand reports its CPUs for vLLM's import, and none once imported with no
    work found: every process of the run is back on every CPU (one started meanwhile from a
    narrowed process too), the engine's own stays bound; reported again, they leave it again."""
    cpus = sorted(os.sched_getaffinity(0))
    rest = [c for c in cpus if c != 0]
    done = subprocess.run([sys.executable, "-c", WIDEN], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["narrowed"] == {"other": rest, "late": rest}
    assert out["widened"] == {"other": cpus, "late": cpus, "driver": cpus, "engine": [0]}
    assert out["summary"] is None  # nothing kept apart now
    assert out["again"] == {"other": rest, "late": rest}
