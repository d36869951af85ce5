"""What each vLLM engine step did, read from vLLM's own per-step stats.

vLLM's `LLMEngine.step` ends by handing the step's `SchedulerStats` (requests
running and waiting, KV-cache usage, prefix-cache lookups) and `IterationStats`
(prompt and generated tokens, preemptions) to its stat logger manager, when its
stats are on (`disable_log_stats: false`). `StepTap` wraps that one call, so
every step's readings are exact and cost nothing extra (`get_metrics()`
collects every Prometheus metric instead: about a millisecond, a sixth of a tiny
model's step). It also wraps the output processor's `process_outputs`, to learn
*which* requests were preempted (their outputs carry a PREEMPTED event, when the
scheduler runs them again), so a preemption can be charged to the rows it hit. Given a `StepTimeline`, it also times each `LLMEngine.step` call,
so the timeline holds when every step began, how long it took and what it ran,
and the gaps between steps are the caller's own time.

The engine wrapper (`pipeline.generation.vllm`) taps its engine; the benchmark
taps raw `LLM.generate`'s (bench/timeline.py), so the two are read alike.
"""

from __future__ import annotations

import threading
import time
from typing import Any

TIMELINE_COLUMNS = ("start", "seconds", "running", "waiting", "prompt_tokens", "generated_tokens")


class StepTimeline:
    """One row per engine step, as columns: its start (Unix time), its duration, the
    requests running and waiting after it, and the prompt and generated tokens it
    scheduled. `take` hands over the steps recorded since the last `take` (the generate
    stage sends them out with each engine call's record, so none is sent twice). At most
    `limit` steps are held between takes; `dropped` counts those past it."""

    def __init__(self, limit: int = 200_000) -> None:
        self.limit = limit
        self.columns: dict[str, list[float]] = {name: [] for name in TIMELINE_COLUMNS}
        self.dropped = 0
        self._lock = threading.Lock()  # the stepping thread adds, a finishing call's thread takes

    def add(self, start: float, seconds: float, running: int, waiting: int, prompt_tokens: int,
            generated_tokens: int) -> None:
        with self._lock:
            if len(self.columns["start"]) >= self.limit:
                self.dropped += 1
                return
            for name, value in zip(TIMELINE_COLUMNS, (start, seconds, running, waiting, prompt_tokens,
                                                      generated_tokens)):
                self.columns[name].append(value)

    def __len__(self) -> int:
        return len(self.columns["start"])

    def take(self) -> dict[str, Any]:
        """The steps since the last take, as JSON-ready columns (and how many were dropped)."""
        with self._lock:
            columns, dropped = self.columns, self.dropped
            self.columns, self.dropped = {name: [] for name in TIMELINE_COLUMNS}, 0
        return {"start": [round(t, 6) for t in columns["start"]],
                "seconds": [round(s, 6) for s in columns["seconds"]],
                **{name: [int(v) for v in columns[name]] for name in TIMELINE_COLUMNS[2:]},
                "dropped": dropped}


def joined(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """Timeline chunks (from `take`) as one timeline, in step order: each chunk is a run of
    consecutive steps, so the chunks are put in order by their first step."""
    ordered = sorted((c for c in chunks if c["start"]), key=lambda c: c["start"][0])
    out: dict[str, Any] = {name: [v for c in ordered for v in c[name]] for name in TIMELINE_COLUMNS}
    out["dropped"] = sum(c.get("dropped", 0) for c in chunks)
    return out


class StepTap:
    """Every step's stats, read where vLLM records them; and, with a timeline, each step timed.

    `kv_usage` is None until the first step has reported (or where the engine keeps no
    logger manager: another vLLM version, or stats off)."""

    def __init__(self, llm_engine: Any, timeline: StepTimeline | None = None) -> None:
        self.kv_usage: float | None = None
        self.preemptions = 0
        self.prefix_queries = self.prefix_hits = 0  # prompt tokens looked up in the prefix cache, and found
        # Our request ids of the requests preempted, as vLLM reports them; the engine
        # wrapper hands them out (`take_preempted`). None where the processor isn't there.
        self.preempted: list[str] | None = None
        self.timeline = timeline
        self._last: tuple[int, int, int, int] = (0, 0, 0, 0)  # running, waiting, prompt, generated
        manager = getattr(llm_engine, "logger_manager", None)
        self.tapped = manager is not None
        if manager is not None:
            manager.record = self._recorder(manager.record)
        processor = getattr(llm_engine, "output_processor", None)
        if self.tapped and processor is not None and hasattr(processor, "request_states"):
            self.preempted = []
            processor.process_outputs = self._preemption_reader(processor)
        if timeline is not None:
            llm_engine.step = self._timed(llm_engine.step)

    def take_preempted(self) -> list[str] | None:
        """Our ids of the requests preempted since the last take; None: vLLM can't say which."""
        if self.preempted is None:
            return None
        taken, self.preempted = self.preempted, []
        return taken

    def _preemption_reader(self, processor: Any) -> Any:
        """`process_outputs`, which first notes the requests whose outputs report a
        preemption: one pass over the step's outputs, whose `events` are None but for a
        request just queued, scheduled or preempted (stats on)."""
        from vllm.v1.engine import EngineCoreEventType

        original = processor.process_outputs
        preempted_type = EngineCoreEventType.PREEMPTED

        def process_outputs(engine_core_outputs: Any, *args: Any, **kwargs: Any) -> Any:
            for output in engine_core_outputs:
                if output.events and any(e.type == preempted_type for e in output.events):
                    state = processor.request_states.get(output.request_id)  # processed below: still there
                    if state is not None and self.preempted is not None:
                        self.preempted.append(state.external_req_id)
            return original(engine_core_outputs, *args, **kwargs)

        return process_outputs

    def _recorder(self, original: Any) -> Any:
        def record(scheduler_stats: Any = None, iteration_stats: Any = None, *args: Any, **kwargs: Any) -> Any:
            running = waiting = prompt = generated = 0
            if scheduler_stats is not None:
                self.kv_usage = float(scheduler_stats.kv_cache_usage)
                running, waiting = int(scheduler_stats.num_running_reqs), int(scheduler_stats.num_waiting_reqs)
                prefix = getattr(scheduler_stats, "prefix_cache_stats", None)
                if prefix is not None:
                    self.prefix_queries += int(prefix.queries)
                    self.prefix_hits += int(prefix.hits)
            if iteration_stats is not None:
                self.preemptions += int(getattr(iteration_stats, "num_preempted_reqs", 0))
                prompt, generated = int(iteration_stats.num_prompt_tokens), int(iteration_stats.num_generation_tokens)
            self._last = (running, waiting, prompt, generated)
            return original(scheduler_stats, iteration_stats, *args, **kwargs)

        return record

    def _timed(self, step: Any) -> Any:
        timeline = self.timeline
        assert timeline is not None

        def timed() -> Any:
            self._last = (0, 0, 0, 0)
            started, t = time.time(), time.perf_counter()
            outputs = step()
            timeline.add(started, time.perf_counter() - t, *self._last)
            return outputs

        return timed
