"""What the generation core asks of an engine, and the plain data it passes.

An engine takes prompts that are already token ids and a `Sampling`, and is
stepped by its caller (the feeder): `submit` queues one request, `step` runs
the engine once and returns the requests it finished, `abort` drops requests.
It knows nothing about rows, templates, buckets or config files. vLLM is one
implementation (`pipeline.generation.vllm`); the unit tests use a fake with
this interface.

Failures an engine must translate into these types, so that callers never
recognise an error by its class name:
- `EngineDead`: the engine can no longer run (its core process died). Of memory,
  the caller rebuilds it smaller with `rebuild` and retries what was in flight;
  else the caller raises `EngineCrashed` and the actor is started afresh.
- an out-of-memory: any exception for which `is_oom` is true.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from typing import Any, Protocol


@dataclass(frozen=True)
class Completion:
    """One prompt's result. `error` is set, and `text` is None, when it failed."""

    text: str | None
    output_tokens: int
    latency_s: float
    finish_reason: str | None = None
    error: str | None = None
    first_token_s: float | None = None  # submit to first token, where the engine reports it
    finished_at: float | None = None  # time.monotonic() when the feeder saw it finish


@dataclass(frozen=True)
class Sampling:
    """How to sample one request: the single source of its token limit."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    json_schema: dict[str, Any] | None = None  # constrain the output to this JSON Schema
    allowed_token_ids: tuple[int, ...] | None = None  # sample only these tokens (vLLM)

    def with_room(self, max_new_tokens: int, json_schema: dict[str, Any] | None = None) -> Sampling:
        return replace(self, max_new_tokens=max_new_tokens,
                       json_schema=json_schema if json_schema is not None else self.json_schema)


@dataclass
class PaddingTotals:
    """Prompt tokens as the batches ran them (padded) against the rows' own."""

    padded: int = 0
    real: int = 0
    batches: int = 0
    by_bucket: dict[str, list[int]] = field(default_factory=dict)  # bucket -> [padded, real]

    def add(self, padded: int, real: int, bucket: str | None = None) -> None:
        self.padded += padded
        self.real += real
        self.batches += 1
        if bucket is not None:
            pair = self.by_bucket.setdefault(bucket, [0, 0])
            pair[0] += padded
            pair[1] += real

    def since(self, padded: int, real: int) -> tuple[int, int]:
        """(padded, real) added since the totals were (padded, real)."""
        return self.padded - padded, self.real - real

    @staticmethod
    def fraction(padded: int, real: int) -> float:
        """The share of the prompt tokens run that were padding."""
        return 0.0 if padded <= 0 else round((padded - real) / padded, 4)

    def to_json(self) -> dict[str, Any]:
        return {"padded_tokens": self.padded, "real_tokens": self.real, "batches": self.batches,
                "padding_fraction": self.fraction(self.padded, self.real),
                "by_bucket": {b: {"padded_tokens": p, "real_tokens": r, "padding_fraction": self.fraction(p, r)}
                              for b, (p, r) in self.by_bucket.items()}}


class EngineDead(RuntimeError):
    """The engine cannot run any more (its core process is gone). `memory`: the core said
    why, and it was memory; the caller rebuilds it smaller. Otherwise it crashed (or was
    killed): see `EngineCrashed`."""

    def __init__(self, message: str, memory: bool = False):
        super().__init__(message)
        self.memory = memory


class EngineCrashed(RuntimeError):
    """The engine core died of something other than memory, or stopped making progress.
    Nothing in this process is to be trusted with it: the actor ends, Ray starts a fresh
    one (up to `engine.max_restarts` times) and retries the blocks it held."""


def is_oom(error: BaseException) -> bool:
    """An out-of-memory during generation: CUDA's own, an injected one, or a dead engine
    (how an OOM in a separate engine process surfaces)."""
    if isinstance(error, EngineDead):
        return error.memory
    if isinstance(error, MemoryError):
        return True
    torch = sys.modules.get("torch")  # loaded wherever a torch engine runs; never imported here
    if torch is not None and isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    return "out of memory" in str(error).lower()


class Engine(Protocol):
    """A steppable engine: what the feeder, the generate stage and the metrics call, and
    nothing more (`tests/unit/generation/test_engine_protocol.py` checks that both engines have
    every member). `max_num_seqs` is how many requests it runs at once (it queues the
    rest itself); `max_model_len` is the longest prompt plus output it takes;
    `kv_cache_tokens` its KV-cache capacity where it has one. `pads_batches`: it runs
    each batch padded to its longest prompt (static batches), so the feeder charges a
    batch its rows times its longest; `padding` is then what that cost, else None. The
    start-up and rebuild records are for the report."""

    max_num_seqs: int
    max_model_len: int
    kv_cache_tokens: int | None
    startup_s: float
    startup_attempts: list[dict[str, Any]]
    rebuilds: list[dict[str, Any]]
    pads_batches: bool
    padding: PaddingTotals | None

    def submit(self, prompt_token_ids: list[int], sampling: Sampling) -> str:
        """Queue one request; raises if the engine refuses it (too long, say)."""
        ...

    def step(self) -> list[tuple[str, Completion]]:
        """Run once; the requests finished, latency left for the caller to fill in."""
        ...

    def abort(self, request_ids: list[str]) -> None: ...

    def kv_gauges(self) -> tuple[float, int]:
        """(KV-cache usage 0..1 at the last step, preemptions so far)."""
        ...

    def preempted(self) -> list[str] | None:
        """The ids of requests preempted since the last call (a request preempted twice
        is there twice). None: the engine cannot say which, and the feeder charges each
        preemption to every call with rows in flight."""
        ...

    def rebuild(self, reason: str) -> None:
        """Replace a dead engine with one that asks for less memory."""
        ...

    def kill_core(self, memory: bool = False) -> bool:
        """Fault injection and the stall watchdog: end the engine's core abruptly, as the
        kernel's OOM killer would (`memory`: as if it died of memory). False: it found no
        core process to end."""
        ...

    def metric_families(self) -> list[dict[str, Any]]:
        """The engine's own Prometheus metric families, as plain data ([] if it has none)."""
        ...

    def worker_cpus(self) -> dict[int, list[int]]:
        """The CPUs its worker processes are bound to, by pid ({} where it has none apart
        from its own process, or binds none)."""
        ...

    def step_timeline(self) -> dict[str, Any] | None:
        """The steps since the last time it was asked (start, duration, load, as columns),
        where it records them (`debug.step_timeline`); else None."""
        ...

    def close(self) -> None:
        """Stop the engine and free its memory now."""
        ...
