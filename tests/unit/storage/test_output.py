"""Ownership, staging and publishing (`pipeline.storage.output`) on real filesystems: a local
folder, and a pyarrow SubTreeFileSystem standing in for a bucket, which takes the
object-store code path (no folder rename, copy then delete)."""

import json
import os
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from pipeline.storage import output as output_module
from pipeline.storage.output import STAGING_MARKER, OutputError, OutputTarget, PublishError, survey
from pipeline.observe.report import REPORT_NAME
from tests.helpers.parts import earlier_output, run, stage, tree

JOB = "nightly_summarize"










# --- what counts as ours ---------------------------------------------------------


def test_survey_tells_ours_from_foreign(tmp_path):
    fs = pafs.LocalFileSystem()
    assert survey(fs, str(tmp_path / "none"), JOB).state == "absent"
    (tmp_path / "empty").mkdir()
    assert survey(fs, str(tmp_path / "empty"), JOB).state == "empty"

    owned = earlier_output(tmp_path / "ours")
    s = survey(fs, str(tmp_path / "ours"), JOB)
    assert (s.state, s.previous_run, sorted(s.owned)) == ("ours", "run0", sorted(owned))

    # A part the report does not list, a folder, a hidden file: not provably ours.
    earlier_output(tmp_path / "mixed")
    (tmp_path / "mixed" / "part-spark-00000.parquet").write_bytes(b"spark")
    (tmp_path / "mixed" / "notes").mkdir()
    (tmp_path / "mixed" / ".DS_Store").write_bytes(b"x")
    s = survey(fs, str(tmp_path / "mixed"), JOB)
    assert s.state == "foreign" and s.foreign == (".DS_Store", "notes/", "part-spark-00000.parquet")

    earlier_output(tmp_path / "other", job="kb_ingest")
    s = survey(fs, str(tmp_path / "other"), JOB)
    assert s.state == "foreign" and "job 'kb_ingest' (run run0), not of 'nightly_summarize'" in s.refusal()

    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / REPORT_NAME).write_text("{not json")
    s = survey(fs, str(tmp_path / "bad"), JOB)
    assert s.state == "foreign" and "_report.json is unreadable" in s.refusal()

    (tmp_path / "file.parquet").write_bytes(b"x")
    s = survey(fs, str(tmp_path / "file.parquet"), JOB)
    assert s.state == "foreign" and "is a file, not a folder" in s.refusal()


def test_a_folder_of_foreign_files_is_refused_before_anything_is_written(tmp_path):
    user = tmp_path / "user"
    (user / "notes" / "deep").mkdir(parents=True)
    (user / "thesis.tex").write_text("\\documentclass{article}")
    (user / "notes" / "a.txt").write_text("a")
    (user / "notes" / "deep" / "b.bin").write_bytes(os.urandom(64))
    before = tree(user)

    target = OutputTarget(str(user), JOB, "run1")
    with pytest.raises(OutputError) as e:
        target.open()
    assert str(user) in str(e.value) and "notes/, thesis.tex" in str(e.value)
    assert "--backup-existing" in str(e.value)
    assert tree(user) == before
    # No lock, no staging: the parent holds what it held.
    assert sorted(os.listdir(tmp_path)) == ["user"]


def test_many_foreign_entries_are_summarised(tmp_path):
    for i in range(9):
        (tmp_path / f"f{i}.txt").write_text("x")
    s = survey(pafs.LocalFileSystem(), str(tmp_path), JOB)
    assert "f0.txt, f1.txt, f2.txt, f3.txt, f4.txt and 4 more" in s.refusal()


def test_an_output_needs_a_folder_of_its_own():
    with pytest.raises(OutputError, match="not the root"):
        OutputTarget("/", JOB, "run1")


# --- publishing, local ------------------------------------------------------------


def test_rerunning_one_day_replaces_its_partition_and_leaves_the_other_days(tmp_path):
    """The nightly job's dt= partitions: a re-run of one day publishes over that day's own
    earlier output only; the day beside it keeps every byte and every time stamp."""
    days = tmp_path / "nightly_summarize"
    earlier_output(days / "dt=2026-10-31", run_id="run0")
    earlier_output(days / "dt=2026-11-01", run_id="run0")
    other = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in (days / "dt=2026-10-31").iterdir()}
    target, names = run(str(days / "dt=2026-11-01"), "run1", parts=3)
    assert sorted(os.listdir(days / "dt=2026-11-01")) == sorted(names)  # the new run's parts only
    assert json.loads((days / "dt=2026-11-01" / REPORT_NAME).read_text())["replaces_run"] == "run0"
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in (days / "dt=2026-10-31").iterdir()} == other
    assert sorted(os.listdir(days)) == ["dt=2026-10-31", "dt=2026-11-01"]  # no staging, no lock left


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_an_earlier_output_of_the_same_job_is_replaced_whole(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(output_module, "_exchange", lambda a, b: False)
    out = tmp_path / "out"
    earlier_output(out, plot=True)
    target, names = run(str(out), "run1", parts=2)
    assert sorted(os.listdir(out)) == sorted(names)  # the old plot went too: it was listed
    assert tree(out)["part-run1-00000.parquet"].startswith(b"PAR1 new")
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no staging, no lock left


def test_a_fresh_output_and_an_empty_folder(tmp_path):
    _, names = run(str(tmp_path / "a" / "b" / "out"), "run1")
    assert sorted(os.listdir(tmp_path / "a" / "b")) == ["out"]
    (tmp_path / "empty").mkdir()
    _, names = run(str(tmp_path / "empty"), "run2")
    assert sorted(os.listdir(tmp_path / "empty")) == sorted(names)


def test_backup_existing_moves_a_foreign_folder_aside_whole(tmp_path):
    user = tmp_path / "user"
    (user / "notes").mkdir(parents=True)
    (user / "thesis.tex").write_text("mine")
    (user / "notes" / "a.txt").write_text("a")
    before = tree(user)
    target, names = run(str(user), "run1", backup=True)
    backups = [p for p in tmp_path.iterdir() if p.name.startswith("user.backup-")]
    assert len(backups) == 1 and tree(backups[0]) == before
    assert sorted(os.listdir(user)) == sorted(names)
    report = json.loads((user / REPORT_NAME).read_text())
    assert report["backup"] == str(backups[0]) and report["replaces_run"] is None


def test_another_jobs_output_is_refused_and_a_file_is_refused(tmp_path):
    earlier_output(tmp_path / "kb", job="kb_ingest")
    before = tree(tmp_path / "kb")
    with pytest.raises(OutputError, match="kb_ingest"):
        OutputTarget(str(tmp_path / "kb"), JOB, "run1").open()
    assert tree(tmp_path / "kb") == before
    (tmp_path / "f.parquet").write_bytes(b"data")
    with pytest.raises(OutputError, match="is a file"):
        OutputTarget(str(tmp_path / "f.parquet"), JOB, "run1").open()
    assert (tmp_path / "f.parquet").read_bytes() == b"data"


def test_foreign_files_that_appear_during_the_run_stop_the_publish_and_nothing_is_lost(tmp_path):
    out = tmp_path / "out"
    earlier_output(out)
    before = tree(out)
    target = OutputTarget(str(out), JOB, "run1")
    target.open()
    try:
        (out / "late.txt").write_text("written by someone else mid-run")
        before["late.txt"] = b"written by someone else mid-run"
        with pytest.raises(PublishError) as e:
            stage(target, "run1")
    finally:
        target.close()
    assert "late.txt" in str(e.value) and target.staging.data in str(e.value)
    assert tree(out) == before
    # The run's complete output is kept, marked, for the user to take.
    assert os.path.exists(f"{target.staging.data}/part-run1-00000.parquet")
    assert os.path.exists(f"{target.staging.root}/{STAGING_MARKER}")


def test_staging_is_marked_and_only_marked_staging_is_removed(tmp_path):
    target = OutputTarget(str(tmp_path / "out"), JOB, "run1")
    target.open()
    marker = json.loads(Path(target.staging.root, STAGING_MARKER).read_text())
    assert {k: marker[k] for k in ("run_id", "job", "pid")} == {"run_id": "run1", "job": JOB, "pid": os.getpid()}
    assert marker["host"] and marker["process_started"] > 0
    # A marker that names another run: this run must not remove that folder.
    Path(target.staging.root, STAGING_MARKER).write_text(json.dumps({**marker, "run_id": "someone-else"}))
    assert target.stop() is None  # nothing committed: nothing to keep, but not this run's to remove
    assert os.path.isdir(target.staging.data)
    Path(target.staging.root, STAGING_MARKER).write_text(json.dumps(marker))
    assert target.stop() is None
    target.close()
    assert sorted(os.listdir(tmp_path)) == []


def test_a_killed_runs_staging_stops_the_next_run_until_it_is_resumed_or_discarded(tmp_path):
    killed = OutputTarget(str(tmp_path / "out"), JOB, "run1")
    killed.open(rows_in=10)
    killed.close()  # its lease goes, its staging stays: as after kill -9 and an expired lease
    with pytest.raises(OutputError, match="run run1 stopped at 0% .0 rows committed.*--resume.*--restart"):
        OutputTarget(str(tmp_path / "out"), JOB, "run2").open()
    target = OutputTarget(str(tmp_path / "out"), JOB, "run2", stopped="restart")
    target.open()
    try:
        assert any(killed.staging.root in w and "discarded" in w for w in target.warnings)
        stage(target, "run2")
        target.publish()
    finally:
        target.close()
    assert sorted(os.listdir(tmp_path)) == ["out"]


# --- publishing on the object-store path ---------------------------------------------


@pytest.fixture
def bucket(tmp_path):
    (tmp_path / "bucket").mkdir()
    return pafs.SubTreeFileSystem(str(tmp_path / "bucket"), pafs.LocalFileSystem()), tmp_path / "bucket"


def test_object_store_path_replaces_only_its_own_earlier_output(bucket):
    fs, root = bucket
    old = earlier_output(root / "out", parts=3)
    target, names = run("out", "run1", fs=fs, parts=2)
    assert not target.local
    assert sorted(os.listdir(root / "out")) == sorted(names)
    assert not set(old) - {REPORT_NAME} & set(os.listdir(root / "out"))
    assert sorted(os.listdir(root)) == ["out"]  # staging and lock gone


def test_object_store_path_leaves_parts_it_did_not_write(bucket):
    fs, root = bucket
    earlier_output(root / "out", parts=1)
    (root / "out" / "part-00000-spark.snappy.parquet").write_bytes(b"spark")
    before = tree(root / "out")
    with pytest.raises(OutputError, match="part-00000-spark"):
        run("out", "run1", fs=fs)
    assert tree(root / "out") == before
    # Moved aside on request, byte for byte, never deleted.
    run("out", "run2", fs=fs, backup=True)
    backups = [p for p in root.iterdir() if p.name.startswith("out.backup-")]
    assert len(backups) == 1 and tree(backups[0]) == before
    assert sorted(os.listdir(root / "out")) == ["_report.json", "part-run2-00000.parquet"]


def test_a_failed_run_on_the_object_store_path_leaves_the_output_as_it_was(bucket):
    fs, root = bucket
    earlier_output(root / "out")
    before = tree(root / "out")
    target = OutputTarget("out", JOB, "run1", filesystem=fs)
    target.open()
    with fs.open_output_stream(f"{target.staging.data}/part-run1-00000.parquet") as f:
        f.write(b"half")
    assert target.stop() is None  # no part committed: nothing worth resuming
    target.close()
    assert tree(root / "out") == before and sorted(os.listdir(root)) == ["out"]
