"""glibc's malloc held to a few arenas in the engine actor's process (`engine.malloc_arenas`,
`pipeline.generation.vllm.hold_malloc_arenas`)."""

import subprocess
import sys

from pipeline.config import load_run_config
from tests.helpers import REPO

# Eight threads allocate at once, then glibc prints each arena it made (malloc_stats).
SCRIPT = """
import ctypes, sys, threading
from pipeline.generation.vllm import hold_malloc_arenas
if sys.argv[1] != "none":
    assert hold_malloc_arenas(int(sys.argv[1]))
held, go = [], threading.Barrier(8)
def work():
    go.wait()
    held.append([bytes(20_000) for _ in range(200)])
threads = [threading.Thread(target=work) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
ctypes.CDLL(None).malloc_stats()
"""


def arenas(held: str) -> int:
    done = subprocess.run([sys.executable, "-c", SCRIPT, held], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    return sum(line.startswith("Arena ") for line in done.stderr.splitlines())


def test_threads_share_the_arenas_they_are_held_to():
    assert arenas("none") > 2  # glibc's own: a thread that finds the arenas busy makes one
    assert arenas("2") == 2


def test_the_setting_reaches_the_engine_and_is_off_by_default():
    from pipeline.run.plan import generate_settings, prepare_settings

    job, profile = REPO / "jobs" / "nightly_summarize.yaml", REPO / "conf" / "local.yaml"
    for sets, arenas_set in (([], None), (["engine.malloc_arenas=2"], 2)):
        config = load_run_config(job, profile, ["engine.max_model_len=4096", *sets])
        settings = generate_settings(config, prepare_settings(config, "tiny", 4096), "run")
        assert settings.engine.malloc_arenas == arenas_set
