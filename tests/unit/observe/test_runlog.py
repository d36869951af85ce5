"""A quiet run: Ray's and vLLM's chatter into the log file, our own output on the terminal.
In a child process, since the test moves its file descriptors 1 and 2."""

import subprocess
import sys
import textwrap

from tests.helpers import REPO

CHILD = textwrap.dedent("""
    import logging, os, subprocess, sys
    from pathlib import Path
    from pipeline.observe.runlog import quiet_output

    with quiet_output(Path(sys.argv[1])) as terminal:
        print("ray: Started a local Ray instance.")                   # Python, to stdout
        os.write(2, b"[core_worker.cc:2465] constructor arguments\\n")  # C++, straight to fd 2
        subprocess.run([sys.executable, "-c", "import sys; print('(raylet) WARNING: 12 PYTHON workers', file=sys.stderr)"])
        logging.getLogger("pipeline.run.job").warning("no metrics endpoint on port 9100")
        print("progress 3/10 rows", file=terminal.out, flush=True)
    print("table after the run")
""")


def test_chatter_goes_to_the_log_and_ours_to_the_terminal(tmp_path):
    log = tmp_path / "logs" / "run.log"
    r = subprocess.run([sys.executable, "-c", CHILD, str(log)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["progress 3/10 rows", "table after the run"]
    assert r.stderr.splitlines() == ["no metrics endpoint on port 9100"]  # our warnings are meant to be read
    kept = log.read_text()
    for line in ("Started a local Ray instance", "constructor arguments", "12 PYTHON workers",
                 "no metrics endpoint on port 9100"):
        assert line in kept
    assert "progress 3/10" not in kept and "table after the run" not in kept
