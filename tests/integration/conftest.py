"""One real run of the whole job, shared by the integration tests.

It goes through the CLI as a user would (`python -m pipeline run`), so Ray,
the prepare actors, vLLM on the tiny model and the Parquet sink are all real.
Building the engine is the slow part (about 20 s), so it happens once per session.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.tools.dev.corpus import write_corpus
from tests.helpers import REPO
from tests.helpers.servers import Prometheus, free_port, servers_installed, start_prometheus, start_pushgateway
from tests.helpers.runs import JobRun, read_run, run_cli

ROWS = 200
MAX_NEW_TOKENS = 16
DATE = "2026-11-01"  # the shared run is the nightly job's partition for this day








@pytest.fixture(scope="session")
def sample_corpus(tmp_path_factory) -> Path:
    """The `make run` corpus: 1,000 rows, seed 0."""
    return write_corpus(tmp_path_factory.mktemp("sample") / "corpus.parquet", rows=1000, seed=0)


@dataclass
class Watchers:
    """A Prometheus server scraping the shared run's metrics port every second, and a
    Pushgateway it pushes to (`tests/integration/observe/test_watch.py`)."""

    prometheus: Prometheus
    pushgateway: str
    metrics_port: int


@pytest.fixture(scope="session")
def watchers(tmp_path_factory) -> Iterator[Watchers | None]:
    """None where Debian's prometheus packages are missing: the shared run goes on without
    them, and the tests that need them say so in their skip reason."""
    if not servers_installed():
        yield None
        return
    folder = tmp_path_factory.mktemp("watch")
    port = free_port()
    prometheus, proc = start_prometheus(folder, [f"127.0.0.1:{port}"])
    gateway, gateway_proc = start_pushgateway(folder)
    yield Watchers(prometheus, gateway, port)
    for p in (proc, gateway_proc):
        p.terminate()
        p.wait(10)


PROGRESS_INTERVAL_S = 2


@pytest.fixture(scope="session")
def job_run(tmp_path_factory, tiny_model, watchers) -> JobRun:
    tmp = tmp_path_factory.mktemp("job")
    # Ten files: ten read blocks that reach the prepare stage one after another, as a
    # large corpus's files and row groups do (a one-file corpus is one read block).
    whole = pq.read_table(write_corpus(tmp / "whole.parquet", rows=ROWS, seed=11))
    corpus_path = tmp / "in" / f"dt={DATE}"
    corpus_path.mkdir(parents=True)
    for k in range(10):
        pq.write_table(whole.slice(k * ROWS // 10, ROWS // 10), corpus_path / f"part-{k}.parquet")
    output = tmp / "out" / f"dt={DATE}"
    sets = (
        "--set", f"model.name={tiny_model}",
        "--set", f"sampling.max_new_tokens={MAX_NEW_TOKENS}",
        # Small blocks: many engine calls, blocks that straddle buckets, and enough of
        # them that each of the two engines holds its 4 and more wait.
        "--set", "batching.generate_batch_rows=16",
        # Two engines on the local profile: the pool's block assignment is asserted on this run.
        "--set", "hardware.num_engines=2",
        # Input that arrives while generation runs: after the first window (two files) the
        # rest is held until the first part is committed, so the first part is written
        # before the last row is read, with no fixed delay to outlast the engines' start
        # (25-70 s for two engines on 2 cores); a pipeline with a barrier would wait out the
        # hold's bound and fail the assertion. Windows of two files come out as three
        # blocks at once, so both engines get blocks of each window.
        "--set", "batching.prepare_batch_rows=20", "--set", "bucketing.window_rows=40",
        "--set", "debug.hold_input_until_output_s=900",
        "--set", "engine.max_model_len=8192",
        "--set", "batching.learned_limits=null",  # no state carried between test runs
    )
    # Watched as a nightly run would be: progress lines (stdout is a pipe here), and, where
    # Prometheus is installed, its metrics scraped and pushed.
    watch = ["--progress-interval-s", str(PROGRESS_INTERVAL_S)]
    if watchers is not None:
        watch += ["--metrics-port", str(watchers.metrics_port), "--metrics-host", "127.0.0.1",
                  "--metrics-linger-s", "3", "--pushgateway", watchers.pushgateway]
    result = run_cli(
        REPO / "jobs/nightly_summarize.yaml", REPO / "conf/local.yaml", "--date", DATE,
        # {date} in paths given on the command line is filled in too.
        "--input", str(tmp / "in" / "dt={date}"), "--output", str(tmp / "out" / "dt={date}"), *sets, *watch,
    )
    run = read_run(output, corpus_path, result)
    run.sets = sets
    return run


@pytest.fixture(scope="module")
def ray_tmp() -> Iterator[str]:
    """Each run's Ray instance under a temp dir of the test module's own (short: Ray's
    sockets live there), so a test can tell its processes from any other Ray on this machine."""
    path = tempfile.mkdtemp(prefix="rr-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)
