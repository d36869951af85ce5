"""A local publish killed at each of its steps (`debug.kill_publish_at`, a real SIGKILL of
a real process): the output holds the old run's whole output or the new one's, never a
mix, and the next run of the output finishes the publish before anything else."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.storage.output import LOCAL_PUBLISH_STEPS, PUBLISHING_MARKER, OutputError, OutputTarget
from pipeline.observe.report import REPORT_NAME
from tests.helpers.parts import JOB, earlier_output, stage, tree

REPO = Path(__file__).resolve().parents[3]

# A run's life cycle around its output, in a process of its own, killed at `step`.
KILLED_RUN = textwrap.dedent("""
    import sys
    from pipeline.storage import output
    from pipeline.storage.output import OutputTarget
    from tests.helpers.parts import stage
    out, step, backup, exchange = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1"
    if not exchange:
        output._exchange = lambda a, b: False
    target = OutputTarget(out, "nightly_summarize", "run1", backup_existing=backup, kill_publish_at=step)
    target.open()
    stage(target, "run1", parts=2)
    target.publish()
    target.close()
""")


def killed_publish(out: Path, step: str, backup: bool = False, exchange: bool = True) -> None:
    done = subprocess.run([sys.executable, "-c", KILLED_RUN, str(out), step, str(int(backup)), str(int(exchange))],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr


def staging_left(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.endswith(".staging"))


NEW = sorted(["part-run1-00000.parquet", "part-run1-00001.parquet", REPORT_NAME])


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
@pytest.mark.parametrize("step", [s for s in LOCAL_PUBLISH_STEPS if s != "backup"])
def test_a_publish_killed_at_any_step_is_finished_by_the_next_run(tmp_path, step, exchange):
    out = tmp_path / "dt=2026-12-01"
    earlier_output(out, run_id="run0")
    old = tree(out)
    neighbour = tmp_path / "dt=2026-11-30"
    earlier_output(neighbour, run_id="run0")
    beside = tree(neighbour)

    killed_publish(out, step, exchange=exchange)
    # Whatever the step: the output is one run's whole output, the old or the new.
    now = tree(out)
    assert now == old or sorted(now) == NEW and json.loads(now[REPORT_NAME])["run_id"] == "run1"
    assert len(staging_left(tmp_path)) == 1  # the killed run's, with its journal

    nxt = OutputTarget(str(out), JOB, "run2")
    nxt.open()
    try:
        assert any("run run1 died while publishing; its publish was finished now" in w for w in nxt.warnings)
        assert sorted(os.listdir(out)) == NEW  # the new output whole; no file of run0's left
        assert json.loads((out / REPORT_NAME).read_text())["run_id"] == "run1"
        assert staging_left(tmp_path) == [f".{out.name}.run2.staging"]  # the killed run's is gone
        assert nxt.resumed is None  # nothing looked resumable
        stage(nxt, "run2")
        nxt.publish()
    finally:
        nxt.close()
    assert sorted(os.listdir(out)) == sorted(["part-run2-00000.parquet", REPORT_NAME])
    assert tree(neighbour) == beside
    assert sorted(os.listdir(tmp_path)) == ["dt=2026-11-30", "dt=2026-12-01"]


@pytest.mark.parametrize("step", ["journal", "backup", "swap"])
def test_a_publish_over_a_foreign_folder_killed_midway_keeps_the_folder_whole(tmp_path, step):
    user = tmp_path / "user"
    (user / "notes").mkdir(parents=True)
    (user / "thesis.tex").write_text("mine")
    (user / "notes" / "a.txt").write_text("a")
    before = tree(user)

    killed_publish(user, step, backup=True)
    nxt = OutputTarget(str(user), JOB, "run2", backup_existing=True)
    backups = lambda: [p for p in tmp_path.iterdir() if p.name.startswith("user.backup-")]
    if step == "journal":
        # Killed before the folder was moved aside: it is where it was, untouched, and the
        # killed run's staging is a stopped run whose output is complete (--resume publishes it).
        with pytest.raises(OutputError, match="--resume to continue"):
            nxt.open()
        assert backups() == [] and tree(user) == before
        assert staging_left(tmp_path) == [".user.run1.staging"]
    else:
        nxt.open()
        nxt.close()
        nxt.staging.remove()
        backups = backups()
        assert len(backups) == 1 and tree(backups[0]) == before
        assert sorted(os.listdir(user)) == NEW and staging_left(tmp_path) == []


def test_a_publish_that_cannot_be_finished_is_dropped_and_the_output_left_as_it_is(tmp_path):
    """Killed before the swap; then someone's own file appears in the output. The next run
    neither finishes the publish nor deletes anything: it refuses the output, and the killed
    run's staging stays a complete stopped run."""
    out = tmp_path / "out"
    earlier_output(out, run_id="run0")
    killed_publish(out, "journal")
    (out / "mine.txt").write_text("mine")
    before = tree(out)
    with pytest.raises(OutputError, match="mine.txt"):
        OutputTarget(str(out), JOB, "run2").open()
    assert tree(out) == before
    [left] = staging_left(tmp_path)
    assert not (tmp_path / left / PUBLISHING_MARKER).exists()
    assert sorted(os.listdir(tmp_path / left / "output")) == NEW
