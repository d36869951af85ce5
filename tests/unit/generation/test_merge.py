"""Identical prompts generated once (pipeline/generation/merge.py), through `EngineCalls`
over the real feeder and a fake engine; real vLLM serves merged rows in
tests/integration/run/test_real_model.py."""

from __future__ import annotations

import threading

import pytest

from pipeline.generation.engine import Completion, Sampling
from pipeline.generation.feeder import EngineFeeder
from pipeline.generation.merge import IdenticalPrompts, merge_key
from pipeline.generation.policy import BatchSizeController, ControllerSettings
from pipeline.generation.tasks import CallKind, EngineCalls
from tests.helpers.fake_engine import FakeEngine

GREEDY = Sampling(max_new_tokens=4)


def engine_calls(engine: FakeEngine, merge: bool = True) -> EngineCalls:
    feeder = EngineFeeder(engine, BatchSizeController(ControllerSettings(), initial_budget_tokens=4000))
    return EngineCalls(feeder, "a", lambda: {}, lambda: {}, IdenticalPrompts() if merge else None)


def echo(ids: list[int], sampling: Sampling) -> str:
    return f"summary of {ids[0]}"


def test_rows_merge_only_when_their_tokens_and_sampling_agree():
    assert merge_key([1, 2, 3], GREEDY) == merge_key([1, 2, 3], Sampling(max_new_tokens=4))
    assert merge_key([1, 2, 3], GREEDY) != merge_key([1, 2, 4], GREEDY)
    assert merge_key([1, 2, 3], GREEDY) != merge_key([1, 2, 3], Sampling(max_new_tokens=5))
    assert merge_key([1, 2, 3], GREEDY) != merge_key([1, 2, 3], GREEDY.with_room(4, {"type": "object"}))
    seeded = Sampling(max_new_tokens=4, temperature=0.8, seed=7)
    assert merge_key([1, 2, 3], seeded) == merge_key([1, 2, 3], Sampling(max_new_tokens=4, temperature=0.8, seed=7))
    assert merge_key([1, 2, 3], seeded) != merge_key([1, 2, 3], Sampling(max_new_tokens=4, temperature=0.8, seed=8))
    # Unseeded sampling: every row's result is its own.
    assert merge_key([1, 2, 3], Sampling(max_new_tokens=4, temperature=0.8)) is None


def test_every_row_comes_out_once_with_its_own_position_and_one_request_per_prompt():
    engine = FakeEngine(reply=echo)
    calls = engine_calls(engine)
    items = [(0, [5] * 20), (1, [6] * 20), (2, [5] * 20), (3, [5] * 20), (4, [7] * 20)]
    _, out = calls.serve("le128", items, GREEDY, CallKind.ROWS)
    assert sorted(out) == [0, 1, 2, 3, 4]
    assert [out[i].text for i in range(5)] == ["summary of 5", "summary of 6", "summary of 5", "summary of 5",
                                               "summary of 7"]
    assert len(engine.submitted) == 3 and calls.merged == {"rows": 2}
    # A later call's duplicates take the kept result; unseeded sampling never merges.
    record, again = calls.serve("le128", [(9, [6] * 20), (10, [8] * 20)], GREEDY, CallKind.ROWS)
    assert again[9].text == "summary of 6" and record.record.rows == 1 and len(engine.submitted) == 4
    hot = Sampling(max_new_tokens=4, temperature=0.8)
    calls.serve("le128", [(0, [5] * 20), (1, [5] * 20)], hot, CallKind.ROWS)
    assert len(engine.submitted) == 6 and calls.merged == {"rows": 3}


def test_the_setting_off_gives_every_row_its_own_request():
    engine = FakeEngine(reply=echo)
    calls = engine_calls(engine, merge=False)
    _, out = calls.serve("le128", [(0, [5] * 20), (1, [5] * 20)], GREEDY, CallKind.ROWS)
    assert len(out) == 2 and len(engine.submitted) == 2 and calls.merged == {}


def test_an_error_on_the_shared_request_reaches_every_merged_row_and_is_not_kept():
    engine = FakeEngine(reply=echo)
    tried: list[int] = []
    submit = engine.submit
    engine.submit = lambda ids, sampling: tried.append(len(ids)) or submit(ids, sampling)
    calls = engine_calls(engine)
    # The fake refuses prompts over 1,000 tokens: an error row, as vLLM's refusals are.
    _, out = calls.serve("le2048", [(0, [5] * 1200), (1, [5] * 1200), (2, [6] * 20)], GREEDY, CallKind.ROWS)
    assert out[0].error and out[1].error == out[0].error and out[2].error is None
    assert tried.count(1200) == 1
    _, later = calls.serve("le2048", [(3, [5] * 1200)], GREEDY, CallKind.ROWS)
    assert later[3].error and tried.count(1200) == 2  # tried again, not taken from a kept error


class GatedEngine(FakeEngine):
    """Completes nothing until `go` is set: a call whose request another call waits on."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.go = threading.Event()

    def step(self):
        self.go.wait(5)
        return super().step()


def test_a_call_waits_for_the_identical_request_another_call_is_generating():
    engine = GatedEngine(reply=echo)
    calls = engine_calls(engine)
    results: dict[str, dict[int, Completion]] = {}
    first = threading.Thread(target=lambda: results.__setitem__(
        "first", calls.serve("le128", [(0, [5] * 20)], GREEDY, CallKind.ROWS)[1]))
    first.start()
    while not engine.submitted:
        pass
    second = threading.Thread(target=lambda: results.__setitem__(
        "second", calls.serve("le128", [(7, [5] * 20)], GREEDY, CallKind.ROWS)[1]))
    second.start()
    engine.go.set()
    first.join(10), second.join(10)
    assert results["first"][0].text == results["second"][7].text == "summary of 5"
    assert len(engine.submitted) == 1 and calls.merged == {"rows": 1}


def test_an_engine_failure_fails_the_calls_waiting_on_it_too():
    merge = IdenticalPrompts()
    owner = merge.plan([(0, [5] * 20)], GREEDY)
    waiter = merge.plan([(1, [5] * 20)], GREEDY)
    assert waiter.waits and not waiter.fresh
    merge.fail(owner, RuntimeError("engine core died"))
    with pytest.raises(RuntimeError, match="engine core died"):
        merge.finish(waiter, {})
    # Nothing kept and nothing pending: the retried rows are generated afresh.
    assert merge.plan([(2, [5] * 20)], GREEDY).fresh
