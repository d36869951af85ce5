"""The job on a real multi-node Ray cluster: two nodes on this machine, each a raylet
with its own object store, and the driver joining them by address as it would a
cluster of machines (`hardware.ray_address`).

One run through the CLI, shared by the tests: two engines, one per node
(`hardware.engines_per_node: 1`), on a corpus whose largest bucket spans several
blocks. It shows what a cluster adds to a local run: the engines are placed on
different nodes, both serve the largest bucket, no call mixes buckets, and the
workers run the package the runtime_env shipped (`py_modules`), not a copy they
found on the node. The last test kills the worker node in the middle of a run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import pyarrow.parquet as pq
import pytest

from pipeline.tools.dev.corpus import write_corpus
from tests.helpers import REPO
from tests.helpers.servers import servers_installed, start_pushgateway
from tests.helpers.runs import JobRun, committed_rows, read_run, run_cli

NODES = 2
NODE_CPUS = 3  # logical: one engine, the prepare actor and reads per node never starve
OBJECT_STORE_BYTES = 400 * 1024**2  # per node; the corpus is a few MB
ROWS = 240
BLOCK_ROWS = 32  # batching.generate_batch_rows: the largest bucket is several blocks
MAX_NEW_TOKENS = 16
PLACEMENT_TIMEOUT_S = 5  # hardware.placement_timeout_s for a pool that cannot be placed
HEALTH_CHECKS = {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 1000,
                 "health_check_failure_threshold": 3}
# With those checks, a run whose worker node dies never waits this long with no row
# committed and no new engine building, from the death to its exit (docs/reliability.md).
# A bound on the wait, not on the run's tail: the tail is the rows left and the new
# engine's build, and on a loaded 2-core CI machine it was 204 s (35-43 s here).
NODE_LOSS_STALL_BOUND_S = 90.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A Ray cluster of `NODES` nodes started by this test, and stopped by it whether the
    tests pass or not: exactly the processes it started (`Cluster.shutdown`, then the
    workers that ran under its raylets). Should pytest itself be killed, the nodes go
    with it (Ray ties each process it starts to its parent's life on Linux).

    Its temp dir is its own (RAY_TMPDIR): `Cluster` records its address in
    `<temp>/ray/ray_current_cluster`, where a plain `ray.init()` elsewhere on this
    machine would find it and join it instead of starting its own. The dir is short,
    since Ray's Unix sockets live under it (paths of at most 107 bytes)."""
    from ray.cluster_utils import Cluster

    ray_tmp = tempfile.mkdtemp(prefix="rc-", dir="/tmp")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_TMPDIR", ray_tmp)
        cluster = Cluster()
        try:
            for i in range(NODES):
                # The head (the first) declares a node dead after about 3 s without an answer
                # (1 s checks, 3 misses), where Ray's defaults take about 30 s.
                fast = {"_system_config": HEALTH_CHECKS} if i == 0 else {}
                cluster.add_node(num_cpus=NODE_CPUS, object_store_memory=OBJECT_STORE_BYTES,
                                 include_dashboard=False, **fast)
            cluster.wait_for_nodes()
            yield cluster
        finally:
            workers = raylet_descendants(cluster)
            cluster.shutdown()
            end_processes(workers)
            shutil.rmtree(ray_tmp, ignore_errors=True)


def raylet_descendants(cluster: Any) -> list[psutil.Process]:
    """Every process under this cluster's raylets: Ray's workers and what they started
    (vLLM's engine core). `Cluster.shutdown` stops the raylets, GCS and agents, not these."""
    from ray._private import ray_constants

    found: list[psutil.Process] = []
    for node in cluster.list_all_nodes():
        for info in node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, []):
            try:
                found += psutil.Process(info.process.pid).children(recursive=True)
            except psutil.Error:
                pass  # a raylet already gone: its workers are past finding
    return found


def engine_actors(cluster: Any) -> list[psutil.Process]:
    """The engine actors' processes on the cluster (Ray titles them after the stage)."""
    found = []
    for p in raylet_descendants(cluster):
        try:
            if "GenerateStage" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            pass
    return found


def end_processes(processes: list[psutil.Process], grace_s: float = 5.0) -> None:
    """Give workers whose raylet is gone `grace_s` to notice and exit, then terminate the
    rest, then kill what is left. psutil checks each process's start time, so a reused
    pid is never signalled."""
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    for stop in (psutil.Process.terminate, psutil.Process.kill):
        for p in alive:
            try:
                stop(p)
            except psutil.NoSuchProcess:
                pass  # exited in between
        _, alive = psutil.wait_procs(alive, timeout=10)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> Iterator[str | None]:
    """A Pushgateway the cluster run pushes to (None where Debian's package is missing)."""
    if not servers_installed():
        yield None
        return
    url, proc = start_pushgateway(tmp_path_factory.mktemp("cluster-gateway"))
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def cluster_run(cluster, tiny_model, tmp_path_factory, gateway) -> JobRun:
    tmp = tmp_path_factory.mktemp("cluster")
    corpus = write_corpus(tmp / "in" / "corpus.parquet", rows=ROWS, seed=5)
    sets = (
        "--set", f"hardware.ray_address={cluster.address}",
        "--set", "hardware.num_engines=2",
        "--set", "hardware.engines_per_node=1",
        "--set", f"model.name={tiny_model}",
        "--set", f"sampling.max_new_tokens={MAX_NEW_TOKENS}",
        "--set", f"batching.generate_batch_rows={BLOCK_ROWS}",
        # At most 4 of the corpus's 8 blocks per engine: at the default 8 the first engine
        # Ray Data hands work to may take them all.
        "--set", "batching.concurrent_batches=4",
        "--set", "batching.learned_limits=null",  # no state carried between test runs
    )
    # The child inherits RAY_TMPDIR while the cluster is up: the driver keeps to its temp dir too.
    result = run_cli(REPO / "jobs/nightly_summarize.yaml", REPO / "conf/local.yaml",
                     "--input", str(corpus), "--output", str(tmp / "out"), *sets,
                     *(("--pushgateway", gateway) if gateway else ()))
    run = read_run(tmp / "out", corpus, result)
    run.sets = sets
    return run


def test_every_input_id_comes_out_exactly_once(cluster_run):
    ids = cluster_run.written.column("id").to_pylist()
    assert Counter(ids) == Counter(cluster_run.corpus.column("id").to_pylist())
    assert len(ids) == ROWS
    assert cluster_run.report["status"] == {"ok": ROWS}


def test_engines_run_on_different_nodes(cluster, cluster_run):
    actors = cluster_run.report["engine"]["actors"]
    assert len(actors) == 2
    nodes = {a["node"] for a in actors}
    assert len(nodes) == 2, actors
    assert nodes <= {n.node_id for n in cluster.list_all_nodes()}


def test_every_engines_metrics_reach_the_driver_whichever_node_it_is_on(cluster_run, gateway):
    if gateway is None:
        pytest.skip("prometheus-pushgateway is not installed; `make test` installs it where apt-get can")
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{gateway}/metrics", timeout=5) as r:
        samples = [s for f in text_string_to_metric_families(r.read().decode()) for s in f.samples]
    busy = {s.labels["engine"] for s in samples if s.name == "pipeline_engine_busy_ratio"}
    vllm = {s.labels["engine"] for s in samples if s.name == "vllm:time_to_first_token_seconds_count"}
    assert len(busy) == 2 and vllm == busy  # both engines, one per node, through the driver's one push
    assert sum(s.value for s in samples if s.name == "pipeline_rows_done_total") == ROWS


def test_both_engines_serve_the_largest_bucket(cluster_run):
    pool = cluster_run.report["engine"]["pool"]
    rows = Counter(cluster_run.written.column("bucket").to_pylist())
    largest = pool["largest_bucket"]
    assert rows[largest] == max(rows.values())
    # The premise: the bucket is several blocks, so both engines could get some.
    assert rows[largest] > 2 * BLOCK_ROWS
    assert pool["engines_serving_largest_bucket"] == 2
    served = pool["rows_by_bucket"][largest]
    assert len(served) == 2 and all(n > 0 for n in served.values())
    assert sum(served.values()) == rows[largest]


def test_every_engine_call_is_bucket_pure(cluster_run):
    calls = cluster_run.report["engine_calls"]
    assert calls
    for c in calls:
        assert len(c["buckets"]) <= 1, c
        if c.get("kind") == "rows":
            assert c["buckets"] == [c["bucket"]], c
    assert {c["actor"] for c in calls} == {a["actor"] for a in cluster_run.report["engine"]["actors"]}


def test_workers_import_the_shipped_package(cluster_run):
    """With `hardware.ray_address`, the runtime_env's py_modules carries this package to
    every node: each engine imports the copy Ray unpacked in its session's
    runtime_resources. Not the checkout at the driver's working directory (the CLI runs
    in the repository root), which Ray puts first on every worker's sys.path unless the
    job has a working_dir, so a node holding any checkout at that path would run it."""
    checkout = str(REPO / "pipeline")
    for a in cluster_run.report["engine"]["actors"]:
        assert "runtime_resources" in a["package_path"], f"engine {a['actor']} imported {a['package_path']}"
        assert a["package_path"] != checkout
        assert Path(a["package_path"]).name == "pipeline"


def test_more_engines_than_nodes_fails_clearly(cluster, tiny_model, tmp_path):
    """One engine per node, three engines, two nodes: the run stops before any engine
    starts, says what could not be placed and what the cluster has, and writes nothing."""
    corpus = write_corpus(tmp_path / "c.parquet", rows=20, seed=1)
    result = run_cli(REPO / "jobs/nightly_summarize.yaml", REPO / "conf/local.yaml",
                     "--input", str(corpus), "--output", str(tmp_path / "out"),
                     "--set", f"hardware.ray_address={cluster.address}", "--set", "hardware.num_engines=3",
                     "--set", "hardware.engines_per_node=1", "--set", "hardware.placement_timeout_s=5",
                     "--set", f"model.name={tiny_model}", "--set", "batching.learned_limits=null")
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1 and last.startswith("error:"), result.stderr[-2000:]
    assert "3 engines" in last and "could not be placed in 5 s" in last and "2 nodes" in last
    assert "CPUs per node [3.0, 3.0]" in last
    assert not (tmp_path / "out").exists()


def test_two_jobs_share_the_cluster_each_with_its_own_engine_output_and_metrics(cluster, tiny_model, tmp_path,
                                                                                 gateway):
    """The nightly job and kb_ingest at once on the cluster, one engine each: both finish,
    every id once in each output, each run's engine its own (no actor, staging or lease in
    common), and each run's metrics under its own job and output. A third job, started
    once both runs' engines are up, asks for a pool the cluster can't hold beside them
    (a whole node per engine, on both nodes): it waits `hardware.placement_timeout_s`,
    then stops saying so, having written nothing, and the two others are unharmed."""
    nightly_in = write_corpus(tmp_path / "nightly" / "in.parquet", rows=160, seed=11)
    kb_in = write_corpus(tmp_path / "kb" / "in.parquet", rows=40, seed=12)
    on_cluster = ["--set", f"hardware.ray_address={cluster.address}", "--set", f"model.name={tiny_model}",
                  "--set", "sampling.max_new_tokens=16", "--set", "batching.learned_limits=null"]
    common = [*on_cluster, "--set", "hardware.num_engines=1", *(("--pushgateway", gateway) if gateway else ())]
    runs = {}
    for job, corpus in (("nightly_summarize", nightly_in), ("kb_ingest", kb_in)):
        out = corpus.parent / "out"
        log = open(corpus.parent / "run.log", "w")
        runs[job] = (subprocess.Popen([sys.executable, "-m", "pipeline", "run", str(REPO / f"jobs/{job}.yaml"),
                                       "--profile", str(REPO / "conf/local.yaml"), "--input", str(corpus),
                                       "--output", str(out), *common], cwd=REPO, stdout=log,
                                      stderr=subprocess.STDOUT, env=os.environ.copy()), out, corpus, log)
    try:
        # Once both runs' engine actors are up (their pools placed), the third asks for its pool.
        deadline = time.monotonic() + 300
        while len(engine_actors(cluster)) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        third_out = tmp_path / "third" / "out"
        asked = time.monotonic()
        third = run_cli(REPO / "jobs/nightly_summarize.yaml", REPO / "conf/local.yaml",
                        "--input", str(nightly_in), "--output", str(third_out), *on_cluster,
                        "--set", "hardware.num_engines=2", "--set", "hardware.engines_per_node=1",
                        "--set", f"hardware.engine_num_cpus={NODE_CPUS}",
                        "--set", f"hardware.placement_timeout_s={PLACEMENT_TIMEOUT_S}")
        third_took = time.monotonic() - asked
        nightly_running = runs["nightly_summarize"][0].poll() is None
        for proc, _, _, log in runs.values():
            proc.wait(timeout=480)
            log.close()
    finally:
        for proc, *_ in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    last = third.stderr.strip().splitlines()[-1]
    assert third.returncode == 1 and f"could not be placed in {PLACEMENT_TIMEOUT_S} s" in last, third.stderr[-2000:]
    assert nightly_running  # it was the nightly run's engine that left no room
    assert third_took < PLACEMENT_TIMEOUT_S + 60, third_took  # the bound, and the driver's start and exit
    assert not third_out.exists() and not list(third_out.parent.glob(".out*"))  # nothing written, no staging
    print(f"the third job's pool could not be placed: it stopped {third_took:.1f} s after it started: {last}")
    reports = {}
    for job, (proc, out, corpus, _) in runs.items():
        assert proc.returncode == 0, (corpus.parent / "run.log").read_text()[-3000:]
        reports[job] = report = json.loads((out / "_report.json").read_text())
        ids = set(pq.read_table(corpus).column("id").to_pylist())
        assert set(pq.read_table(out).column("id").to_pylist()) == ids
        assert report["job"] == job and len(report["engine"]["actors"]) == 1
        assert sorted(os.listdir(out.parent)) == ["in.parquet", "out", "run.log"]  # no staging, no lease left
    a, b = (r["engine"]["actors"][0] for r in reports.values())
    assert a["actor"] != b["actor"] and set(a["pids"]).isdisjoint(b["pids"])
    assert reports["nightly_summarize"]["run_id"] != reports["kb_ingest"]["run_id"]
    spans = [(datetime.fromisoformat(r["started_at"]).timestamp(), r["wall_s"]) for r in reports.values()]
    assert max(s for s, _ in spans) < min(s + w for s, w in spans), spans  # they did run at once
    if gateway is not None:
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"{gateway}/metrics", timeout=5) as r:
            samples = [s for f in text_string_to_metric_families(r.read().decode()) for s in f.samples]
        for job, (_, out, corpus, _) in runs.items():
            mine = [s for s in samples if s.labels.get("output") == str(out)]
            assert {s.labels.get("job") for s in mine} == {job}
            done = sum(s.value for s in mine if s.name == "pipeline_rows_done_total")
            assert done == reports[job]["rows_in"], (job, done)  # documents: kb_ingest writes a row per passage


def test_a_node_that_dies_mid_run_leaves_its_rows_to_the_engine_left(cluster, tiny_model, tmp_path):
    """Last in the module: it kills the worker node (its raylet and every process of that
    node, by pid) once a third of the rows are committed. The run goes on with the engine
    on the node left, which serves again the blocks the dead one held; every id comes out
    once, and the report's incidents name the node and the rows it held."""
    rows = 1200
    corpus = write_corpus(tmp_path / "in" / "corpus.parquet", rows=rows, seed=8)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "pipeline", "run", str(REPO / "jobs/nightly_summarize.yaml"),
           "--profile", str(REPO / "conf/local.yaml"), "--input", str(corpus), "--output", str(out),
           "--set", f"hardware.ray_address={cluster.address}", "--set", "hardware.num_engines=2",
           "--set", "hardware.engines_per_node=1", "--set", f"model.name={tiny_model}",
           "--set", "sampling.max_new_tokens=32", "--set", "batching.generate_batch_rows=16",
           "--set", "batching.prepare_batch_rows=40", "--set", "bucketing.window_rows=80",
           "--set", "batching.concurrent_batches=4", "--set", "batching.learned_limits=null"]
    head_id = cluster.head_node.node_id
    [worker] = [n for n in cluster.list_all_nodes() if n.node_id != head_id]
    with open(tmp_path / "run.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        deadline = time.monotonic() + 400
        while committed_rows(out) < rows // 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
        at_kill = committed_rows(out)
        victims = []
        for infos in worker.all_processes.values():
            for info in infos:
                try:
                    p = psutil.Process(info.process.pid)
                    victims += [p, *p.children(recursive=True)]
                except psutil.Error:
                    pass
        killed_at = time.time()  # wall clock: the report's times are too
        end_processes(victims, grace_s=0)
        commits = [(killed_at, at_kill)]  # (when, rows committed) at each new commit
        while proc.poll() is None and time.time() < killed_at + 600:
            done = committed_rows(out)
            if done > commits[-1][1]:
                commits.append((time.time(), done))
            time.sleep(0.2)
        ended_at = time.time()
        assert proc.poll() is not None, f"the run still ran 600 s after the kill; commits {commits}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = (tmp_path / "run.log").read_text()
    assert proc.returncode == 0, text[-3000:]
    written = pq.read_table(out)
    assert Counter(written.column("id").to_pylist()) == Counter(pq.read_table(corpus).column("id").to_pylist())
    report = json.loads((out / "_report.json").read_text())
    lost = [i for i in report["incidents"] if i["kind"] == "node_lost"]
    assert [i["node"] for i in lost] == [worker.node_id], report["incidents"]
    assert lost[0]["rows"] >= 0 and lost[0]["address"] in lost[0]["cause"]
    # The run went on: from the kill to its exit it never waited with nothing committed on
    # the dead node, nor on Ray's timeouts for it, but only on a new engine's build (which
    # is the model's load: minutes for a large one, and slow on a loaded CI machine).
    restarted = {i["incarnation"] for i in report["incidents"] if i["kind"] == "restart"}
    builds = [(a["born_at"], a["ready_at"]) for a in report["engine"]["actors"]
              if a["actor"] in restarted and a.get("ready_at")]
    times = [t for t, _ in commits] + [ended_at]
    gaps = [(b - a - sum(max(0.0, min(b, ready) - max(a, born)) for born, ready in builds), a - killed_at, b - a)
            for a, b in zip(times, times[1:])]
    stall, stall_from, stall_whole = max(gaps)
    assert stall < NODE_LOSS_STALL_BOUND_S, (
        f"{stall:.1f} s with no row committed and no engine building, {stall_from:.1f} s after the kill "
        f"({stall_whole:.1f} s in all); new engines built (born, ready) {builds}; "
        f"commits (when, rows) {commits}; the run ended {ended_at - killed_at:.1f} s after the kill")
    engines = [(a["node"][:8], a.get("rows")) for a in report["engine"]["actors"]]
    print(f"node lost at {at_kill} of {rows} rows committed; it held {lost[0]['rows']} rows in "
          f"{lost[0]['blocks']} blocks; the run ended {ended_at - killed_at:.1f} s after the kill; its longest "
          f"wait not on a new engine's build {stall:.1f} s, from {stall_from:.1f} s after it ({stall_whole:.1f} s "
          f"in all); engines (node, rows) {engines}; "
          f"incidents {[(i['kind'], i.get('rows')) for i in report['incidents']]}")
