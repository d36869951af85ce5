"""The end of a run (`pipeline.run.job.finish`, then publishing) with the real sink and output
target and no engine: a failing side step (saving learned limits, drawing the plot)
is a warning in the report, and the rows that were written are still published."""

import json
import os
import time
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline import schema
from pipeline.run import job as runner
from pipeline.text.bucketing import LengthBucketer
from pipeline.config import load_run_config
from pipeline.observe.report import RunContext
from pipeline.storage.output import OutputTarget
from pipeline.storage.sink import ParquetPartsSink
from tests.helpers import REPO
from tests.helpers.parts import Ctx, block

ACTOR = {"actor": "a1", "busy_s": 0.2, "active_s": 0.25, "windows": 2, "learned": {"le128": 64}}
CALL = {"call": "c0", "kind": "rows", "bucket": "le128", "rows": 3, "wall_s": 0.25, "busy_s": 0.2,
        "trajectory": [{"t": 0.0, "rows": 3, "pressure": 0.1, "action": "grow"}], "actor": ACTOR}


@pytest.mark.parametrize("failing", [None, "learned_limits", "plot"])
def test_a_failing_side_step_is_a_warning_and_the_output_is_published(tmp_path, monkeypatch, failing):
    limits_file = tmp_path / "limits.yaml"
    config = load_run_config(REPO / "jobs/nightly_summarize.yaml", REPO / "conf/local.yaml",
                             [f"batching.learned_limits={limits_file}"], str(tmp_path / "in.parquet"),
                             str(tmp_path / "out"))
    if failing == "learned_limits":
        def no_room(*args):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(runner.limits_store, "save_limits", no_room)
    if failing == "plot":
        def broken(report):
            raise RuntimeError("matplotlib backend unavailable")
        monkeypatch.setattr(runner, "plot_trajectories", broken)

    out_schema = schema.output_schema(pa.schema([("id", pa.string()), ("text", pa.string())]), "id", "text")
    target = OutputTarget(config.job.output.path, config.job.name, "run1")
    target.open()
    sink = ParquetPartsSink(target.staging, "run1", out_schema, ["id"])
    written = sink.write([block(["a", "b", "c"], "le128", "c0", CALL)], Ctx(0))

    class WR:
        write_returns = [written]

    sink.on_write_complete(WR())
    ctx = RunContext(config, "run1", started=time.monotonic() - 1, started_at="2026-11-30T00:00:00+00:00",
                     inputs=SimpleNamespace(rows=3, format="parquet", paths=["in.parquet"], skipped=[]),
                     model_path="model", max_model_len=4096, bucket_order=LengthBucketer().names,
                     limits_key={"model": "m", "hardware": "cpu:x", "max_model_len": 4096, "dtype": "bfloat16"},
                     written=sink.summary, generated_rows=sink.generated_rows)
    typed = runner.finish(ctx, target)
    typed.warnings += target.publish()
    report = typed.to_json()
    target.close()

    out = tmp_path / "out"
    on_disk = json.loads((out / "_report.json").read_text())
    assert pq.read_table(out).column("id").to_pylist() == ["a", "b", "c"]
    assert on_disk["files"] == ["part-run1-00000.parquet"] and on_disk["warnings"] == report["warnings"]
    assert sorted(os.listdir(tmp_path)) == (["limits.yaml", "out"] if failing != "learned_limits" else ["out"])
    saved = report["batching"]["learned_limits"].get("saved")
    if failing == "learned_limits":
        assert report["warnings"] == [f"saving learned limits to {limits_file} failed: OSError: "
                                      "[Errno 28] No space left on device"]
        assert saved is None and not limits_file.exists()
    else:
        assert saved == {"le128": 64} and yaml.safe_load(limits_file.read_text())["limits"] == saved
    if failing == "plot":
        assert report["warnings"] == ["drawing the batching plot failed: RuntimeError: matplotlib backend unavailable"]
        assert report["plot_path"] is None and not (out / "_batching.png").exists()
    else:
        assert report["plot_path"] == f"{out}/_batching.png"
        assert (out / "_batching.png").read_bytes().startswith(b"\x89PNG")
    if failing is None:
        assert report["warnings"] == []


@pytest.mark.parametrize("error", [RuntimeError("engine died"), "publish"])
def test_run_job_keeps_a_finished_runs_staging_and_discards_a_failed_ones(tmp_path, monkeypatch, error):
    """The wiring around generation: a run that failed before its report removes its
    staging; one that finished but may not publish keeps it, with every row in it."""
    from pipeline.tools.dev.corpus import write_corpus
    from pipeline.storage.output import PublishError

    corpus = write_corpus(tmp_path / "c.parquet", rows=4, seed=0)
    config = load_run_config(REPO / "jobs/nightly_summarize.yaml", REPO / "conf/local.yaml", [],
                             str(corpus), str(tmp_path / "out"))
    seen = {}

    def generate(ctx, target, *metrics_and_verbose):
        seen["staging"] = target.staging.root
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "late.txt").write_text("appeared mid-run")
        if error == "publish":
            target.plan()  # what finish does last: finds late.txt
        raise error

    monkeypatch.setattr(runner, "generate", generate)
    with pytest.raises(PublishError if error == "publish" else RuntimeError):
        runner.run_job(config, run_id="run1")
    assert os.path.isdir(seen["staging"]) == (error == "publish")
    assert os.listdir(tmp_path / "out") == ["late.txt"]
    assert not os.path.exists(tmp_path / ".out.lock")  # the lease is given back either way
