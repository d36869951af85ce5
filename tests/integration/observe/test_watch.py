"""Watching a run live: the shared nightly run (two engines, `conftest.job_run`) was
scraped every second by a real Prometheus server and pushed to a real Pushgateway
(Debian's packages, on loopback), with its stdout a pipe, so progress came as plain
lines. The run under a terminal is in test_s3.py, which shares its engine start."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import REPO
from tests.integration.conftest import DATE, PROGRESS_INTERVAL_S, ROWS
from tests.helpers.runs import run_cli
from tests.helpers.dashboard import queried_metrics



def since_the_run(job_run) -> str:
    """A PromQL range from before the shared run started until now: it ran at the start of
    the session, which on a slow machine is well over half an hour before these ask."""
    return f"[{int(time.time() - run_started(job_run)) + 120}s]"


def run_started(job_run) -> float:
    return datetime.fromisoformat(job_run.report["started_at"]).timestamp()


def watched(watchers):
    if watchers is None:
        pytest.skip("Debian's prometheus and prometheus-pushgateway are not installed; `make test` installs "
                    "them where apt-get can (README, 'Watching a run')")
    return watchers


def value(result: list[dict]) -> float:
    assert len(result) == 1, result
    return float(result[0]["value"][1])


def test_prometheus_saw_every_engine_and_rows_done_reach_rows_in(job_run, watchers):
    prom = watched(watchers).prometheus
    window = since_the_run(job_run)
    assert value(prom.query(f"last_over_time(pipeline_input_rows{window})")) == ROWS
    assert value(prom.query(f"sum(last_over_time(pipeline_rows_done_total{window}))")) == ROWS
    assert value(prom.query(f"min_over_time(pipeline_rows_remaining{window})")) == 0
    assert value(prom.query(f"last_over_time(pipeline_output_tokens_total{window})")) == \
        job_run.report["tokens"]["output"]
    # Per engine, labelled by engine and node: ours, and vLLM's own histograms.
    busy = prom.query(f"last_over_time(pipeline_engine_busy_ratio{window})")
    engines = {r["metric"]["engine"] for r in busy}
    assert len(engines) == 2 and all(r["metric"]["node"] for r in busy)
    ttft = prom.query(f'sum by (engine) (last_over_time({{__name__="vllm:time_to_first_token_seconds_count"}}'
                      f"{window}))")
    assert {r["metric"]["engine"] for r in ttft} == engines and all(float(r["value"][1]) > 0 for r in ttft)
    # Seen while the run went, not only at its end: the rows grew over several scrapes.
    growth = prom.query(f"count_over_time(pipeline_rows_remaining{window})")
    assert value(growth) >= 10
    info = prom.query(f"last_over_time(pipeline_run_info{window})")
    assert info[0]["metric"]["run_id"] == job_run.report["run_id"]


def test_every_metric_the_dashboard_queries_is_one_the_run_exported(job_run, watchers):
    prom = watched(watchers).prometheus
    window = since_the_run(job_run)
    dashboard = json.loads((REPO / "dashboards/pipeline.json").read_text())
    missing = {}
    for panel, names in queried_metrics(dashboard).items():
        for name in names:
            if not prom.query(f'count(last_over_time({{__name__="{name}"}}{window}))'):
                missing.setdefault(panel, []).append(name)
    assert not missing, missing


def pushed(gateway: str, name: str) -> list[float]:
    with urllib.request.urlopen(f"{gateway}/metrics", timeout=5) as r:
        return [s.value for f in text_string_to_metric_families(r.read().decode()) for s in f.samples
                if s.name == name and s.labels.get("job") == "nightly_summarize"]


def test_the_pushgateway_has_the_success_and_keeps_it_through_a_failed_run(job_run, watchers, tmp_path):
    gateway = watched(watchers).pushgateway
    success = pushed(gateway, "pipeline_last_success_timestamp_seconds")
    ended = run_started(job_run) + job_run.report["wall_s"]
    assert len(success) == 1 and abs(success[0] - ended) < 60  # the run's own success, when it ended
    assert pushed(gateway, "pipeline_rows_done_total") and sum(pushed(gateway, "pipeline_rows_done_total")) == ROWS
    # The same job and output, failing (its input is gone): it pushes, but not a success.
    failed = run_cli(REPO / "jobs/nightly_summarize.yaml", REPO / "conf/local.yaml", "--date", DATE,
                     "--input", str(tmp_path / "nowhere"), "--output", str(job_run.output.parent / "dt={date}"),
                     *job_run.sets, "--pushgateway", gateway)
    assert failed.returncode == 2, failed.stderr[-2000:]
    assert pushed(gateway, "pipeline_last_success_timestamp_seconds") == success
    assert max(pushed(gateway, "pipeline_run_end_timestamp_seconds")) > success[0]


def test_off_a_terminal_progress_comes_as_lines_at_the_interval_and_ray_keeps_quiet(job_run):
    out, err = job_run.result.stdout, job_run.result.stderr
    lines = [line for line in out.splitlines() if line.startswith("progress ")]
    expected = job_run.report["wall_s"] / PROGRESS_INTERVAL_S
    assert 0.5 * expected <= len(lines) <= expected + 2, (len(lines), expected)
    assert lines[-1].startswith(f"progress {ROWS}/{ROWS} rows (100%) · ok {ROWS}") and lines[-1].endswith("done")
    assert any("ETA" in line and "engine " in line for line in lines)
    # Ray's own progress: a block of lines every 10 s off a terminal, now only with --verbose.
    assert "Running Dataset" not in err and "logging_progress" not in err
    assert "``concurrency`` is deprecated" not in err and "`ray_remote_args` is deprecated" not in err


def test_ray_and_vllm_chatter_goes_to_the_run_log_whose_path_comes_first(job_run):
    err = job_run.result.stderr
    first = err.splitlines()[0]
    assert first.startswith("log: ") and first.endswith("(Ray's and vLLM's output; --verbose prints it here)")
    log = Path(first.removeprefix("log: ").split(" (")[0])
    kept = log.read_text()
    assert "Started a local Ray instance" in kept and "Execution plan of Dataset" in kept
    for chatter in ("Started a local Ray instance", "Execution plan", "core_worker", "Progress bars disabled",
                    "PYTHON worker processes", "Triton", "NUMA", "LD_PRELOAD", "FutureWarning", "(raylet)"):
        assert chatter not in err and chatter not in job_run.result.stdout, chatter
    # The cause fixed, not hidden: token ids are rendered before they reach the engine.
    assert "Passing raw prompts" not in kept
