"""The per-step readings of a vLLM engine, on a fake `LLMEngine` with vLLM's two hooks:
`step()` and the stat logger manager's `record(scheduler_stats, iteration_stats)`."""

from types import SimpleNamespace as NS

from pipeline.generation.vllm_steps import TIMELINE_COLUMNS, StepTap, StepTimeline, joined
from pipeline.observe.report import actor_summaries


class FakeLLMEngine:
    """Each step records its stats as vLLM's does, at the end of the step."""

    def __init__(self, loads):
        self.loads = list(loads)  # per step: (running, waiting, prompt tokens, generated tokens, preempted)
        self.recorded = 0
        self.logger_manager = NS(record=self._record)

    def _record(self, scheduler_stats=None, iteration_stats=None, mm_cache_stats=None):
        self.recorded += 1

    def step(self):
        running, waiting, prompt, generated, preempted = self.loads.pop(0)
        scheduler = NS(kv_cache_usage=running / 10, num_running_reqs=running, num_waiting_reqs=waiting,
                       prefix_cache_stats=NS(queries=prompt, hits=prompt // 2))
        iteration = NS(num_prompt_tokens=prompt, num_generation_tokens=generated, num_preempted_reqs=preempted)
        self.logger_manager.record(scheduler_stats=scheduler, iteration_stats=iteration, mm_cache_stats=None)
        return [f"out-{running}"]


def test_the_tap_reads_every_step_and_still_hands_the_stats_on():
    engine = FakeLLMEngine([(4, 2, 100, 4, 0), (6, 0, 20, 6, 1)])
    tap = StepTap(engine)
    assert tap.kv_usage is None
    engine.step()
    engine.step()
    assert tap.kv_usage == 0.6 and tap.preemptions == 1
    assert (tap.prefix_queries, tap.prefix_hits) == (120, 60)
    assert engine.recorded == 2  # vLLM's own loggers still see every step


def test_the_tap_names_the_requests_vllm_preempted_by_our_ids():
    """vLLM's outputs carry a PREEMPTED event for a request it runs again after preempting
    it; the tap maps vLLM's internal id to ours before the processor drops a finished one."""
    from vllm.v1.engine import EngineCoreEventType as Event

    processed = []
    processor = NS(request_states={"req-1-ab12": NS(external_req_id="req-1"),
                                   "req-2-cd34": NS(external_req_id="req-2")},
                   process_outputs=lambda outputs, *a, **k: processed.append(len(outputs)))
    engine = FakeLLMEngine([])
    engine.output_processor = processor
    tap = StepTap(engine)
    outputs = [NS(request_id="req-1-ab12", events=None),
               NS(request_id="req-2-cd34", events=[NS(type=Event.SCHEDULED), NS(type=Event.PREEMPTED)])]
    processor.process_outputs(outputs, 0.0, None)
    assert processed == [2]  # vLLM's own processing still runs, on every output
    assert tap.take_preempted() == ["req-2"] and tap.take_preempted() == []
    assert StepTap(FakeLLMEngine([])).take_preempted() is None  # no processor: it can't say


def test_with_a_timeline_each_step_is_timed_with_its_load():
    engine = FakeLLMEngine([(4, 2, 100, 4, 0), (6, 0, 20, 6, 0), (3, 0, 0, 3, 0)])
    timeline = StepTimeline()
    StepTap(engine, timeline)
    assert [engine.step() for _ in range(2)] == [["out-4"], ["out-6"]]
    first = timeline.take()
    assert first["running"] == [4, 6] and first["waiting"] == [2, 0]
    assert first["prompt_tokens"] == [100, 20] and first["generated_tokens"] == [4, 6]
    assert first["start"][0] <= first["start"][1] and all(s >= 0 for s in first["seconds"])
    engine.step()
    second = timeline.take()  # only what came since the last take
    assert second["running"] == [3] and len(timeline) == 0
    whole = joined([second, first])
    assert whole["running"] == [4, 6, 3] and whole["dropped"] == 0
    assert set(whole) == {*TIMELINE_COLUMNS, "dropped"}


def test_past_the_limit_steps_are_counted_not_kept():
    timeline = StepTimeline(limit=2)
    for k in range(5):
        timeline.add(float(k), 0.01, 1, 0, 0, 1)
    taken = timeline.take()
    assert taken["start"] == [0.0, 1.0] and taken["dropped"] == 3


def test_the_report_joins_each_actors_steps_from_all_its_calls():
    def call(actor, calls, starts):
        steps = {"start": starts, "seconds": [0.01] * len(starts), "running": [1] * len(starts),
                 "waiting": [0] * len(starts), "prompt_tokens": [0] * len(starts),
                 "generated_tokens": [1] * len(starts), "dropped": 0}
        return {"actor": {"actor": actor, "calls": calls, "windows": calls, "busy_s": float(calls),
                          "step_timeline": steps}}

    actors = actor_summaries([call("a", 1, [1.0, 2.0]), call("b", 1, [1.5]), call("a", 2, [3.0])])
    by = {a["actor"]: a for a in actors}
    assert by["a"]["step_timeline"]["start"] == [1.0, 2.0, 3.0]
    assert by["b"]["step_timeline"]["start"] == [1.5]
