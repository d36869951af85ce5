"""`pipeline tune` on the tiny model with real vLLM, and `run` with the profile it writes."""

import csv
import json
import subprocess
import sys

import pytest
import yaml

from pipeline.tools.dev.corpus import write_corpus
from tests.helpers import REPO
from tests.helpers.runs import read_run, run_cli


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("tune")
    corpus = write_corpus(tmp / "corpus.parquet", rows=300, seed=31)
    out = tmp / "tune"
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", "tune", str(REPO / "jobs/nightly_summarize.yaml"),
         "--profile", str(REPO / "conf/local.yaml"), "--input", str(corpus), "--out", str(out),
         "--sample", "48", "--bucket", "le128", "--bucket", "le256", "--max-batch", "64",
         "--set", f"model.name={tiny_model}", "--set", "sampling.max_new_tokens=16",
         "--set", "engine.max_model_len=4096"],
        capture_output=True, text=True, cwd=REPO,
        timeout=180,  # the bound: tune on the tiny model finishes in under 3 minutes
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp, corpus, out, result


def test_tune_writes_every_artifact_and_a_table(tuned):
    _, _, out, result = tuned
    for name in ("sweep.csv", "sweep.json", "sweep.png", "profile.yaml"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "sweep.png").read_bytes().startswith(b"\x89PNG")
    assert "◀" in result.stdout and "run with it: pipeline run" in result.stdout
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert {r["bucket"] for r in rows} == {"le128", "le256"}
    assert sum(r["chosen"] == "True" for r in rows) == 2


def test_each_point_is_measured_twice_and_the_choice_keeps_95_percent(tuned):
    _, _, out, _ = tuned
    sweep = json.loads((out / "sweep.json").read_text())
    assert set(sweep["buckets"]) == {"le128", "le256"}
    for bucket, b in sweep["buckets"].items():
        points = b["points"]
        assert [p["batch"] for p in points] == [2 ** k for k in range(len(points))]
        assert len(points) >= 3, bucket
        for p in points:
            assert p["oom"] or p["repeats"] >= 2
            assert p["oom"] or (p["throughput"] > 0 and 0 < p["p50_ms"] <= p["p99_ms"])
            assert p["ttft_p50_ms"] is None or 0 < p["ttft_p50_ms"] <= p["p99_ms"]
        best = max(p["throughput"] for p in points if not p["oom"])
        chosen = next(p for p in points if p["batch"] == b["choice"]["batch"])
        assert chosen["throughput"] >= 0.95 * best, (bucket, b["choice"])
        assert b["choice"]["reason"]


def test_run_uses_the_profile_tune_wrote(tuned):
    tmp, corpus, out, _ = tuned
    profile = yaml.safe_load((out / "profile.yaml").read_text())
    assert profile["batching"]["policy"]["kind"] == "tuned"
    chosen = profile["batching"]["policy"]["rows"]
    sweep = json.loads((out / "sweep.json").read_text())
    assert chosen == {b: v["choice"]["batch"] for b, v in sweep["buckets"].items()}
    output = tmp / "run"
    result = run_cli(REPO / "jobs/nightly_summarize.yaml", out / "profile.yaml", "--input", str(corpus),
                     "--output", str(output), "--set", "batching.learned_limits=null")
    run = read_run(output, corpus, result)
    assert run.report["status"] == {"ok": 300}
    assert run.report["batching"]["policy"] == "tuned" and run.report["batching"]["tuned_rows"] == chosen
    assert "batch sizes from pipeline tune" in result.stdout
    for bucket, rows in chosen.items():
        steps = run.report["batching"]["per_bucket"][bucket]["trajectory"]
        assert steps and all(s["rows"] == rows for s in steps)
