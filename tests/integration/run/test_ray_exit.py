"""The CLI's exit stops the Ray it started, workers and all, and nothing else."""

import json
import subprocess
import sys
import textwrap

import psutil

SCRIPT = textwrap.dedent("""
    import json, subprocess, sys, time
    import ray
    from pipeline import cli

    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Actor:
        def start(self):
            # As vLLM's engine core is, a process under the actor's; this one ignores SIGTERM,
            # so it outlives its actor unless it is killed.
            import os, subprocess, sys
            deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
            self.core = subprocess.Popen([sys.executable, "-c", deaf])
            return os.getpid(), self.core.pid

    actors = [Actor.remote() for _ in range(2)]
    pids = ray.get([a.start.remote() for a in actors])
    ray_pids = [p.pid for p in cli._local_ray_processes()]
    cli._stop_ray()
    print(json.dumps({"actors": pids, "ray": ray_pids, "bystander": bystander.pid}))
""")


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_stopping_the_local_ray_leaves_none_of_its_processes_and_spares_the_rest():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    try:
        # The workers, and the processes under them, are found under Ray's own processes.
        assert {pid for pair in got["actors"] for pid in pair} <= set(got["ray"])
        # Checked the moment the CLI's stop returned, not after a grace: none is left.
        assert [p for p in got["ray"] if alive(p)] == []
        assert alive(got["bystander"])  # a process Ray did not start is not Ray's to stop
    finally:
        psutil.Process(got["bystander"]).kill()
