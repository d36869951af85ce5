"""Outputs on an object store, against a real S3 server (moto's, on loopback): the lease
by conditional writes, the publishing contract, a publish cut short, a stopped run."""

import json
import threading
import time

import pytest

from pipeline.storage.commits import commit_part
from pipeline.storage.lease import Lease, LeaseLost, OutputBusy, OutputLease, Owner
from pipeline.storage.output import PUBLISHING_MARKER, OutputError, OutputTarget, PublishError
from pipeline.observe.report import REPORT_NAME
from tests.helpers.parts import JOB, run, stage


def earlier_output(s3, prefix: str = "out", run_id: str = "run0", parts: int = 3) -> list[str]:
    names = [f"part-{run_id}-{i:05d}.parquet" for i in range(parts)]
    for n in names:
        s3.client.put_object(Bucket=s3.bucket, Key=f"{prefix}/{n}", Body=b"PAR1 old")
    report = {"run_id": run_id, "job": JOB, "files": names, "plot_path": None}
    s3.client.put_object(Bucket=s3.bucket, Key=f"{prefix}/{REPORT_NAME}", Body=json.dumps(report).encode())
    return sorted([*names, REPORT_NAME])


def listed(s3, prefix: str = "out") -> list[str]:
    return [k[len(prefix) + 1:] for k in s3.keys(prefix + "/")]


# --- the lease: conditional writes ----------------------------------------------------


def lease_for(s3, run_id: str, lease_s: float = 120.0) -> OutputLease:
    return OutputLease(s3.fs, f"{s3.bucket}/out", Owner.this_process(run_id, JOB), lease_s)


def test_of_many_runs_racing_for_an_s3_output_exactly_one_gets_the_lease(s3):
    leases = [lease_for(s3, f"r{i}") for i in range(8)]
    start, results = threading.Barrier(len(leases)), {}

    def take(lease):
        start.wait()
        try:
            lease.acquire()
            results[lease.owner.run_id] = "got"
        except OutputBusy as e:
            results[lease.owner.run_id] = str(e)

    threads = [threading.Thread(target=take, args=(lease,)) for lease in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [r for r, v in results.items() if v == "got"]
    assert len(winners) == 1, results
    assert all("is writing this output" in v for r, v in results.items() if r not in winners)
    assert json.loads(s3.get(".out.lock"))["run_id"] == winners[0]
    for lease in leases:
        lease.release()
    assert ".out.lock" not in s3.keys()  # the winner removed its own lock; the others touched nothing


def test_an_expired_s3_lease_is_taken_over_and_its_old_holder_learns_it_lost(s3):
    old = lease_for(s3, "old", lease_s=0.3)
    old.acquire()
    old._stop.set()  # it hangs: no more renewals, and its lease runs out
    time.sleep(0.5)
    new = lease_for(s3, "new")
    assert "let it expire" in new.acquire()
    with pytest.raises(LeaseLost, match="run new"):
        old.renew()  # its If-Match names the lock it wrote, which is gone
    old.release()  # deletes nothing: the lock is no longer the one it wrote
    assert json.loads(s3.get(".out.lock"))["run_id"] == "new"
    new.release()


def test_a_live_s3_lease_refuses_a_second_run(s3):
    live = Lease(Owner("other", JOB, "some-other-host", 1, 1.0), time.time() + 60)
    s3.client.put_object(Bucket=s3.bucket, Key=".out.lock", Body=live.to_bytes())
    with pytest.raises(OutputBusy, match="run other .pid 1 on host some-other-host"):
        lease_for(s3, "me").acquire()


# --- publishing ------------------------------------------------------------------------


def test_a_reader_listing_the_output_sees_one_runs_whole_set_whenever_a_report_is_there(s3):
    old = earlier_output(s3, parts=40)
    seen, stop = [], threading.Event()

    def reader():  # report, listing, report again: a consistent read if both reports agree
        while not stop.is_set():
            before = _report_run(s3)
            names = [n for n in listed(s3) if n != REPORT_NAME]
            seen.append((before, names, _report_run(s3)))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        target, names = run(f"s3://{s3.bucket}/out", "run1", parts=60)
    finally:
        stop.set()
        thread.join()
    assert listed(s3) == sorted(names)
    parts = {"run0": sorted(n for n in old if n != REPORT_NAME), "run1": sorted(n for n in names if n != REPORT_NAME)}
    consistent = [(b, n) for b, n, a in seen if b is not None and b == a]
    assert consistent and all(n == parts[b] for b, n in consistent)
    assert any(b is None for b, _, _ in seen)  # the reader did look during the window
    # The report measures the window and counts its requests.
    report = json.loads(s3.get(f"out/{REPORT_NAME}"))
    published = report["publish"]
    assert report["mode"] == "copy" and published["copied"] == 60 and published["deleted"] == 40
    assert published["requests"] == 1 + 60 + 1 + 1  # old report, copies, one batch delete, new report
    assert 0 < published["window_s"] == target.published["window_s"]
    assert s3.keys() == sorted(f"out/{n}" for n in names)  # no staging, no lock


def _report_run(s3) -> str | None:
    try:
        return json.loads(s3.get(f"out/{REPORT_NAME}"))["run_id"]
    except s3.client.exceptions.NoSuchKey:
        return None


def test_a_publish_cut_short_is_finished_by_the_next_run(s3, monkeypatch):
    earlier_output(s3, parts=3)
    from pipeline.storage import objectstore

    real = objectstore.S3Store.copy_many

    def dies_halfway(self, pairs):
        pairs = list(pairs)
        real(self, pairs[: len(pairs) // 2])
        raise OSError("connection reset")  # as if the process died here

    monkeypatch.setattr(objectstore.S3Store, "copy_many", dies_halfway)
    target = OutputTarget(f"s3://{s3.bucket}/out", JOB, "run1")
    target.open()
    try:
        names = stage(target, "run1", parts=4)
        with pytest.raises(PublishError, match="publishing failed"):
            target.publish()
    finally:
        target.close()
    assert REPORT_NAME not in listed(s3)  # the window is open: no report says it
    assert any(k.endswith(PUBLISHING_MARKER) for k in s3.keys(".out.run1"))
    monkeypatch.setattr(objectstore.S3Store, "copy_many", real)
    # The next run of the output finishes run1's publish before anything else.
    nxt = OutputTarget(f"s3://{s3.bucket}/out", JOB, "run2")
    nxt.open()
    try:
        assert any("run run1 died while publishing" in w for w in nxt.warnings)
        assert listed(s3) == sorted(names)
        assert json.loads(s3.get(f"out/{REPORT_NAME}"))["run_id"] == "run1"
        nxt.stop()
    finally:
        nxt.close()
    assert s3.keys() == sorted(f"out/{n}" for n in names)


def test_a_failed_s3_run_leaves_the_output_and_keeps_its_staging_beside_it_for_resume(s3):
    old = earlier_output(s3)
    target = OutputTarget(f"s3://{s3.bucket}/out", JOB, "run1")
    target.open(rows_in=4)
    import pyarrow as pa

    keys = pa.table({"id": ["a", "b"]})
    with target.fs.open_output_stream(f"{target.staging.data}/part-run1-00000.parquet") as f:
        f.write(b"PAR1")
    commit_part(target.fs, target.staging.root, "part-run1-00000.parquet", keys,
                {"file": "part-run1-00000.parquet", "rows": 2, "prompt_tokens_by_bucket": {}})
    assert "run run1 stopped at 50% (2 rows committed)" in target.stop()
    target.close()
    assert listed(s3) == old  # the output as it was
    assert all(k.startswith(("out/", ".out.run1.staging/")) for k in s3.keys())  # readers of out/ skip it
    with pytest.raises(OutputError, match="run run1 stopped at 50%.*--resume"):
        OutputTarget(f"s3://{s3.bucket}/out", JOB, "run2").open()
    resumed = OutputTarget(f"s3://{s3.bucket}/out", JOB, "run2", stopped="resume")
    resumed.open(rows_in=4)
    try:
        assert resumed.committed.rows == 2 and resumed.lineage == ("run1",)
        assert resumed.staging.root.endswith(".out.run1.staging")
        names = stage(resumed, "run2")
        resumed.publish()
    finally:
        resumed.close()
    assert listed(s3) == sorted(["part-run1-00000.parquet", *names])


def test_a_second_s3_run_replaces_only_what_the_first_wrote(s3):
    _, first = run(f"s3://{s3.bucket}/out", "run1", parts=2)
    s3.client.put_object(Bucket=s3.bucket, Key="out-notes.txt", Body=b"a neighbour")
    _, second = run(f"s3://{s3.bucket}/out", "run2", parts=3)
    assert listed(s3) == sorted(second)
    assert s3.get("out-notes.txt") == b"a neighbour"
    s3.client.put_object(Bucket=s3.bucket, Key="out/part-00000-spark.parquet", Body=b"spark")
    with pytest.raises(OutputError, match="part-00000-spark"):
        run(f"s3://{s3.bucket}/out", "run3")
    assert listed(s3) == sorted([*second, "part-00000-spark.parquet"])
