"""Faults at cluster scale, through the CLI on real Ray and real vLLM (docs/reliability.md):
an output disk that fills while parts are written; an object store that stops answering
while the run reads its input."""

import base64
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from pipeline.cli import EXIT_FAILED
from pipeline.storage.commits import load_commits
from pipeline.tools.dev.corpus import make_corpus
from tests.helpers import REPO
from tests.helpers.parts import run as fake_run
from tests.helpers.runs import end_all, run_cli, run_processes, start, wait_for
from tests.helpers.servers import S3, start_moto

JOB = REPO / "jobs/nightly_summarize.yaml"
LOCAL = REPO / "conf/local.yaml"
ROWS, FILE_ROWS = 240, 20
BLOB_BYTES = 24_000  # a pass-through column that carries most of each row's bytes
FULL_DISK_BOUND_S = 30.0  # a run stops within this of its output's disk filling (docs/reliability.md)


def heavy_corpus(folder: Path) -> pa.Table:
    """Short documents with a large incompressible column: the output is megabytes while
    generation stays cheap. One file per FILE_ROWS rows, a part each."""
    corpus = make_corpus(ROWS, seed=5)
    rng = random.Random(5)
    blobs = [base64.b64encode(rng.randbytes(BLOB_BYTES * 3 // 4)).decode() for _ in range(ROWS)]
    corpus = corpus.append_column("blob", pa.array(blobs, pa.string()))
    folder.mkdir()
    for k in range(0, ROWS, FILE_ROWS):
        pq.write_table(corpus.slice(k, FILE_ROWS), folder / f"part-{k // FILE_ROWS:02d}.parquet")
    return corpus


@pytest.fixture
def small_disk(tmp_path):
    """A real 8 MiB filesystem (tmpfs), unmounted after the test; needs root, as CI has."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root (CI runs as root)")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], check=True)
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_full_disk_stops_the_run_naming_the_path_and_resume_finishes_after_space_is_freed(tmp_path, small_disk,
                                                                                             tiny_model):
    corpus = heavy_corpus(tmp_path / "heavy")
    filler = small_disk / "someone-elses.bin"  # leaves room for about half the output
    filler.write_bytes(os.urandom(5 * 2**20))
    out = small_disk / "out"
    sets = ["--set", f"model.name={tiny_model}", "--set", "batching.learned_limits=null",
            "--set", f"batching.prepare_batch_rows={FILE_ROWS}", "--set", "batching.generate_batch_rows=16",
            "--set", "bucketing.window_rows=40", "--set", "sampling.max_new_tokens=8"]

    started = time.time()
    first = run_cli(JOB, LOCAL, "--input", str(tmp_path / "heavy"), "--output", str(out), *sets)
    ended = time.time()
    assert first.returncode == EXIT_FAILED, first.stderr[-3000:]
    last = first.stderr.strip().splitlines()[-1]
    assert "no space" in last.lower() and str(small_disk) in last, first.stderr[-3000:]
    assert "--resume" in last
    assert not out.exists()  # nothing published
    [staging] = [p for p in small_disk.iterdir() if p.name.endswith(".staging")]
    committed = load_commits(pafs.LocalFileSystem(), str(staging))  # as --resume will read them
    assert 0 < committed.rows < ROWS
    for part in committed.files:  # every committed part is whole
        assert pq.read_table(staging / "output" / part).num_rows > 0
    # The disk filled while a part after the last committed one was written: the run
    # stopped within the bound of that (a watch on the free space misses the moment,
    # as the part cut off is removed at once).
    after_last = ended - max(m.stat().st_mtime for m in (staging / "commits").iterdir())
    assert after_last < FULL_DISK_BOUND_S, after_last
    assert filler.stat().st_size == 5 * 2**20  # not ours: untouched

    filler.unlink()  # the user frees space
    second = run_cli(JOB, LOCAL, "--input", str(tmp_path / "heavy"), "--output", str(out), "--resume",
                     *sets)
    assert second.returncode == 0, second.stderr[-3000:]
    written = pq.read_table(out)
    assert sorted(written.column("id").to_pylist()) == sorted(corpus.column("id").to_pylist())  # each once
    assert pc.all(pc.equal(written.sort_by("id").column("blob"), corpus.sort_by("id").column("blob"))).as_py()
    print(f"full disk: stopped {after_last:.1f} s after its last part committed ({ended - started:.1f} s after it "
          f"began), with {committed.rows} of {ROWS} rows committed: {last}")


STORE_TIMEOUT_S = 3.0  # store.request_timeout_s for the test: the bound is 3 tries of it
HOLD_S = 5  # debug.hold_before_publish_s: the store is stopped during it


def test_a_store_that_stops_answering_while_reading_or_publishing_stops_the_run_within_the_bound(tmp_path,
                                                                                                   tiny_model,
                                                                                                   ray_tmp):
    """moto in a process of its own, stopped (SIGSTOP) once the run has taken its output:
    the run's reads from it fail, and the run stops (exit 1) within the bound with a last
    line that says so. `--resume` is then stopped the same way while it publishes. The
    output an earlier run published there is untouched by both, and `--resume`, once the
    store answers again, publishes with every id once."""
    endpoint, moto = start_moto(tmp_path)
    started = []
    try:
        store = S3(endpoint, "faults")
        corpus = make_corpus(80, seed=9)
        for k in range(4):
            buf = io.BytesIO()
            pq.write_table(corpus.slice(k * 20, 20), buf)
            store.client.put_object(Bucket=store.bucket, Key=f"in/part-{k}.parquet", Body=buf.getvalue())
        with pytest.MonkeyPatch.context() as env:
            for k, v in store.env.items():
                env.setenv(k, v)
            fake_run(f"s3://{store.bucket}/out", "run0", parts=2)  # an earlier run's output
        before = {k: store.get(k) for k in store.keys("out/")}
        cmd = [sys.executable, "-m", "pipeline", "run", str(JOB), "--profile", str(LOCAL), "--input", f"s3://{store.bucket}/in/", "--output", f"s3://{store.bucket}/out",
               "--set", f"model.name={tiny_model}", "--set", "batching.learned_limits=null",
               "--set", "sampling.max_new_tokens=8", "--set", f"store.request_timeout_s={STORE_TIMEOUT_S}",
               "--set", f"store.connect_timeout_s={STORE_TIMEOUT_S}"]

        proc, driver = start(cmd, ray_tmp, tmp_path / "stalled.log", env=store.env)
        wait_for("the run's staging on the store",
                 lambda: [k for k in store.keys(".out.") if k.endswith("/_staging.json")], proc)
        started += run_processes(driver, ray_tmp)
        moto.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        proc.wait(timeout=300)
        took = time.monotonic() - stopped_at
        started += run_processes(driver, ray_tmp) if driver.is_running() else []
        moto.send_signal(signal.SIGCONT)
        log = (tmp_path / "stalled.log").read_text()
        assert proc.returncode == EXIT_FAILED, log[-3000:]
        last = log.strip().splitlines()[-1]
        assert "object store stopped answering" in last and "--resume" in last, log[-3000:]
        bound = 3 * STORE_TIMEOUT_S
        assert took <= bound + 45, f"stopped {took:.0f} s after the store did"  # the bound, and Ray's shutdown
        assert {k: store.get(k) for k in store.keys("out/")} == before

        # 2. --resume writes the rest, then holds before publishing; the store stops during
        # the hold. The publish fails within the bound, the earlier output stays as it was.
        publishing = tmp_path / "publishing.log"
        proc, driver = start([*cmd, "--resume", "--set", f"debug.hold_before_publish_s={HOLD_S}"], ray_tmp,
                             publishing, env=store.env)
        wait_for("the run holding before it publishes",
                 lambda: "debug.hold_before_publish_s" in publishing.read_text(), proc)
        # Stopped at once, its processes listed after: a list of every process on a loaded
        # machine can take longer than the hold, and the publish would be done before the stop.
        moto.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        started += run_processes(driver, ray_tmp)
        proc.wait(timeout=300)
        took_publishing = time.monotonic() - stopped_at
        moto.send_signal(signal.SIGCONT)
        log = publishing.read_text()
        assert proc.returncode == EXIT_FAILED, log[-3000:]
        last_publishing = log.strip().splitlines()[-1]
        assert "publishing failed" in last_publishing and "--resume" in last_publishing, log[-3000:]
        assert took_publishing <= HOLD_S + bound + 45, f"stopped {took_publishing:.0f} s after the store did"
        assert {k: store.get(k) for k in store.keys("out/")} == before

        # 3. --resume once the store answers: it publishes what the staging holds.
        resumed = subprocess.run([*cmd, "--resume"], cwd=REPO, capture_output=True, text=True, timeout=600,
                                 env={**os.environ, **store.env, "RAY_TMPDIR": ray_tmp})
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        ids = []
        for key in store.keys("out/"):
            if key.endswith(".parquet"):
                ids += pq.read_table(io.BytesIO(store.get(key))).column("id").to_pylist()
        assert sorted(ids) == sorted(corpus.column("id").to_pylist())
        report = json.loads(store.get("out/_report.json"))
        assert report["publish"]["replaces_run"] == "run0"
        print(f"stalled store: the run stopped {took:.1f} s after the store (bound {bound:g} s + shutdown): {last}; "
              f"while publishing, {took_publishing:.1f} s (a {HOLD_S} s hold first): {last_publishing}")
    finally:
        end_all([p for p in started if p.is_running()])
        moto.send_signal(signal.SIGCONT)
        moto.kill()
        moto.wait()
