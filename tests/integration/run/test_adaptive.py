"""Adaptive batch sizing on the real engine (vLLM CPU backend, tiny model).

`conf/local-small-kv.yaml` gives the engine a 72-block KV cache, so on the
sample corpus memory pressure reaches the target and the engine preempts.
"""

import os
from collections import Counter
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO
from tests.helpers.runs import read_run, run_cli

SMALL_KV = REPO / "conf/local-small-kv.yaml"
JOB = REPO / "jobs/nightly_summarize.yaml"


def small_kv(tiny_model, corpus: Path, output: Path, *sets: str):
    args = ["--input", str(corpus), "--output", str(output), "--set", f"model.name={tiny_model}"]
    for s in sets:
        args += ["--set", s]
    return read_run(output, corpus, run_cli(JOB, SMALL_KV, *args))


@pytest.fixture(scope="module")
def limits_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("learned") / "limits.yaml"


@pytest.fixture(scope="module")
def adaptive_run(tiny_model, sample_corpus, limits_file, tmp_path_factory):
    # The controller's proof, with its windows measuring one bucket each: the corpus in one
    # block and one block at a time, so each bucket is one call, and those calls fed one
    # after another (`continuous`). Blocks served at once share the engine across a bucket
    # switch (tests/unit/generation/test_feeder.py), and a window spanning a switch
    # measures two buckets' rows; fed `mixed` (the default), every window measures the mix.
    return small_kv(tiny_model, sample_corpus, tmp_path_factory.mktemp("adaptive") / "out",
                    f"batching.learned_limits={limits_file}", "batching.generate_batch_rows=4096",
                    "batching.concurrent_batches=1", "batching.feed=continuous")


def assert_nothing_lost(run):
    ids = run.written.column("id").to_pylist()
    assert Counter(ids) == Counter(run.corpus.column("id").to_pylist())
    assert run.report["status"] == {"ok": run.corpus.num_rows}


def test_every_row_ends_ok(adaptive_run):
    assert_nothing_lost(adaptive_run)


def test_controller_grew_and_backed_off(adaptive_run):
    per_bucket = adaptive_run.report["batching"]["per_bucket"]
    grows = {b: sum(s["action"] == "grow" for s in v["trajectory"]) for b, v in per_bucket.items()}
    assert max(grows.values()) >= 2, grows
    backoffs = [x for v in per_bucket.values() for x in v["backoffs"]]
    assert len(backoffs) >= 1
    assert all(x["to"] < x["from"] and x["ceiling"] < x["from"] for x in backoffs)
    assert adaptive_run.report["batching"]["backoffs"] == len(backoffs)


def test_pressure_stays_near_the_target_after_warm_up(adaptive_run):
    target = adaptive_run.report["batching"]["memory_target"]
    # Below: a bucket that backs off twice holds at a ceiling 5% under its second failing
    # budget, and windows at one budget read ±0.04 apart (0.817-0.901 holding one ceiling,
    # le512, with the engine core in the actor's process).
    low, high = target - 0.16, target + 0.05
    warmed = 0
    for name, v in adaptive_run.report["batching"]["per_bucket"].items():
        steps = [s for s in v["trajectory"] if s["action"] != "start" and s["reason"] != "drain"]
        # Warm-up ends the first time a window reaches the band.
        first = next((i for i, s in enumerate(steps) if s["pressure"] >= low), None)
        if first is None or len(steps) - first < 4:
            continue  # a bucket too small to finish warming up (a handful of long rows)
        warmed += 1
        # The window right after a preemption back-off is left out: vLLM has just freed the
        # preempted rows' KV blocks to recompute them, so it reads low (0.39 once, le512).
        after = [s["pressure"] for k, s in enumerate(steps[first:], first)
                 if not (k > 0 and steps[k - 1]["action"] == "backoff")]
        assert all(low <= p <= high for p in after), (name, low, high, after)
    assert warmed >= 2  # le256 and le512 hold hundreds of rows each


def test_busy_fraction_and_plot_are_reported(adaptive_run):
    report = adaptive_run.report
    assert 0.5 < report["busy_fraction"] <= 1.0
    for v in report["batching"]["per_bucket"].values():
        assert 0.0 < v["busy_fraction"] <= 1.0 and 0.0 <= v["peak_pressure"] <= 1.0
    plot = Path(report["plot_path"])
    assert plot.parent == adaptive_run.output and plot.read_bytes()[:4] == b"\x89PNG"


def test_one_engine_in_its_actors_process_runs_on_cores_the_others_keep_off(adaptive_run):
    """One engine on the CPU backend runs in its actor's process (engine.in_process), which
    binds itself to all but one of the run's CPUs, as vLLM binds a worker of its own (the
    first that no other engine of the machine holds: the suite runs two modules at once);
    the driver then keeps the run's other processes on the rest (bench/README, *Engine
    steps*: each step took 1.13-1.16x raw vLLM's unbound)."""
    actor = adaptive_run.report["engine"]["actors"][0]
    assert actor["pids"] == [actor["pid"]]  # no engine core or worker process of its own
    cpus, mine = adaptive_run.report["engine"]["cpus"], sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        assert cpus is None  # one CPU: nothing to keep apart
    else:
        assert len(cpus["engine"]) == len(mine) - 1 and sorted(cpus["engine"] + cpus["others"]) == mine, cpus
        assert cpus["processes"] >= 3  # the driver and Ray's own, at least


def test_learned_limits_are_saved_with_their_key(adaptive_run, limits_file, tiny_model):
    saved = yaml.safe_load(limits_file.read_text())
    assert saved["key"]["model"] == str(tiny_model)
    # The local profile's dtype is auto: made concrete from the CPU's flags, before the key is made.
    chosen = adaptive_run.report["checks"]["dtype"]["dtype"]
    assert chosen in ("bfloat16", "float32") and adaptive_run.report["engine"]["settings"]["dtype"] == chosen
    assert saved["key"]["max_model_len"] == 8192 and saved["key"]["dtype"] == chosen
    assert saved["key"]["hardware"].startswith("cpu:")
    assert set(saved["limits"]) >= {"le256", "le512"}
    assert saved["limits"] == adaptive_run.report["batching"]["learned_limits"]["saved"]


def test_a_mixed_feed_loses_no_row_and_keeps_each_call_to_one_bucket(tiny_model, sample_corpus, tmp_path):
    """`batching.feed: mixed` (the default) on real vLLM, with the job's 8 blocks of 128
    rows open at once: rows of several buckets share the engine a row at a time (the order they go in:
    tests/unit/generation/test_feeder.py), yet every row ends ok and every engine call,
    and the result it gives back, is one bucket's. The heap is trimmed after every block here."""
    run = small_kv(tiny_model, sample_corpus, tmp_path / "out", "batching.feed=mixed", "engine.heap_trim_s=0.001")
    assert_nothing_lost(run)
    calls = run.report["engine_calls"]
    assert len({c["bucket"] for c in calls}) >= 3
    assert all(c["buckets"] == [c["bucket"]] and c["rows_written"] == c["rows"] for c in calls)
    assert sum(c["rows"] for c in calls) == run.corpus.num_rows
    # The engine actor gave its freed heap back after its blocks (pipeline.generation.memory.HeapTrim),
    # with vLLM in its process, and no row was lost for it. (What a trim returns: tests/unit/generation/test_memory.py.)
    assert run.report["engine"]["actors"][0]["heap_trims"]["count"] >= 1


def test_injected_oom_loses_no_row_and_the_next_run_starts_warm(
    adaptive_run, tiny_model, sample_corpus, limits_file, tmp_path
):
    run = small_kv(tiny_model, sample_corpus, tmp_path / "out",
                   f"batching.learned_limits={limits_file}", "debug.inject_oom_at_batch=3")
    assert_nothing_lost(run)
    batching = run.report["batching"]
    backoffs = [x for v in batching["per_bucket"].values() for x in v["backoffs"]]
    # One out-of-memory: every bucket with rows in flight then (fed `mixed`, often several)
    # halves its budget once, at that moment.
    oom = [x for x in backoffs if x["reason"] == "oom"]
    assert len(oom) >= 1 and max(x["t"] for x in oom) - min(x["t"] for x in oom) < 0.5
    assert all(x["to"] <= x["from"] // 2 + 1 for x in oom)
    assert run.report["engine"]["actors"][0]["oom_retries"] == 1
    # It started from what the first run learned, not from scratch.
    assert batching["learned_limits"]["started_from"] == adaptive_run.report["batching"]["learned_limits"]["saved"]
    starts = [v["trajectory"][0] for v in batching["per_bucket"].values()]
    assert any(s["action"] == "start" and s["reason"] == "learned" for s in starts)


def test_engine_death_rebuilds_the_engine_and_retries_the_rows(tiny_model, tmp_path):
    from pipeline.tools.dev.corpus import write_corpus

    corpus = write_corpus(tmp_path / "c.parquet", rows=200, seed=5)
    run = small_kv(tiny_model, corpus, tmp_path / "out",
                   "debug.inject_oom_at_batch=1", "debug.inject_oom_kind=engine_oom_death")
    assert_nothing_lost(run)
    actor = run.report["engine"]["actors"][0]
    # The drill fired (once, at its first step with rows in flight), before anything is said of
    # the recovery: a drill that never fired would pass for one that failed.
    assert [f["kind"] for f in actor["faults_fired"]] == ["engine_oom_death"], actor
    # Judged as memory, so rebuilt in place: no crash, no restart of the actor.
    assert run.report["incidents"] == [], run.report["incidents"]
    rebuilds = actor["rebuilds"]
    assert len(rebuilds) == 1 and "EngineDeadError" in rebuilds[0]["reason"], rebuilds
    before, after = rebuilds[0]["before"], rebuilds[0]["after"]
    assert after["max_num_seqs"] == before["max_num_seqs"] // 2
    assert after["gpu_memory_utilization"] < before["gpu_memory_utilization"]
    # The drill kills the core, so it runs apart (engine.in_process); vLLM binds its CPU
    # worker to cores of its own, and the driver moves the run's other processes off them.
    assert len(run.report["engine"]["actors"][0]["pids"]) > 1 and run.engines_left == []
    cpus = run.report["engine"]["cpus"]
    if len(os.sched_getaffinity(0)) < 2:
        assert cpus is None  # one CPU: nothing to keep apart
    else:
        assert cpus is not None and cpus["engine"] and cpus["others"], cpus
        assert not set(cpus["engine"]) & set(cpus["others"]) and cpus["processes"] >= 3  # the driver, Ray's, the actor
