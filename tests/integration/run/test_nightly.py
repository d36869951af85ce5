"""Incremental nightly runs through the CLI, real Ray and real vLLM on the tiny model: one
corpus over three nights, night 1 being the session's shared run (tests/integration/conftest.py).

- night 2: 5% of the documents edited, 2% new, 1% removed, and one row that was an error
  on night 1; exactly those are generated, every other row is night 1's. It is killed
  once its first rows are committed and resumed: no committed row is generated or looked
  up again;
- the same corpus once more: every row reused, no engine started, the output whole;
- night 3: another prompt template: every row generated.
"""

import json
import os
import shutil
import sys
import time
from collections import Counter

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from tests.helpers import REPO
from tests.helpers.runs import committed_rows, end_all, read_run, run_cli, run_processes, start, wait_for

JOB = REPO / "jobs/nightly_summarize.yaml"
PROFILE = REPO / "conf/local.yaml"
RESULTS = ("summary", "finish_reason", "output_tokens", "prompt_tokens", "truncated", "bucket", "result_key",
           "input_key")


def keyed_sets(job_run):
    """Night 1's settings that go into a row's key (the model, max_new_tokens, the context):
    the rest of the shared run's (two engines, held input) change no result."""
    sets = list(job_run.sets)
    out = []
    for flag, value in zip(sets[::2], sets[1::2]):
        if value.split("=")[0] in ("model.name", "sampling.max_new_tokens", "engine.max_model_len",
                                   "batching.learned_limits"):
            out += [flag, value]
    return out


@pytest.fixture(scope="module")
def nights(job_run, tmp_path_factory, ray_tmp):
    """Night 2's corpus and output, after night 1 (the shared run) with one row made an
    error in a copy of its output (what a failed row looks like there)."""
    tmp = tmp_path_factory.mktemp("nights")
    night1 = job_run.written
    # An error row on night 1, in a copy of its output: one whose key no other row shares.
    keys = Counter(night1.column("result_key").to_pylist())
    corpus = job_run.corpus.to_pylist()
    key_of = {r["id"]: r["result_key"] for r in night1.to_pylist()}
    failed = next(r["id"] for r in corpus[30:] if keys[key_of[r["id"]]] == 1)  # neither removed nor edited
    flipped = tmp / "night1"
    shutil.copytree(job_run.output, flipped)
    for part in json.loads((flipped / "_report.json").read_text())["files"]:
        t = pq.read_table(flipped / part)
        hit = pc.equal(t.column("id"), failed)
        t = t.set_column(t.schema.get_field_index("status"), "status",
                         pc.if_else(hit, pa.scalar("error"), t.column("status")))
        t = t.set_column(t.schema.get_field_index("summary"), "summary",
                         pc.if_else(hit, pa.scalar(None, pa.string()), t.column("summary")))
        pq.write_table(t, flipped / part)
    removed = {r["id"] for r in corpus[:2]}  # 1%
    edited = {r["id"] for r in corpus[2:12]}  # 5%
    rows = [r | {"text": r["text"] + " Edited tonight."} if r["id"] in edited else r
            for r in corpus if r["id"] not in removed]
    new = [r | {"id": f"new-{k}", "text": r["text"] + " A new document."} for k, r in enumerate(corpus[20:24])]  # 2%
    path = tmp / "night2.parquet"
    pq.write_table(pa.Table.from_pylist(rows + new, schema=job_run.corpus.schema), path)
    out = tmp / "out" / "dt={date}"
    sets = keyed_sets(job_run)
    night2 = ["--date", "2026-11-02", "--input", str(path), "--output", str(out), "--reuse", str(flipped), *sets,
              # Batch sizes change no key. Blocks of 16 rows: a held window (below) must fill one.
              "--set", "batching.prepare_batch_rows=20", "--set", "bucketing.window_rows=40",
              "--set", "batching.generate_batch_rows=16"]
    # Night 2 is killed (driver first, then every process of its Ray, by pid) once its first
    # rows are committed, then resumed: resume and reuse compose. The rows after the first
    # window are held until that commit, then read 1 s a batch: the kill comes while they are.
    partition = tmp / "out" / "dt=2026-11-02"
    proc, driver = start([sys.executable, "-m", "pipeline", "run", str(JOB), "--profile", str(PROFILE), *night2,
                          "--set", "debug.hold_input_until_output_s=900", "--set", "debug.slow_prepare_s=1.0"],
                         ray_tmp, tmp / "night2-killed.log")
    try:
        wait_for("night 2's first rows committed", lambda: committed_rows(partition) > 0, proc)
    finally:
        everything = run_processes(driver, ray_tmp)
        if proc.poll() is None:
            driver.kill()
        proc.wait(30)
        end_all([p for p in everything if p.is_running()])
    at_kill = committed_rows(partition)
    resumed_at = time.time()
    run = read_run(partition, path, run_cli(JOB, PROFILE, *night2, "--resume"))
    return {"run": run, "night1": night1, "failed": failed, "edited": edited, "new": {r["id"] for r in new},
            "removed": removed, "corpus": path, "out": out, "sets": sets, "tmp": tmp, "at_kill": at_kill,
            "resumed_at": resumed_at}


def test_night_2_generates_exactly_the_edited_new_and_failed_rows(nights):
    run = nights["run"]
    out = {r["id"]: r for r in run.written.to_pylist()}
    assert Counter(run.written.column("id").to_pylist()) == Counter(run.corpus.column("id").to_pylist())
    generated = {i for i, r in out.items() if r["reused_from"] is None}
    assert generated == nights["edited"] | nights["new"] | {nights["failed"]}
    assert {r["status"] for r in out.values()} == {"ok"}
    reuse = run.report["reuse"]
    assert reuse["rows_reused"] == len(out) - len(generated) and reuse["rows_generated"] == len(generated)
    assert reuse["sources"][0]["rows_reused"] == reuse["rows_reused"] and reuse["lookup"]["keys"] > 0
    assert reuse["output_tokens_not_generated"] > 0 and reuse["engine_s_saved"] > 0
    assert f"reused: {reuse['rows_reused']:,} rows" in run.result.stdout  # and the run's summary says so
    # The engine on demand: its actor imported vLLM, then was told of work, then built it.
    actor = run.report["engine"]["actors"][-1]
    assert actor["born_at"] <= actor["imported_at"] <= actor["work_found_at"] <= actor["ready_at"]
    if len(os.sched_getaffinity(0)) > 1:  # bound before the import, and the run's others kept off its CPUs
        cpus = run.report["engine"]["cpus"]
        assert cpus is not None and cpus["engine"] and not set(cpus["engine"]) & set(cpus["others"]), cpus


def test_night_2_killed_and_resumed_neither_generates_nor_looks_up_a_committed_row_again(nights):
    run = nights["run"]
    resume, reuse = run.report["resume"], run.report["reuse"]
    assert 0 < resume["rows_committed_before"] == nights["at_kill"] < run.written.num_rows
    assert resume["rows_generated"] == run.written.num_rows - resume["rows_committed_before"]
    assert reuse["lookup"]["rows_looked_up"] == resume["rows_generated"]  # none of the committed rows
    # The resumed run's engine generated exactly the rows it wrote that no earlier night
    # had: none that the killed run committed (rows with one prompt between them are one request).
    mine = [r for r in run.written.to_pylist() if r["run_id"] == run.report["run_id"] and r["reused_from"] is None]
    actors = [a for a in run.report["engine"]["actors"] if a["ready_at"] >= nights["resumed_at"]]
    assert sum(a["requests"] + sum(a["merged"].values()) for a in actors) == len(mine)
    # Every unchanged row it reused was found by its input key, before it was tokenized.
    reused = [r for r in run.written.to_pylist() if r["run_id"] == run.report["run_id"] and r["reused_from"]]
    assert reuse["lookup"]["rows_found_before_tokenizing"] == len(reused) > 0


def test_night_2_keeps_night_1s_results_for_every_other_row(nights):
    night1 = {r["id"]: r for r in nights["night1"].to_pylist()}
    run = nights["run"]
    for r in run.written.to_pylist():
        if r["reused_from"] is None:
            continue
        before = night1[r["id"]]
        assert {c: r[c] for c in RESULTS} == {c: before[c] for c in RESULTS}, r["id"]
        # Written by night 2: by the killed run (committed before the kill) or by its resume.
        assert r["reused_from"].startswith(before["run_id"]) and r["run_id"] in run.report["resume"]["lineage"]


def test_a_night_whose_every_row_is_reused_starts_no_engine(nights, ray_tmp):
    """The same corpus again, reusing the latest earlier partition by the job's own default
    (night 2's); the engine core would be a process of its own (`engine.in_process=false`),
    and none appears."""
    tmp = nights["tmp"]
    cmd = [sys.executable, "-m", "pipeline", "run", str(JOB), "--profile", str(PROFILE), "--date", "2026-11-03",
           "--input", str(nights["corpus"]), "--output", str(nights["out"]), *nights["sets"],
           "--set", "engine.in_process=false"]
    proc, driver = start(cmd, ray_tmp, tmp / "night3.log")
    names = set()

    def seen() -> bool:
        for p in run_processes(driver, ray_tmp):
            try:
                names.add(p.name())
            except Exception:  # ended while listed
                pass
        return proc.poll() is not None

    wait_for("the run's end", seen, proc)
    assert proc.returncode == 0, (tmp / "night3.log").read_text()[-3000:]
    assert not any("EngineCore" in n for n in names), names
    output = tmp / "out" / "dt=2026-11-03"
    report = json.loads((output / "_report.json").read_text())
    rows = nights["run"].written.num_rows
    assert report["reuse"]["rows_reused"] == rows and report["reuse"]["rows_generated"] == 0
    assert report["reuse"]["lookup"]["rows_found_before_tokenizing"] == rows  # none tokenized
    assert report["reuse"]["sources"][0]["date"] == "2026-11-02"
    assert report["engine"]["actors"] == [] and report["engine_s"] == 0
    assert report["engine"]["cpus"] is None  # no engine: the run's processes kept every CPU
    written = pq.read_table(output)
    assert written.num_rows == rows and set(written.column("status").to_pylist()) == {"ok"}
    # Reuse on: a part per tokenizing batch (1,024 rows by default), not one per engine block.
    assert rows < 1024 and [pq.read_metadata(output / f).num_rows for f in report["files"]] == [rows]


def test_night_3_with_another_template_generates_every_row(nights, tiny_model):
    run = read_run(nights["tmp"] / "out" / "dt=2026-11-04", nights["corpus"], run_cli(
        JOB, PROFILE, "--date", "2026-11-04", "--input", str(nights["corpus"]), "--output", str(nights["out"]),
        *nights["sets"], "--set", "prompt.template=Summarize this {source} in one sentence.\n\n{text}"))
    assert run.report["reuse"]["rows_reused"] == 0 and run.report["reuse"]["rows_generated"] == run.written.num_rows
    assert run.written.column("reused_from").null_count == run.written.num_rows
    assert run.report["reuse"]["lookup"]["rows_found_before_tokenizing"] == 0  # another template, other input keys
    assert sum(a["requests"] for a in run.report["engine"]["actors"]) > 0


def test_a_reuse_path_holding_another_tools_parquet_is_refused_before_ray(tmp_path):
    from pipeline.tools.dev.corpus import write_corpus

    corpus = write_corpus(tmp_path / "corpus.parquet", rows=5)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    pq.write_table(pa.table({"id": ["a"], "summary": ["?"]}), theirs / "data.parquet")
    started = time.monotonic()
    result = run_cli(JOB, PROFILE, "--input", str(corpus), "--output", str(tmp_path / "o"), "--reuse", str(theirs))
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"{theirs} holds Parquet files (data.parquet) but no _report.json" in result.stderr
    assert time.monotonic() - started < 30 and not (tmp_path / "o").exists()
