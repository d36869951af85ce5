"""Hugging Face transformers as an engine: static, padded batches, decoder-only or
encoder-decoder, where memory grows with rows x padded length.

vLLM preallocates its memory and batches continuously, so a mixed batch costs it
little. Plain `model.generate` is the opposite: every row of a batch is padded to
the batch's longest prompt, and the batch's memory (activations and the KV cache)
grows with rows x padded length until a real out-of-memory. That is where length
buckets and memory-driven batch sizes pay most, and where vLLM can't go: encoder-
decoder summarizers (BART, T5, Pegasus), and machines without vLLM.

The same `Engine` protocol as vLLM (`pipeline.generation.engine`): `submit` queues a
request, `step` runs every queued request as one static batch and returns them all
finished. The feeder in `drain` mode (which this backend always uses) admits one
call's rows at a time, so a batch never mixes buckets.

Memory, as one pressure in 0..1 (`kv_gauges`, which the feeder's probe reads after
each step): the batch's peak over the memory this engine may use.
- CUDA: `torch.cuda.max_memory_reserved` over the batch, against the device's memory
  times `memory_fraction`, or `memory_budget_gib`. Before each batch the allocator's
  cache is emptied and its peaks reset, so the peak is this batch's own. Reserved, not
  allocated: the cap (and a full device) refuses the allocator's blocks, which its
  fragmentation makes larger than the tensors in them. On an H200 the allocated peak
  read 0.76-0.83 of the cap at the batch before an out-of-memory (bench/results/gpu/).
- CPU: PyTorch has no peak figure per batch on CPU, and an out-of-memory there can't
  be caught (the kernel kills the process). So the memory is estimated: the weights,
  plus a cost per batch token (rows x (padded prompt + new tokens)) calibrated on the
  first batches from the process's peak resident memory above its level before the
  batch (sampled every 5 ms while it runs), against `memory_budget_gib`. The
  controller then keeps the estimate under its target; it never meets a real OOM.

This module imports torch and transformers only when an engine is built, and nothing
of Ray, pydantic or psutil at all: `pipeline.tools.gpucheck` runs it on a machine that
has only torch, transformers, nvidia-ml-py and pyarrow.
"""

from __future__ import annotations

import itertools
from collections import deque
import threading
import time
from dataclasses import dataclass
from typing import Any

from pipeline.generation.engine import Completion, PaddingTotals, Sampling, is_oom
from pipeline.generation.memory import resident_bytes

GIB = 2**30
CALIBRATION_BATCHES = 3


@dataclass(frozen=True)
class HFSettings:
    """What a transformers engine is built with."""

    model: str
    dtype: str = "auto"  # auto, bfloat16, float16, float32
    device: str = "auto"  # auto: cuda when there is one, else cpu
    max_model_len: int | None = None  # default: the model's
    max_num_seqs: int = 256  # rows in one batch at most
    memory_budget_gib: float | None = None  # the memory this engine may use; CPU: required
    memory_fraction: float = 1.0  # CUDA without a budget: this share of the device
    seed: int | None = None


def padded_tokens(batches: list[list[int]]) -> tuple[int, int]:
    """(padded, real) prompt tokens of static batches, each a list of prompt lengths:
    what a batch plan costs this engine before it runs."""
    return sum(len(b) * max(b) for b in batches if b), sum(sum(b) for b in batches)


class _PeakRSS:
    """This process's peak resident memory while a block of code runs (CPU)."""

    def __init__(self, every_s: float = 0.005):
        self.every_s, self.peak, self._stop = every_s, 0, threading.Event()

    rss = staticmethod(resident_bytes)

    def __enter__(self) -> _PeakRSS:
        self.before = self.peak = self.rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, self.rss())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


class TransformersEngine:
    """One transformers model, kept loaded; each `step` is one static batch."""

    pads_batches = True  # the feeder charges a batch its rows x its longest row

    def __init__(self, settings: HFSettings, model: Any = None, tokenizer: Any = None):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

        started = time.monotonic()
        self.settings = settings
        self.torch = torch
        device = settings.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = device
        self.cuda = device.startswith("cuda")
        self.device_api = torch.cuda if self.cuda else None
        # `model` and `tokenizer`: built already (the GPU check's random model), else loaded.
        config = model.config if model is not None else AutoConfig.from_pretrained(settings.model)
        self.encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
        if model is None:
            dtype = {"auto": "auto", "bfloat16": torch.bfloat16, "float16": torch.float16,
                     "float32": torch.float32}[settings.dtype]
            model_cls = AutoModelForSeq2SeqLM if self.encoder_decoder else AutoModelForCausalLM
            model = model_cls.from_pretrained(settings.model, dtype=dtype)
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(settings.model)
        gen = self.model.generation_config
        self.eos_ids = {i for i in _as_list(gen.eos_token_id if gen.eos_token_id is not None
                                            else self.tokenizer.eos_token_id) if i is not None}
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else gen.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_ids, default=0)
        self.max_model_len = settings.max_model_len or _context_length(config)
        self.max_num_seqs = settings.max_num_seqs
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.budget_bytes = self._budget()
        self.kv_cache_tokens: int | None = None  # set once the cost per token is known
        self.token_bytes: float | None = None  # memory per batch token, measured
        self.startup_s = time.monotonic() - started
        self.startup_attempts: list[dict[str, Any]] = [{"device": device, "weights_gib": round(
            self.weights_bytes / GIB, 3), "budget_gib": round(self.budget_bytes / GIB, 3)}]
        self.rebuilds: list[dict[str, Any]] = []
        self.padding = PaddingTotals()  # by bucket: the feeder, which knows each batch's bucket
        self.peaks: deque[dict[str, Any]] = deque(maxlen=100_000)  # per batch: rows, padded length, pressure
        self._queue: dict[str, tuple[list[int], Sampling]] = {}
        self._ids = itertools.count()
        self._pressure = 0.0
        self._calibrations: list[float] = []

    # --- memory -----------------------------------------------------------------------

    def _budget(self) -> int:
        s = self.settings
        if s.memory_budget_gib is not None:
            return int(s.memory_budget_gib * GIB)
        if self.cuda:
            total = self.device_api.get_device_properties(self.device).total_memory
            return int(total * s.memory_fraction)
        raise ValueError("engine.memory_budget_gib is needed on CPU: an out-of-memory there can't be caught, "
                         "so the batch grows against a budget instead")

    def kv_gauges(self) -> tuple[float, int]:
        """(the last batch's peak memory over this engine's budget, 0): no preemptions here."""
        return self._pressure, 0

    def preempted(self) -> list[str] | None:
        """None preempted, ever: a batch that does not fit runs out of memory instead."""
        return []

    def _learn_token_cost(self, extra_bytes: int, tokens: int) -> None:
        """Memory per batch token beyond the weights, from a batch's peak; the capacity in
        tokens follows, which the batch controller starts each new bucket from."""
        if tokens <= 0:
            return
        if len(self._calibrations) < CALIBRATION_BATCHES:
            self._calibrations.append(max(extra_bytes, 0) / tokens)
        # The first batch also pays one-time allocations (kernels, caches): once there is
        # another, it no longer counts. Then the largest of the first few: the estimate
        # keeps to what it has seen, and what a batch is seen to take guards the rest.
        self.token_bytes = max(self._calibrations[1:] or self._calibrations)
        if self.token_bytes > 0:
            self.kv_cache_tokens = int(max(self.budget_bytes - self.weights_bytes, 0) / self.token_bytes)

    # --- the Engine protocol ----------------------------------------------------------------

    def submit(self, prompt_token_ids: list[int], sampling: Sampling) -> str:
        if sampling.json_schema is not None or sampling.allowed_token_ids is not None:
            raise ValueError("structured outputs and allowed_token_ids need engine.backend: vllm")
        if len(prompt_token_ids) + sampling.max_new_tokens > self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_token_ids)} tokens + {sampling.max_new_tokens} new is longer "
                             f"than the model's context ({self.max_model_len})")
        rid = f"hf-{next(self._ids)}"
        self._queue[rid] = (list(prompt_token_ids), sampling)
        return rid

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._queue.pop(rid, None)

    def step(self) -> list[tuple[str, Completion]]:
        """Every queued request (up to max_num_seqs) as one static batch; all finish."""
        batch = list(itertools.islice(self._queue.items(), self.max_num_seqs))
        for rid, _ in batch:
            del self._queue[rid]
        out: list[tuple[str, Completion]] = []
        by_sampling: dict[tuple[Any, ...], list[tuple[str, list[int], Sampling]]] = {}
        for rid, (ids, sampling) in batch:
            by_sampling.setdefault((sampling.temperature, sampling.top_p, sampling.seed), []).append(
                (rid, ids, sampling))
        for group in by_sampling.values():
            out += self._run(group)
        return out

    def _run(self, group: list[tuple[str, list[int], Sampling]]) -> list[tuple[str, Completion]]:
        torch = self.torch
        rows, longest = len(group), max(len(ids) for _, ids, _ in group)
        new = max(s.max_new_tokens for _, _, s in group)
        first = group[0][2]
        input_ids = torch.full((rows, longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((rows, longest), dtype=torch.long)
        for k, (_, ids, _) in enumerate(group):
            if self.encoder_decoder:  # the encoder reads right-padded input
                input_ids[k, :len(ids)], mask[k, :len(ids)] = torch.tensor(ids), 1
            else:  # a decoder continues from the last position: pad on the left
                input_ids[k, longest - len(ids):], mask[k, longest - len(ids):] = torch.tensor(ids), 1
        kwargs: dict[str, Any] = {"max_new_tokens": new, "pad_token_id": self.pad_id,
                                  "eos_token_id": sorted(self.eos_ids) or None}
        if first.temperature > 0:
            kwargs.update(do_sample=True, temperature=first.temperature, top_p=first.top_p)
            if first.seed is not None:
                torch.manual_seed(first.seed)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        tokens = rows * (longest + new)
        started = time.monotonic()
        try:
            with torch.inference_mode(), self._measure(tokens) as measured:
                generated = self.model.generate(input_ids=input_ids.to(self.device),
                                                attention_mask=mask.to(self.device), **kwargs)
        except BaseException as e:
            if is_oom(e):
                self.peaks.append({"rows": rows, "padded_len": longest, "new_tokens": new, "pressure": 1.0,
                                   "oom": True, "s": round(time.monotonic() - started, 4)})
            if self.cuda:
                self.device_api.empty_cache()  # what the failed batch held, back for the retry
            raise
        self.padding.add(rows * longest, sum(len(ids) for _, ids, _ in group))
        peak = {"rows": rows, "padded_len": longest, "new_tokens": new, "pressure": round(self._pressure, 4),
                "s": round(time.monotonic() - started, 4)}
        if measured.allocated is not None:  # CUDA: what the tensors took, beside what the allocator held
            peak["allocated"] = round(measured.allocated / self.budget_bytes, 4)
        self.peaks.append(peak)
        start = 1 if self.encoder_decoder else longest  # a decoder's output repeats its prompt
        finished = []
        for k, (rid, _, sampling) in enumerate(group):
            ids = generated[k, start:start + sampling.max_new_tokens].tolist()
            stop = next((i for i, t in enumerate(ids) if t in self.eos_ids), None)
            kept = ids if stop is None else ids[:stop]  # after its end a row holds only padding
            text = self.tokenizer.decode(kept, skip_special_tokens=True)
            finished.append((rid, Completion(text, len(kept), 0.0, "stop" if stop is not None else "length")))
        return finished

    class _Measured:
        def __init__(self, engine: TransformersEngine, tokens: int):
            self.engine, self.tokens = engine, tokens
            self.allocated: int | None = None  # CUDA: the batch's peak of allocated tensors

        def __enter__(self) -> TransformersEngine._Measured:
            e = self.engine
            if e.cuda:
                e.device_api.empty_cache()  # the last batch's cached blocks: not this batch's
                e.device_api.reset_peak_memory_stats(e.device)
            else:
                self.rss = _PeakRSS().__enter__()
            return self

        def __exit__(self, kind: Any, *exc: Any) -> None:
            e = self.engine
            if e.cuda:
                peak = e.device_api.max_memory_reserved(e.device)
                self.allocated = e.device_api.max_memory_allocated(e.device)
                if kind is None:
                    e._learn_token_cost(peak - e.weights_bytes, self.tokens)
                e._pressure = peak / e.budget_bytes
                return
            self.rss.__exit__()
            extra = self.rss.peak - self.rss.before
            if kind is None:
                e._learn_token_cost(extra, self.tokens)
            if e.token_bytes is not None:
                # The estimate, or what the batch was seen to take if that was more: attention's
                # memory grows faster than its tokens on long padded batches, and the next
                # batch of the bucket then backs off instead of growing.
                e._pressure = max(e.weights_bytes + e.token_bytes * self.tokens, e.weights_bytes + extra) / e.budget_bytes

    def _measure(self, tokens: int) -> TransformersEngine._Measured:
        return self._Measured(self, tokens)

    # --- the rest of the protocol -------------------------------------------------------

    def rebuild(self, reason: str) -> None:
        """Nothing runs apart from this process: an out-of-memory leaves the model usable."""
        self.rebuilds.append({"reason": reason, "at": time.time(), "action": "none"})

    def metric_families(self) -> list[dict[str, Any]]:
        """transformers keeps no Prometheus metrics of its own."""
        return []

    def worker_cpus(self) -> dict[int, list[int]]:
        """None: the model runs in this process."""
        return {}

    def step_timeline(self) -> dict[str, Any] | None:
        """Not recorded: a static batch is one `generate` call, not steps."""
        return None

    def kill_core(self, memory: bool = False) -> bool:
        """There is no core process apart from this one: a hung step ends with the actor."""
        return False

    def close(self) -> None:
        self._queue.clear()
        self.model = None
        if self.cuda:
            self.device_api.empty_cache()


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple, set)) else [value]


def _context_length(config: Any) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 512  # T5's relative positions have no limit; its training length
