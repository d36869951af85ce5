"""Fake engines with the real `Engine` interface, for unit tests only: `FakeEngine`
(continuous batching) and `FakeDevice` (static batches on a device of fixed memory).

Real vLLM runs the same code in tests/integration. The fake makes the edge cases
deterministic: when completions happen, what text comes back, when an
out-of-memory strikes, when the engine dies.
"""

from __future__ import annotations

import itertools
import time

from collections.abc import Callable

from pipeline.generation.engine import Completion, EngineDead, PaddingTotals, Sampling


def default_reply(ids: list[int], sampling: Sampling) -> str:
    return "x"


class FakeEngine:
    """Each request finishes `steps_per_request` steps after it is submitted, with the text
    `reply(ids, sampling)` and 4 output tokens (or `max_new_tokens`, if fewer: then its
    finish reason is "length", else "stop").
    `oom_when_in_flight` raises torch-style OOM when that many rows run at once."""

    max_num_seqs = 256
    max_model_len = 4096
    pads_batches = False
    padding = None

    def __init__(self, steps_per_request=3, oom_when_in_flight=None, capacity_tokens=10_000, vary=False,
                 reply: Callable[[list[int], Sampling], str] = default_reply):
        self.steps_per_request = steps_per_request
        self.vary = vary  # rows of uneven length: 3, 4, 5, 6 steps
        self.oom_when_in_flight = oom_when_in_flight
        self.capacity = capacity_tokens
        self.reply = reply
        self.live: dict[str, list] = {}
        self.max_seen = 0
        self.aborted: list[str] = []
        self.submitted: list[tuple[list[int], Sampling]] = []
        self.n = 0
        self.dead = False
        self.dead_of_memory = False
        self.kv_cache_tokens = capacity_tokens
        self.startup_s = 0.0
        self.startup_attempts: list[dict] = []
        self.rebuilds: list[dict] = []
        self.closed = False

    def submit(self, ids, sampling):
        if self.dead:  # as vLLM's add_request on a dead core
            raise EngineDead("EngineDeadError: the engine core died", memory=self.dead_of_memory)
        if len(ids) > 1000:
            raise ValueError("prompt too long")
        self.n += 1
        self.submitted.append((ids, sampling))
        rid = f"r{self.n}"
        steps = self.steps_per_request + (self.n % 4 if self.vary else 0)
        self.live[rid] = [steps, len(ids) + sampling.max_new_tokens, ids, sampling]
        return rid

    def step(self):
        if self.dead:
            raise EngineDead("EngineDeadError: the engine core died", memory=self.dead_of_memory)
        self.max_seen = max(self.max_seen, len(self.live))
        if self.oom_when_in_flight is not None and len(self.live) >= self.oom_when_in_flight:
            raise MemoryError("CUDA out of memory")
        done = []
        for rid in list(self.live):
            self.live[rid][0] -= 1
            if self.live[rid][0] == 0:
                _, _, ids, sampling = self.live.pop(rid)
                tokens = min(4, sampling.max_new_tokens)  # "length" only where the limit cut it, as in vLLM
                done.append((rid, Completion(self.reply(ids, sampling), tokens, 0.0,
                                             "length" if tokens == sampling.max_new_tokens else "stop")))
        return done

    def abort(self, ids):
        self.aborted += ids
        for rid in ids:
            self.live.pop(rid, None)

    def kv_gauges(self):
        used = sum(v[1] for v in self.live.values())
        return min(1.0, used / self.capacity), 0

    def preempted(self):
        return None  # as an engine that can't say which: the feeder charges by count

    def kill_core(self, memory=False):
        self.dead, self.dead_of_memory = True, memory
        return True

    def metric_families(self):
        return []

    def step_timeline(self):
        return None

    def worker_cpus(self):
        return {}

    def rebuild(self, reason):
        before = self.max_num_seqs
        self.max_num_seqs = max(1, before // 2)
        self.live.clear()
        self.dead = False
        self.rebuilds.append({"reason": reason, "before": {"max_num_seqs": before},
                              "after": {"max_num_seqs": self.max_num_seqs}})

    def close(self):
        self.closed = True


class FakeDevice:
    """A static-batch engine on a device of `capacity` bytes: a batch costs the weights
    plus `per_token` bytes per batch token (rows x (padded prompt + new tokens)), and one
    over the capacity raises as CUDA does. Reports like the transformers engine."""

    pads_batches = True

    def __init__(self, capacity=2e9, weights=5e8, per_token=20_000.0, max_num_seqs=4096):
        self.capacity, self.weights, self.per_token = capacity, weights, per_token
        self.max_num_seqs, self.max_model_len = max_num_seqs, 16384
        self.kv_cache_tokens = None
        self.startup_s, self.startup_attempts, self.rebuilds = 0.0, [], []
        self.padding, self.peaks = PaddingTotals(), []
        self._queue, self._ids, self._pressure = {}, itertools.count(), 0.0

    def submit(self, ids, sampling):
        rid = f"f{next(self._ids)}"
        self._queue[rid] = (ids, sampling)
        return rid

    def abort(self, request_ids):
        for rid in request_ids:
            self._queue.pop(rid, None)

    def step(self):
        batch, self._queue = list(self._queue.items()), {}
        longest = max(len(ids) for _, (ids, _) in batch)
        new = max(s.max_new_tokens for _, (_, s) in batch)
        used = self.weights + self.per_token * len(batch) * (longest + new)
        if used > self.capacity:
            self.peaks.append({"rows": len(batch), "padded_len": longest, "pressure": 1.0, "oom": True})
            raise MemoryError("CUDA out of memory (fake device)")
        time.sleep(0.002)  # a batch's fixed cost: bigger batches are faster per row, as on a GPU
        self._pressure = used / self.capacity
        self.kv_cache_tokens = int((self.capacity - self.weights) / self.per_token)
        self.padding.add(len(batch) * longest, sum(len(ids) for _, (ids, _) in batch))
        self.peaks.append({"rows": len(batch), "padded_len": longest, "pressure": round(self._pressure, 4)})
        return [(rid, Completion("ok", s.max_new_tokens, 0.0, "length")) for rid, (_, s) in batch]

    def kv_gauges(self):
        return self._pressure, 0

    def preempted(self):
        return []

    def rebuild(self, reason):
        pass

    def kill_core(self, memory=False):
        return False

    def metric_families(self):
        return []

    def step_timeline(self):
        return None

    def worker_cpus(self):
        return {}

    def close(self):
        pass
