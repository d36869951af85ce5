"""The whole job through Ray and real vLLM on the tiny model."""

from collections import Counter
from statistics import median

import pyarrow.parquet as pq
import pytest

from pipeline import schema
from pipeline.text.bucketing import LengthBucketer
from pipeline.text.quality import copies_opening
from tests.helpers.runs import ENGINE_GRACE_S
from tests.integration.conftest import MAX_NEW_TOKENS, ROWS


def test_every_input_id_comes_out_exactly_once(job_run):
    ids = job_run.written.column("id").to_pylist()
    assert Counter(ids) == Counter(job_run.corpus.column("id").to_pylist())
    assert len(ids) == ROWS


def test_columns_and_types_match_the_schema(job_run):
    expected = schema.output_schema(job_run.corpus.schema, "id", "text")
    for part in job_run.report["files"]:
        assert pq.read_schema(job_run.output / part).remove_metadata() == expected


def test_passthrough_columns_are_intact(job_run):
    source = {r["id"]: r for r in job_run.corpus.to_pylist()}
    for row in job_run.written.to_pylist():
        assert row["text"] == source[row["id"]]["text"]
        assert row["source"] == source[row["id"]]["source"]


def test_rows_are_generated(job_run):
    rows = job_run.written.to_pylist()
    assert {r["status"] for r in rows} == {"ok"}
    for r in rows:
        assert r["error"] is None and r["summary"] is not None
        assert 1 <= r["output_tokens"] <= MAX_NEW_TOKENS
        assert r["latency_s"] > 0
        assert r["run_id"] == job_run.report["run_id"]
        assert r["bucket"] == LengthBucketer().name(r["prompt_tokens"])


def test_every_row_has_a_result_key_that_follows_its_prompt(job_run):
    """Equal prompts (the template reads `source` and `text`), equal keys; any other, another."""
    keys = {}
    for r in job_run.written.to_pylist():
        assert r["result_key"].startswith("v1:")
        keys.setdefault((r["source"], r["text"]), set()).add(r["result_key"])
    assert all(len(k) == 1 for k in keys.values())
    assert len(set().union(*keys.values())) == len(keys)
    made = job_run.report["result_key"]
    assert made["version"] == 1 and made["off"] is None and len(made["model_digest"]) == 32


def test_no_engine_call_mixed_buckets(job_run):
    calls = job_run.report["engine_calls"]
    # A call is one bucket's rows within one 16-row block: blocks straddle buckets.
    assert len(calls) > len(job_run.report["buckets"])
    bounds = dict(zip(LengthBucketer().names, [0, *LengthBucketer().boundaries]))
    for c in calls:
        assert c["buckets"] == [c["bucket"]]
        assert 1 <= c["rows"] <= 16 and c["rows_written"] == c["rows"]
        low = bounds[c["bucket"]]
        assert low < c["min_prompt_tokens"] <= c["max_prompt_tokens"]
        assert c["bucket"].startswith("gt") or c["max_prompt_tokens"] <= int(c["bucket"][2:])
    assert sum(c["rows"] for c in calls) == ROWS


def test_two_engines_share_the_largest_bucket(job_run):
    """From the block assignment the report records, not from timing: on 2 cores whichever
    engine starts first would get a head start, so the pool's engines start together."""
    pool, actors = job_run.report["engine"]["pool"], job_run.report["engine"]["actors"]
    assert pool["engines"] == 2 and len(actors) == 2
    largest = max(job_run.report["buckets"], key=lambda b: job_run.report["buckets"][b]["rows"])
    assert pool["largest_bucket"] == largest and pool["engines_serving_largest_bucket"] == 2
    assert all(n > 0 for n in pool["rows_by_bucket"][largest].values())
    assert sum(a["rows"] for a in actors) == ROWS and abs(sum(pool["share_of_rows"].values()) - 1) < 1e-3
    for a in actors:
        assert a["rows"] > 0 and 0 < a["busy_fraction"] <= 1 and a["idle_s"] >= 0 and a["serving_s"] > 0
        assert a["output_tokens"] > 0 and a["package_path"].endswith("pipeline")


def test_no_engine_process_outlives_the_run(job_run):
    """Every process of both engines (each actor, and any vLLM engine core and workers of
    its own), by the pids the report records, is gone within 5 s of the CLI's exit."""
    actors = job_run.report["engine"]["actors"]
    assert len(actors) == 2
    for a in actors:
        assert a["pid"] in a["pids"]
    assert job_run.engines_left == [], f"engine processes alive {ENGINE_GRACE_S:.0f} s after the CLI exited"


def test_on_a_cpu_each_engine_core_runs_in_its_actors_own_process(job_run):
    """engine.in_process (auto on the CPU backend): no engine core or worker process of its
    own, so none is spawned and none imports vLLM again; nothing to keep apart either."""
    for actor in job_run.report["engine"]["actors"]:
        assert actor["pids"] == [actor["pid"]], actor["pids"]
    assert job_run.report["engine"]["cpus"] is None


def test_generation_starts_while_input_is_still_read(job_run):
    """No barrier: the first part is committed to staging before the last input row is
    tokenized (the shared run's input arrives slowly, see conftest)."""
    t = job_run.report["timeline"]
    assert t["first_row_prepared_at"] <= t["last_row_prepared_at"]
    assert t["first_part_written_at"] < t["last_row_prepared_at"], t
    assert job_run.report["checks"]["duplicate_ids"]["seconds"] >= 0


def test_report_agrees_with_the_output_files(job_run):
    report, rows = job_run.report, job_run.written.to_pylist()
    assert report["rows_in"] == report["rows_out"] == len(rows) == ROWS
    assert report["status"] == dict(Counter(r["status"] for r in rows))
    assert report["tokens"]["prompt"] == sum(r["prompt_tokens"] for r in rows)
    assert report["tokens"]["output"] == sum(r["output_tokens"] for r in rows)
    assert report["tokens"]["generated"] == report["tokens"]["output"]  # no map-reduce here: a request per row
    assert report["output_tokens_per_s"] == pytest.approx(report["tokens"]["output"] / report["wall_s"], rel=1e-3)
    by_bucket: dict[str, list[int]] = {}
    for r in rows:
        by_bucket.setdefault(r["bucket"], []).append(r["prompt_tokens"])
    assert set(report["buckets"]) == set(by_bucket)
    for name, values in by_bucket.items():
        b = report["buckets"][name]
        assert b["rows"] == len(values)
        assert b["prompt_tokens"] == {"min": min(values), "median": median(values), "max": max(values)}
        made = [r for r in rows if r["bucket"] == name and r["finish_reason"] is not None]
        assert b["generated"] == {
            "rows": len(made), "cut_at_limit": sum(r["finish_reason"] == "length" for r in made),
            "empty_output": sum(r["status"] == "empty_output" for r in made),
            "copies_opening": sum(copies_opening(r["summary"], r["text"]) for r in made),
            "median_output_tokens": median(r["output_tokens"] for r in made),
        }
    # The tiny model never ends a sequence: every row runs to the limit, and says so.
    assert {(r["finish_reason"], r["output_tokens"]) for r in rows if r["status"] == "ok"} == {("length", MAX_NEW_TOKENS)}
    on_disk = sorted(p.name for p in job_run.output.glob("part-*.parquet"))
    assert report["files"] == on_disk
    assert not list(job_run.output.glob(".*.tmp"))
    assert report["engine"]["settings"]["max_model_len"] == 8192
    assert report["engine"]["engines"][0]["kv_cache_tokens"] > 0
    assert 0 < report["busy_fraction"] <= 1 and 0 < report["fill"] <= 1
    for package in ("vllm", "ray", "torch", "pipeline"):
        assert report["versions"][package]


def test_cli_prints_a_summary(job_run):
    out = job_run.result.stdout
    assert "output tokens/s" in out and f"{ROWS} of {ROWS}" in out
    assert str(job_run.output) in out.replace("\n", "")


def test_fixed_batches_streaming_grouping(tiny_model, tmp_path):
    """The other paths through the generate stage, on real vLLM: a fixed batch
    size run as classic batches (drain), with blocks of 40 rows."""
    from tests.helpers import REPO
    from tests.helpers.runs import read_run, run_cli
    from pipeline.tools.dev.corpus import write_corpus

    corpus = write_corpus(tmp_path / "c.parquet", rows=120, seed=3)
    run = read_run(tmp_path / "out", corpus, run_cli(
        REPO / "jobs/nightly_summarize.yaml", REPO / "conf/local.yaml",
        "--input", str(corpus), "--output", str(tmp_path / "out"),
        "--set", f"model.name={tiny_model}", "--set", "sampling.max_new_tokens=8",
        "--set", "batching.policy={kind: fixed, rows_per_call: 8}",
        "--set", "batching.feed=drain", "--set", "bucketing.grouping=window",
        "--set", "batching.generate_batch_rows=40", "--set", "batching.learned_limits=null",
    ))
    assert Counter(run.written.column("id").to_pylist()) == Counter(run.corpus.column("id").to_pylist())
    assert run.report["status"] == {"ok": 120}
    assert run.report["batching"]["policy"] == "fixed" and run.report["batching"]["feed"] == "drain"
    for call in run.report["engine_calls"]:
        assert call["buckets"] == [call["bucket"]]
    # Streaming: each 40-row batch is split by bucket, so there are more calls than buckets.
    assert len(run.report["engine_calls"]) > len(run.report["buckets"])
    for b in run.report["batching"]["per_bucket"].values():
        assert all(s["rows"] == 8 for s in b["trajectory"])
