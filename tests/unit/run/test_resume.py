"""Crash safety without a cluster: commit markers, adopting a stopped run's staging,
`pipeline gc`, and the generate stage ending its actor on a crashed or hung engine.
The same paths run with real Ray, real kills and real vLLM in tests/integration/run/test_resume.py."""

import json
import os
import threading
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.storage.commits import COMMITS, key_columns, load_commits, row_keys, without
from pipeline.generation.engine import EngineCrashed
from pipeline.storage.lease import OutputBusy
from pipeline.storage.output import STAGING_MARKER, OutputError, OutputTarget, collect_garbage
from pipeline.storage.sink import ParquetPartsSink
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.stages import stages
from tests.helpers.parts import JOB, Ctx, block
from tests.helpers.runs import killed_run
from tests.helpers.runs import OUT_SCHEMA





def test_a_resumed_run_keeps_committed_parts_drops_the_rest_and_states_its_lineage(tmp_path):
    killed = killed_run(tmp_path / "out")
    target = OutputTarget(str(tmp_path / "out"), JOB, "run2", stopped="resume")
    target.open(rows_in=6)
    assert target.resumed is not None and target.resumed.owner.run_id == "run1"
    assert target.staging.root == killed.staging.root and target.lineage == ("run1",)
    assert target.committed.rows == 3 and target.committed.documents() == 3
    # The cut-off part is gone; the committed ones stay.
    assert sorted(os.listdir(target.staging.data)) == ["part-run1-00000.parquet", "part-run1-00001.parquet"]
    marker = json.loads(Path(target.staging.root, STAGING_MARKER).read_text())
    assert marker["run_id"] == "run2" and marker["lineage"] == ["run1"]
    # The committed keys skip exactly those rows.
    batch = pa.table({"id": ["a", "b", "c", "d", "e", "f"], "text": ["t"] * 6})
    left = without(batch, row_keys(target.committed.keys, ["id"]), ["id"])
    assert left.column("id").to_pylist() == ["d", "e", "f"]
    # The report covers both runs' rows: the previous parts' stats come back as written.
    sink = ParquetPartsSink(target.staging, "run2", OUT_SCHEMA, ["id"], previous=target.committed.parts)
    written = sink.write([block(["d", "e", "f"], "le256", "c9")], Ctx(0))

    class WR:
        write_returns = [written]

    sink.on_write_complete(WR())
    assert sink.summary["rows"] == 6 and sink.generated_rows == 3
    assert sink.summary["prompt_tokens_by_bucket"]["le128"] == {10: 2, 11: 1}  # int keys again, merged
    target.close()


def test_passage_keys_name_the_passage_and_a_failed_document():
    keys = key_columns("id", passages=True)
    table = pa.table({"id": ["a", "a", "b"], "passage_index": pa.array([0, 1, None], pa.int32())})
    assert row_keys(table, keys).to_pylist() == ["a\x1f0", "a\x1f1", "b\x1f"]
    left = without(table, pa.array(["a\x1f1", "b\x1f"]), keys)
    assert left.to_pydict() == {"id": ["a"], "passage_index": [0]}


def test_resume_with_nothing_stopped_is_a_fresh_run_and_other_jobs_staging_is_left_be(tmp_path):
    other = OutputTarget(str(tmp_path / "out"), "another_job", "run0")
    other.open()
    other.close()
    target = OutputTarget(str(tmp_path / "out"), JOB, "run1", stopped="resume")
    target.open()
    assert target.resumed is None and target.lineage == ()
    assert any("another_job" in w for w in target.warnings)
    assert os.path.isdir(other.staging.root)
    target.close()


def test_gc_lists_then_removes_stopped_runs_and_waits_for_a_live_one(tmp_path):
    killed = killed_run(tmp_path / "out")
    found = collect_garbage(str(tmp_path / "out"))
    assert [s.owner.run_id for s in found] == ["run1"] and found[0].committed.rows == 3
    assert os.path.isdir(killed.staging.root)
    live = OutputTarget(str(tmp_path / "out"), JOB, "run2", stopped="resume")
    live.open()
    with pytest.raises(OutputBusy, match="run2"):
        collect_garbage(str(tmp_path / "out"), delete=True)
    live.close()
    assert [s.owner.run_id for s in collect_garbage(str(tmp_path / "out"), delete=True)] == ["run2"]
    assert sorted(os.listdir(tmp_path)) == []


def test_a_stopped_run_is_refused_with_its_progress(tmp_path):
    killed_run(tmp_path / "out")
    with pytest.raises(OutputError, match=r"run run1 stopped at 50% \(3 rows committed\)"):
        OutputTarget(str(tmp_path / "out"), JOB, "run2").open()


def test_commits_are_written_after_their_part_and_read_back(tmp_path):
    target = killed_run(tmp_path / "out", parts=(["a"],))
    commits = os.listdir(Path(target.staging.root, COMMITS))
    assert commits == ["part-run1-00000.parquet"]
    assert pq.read_table(Path(target.staging.root, COMMITS, commits[0])).column("id").to_pylist() == ["a"]
    assert load_commits(target.fs, target.staging.root).files == {"part-run1-00000.parquet"}


# --- the generate stage on a crashed or hung engine ---------------------------------------


class Gate:
    """The pool's log, as the stage sees it (`pipeline.run.pool.PoolGate`)."""

    def __init__(self):
        self.events, self.held = [], {}

    def wait(self):
        return None

    def hold(self, actor, block, rows):
        self.held[block] = rows

    def release(self, actor, block):
        self.held.pop(block)

    def note(self, event, restarted=False):
        self.events.append(event)


class Exited(Exception):
    pass


def crash_stage(tiny_model, engine, **settings):
    prepare, generate = stages(tiny_model, "jobs/nightly_summarize.yaml", ["batching.policy.initial_budget_tokens=400"],
                               engine)
    gate, exits = Gate(), []

    def exit_process(code):
        exits.append(code)
        if threading.current_thread() is threading.main_thread():
            raise Exited()  # elsewhere (the watchdog) it returns, and the thread ends

    stage = type(generate)(replace(generate.settings, pool_gate=gate, **settings), engine=engine,
                           exit_process=exit_process)
    return prepare, stage, gate, exits


def corpus(n):
    return pa.table({"id": [f"r{i}" for i in range(n)], "text": [f"note {i}" for i in range(n)], "source": ["x"] * n})


def test_an_engine_core_crash_ends_the_actor_with_its_rows_and_no_oom(tiny_model):
    from pipeline.generation.feeder import FaultInjector

    engine = FakeEngine(reply=lambda ids, s: "ok")
    prepare, stage, gate, exits = crash_stage(tiny_model, engine)
    stage.feeder.faults = FaultInjector(2, "engine_crash")
    with pytest.raises(Exited):
        stage(prepare(corpus(30)))
    assert exits == [1] and engine.rebuilds == [] and stage.feeder.totals.oom_retries == 0
    [event] = gate.events
    assert event["kind"] == "engine_died" and event["rows"] == 30 and "not of memory" in event["cause"]


def test_a_hung_step_is_killed_by_the_watchdog(tiny_model):
    release = threading.Event()

    class Hangs(FakeEngine):
        def step(self):
            if self.n >= 3:  # stops making progress, alive
                release.wait(10)
                self.dead = True
            return super().step()

        def kill_core(self, memory=False):
            release.set()  # SIGKILL ends a stopped process too

    engine = Hangs(reply=lambda ids, s: "ok")
    prepare, stage, gate, exits = crash_stage(tiny_model, engine, stall_timeout_s=0.3)
    # The watchdog ends the process; the call, its step ended with the core, only waits for that.
    with pytest.raises(EngineCrashed):
        stage(prepare(corpus(8)))
    assert exits == [1] and [e["kind"] for e in gate.events] == ["stall"] and gate.events[0]["rows"] == 8
    assert "engine.stall_timeout_s 0.3" in gate.events[0]["cause"]
