"""The nightly job's day partitions: {date} in the paths, replaced whole on a re-run."""

import json
import os
import shutil
from collections import Counter

import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO
from tests.integration.conftest import DATE, run_cli

pytestmark = pytest.mark.integration

OTHER_DATE = "2026-10-31"


def snapshot(folder):
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(folder.iterdir())}


def test_rerunning_a_date_replaces_its_partition_and_leaves_the_others(job_run, tmp_path):
    """Two days written by a real run (the shared one, copied); re-run one of them."""
    assert job_run.output.name == f"dt={DATE}" and job_run.report["date"] == DATE
    in_root, out_root = job_run.output.parent.parent / "in", tmp_path / "out"
    for day in (DATE, OTHER_DATE):
        shutil.copytree(job_run.output, out_root / f"dt={day}", copy_function=shutil.copy2)
    other = snapshot(out_root / f"dt={OTHER_DATE}")
    old_parts = {p for p in os.listdir(out_root / f"dt={DATE}") if p.startswith("part-")}

    result = run_cli(
        REPO / "jobs/nightly_summarize.yaml", job_run.profile, "--date", DATE,
        "--input", str(in_root / "dt={date}"), "--output", str(out_root / "dt={date}"), *job_run.sets,
        "--set", "sampling.max_new_tokens=4", "--set", "debug.slow_prepare_s=0", "--set", "hardware.num_engines=1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    day = out_root / f"dt={DATE}"
    report = json.loads((day / "_report.json").read_text())
    written = pq.read_table(day)

    assert report["date"] == DATE and report["run_id"] != job_run.report["run_id"]
    # What it replaced is what the earlier report listed: its parts, report and plot.
    assert report["publish"] == {"replaces_run": job_run.report["run_id"],
                                 "replaces_files": len(job_run.report["files"]) + 1 + bool(job_run.report["plot_path"]),
                                 "backup": None, "mode": "swap"}
    assert report["warnings"] == []
    # The partition holds the new run only: every id once, none of the old parts left.
    assert Counter(written.column("id").to_pylist()) == Counter(job_run.corpus.column("id").to_pylist())
    assert set(written.column("run_id").to_pylist()) == {report["run_id"]}
    assert not old_parts & set(os.listdir(day))
    assert set(written.column("output_tokens").to_pylist()) <= {1, 2, 3, 4}
    # The other day is untouched, and no staging folder or lock is left behind.
    assert snapshot(out_root / f"dt={OTHER_DATE}") == other
    assert sorted(os.listdir(out_root)) == [f"dt={OTHER_DATE}", f"dt={DATE}"]
