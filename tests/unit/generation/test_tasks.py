"""The generation tasks (`pipeline.generation.tasks`) and the feeder's engine rebuild,
on the fake engine: what was reachable only through real-engine CLI runs before."""

import json

import pytest

from pipeline.generation.engine import Sampling
from pipeline.generation.feeder import EngineFeeder, FaultInjector
from pipeline.generation.policy import BatchSizeController, FixedBatchPolicy
from pipeline.generation.tasks import AnnotationTask, ChunkText, EngineCalls, annotate, map_reduce, summarize
from tests.helpers.fake_engine import FakeEngine


def calls_over(engine, policy=None, faults=None):
    """One batch's calls over a feeder of `engine`: its `records` are the report's."""
    feeder = EngineFeeder(engine, policy or FixedBatchPolicy(8), faults=faults)
    return EngineCalls(feeder, "a1", lambda: {"actor": "a1"}, lambda: {"engine": "fake"}).batch()


def test_calls_are_numbered_and_the_first_carries_the_engine():
    calls = calls_over(FakeEngine())
    ids = [[1] * 10, [2] * 20, [3] * 30]
    out = summarize(calls, [("le128", [0, 2]), ("le256", [1])], ids, Sampling(4))
    records = calls.records
    assert {i: call for i, (call, _) in out.items()} == {0: "a1-00000", 2: "a1-00000", 1: "a1-00001"}
    assert [r["call"] for r in records] == ["a1-00000", "a1-00001"]
    assert records[0]["engine"] == {"engine": "fake"} and "engine" not in records[1]
    assert [r["rows"] for r in records] == [2, 1] and all(r["kind"] == "rows" for r in records)


SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}


def parse(text):
    try:
        value = json.loads(text)
    except (TypeError, json.JSONDecodeError):
        return None, "output is not valid JSON"
    return (value, None) if "title" in value else (None, "no title")


def json_reply(ids, sampling):
    """Whole JSON with room to write it; cut off (as max tokens would) without; row 9 never valid."""
    if ids[0] == 9:
        return '{"other": 1}'
    return '{"title": "t%d"}' % ids[0] if sampling.max_new_tokens >= 64 else '{"title": "t'


def test_annotations_that_do_not_validate_are_retried_once_with_more_room():
    engine = FakeEngine(reply=json_reply)
    ids = [[1] * 5, [2] * 5, [9] * 5]
    calls = calls_over(engine)
    out = annotate(calls, "le128", [0, 1, 2], ids, AnnotationTask(Sampling(32, json_schema=SCHEMA), parse, 128))
    records = calls.records
    assert [r["kind"] for r in records] == ["annotations", "annotations-retry"]
    assert records[1]["rows"] == 3  # all three were cut off the first time
    assert out[0].value == {"title": "t1"} and out[1].value == {"title": "t2"}
    assert out[2].value is None and out[2].invalid == "no title"
    # Tokens and time of both tries count; the retry had the room, and kept the schema.
    assert out[0].completion.output_tokens == 8
    retried = [s for _, s in engine.submitted[3:]]
    assert {s.max_new_tokens for s in retried} == {128} and all(s.json_schema == SCHEMA for s in retried)


def test_no_retry_without_more_room_and_no_call_for_nothing():
    engine = FakeEngine(reply=json_reply)  # max_model_len 4,096
    calls = calls_over(engine)
    out = annotate(calls, "le128", [0], [[1] * 4000], AnnotationTask(Sampling(64, json_schema=SCHEMA), parse))
    # 4,096 - 4,000 tokens of context left: no more room than the first try had.
    assert [r["kind"] for r in calls.records] == ["annotations"] and out[0].value is None
    assert annotate(calls, "le128", [], [], AnnotationTask(Sampling(64), parse)) == {}
    assert len(calls.records) == 1


def test_an_engine_error_in_annotations_is_the_rows_error():
    out = annotate(calls_over(FakeEngine(reply=json_reply)), "le128", [0], [[1] * 2000],
                   AnnotationTask(Sampling(8), parse))
    assert out[0].value is None and "prompt too long" in out[0].completion.error


def pieces_reply(ids, sampling):
    return "s" * 10  # every summary is 10 characters


def test_map_reduce_summarizes_pieces_then_their_summaries_level_by_level():
    engine = FakeEngine(reply=pieces_reply)
    # Row 0: three windows, whose joined summaries (3 x 10 + 2 x 2 = 34 chars) fit one prompt of 40.
    # Row 1: one window: done at the first level.
    pieces = {0: ["a" * 30, "b" * 30, "c" * 30], 1: ["d" * 30]}
    split = lambda i, text: [text] if len(text) <= 40 else [text[:40], text[40:]]  # noqa: E731
    calls = calls_over(engine)
    out = map_reduce(calls, pieces, ChunkText(lambda i, t: [1] * len(t), split, lambda tokens: "le128"), Sampling(4))
    assert [r["kind"] for r in calls.records] == ["chunk-level-1", "chunk-level-2"]
    assert [r["rows"] for r in calls.records] == [4, 1]
    assert out[0].text == out[1].text == "s" * 10 and out[0].error is None


def test_map_reduce_stops_after_its_levels_and_a_failed_piece_fails_its_row():
    engine = FakeEngine(reply=pieces_reply)
    always_two = lambda i, text: [text, text]  # noqa: E731  never converges
    encode = lambda i, t: [1] * (2000 if t == "bad" else 5)  # noqa: E731  the fake refuses > 1000 tokens
    out = map_reduce(calls_over(engine), {0: ["x", "y"], 1: ["bad", "z"]},
                     ChunkText(encode, always_two, lambda tokens: "le128"), Sampling(4), max_levels=2)
    assert out[0].error == "chunk summaries did not converge in 2 levels"
    assert "prompt too long" in out[1].error


def test_a_dead_engine_is_rebuilt_smaller_and_every_row_still_finishes():
    engine = FakeEngine()
    policy = BatchSizeController(initial_budget_tokens=240)  # 10 rows of 24 tokens: several windows
    calls = calls_over(engine, policy, FaultInjector(at=2, kind="engine_oom_death"))
    out = summarize(calls, [("le128", list(range(40)))], [[1] * 20] * 40, Sampling(4))
    assert sorted(out) == list(range(40)) and all(c.error is None for _, c in out.values())
    assert len(engine.rebuilds) == 1 and engine.rebuilds[0]["after"] == {"max_num_seqs": 128}
    assert policy.max_rows == 128  # the policy learned the rebuilt engine's limit
    assert calls.calls.feeder.totals.oom_retries == 1


@pytest.mark.parametrize("kind", ["oom", "engine_oom_death"])
def test_the_fault_injector_fires_once(kind):
    engine = FakeEngine()
    calls = calls_over(engine, FixedBatchPolicy(4), FaultInjector(at=1, kind=kind))
    out = summarize(calls, [("le128", list(range(12)))], [[1] * 20] * 12, Sampling(4))
    assert all(c.error is None for _, c in out.values())
    assert calls.calls.feeder.totals.oom_retries == 1 and len(engine.rebuilds) == (kind == "engine_oom_death")


def test_several_faults_fire_once_each_in_window_order():
    engine = FakeEngine()
    faults = FaultInjector(at=1, kind="oom", then=((3, "engine_oom_death"),))
    calls = calls_over(engine, FixedBatchPolicy(4), faults)
    out = summarize(calls, [("le128", list(range(24)))], [[1] * 20] * 24, Sampling(4))
    assert all(c.error is None for _, c in out.values())
    assert calls.calls.feeder.totals.oom_retries == 2 and len(engine.rebuilds) == 1
    assert faults.pending == []


def test_a_core_drill_waits_for_a_core_process_to_end():
    class Unlisted(FakeEngine):
        """An engine whose core is not found the first two times it is looked for."""
        tries = 0

        def kill_core(self, memory=False):
            self.tries += 1
            return self.tries > 2 and super().kill_core(memory)

    engine = Unlisted()
    faults = FaultInjector(at=1, kind="engine_oom_death")
    calls = calls_over(engine, FixedBatchPolicy(4), faults)
    out = summarize(calls, [("le128", list(range(24)))], [[1] * 20] * 24, Sampling(4))
    assert all(c.error is None for _, c in out.values())
    assert engine.tries == 3 and len(engine.rebuilds) == 1 and faults.pending == []
