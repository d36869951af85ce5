"""The nightly job's day partitions: {date} in the paths, replaced whole on a re-run."""

import json
import os
from collections import Counter

import pyarrow.parquet as pq
import pytest

from pipeline.dev.corpus import write_corpus
from tests.conftest import REPO
from tests.integration.conftest import DATE, run_cli

pytestmark = pytest.mark.integration

OTHER_DATE = "2026-11-02"


def snapshot(folder):
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(folder.iterdir())}


def test_rerunning_a_date_replaces_its_partition_and_leaves_the_others(job_run, tiny_model):
    out_root = job_run.output.parent  # .../out, holding dt=2026-11-01 from the shared run
    in_root = job_run.output.parent.parent / "in"
    assert job_run.output.name == f"dt={DATE}" and job_run.report["date"] == DATE
    corpus = pq.read_table(write_corpus(in_root / f"dt={OTHER_DATE}" / "corpus.parquet", rows=40, seed=12))
    before = snapshot(job_run.output)

    def run_day():
        result = run_cli(
            REPO / "jobs/nightly_summarize.yaml", REPO / "conf/local.yaml", "--date", OTHER_DATE,
            "--input", str(in_root / "dt={date}"), "--output", str(out_root / "dt={date}"),
            "--set", f"model.name={tiny_model}", "--set", "sampling.max_new_tokens=8",
            "--set", "engine.max_model_len=8192", "--set", "batching.learned_limits=null",
        )
        assert result.returncode == 0, result.stderr[-3000:]
        day = out_root / f"dt={OTHER_DATE}"
        return json.loads((day / "_report.json").read_text()), pq.read_table(day), sorted(os.listdir(day))

    first, _, first_files = run_day()
    second, written, second_files = run_day()

    assert first["date"] == second["date"] == OTHER_DATE
    assert first["run_id"] != second["run_id"]
    # The partition holds the second run only: every id once, no part of the first run left.
    assert Counter(written.column("id").to_pylist()) == Counter(corpus.column("id").to_pylist())
    assert set(written.column("run_id").to_pylist()) == {second["run_id"]}
    assert not set(first_files) & set(second_files) - {"_report.json", "_batching.png"}
    # The other day is untouched, and no staging folder is left behind.
    assert snapshot(job_run.output) == before
    assert sorted(os.listdir(out_root)) == [f"dt={DATE}", f"dt={OTHER_DATE}"]
