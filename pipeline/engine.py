"""A thin wrapper over vLLM: token ids and sampling in, completions out.

The engine knows nothing about rows, templates or buckets. It takes prompts
that are already token ids (the prepare stage tokenized them, so the engine's
own tokenizer is not run twice) and drives vLLM's `LLMEngine` step by step.
Stepping by hand, rather than calling `LLM.generate`, is what lets it time
each request to its own completion, reject one bad prompt without failing the
call, and sample the engine's metrics while it works.

`vllm` is imported inside the constructor so that the CLI and config checks
start without it.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from pipeline.config import EngineConfig, SamplingConfig

log = logging.getLogger(__name__)

GAUGE_INTERVAL_S = 0.05


@dataclass(frozen=True)
class Completion:
    """One prompt's result. `error` is set, and `text` is None, when it failed."""

    text: str | None
    output_tokens: int
    latency_s: float
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class EngineCallStats:
    """What one `generate` call did, for the report and the batch policy."""

    rows: int
    wall_s: float
    output_tokens: int
    steps: int
    peak_kv_cache_usage: float = 0.0
    preemptions: int = 0
    rejected: int = 0


@dataclass
class _Pending:
    index: int
    submitted: float
    done: Completion | None = field(default=None)


def engine_kwargs(model: str, engine: EngineConfig, seed: int | None) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM`, from the profile's engine section."""
    kwargs: dict[str, Any] = {
        "model": model,
        "dtype": engine.dtype,
        "gpu_memory_utilization": engine.gpu_memory_utilization,
        "enforce_eager": engine.enforce_eager,
        # Stats on: they are how the engine reports KV-cache use and preemptions.
        "disable_log_stats": False,
        "seed": seed if seed is not None else 0,
    }
    optional = {
        "max_model_len": engine.max_model_len,
        "num_gpu_blocks_override": engine.num_gpu_blocks_override,
        "max_num_seqs": engine.max_num_seqs,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    kwargs.update(engine.extra)
    return kwargs


class VLLMEngine:
    """One vLLM engine, built once and reused for every call."""

    def __init__(self, model: str, engine: EngineConfig, seed: int | None = 0):
        if engine.cpu_kvcache_space_gib is not None:
            # Read by the CPU backend when the engine core starts.
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(engine.cpu_kvcache_space_gib)
        from vllm import LLM

        self.kwargs = engine_kwargs(model, engine, seed)
        started = time.monotonic()
        self._llm = LLM(**self.kwargs)
        self.startup_s = time.monotonic() - started
        self._engine = self._llm.llm_engine
        self._next_id = 0
        cache = self._engine.vllm_config.cache_config
        self.max_model_len: int = self._engine.vllm_config.model_config.max_model_len
        self.kv_cache_tokens: int | None = (
            cache.num_gpu_blocks * cache.block_size if cache.num_gpu_blocks else None
        )

    def _sampling(self, sampling: SamplingConfig) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            max_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=sampling.seed,
        )

    def _gauges(self) -> tuple[float, int]:
        """(KV-cache usage 0..1, preemptions so far), read while the engine works."""
        usage, preemptions = 0.0, 0
        for metric in self._llm.get_metrics():
            if metric.name == "vllm:kv_cache_usage_perc":
                usage = max(usage, float(metric.value))
            elif metric.name == "vllm:num_preemptions":
                preemptions += int(metric.value)
        return usage, preemptions

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig
    ) -> tuple[list[Completion], EngineCallStats]:
        """Run `prompts` (token ids) to completion; one Completion per prompt, in order.

        A prompt the engine refuses (too long for the context, say) gets a
        Completion with `error` set; the others run as usual.
        """
        params = self._sampling(sampling)
        started = time.monotonic()
        _, preempted_before = self._gauges()
        pending: dict[str, _Pending] = {}
        results: list[Completion | None] = [None] * len(prompts)
        rejected = 0

        # 1. Submit everything; the engine's scheduler decides what runs when.
        for i, ids in enumerate(prompts):
            request_id = f"req-{self._next_id}"
            self._next_id += 1
            try:
                self._engine.add_request(request_id, {"prompt_token_ids": ids}, params)
            except Exception as e:  # vLLM validates per request: isolate the culprit.
                results[i] = Completion(None, 0, 0.0, error=f"{type(e).__name__}: {e}")
                rejected += 1
                continue
            pending[request_id] = _Pending(i, time.monotonic())

        # 2. Step until every request finishes, timing each to its own completion.
        steps, output_tokens, peak_usage = 0, 0, 0.0
        last_sample = 0.0
        while self._engine.has_unfinished_requests():
            outputs = self._engine.step()
            steps += 1
            now = time.monotonic()
            for out in outputs:
                if not out.finished:
                    continue
                p = pending[out.request_id]
                first = out.outputs[0]
                results[p.index] = Completion(
                    text=first.text,
                    output_tokens=len(first.token_ids),
                    latency_s=now - p.submitted,
                    finish_reason=first.finish_reason,
                )
                output_tokens += len(first.token_ids)
            # KV usage reads 0 once requests finish, so sample it mid-flight,
            # but not every step: collecting metrics costs about a step's time
            # on a tiny model.
            if now - last_sample >= GAUGE_INTERVAL_S:
                usage, _ = self._gauges()
                peak_usage = max(peak_usage, usage)
                last_sample = now

        _, preempted_after = self._gauges()
        missing = [i for i, r in enumerate(results) if r is None]
        if missing:
            raise RuntimeError(f"engine finished without results for prompts {missing[:5]}")
        stats = EngineCallStats(
            rows=len(prompts),
            wall_s=time.monotonic() - started,
            output_tokens=output_tokens,
            steps=steps,
            peak_kv_cache_usage=peak_usage,
            preemptions=preempted_after - preempted_before,
            rejected=rejected,
        )
        return [r for r in results if r is not None], stats

    def close(self) -> None:
        """Stop the engine core process now rather than at interpreter exit."""
        core = getattr(self._engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
