"""The generate stage end to end on Arrow batches, with the tiny model's real tokenizer
(prepare) and the fake engine in place of vLLM: annotations with their retry, map-reduce
over long documents, and a dead engine, each checked column by column. The same paths
run on real vLLM in tests/integration (test_kb_ingest, test_outliers, test_adaptive)."""

import json
import threading
import time

import pyarrow as pa
import pytest

from pipeline import schema
from pipeline.stages.generate import GenerateStage, at_once
from pipeline.stages.prepare import PrepareStage
from tests.helpers import REPO
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.stages import stages

CORPUS = pa.table({
    "id": ["a", "b", "c"],
    "text": ["Short note about Paris.", "Another note, on Berlin.", "A third, on Rome."],
    "source": ["email", "memo", "email"],
})




def kb_reply(ids, sampling):
    """Summaries as text; annotations as JSON, cut off (as max tokens would) the first time."""
    if sampling.json_schema is None:
        return "a summary"
    if sampling.max_new_tokens < 1024:
        return '{"title": "Par'
    return json.dumps({"title": "Paris", "keywords": ["city"], "entities": [{"name": "Paris", "type": "place"}],
                       "topics": ["travel"], "language": "en"})


def test_annotations_are_typed_columns_after_one_retry(tiny_model):
    engine = FakeEngine(reply=kb_reply)
    prepare, generate = stages(tiny_model, "jobs/kb_ingest.yaml", ["annotations.retry_max_new_tokens=1024"], engine)
    out = generate(prepare(CORPUS))
    rows = out.to_pylist()
    assert {r["status"] for r in rows} == {"ok"} and all(r["summary"] == "a summary" for r in rows)
    assert all(r["title"] == "Paris" and r["entities"] == [{"name": "Paris", "type": "place"}] for r in rows)
    assert out.schema.field("keywords").type == pa.list_(pa.string())
    # Summary, annotation and retry tokens all count: 4 each.
    assert all(r["output_tokens"] == 12 and r["raw_output"] is None for r in rows)
    records = json.loads(out.column(schema.ENGINE_CALL_STATS)[0].as_py())
    assert [r["kind"] for r in records] == ["rows", "annotations", "annotations-retry"]
    assert records[0]["engine"]["max_model_len"] == 2048
    # The row's finish reason is its last call's: the retry's (4 tokens of 1024: a stop).
    assert all(r["finish_reason"] == "stop" for r in rows)


def test_an_annotated_row_keeps_its_summarys_own_finish_reason(tiny_model):
    # The summary is cut at 3 tokens; the annotation after it stops on its own.
    engine = FakeEngine(reply=lambda ids, s: "a summary" if s.json_schema is None else '{"title": "Paris"}')
    prepare, generate = stages(tiny_model, "jobs/kb_ingest.yaml", ["sampling.max_new_tokens=3"], engine)
    out = generate(prepare(CORPUS))
    assert out.schema.names.index(schema.SUMMARY_FINISH.name) == out.schema.names.index("annotation_tries") + 1
    assert out.column(schema.SUMMARY_FINISH.name).to_pylist() == ["length"] * out.num_rows
    assert out.column("finish_reason").to_pylist() == ["stop"] * out.num_rows


def test_finish_reason_says_whether_the_limit_cut_the_summary(tiny_model):
    for limit, reason in ((3, "length"), (16, "stop")):
        prepare, generate = stages(tiny_model, "jobs/nightly_summarize.yaml", [f"sampling.max_new_tokens={limit}"],
                                   FakeEngine())
        out = generate(prepare(CORPUS))
        assert out.schema.field("finish_reason").type == pa.string()
        assert out.column("finish_reason").to_pylist() == [reason] * 3
        assert out.column("output_tokens").to_pylist() == [min(4, limit)] * 3


def test_annotations_that_never_validate_keep_their_text(tiny_model):
    engine = FakeEngine(reply=lambda ids, s: "a summary" if s.json_schema is None else '{"title": 3}')
    prepare, generate = stages(tiny_model, "jobs/kb_ingest.yaml", [], engine)
    rows = generate(prepare(CORPUS)).to_pylist()
    assert {r["status"] for r in rows} == {"invalid_output"}
    assert all(r["raw_output"] == '{"title": 3}' and "schema" in r["error"] for r in rows)
    assert all(r["title"] is None and r["summary"] == "a summary" for r in rows)


def test_long_documents_are_summarized_map_reduce(tiny_model):
    engine = FakeEngine(reply=lambda ids, s: "short summary of a window")
    long = pa.table({"id": ["long", "short"], "text": [" ".join(f"word{i}" for i in range(1500)), "tiny"],
                     "source": ["report", "note"]})
    prepare, generate = stages(tiny_model, "jobs/nightly_summarize.yaml",
                               ["length.policy=chunk", "length.chunk_overlap=16", "sampling.max_new_tokens=16"],
                               engine, max_model_len=512)
    prepared = prepare(long)
    assert prepared.column("chunks").to_pylist()[0] >= 2
    out = generate(prepared)
    rows = {r["id"]: r for r in out.to_pylist()}
    assert rows["long"]["status"] == "ok" and rows["long"]["summary"] == "short summary of a window"
    assert rows["short"]["status"] == "ok" and rows["short"]["chunks"] is None
    records = json.loads(out.column(schema.ENGINE_CALL_STATS)[0].as_py())
    levels = records[1:]
    assert records[0]["kind"] == "rows" and len(levels) >= 2
    assert [r["kind"] for r in levels] == [f"chunk-level-{k}" for k in range(1, len(levels) + 1)]
    # Every window once, then fewer prompts at each level, down to the one last summary.
    assert levels[0]["rows"] == prepared.column("chunks").to_pylist()[0]
    assert all(a["rows"] > b["rows"] for a, b in zip(levels, levels[1:])) and levels[-1]["rows"] == 1


def test_a_dead_engine_is_rebuilt_and_no_row_is_lost(tiny_model):
    engine = FakeEngine(reply=lambda ids, s: "ok")
    corpus = pa.table({"id": [f"r{i}" for i in range(60)], "text": [f"note {i}" for i in range(60)],
                       "source": ["email"] * 60})
    prepare, generate = stages(tiny_model, "jobs/nightly_summarize.yaml",
                               ["debug.inject_oom_at_batch=2", "debug.inject_oom_kind=engine_oom_death",
                                "batching.policy.initial_budget_tokens=400"], engine)
    out = generate(prepare(corpus))
    assert out.column("status").to_pylist() == ["ok"] * 60
    totals = json.loads(out.column(schema.ENGINE_CALL_STATS)[0].as_py())[-1]["actor"]
    assert totals["oom_retries"] == 1 and len(totals["rebuilds"]) == 1


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_both_policies_serve_every_row_once(tiny_model, policy):
    engine = FakeEngine(reply=lambda ids, s: "ok", vary=True)
    sets = ["batching.policy={kind: fixed, rows_per_call: 2}"] if policy == "fixed" else []
    prepare, generate = stages(tiny_model, "jobs/nightly_summarize.yaml", sets, engine)
    out = generate(prepare(CORPUS))
    assert out.column("id").to_pylist() == ["a", "b", "c"] and out.column("status").to_pylist() == ["ok"] * 3
    assert schema.PROMPT_TOKEN_IDS not in out.column_names


def test_the_stage_needs_only_its_own_settings_no_yaml(tiny_model):
    """GenerateSettings and PrepareSettings built by hand: no job or profile file."""
    from pipeline.config import FixedPolicy
    from pipeline.generation.engine import Sampling
    from pipeline.generation.vllm import VLLMSettings
    from pipeline.stages.generate import GenerateSettings
    from pipeline.stages.prepare import PrepareSettings, Prompt

    prep = PrepareSettings(model_path=str(tiny_model), max_model_len=512, prompt=Prompt("{text}"), max_new_tokens=8)
    settings = GenerateSettings(run_id="r", model_name="tiny", engine=VLLMSettings(kwargs={}),
                                sampling=Sampling(8), prepare=prep, policy=FixedPolicy(rows_per_call=2))
    engine = FakeEngine(reply=lambda ids, s: "done")
    out = GenerateStage(settings, engine=engine)(PrepareStage(prep)(pa.table({"id": ["a", "b", "c"],
                                                                           "text": ["x", "y", "z"]})))
    assert out.column("summary").to_pylist() == ["done"] * 3 and engine.max_seen <= 2
    assert out.column("model").to_pylist() == ["tiny"] * 3 and out.column("run_id").to_pylist() == ["r"] * 3


def test_whitespace_only_output_is_empty_output_not_ok(tiny_model):
    """A summary of newlines (the old tiny model wrote nothing else), or an annotation of
    spaces, is a row that failed: its own status, its text kept, the error saying why."""
    blank = {"a": "\n\n\n", "b": " \t ", "c": "a summary"}
    engine = FakeEngine(reply=lambda ids, s: "  \n " if s.json_schema is not None else blank[row_of(ids)])
    prepare, generate = stages(tiny_model, "jobs/kb_ingest.yaml", [], engine)
    prepared = prepare(CORPUS)
    by_ids = {tuple(ids): row for ids, row in zip(prepared.column(schema.PROMPT_TOKEN_IDS).to_pylist(), "abc")}

    def row_of(ids):
        return by_ids[tuple(ids)]

    rows = {r["id"]: r for r in generate(prepared).to_pylist()}
    assert [rows[k]["status"] for k in "abc"] == ["empty_output"] * 3
    assert rows["a"]["summary"] == "\n\n\n" and "summary is empty or only whitespace" in rows["a"]["error"]
    # c's summary is fine; its annotation (retried once with more room) is blanks, kept raw.
    assert rows["c"]["summary"] == "a summary" and rows["c"]["raw_output"] == "  \n "
    assert rows["c"]["error"].startswith("the annotation is empty or only whitespace")


def test_fail_on_error_rate_counts_empty_output_as_failed(monkeypatch):
    from click.testing import CliRunner

    from pipeline.run import job as runner
    from pipeline.cli import EXIT_ERROR_RATE, main

    class Report:
        def to_json(self):
            return {"job": "j", "run_id": "r", "buckets": {}, "status": {"ok": 8, "empty_output": 2}, "rows_in": 10,
                    "rows_out": 10, "tokens": {"prompt": 1, "output": 1}, "wall_s": 1.0, "output_tokens_per_s": 1.0,
                    "output": "out", "report_path": "out/_report.json"}

    monkeypatch.setattr(runner, "run_job", lambda *a, **k: Report())
    args = ["run", str(REPO / "jobs/nightly_summarize.yaml"), "--profile", str(REPO / "conf/local.yaml")]
    r = CliRunner().invoke(main, [*args, "--fail-on-error-rate", "0.1"])
    assert r.exit_code == EXIT_ERROR_RATE and "2 of 10 rows ended in empty_output (20.00%)" in r.output
    assert "empty_output 2" in r.output  # the run's table counts them
    assert CliRunner().invoke(main, [*args, "--fail-on-error-rate", "0.2"]).exit_code == 0


def test_rows_with_the_same_document_are_generated_once_each_with_its_own_id(tiny_model):
    corpus = pa.table({"id": ["a", "b", "c", "d"], "text": ["Same note.", "Other note.", "Same note.", "Same note."],
                       "source": ["email"] * 4})
    for merge, requests in ((True, 2), (False, 4)):
        engine = FakeEngine(reply=lambda ids, s: f"summary {len(ids)} {ids[-8:]}")
        prepare, generate = stages(tiny_model, "jobs/nightly_summarize.yaml",
                                   [f"batching.merge_identical_prompts={str(merge).lower()}"], engine)
        out = generate(prepare(corpus))
        rows = {r["id"]: r for r in out.to_pylist()}
        assert sorted(rows) == ["a", "b", "c", "d"] and {r["status"] for r in rows.values()} == {"ok"}
        assert rows["a"]["summary"] == rows["c"]["summary"] == rows["d"]["summary"] != rows["b"]["summary"]
        assert len(engine.submitted) == requests
        assert generate.actor_totals()["merged"] == ({"rows": 2} if merge else {})


def test_a_blocks_bucket_calls_are_served_at_once():
    """Each bucket's call waits here until every other has started: served one after
    another, the first would wait for good."""
    started = threading.Barrier(3, timeout=10)
    served = {}

    def serve(bucket, members):
        started.wait()
        served[bucket] = members

    at_once(serve, [("le128", [0, 1]), ("le512", [2]), ("le1024", [3, 4])])
    assert served == {"le128": [0, 1], "le512": [2], "le1024": [3, 4]}


def test_a_failed_bucket_call_raises_once_every_other_has_ended():
    ended = []

    def serve(bucket, members):
        if bucket == "le128":
            raise RuntimeError("engine died")
        threading.Event().wait(0.2)
        ended.append(bucket)

    with pytest.raises(RuntimeError, match="engine died"):
        at_once(serve, [("le128", [0]), ("le512", [1]), ("le1024", [2])])
    assert sorted(ended) == ["le1024", "le512"]


def looked_up(prepared, earlier):
    """`prepared` as the reuse lookup hands it on: each row's key, and for the rows in
    `earlier` (position: summary) an earlier run's results (`pipeline.reuse.index`)."""
    from pipeline.reuse.index import REUSED_FROM, REUSED_PREFIX

    n = prepared.num_rows
    found = [earlier.get(i) for i in range(n)]
    return (prepared.append_column("result_key", pa.array([f"v1:k{i}" for i in range(n)]))
            .append_column(REUSED_FROM, pa.array([None if f is None else "r0 (2026-12-01)" for f in found], pa.string()))
            .append_column(REUSED_PREFIX + "summary", pa.array(found, pa.string()))
            .append_column(REUSED_PREFIX + "output_tokens", pa.array([None if f is None else 9 for f in found], pa.int32()))
            .append_column(REUSED_PREFIX + "finish_reason", pa.array([None if f is None else "stop" for f in found]))
            .append_column(REUSED_PREFIX + "latency_s", pa.array([None if f is None else 0.5 for f in found])))


def test_reused_rows_take_the_earlier_results_and_only_the_others_reach_the_engine(tiny_model):
    engine = FakeEngine(reply=lambda ids, s: "fresh")
    prepare, generate = stages(tiny_model, "jobs/nightly_summarize.yaml", [], engine)
    out = generate(looked_up(prepare(CORPUS), {1: "from night one"}))
    rows = {r["id"]: r for r in out.to_pylist()}
    assert len(engine.submitted) == 2 and {r["status"] for r in rows.values()} == {"ok"}
    b = rows["b"]
    assert (b["summary"], b["output_tokens"], b["finish_reason"], b["latency_s"]) == ("from night one", 9, "stop", 0.5)
    assert b["reused_from"] == "r0 (2026-12-01)" and b[schema.ENGINE_CALL] is None and b["result_key"] == "v1:k1"
    assert [rows[i]["summary"] for i in "ac"] == ["fresh", "fresh"]
    assert [rows[i]["reused_from"] for i in "ac"] == [None, None]
    assert out.schema.field("output_tokens").type == pa.int32()


def test_with_every_row_reused_no_engine_starts_until_a_row_needs_one(tiny_model):
    from dataclasses import replace

    prepare, generate = stages(tiny_model, "jobs/nightly_summarize.yaml", [], FakeEngine())
    lazy = GenerateStage(replace(generate.settings, engine_on_demand=True))
    built = []

    def build(settings, warn_once):
        built.append(FakeEngine(reply=lambda ids, s: "fresh"))
        return built[-1]

    lazy._build_engine = build
    prepared = prepare(CORPUS)
    out = lazy(looked_up(prepared, {0: "one", 1: "two", 2: "three"}))
    assert out.column("summary").to_pylist() == ["one", "two", "three"]
    assert set(out.column("status").to_pylist()) == {"ok"} and lazy.engine is None and built == []
    assert out.column(schema.ENGINE_CALL_STATS).to_pylist() == [None] * 3  # no engine call to report
    out = lazy(looked_up(prepared, {0: "one"}))
    assert len(built) == 1 and lazy.engine is built[0] and len(built[0].submitted) == 2
    assert out.column("summary").to_pylist() == ["one", "fresh", "fresh"]


class BlockGate:
    """A pool gate that records the blocks an engine actor holds and releases."""

    def __init__(self):
        self.calls = []

    def wait(self):
        return None

    def hold(self, actor, block, rows):
        self.calls.append(("hold", block, rows))

    def release(self, actor, block):
        self.calls.append(("release", block))


def test_only_a_block_with_rows_to_generate_is_held_with_the_pool(tiny_model):
    """A block whose every row is reused passes through: the pool's log is not called for it
    (two calls per block, on the engine's own process); a block with a row to generate is
    held while it is served and released after, with all its rows."""
    from dataclasses import replace

    prepare, generate = stages(tiny_model, "jobs/nightly_summarize.yaml", [], FakeEngine())
    gate = BlockGate()
    stage = GenerateStage(replace(generate.settings, pool_gate=gate), engine=FakeEngine(reply=lambda ids, s: "fresh"))
    prepared = prepare(CORPUS)
    stage(looked_up(prepared, {0: "one", 1: "two", 2: "three"}))
    assert gate.calls == []
    out = stage(looked_up(prepared, {0: "one"}))
    assert out.column("summary").to_pylist() == ["one", "fresh", "fresh"]
    (hold, block, rows), release = gate.calls
    assert (hold, rows) == ("hold", 3) and release == ("release", block)
    assert stage.life._held == {}


class WorkGate:
    """A pool gate whose reuse lookup has found no row to generate until `found` is set."""

    def __init__(self, order):
        self.order, self.waiting, self.found = order, threading.Event(), threading.Event()

    def wait(self):
        return None

    def first_time(self, key):
        return True

    def await_work(self):
        self.order.append("await_work")
        self.waiting.set()
        self.found.wait(30)

    def hold(self, actor, block, rows):
        pass

    def release(self, actor, block):
        pass


def test_an_engine_on_demand_imports_vllm_while_it_waits_and_starts_once_work_is_found(tiny_model, monkeypatch):
    """vLLM's import (about 10 s on 2 cores) is no engine: it is done before the wait for
    work, not after; the engine itself is built only once the lookup has found a row."""
    from dataclasses import replace

    import pipeline.stages.generate as generate_module

    order = []
    monkeypatch.setattr(generate_module, "preload", lambda warn_once: order.append("preload"))
    _, generate = stages(tiny_model, "jobs/nightly_summarize.yaml", [], FakeEngine())
    assert generate.settings.backend == "vllm"
    gate = WorkGate(order)
    lazy = GenerateStage(replace(generate.settings, engine_on_demand=True, pool_gate=gate))
    built = []

    def build(settings, warn_once):
        order.append("build")
        built.append(FakeEngine())
        return built[-1]

    lazy._build_engine = build
    assert gate.waiting.wait(10)
    assert order == ["preload", "await_work"] and lazy.engine is None
    gate.found.set()
    deadline = time.monotonic() + 10
    while lazy.engine is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert order == ["preload", "await_work", "build"] and lazy.engine is built[0]


def test_an_engine_on_demand_keeps_its_cpus_for_the_import_and_gives_them_back_until_work_is_found(
        tiny_model, monkeypatch):
    """Bound before vLLM's import, it tells the pool (the run's other processes leave its CPUs
    to the import); imported with no row to generate found yet, it tells the pool it holds
    none, and its CPUs again once one is found, before the engine is built."""
    import os
    from dataclasses import replace

    import pipeline.stages.generate as generate_module

    order = []
    monkeypatch.setattr(generate_module, "preload", lambda warn_once: order.append("preload"))
    monkeypatch.setattr(generate_module, "bind_process", lambda cpus: [0])

    class Gate(WorkGate):
        def has_work(self):
            return self.found.is_set()

        def engine_cpus(self, actor, workers):
            order.append(("cpus", workers))

    _, generate = stages(tiny_model, "jobs/nightly_summarize.yaml", [], FakeEngine())
    gate = Gate(order)
    settings = generate.settings
    lazy = GenerateStage(replace(settings, engine_on_demand=True, pool_gate=gate,
                                 engine=replace(settings.engine, in_process=True, bind_cpus=(0, 1))))
    lazy._build_engine = lambda settings, warn_once: order.append("build") or FakeEngine()
    deadline = time.monotonic() + 10
    while order.count("await_work") < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    mine = {os.getpid(): [0]}
    assert order == [("cpus", mine), "preload", ("cpus", {}), "await_work", "await_work"], order
    gate.found.set()
    while "build" not in order and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ("cpus", mine) in order[5:] and "build" in order[5:], order


def test_an_engine_of_its_own_cpus_binds_its_actor_before_vllms_import_and_tells_the_pool(tiny_model, monkeypatch):
    """With the model in the actor's process on CPUs of its own (`bind_cpus`), the actor
    binds itself before vLLM is imported or built, and reports where, so the driver's guard
    keeps the run's other processes off those CPUs while the engine starts."""
    import os
    from dataclasses import replace

    from pipeline.stages import generate

    _, stage = stages(tiny_model, "jobs/nightly_summarize.yaml", [], FakeEngine())
    told = []

    class Gate:
        def engine_cpus(self, actor, workers):
            told.append((actor, workers))

    bound = []
    monkeypatch.setattr(generate, "bind_process", lambda cpus: bound.append(cpus) or [0])
    settings = stage.settings
    stage.settings = replace(settings, pool_gate=Gate(),
                             engine=replace(settings.engine, in_process=True, bind_cpus=(0, 1)))
    assert stage._bind_early() == [0]
    assert bound == [(0, 1)] and told == [(stage.actor, {os.getpid(): [0]})]
    # An engine on demand binds before its import but tells the pool only once there is work.
    assert stage._bind_early(report=False) == [0] and len(told) == 1
    bound.pop()
    # Apart (its core binds its own worker), or no CPUs to bind to: nothing bound, nothing told.
    for engine in (replace(settings.engine, in_process=False, bind_cpus=(0, 1)),
                   replace(settings.engine, in_process=True, bind_cpus=None)):
        stage.settings = replace(settings, pool_gate=Gate(), engine=engine)
        stage._bind_early()
    assert len(bound) == 1 and len(told) == 1
