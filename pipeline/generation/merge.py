"""Identical prompts generated once: rows whose prompt token ids and sampling agree get
one request, and each of them its result.

Only where the results must be equal: greedy decoding (temperature 0), or sampling with
a fixed seed. Unseeded sampled rows always get requests of their own.

One `IdenticalPrompts` per engine actor, shared by the calls it serves at once (several
threads): a prompt another call is generating is waited for, not generated again, and
the results of the last `capacity` distinct prompts are kept for later calls. An error
is shared with the rows merged into its request, but not kept: a later row tries again.
With several engines, identical rows that reach different actors are each generated
once per actor.

    merge = IdenticalPrompts()
    plan = merge.plan(items, sampling)              # items: (position, token ids)
    fresh = generate(plan.fresh)                    # completions of the fresh items by position
    completions = merge.finish(plan, fresh)         # every item's, by position
    # or, if generating them raised: merge.fail(plan, error), and raise it
"""

from __future__ import annotations

import hashlib
import json
import threading
from array import array
from collections import OrderedDict
from dataclasses import asdict, dataclass, field

from pipeline.generation.engine import Completion, Sampling

Key = tuple[bytes, str]


def sampling_key(sampling: Sampling) -> str | None:
    """Every sampling setting, as one string; None where sampling without a seed makes each
    request's result its own."""
    if sampling.temperature > 0 and sampling.seed is None:
        return None
    return json.dumps(asdict(sampling), sort_keys=True, default=list)


def merge_key(ids: list[int], sampling: Sampling | str | None) -> Key | None:
    """What two requests must share to be merged: the prompt's token ids (a 128-bit
    digest) and the sampling (`sampling_key`, or the key itself); None: never merged."""
    key = sampling_key(sampling) if isinstance(sampling, Sampling) else sampling
    if key is None:
        return None
    return hashlib.blake2b(array("q", ids).tobytes(), digest_size=16).digest(), key


@dataclass
class _Pending:
    """A request one call is generating, that others wait for."""

    done: threading.Event = field(default_factory=threading.Event)
    completion: Completion | None = None
    failure: BaseException | None = None  # the error that ended the generating call


@dataclass
class Plan:
    """One call's items sorted out: `fresh` to generate; `copies` (position -> the fresh
    position whose result it takes); `kept` (results from earlier calls); `waits` (requests
    other calls are generating)."""

    fresh: list[tuple[int, list[int]]]
    keys: dict[int, Key]  # fresh position -> its key
    copies: dict[int, int]
    kept: dict[int, Completion]
    waits: dict[int, _Pending]

    @property
    def merged(self) -> int:
        return len(self.copies) + len(self.kept) + len(self.waits)


class IdenticalPrompts:
    def __init__(self, capacity: int = 16_384):
        self.capacity = capacity
        self._done: OrderedDict[Key, Completion] = OrderedDict()
        self._pending: dict[Key, _Pending] = {}
        self._lock = threading.Lock()

    def plan(self, items: list[tuple[int, list[int]]], sampling: Sampling) -> Plan:
        plan = Plan([], {}, {}, {}, {})
        first: dict[Key, int] = {}  # key -> its fresh position in this call
        same = sampling_key(sampling)  # one call, one sampling
        with self._lock:
            for position, ids in items:
                key = merge_key(ids, same)
                if key is None:
                    plan.fresh.append((position, ids))
                elif key in first:
                    plan.copies[position] = first[key]
                elif key in self._done:
                    self._done.move_to_end(key)
                    plan.kept[position] = self._done[key]
                elif key in self._pending:
                    plan.waits[position] = self._pending[key]
                else:
                    first[key] = position
                    plan.keys[position] = key
                    plan.fresh.append((position, ids))
                    self._pending[key] = _Pending()
        return plan

    def fail(self, plan: Plan, error: BaseException) -> None:
        """The call generating `plan.fresh` failed: every call waiting on them raises `error`
        too, as the feeder fails every open call when the engine fails; nothing is kept."""
        with self._lock:
            for key in plan.keys.values():
                pending = self._pending.pop(key)
                pending.failure = error
                pending.done.set()

    def finish(self, plan: Plan, fresh: dict[int, Completion]) -> dict[int, Completion]:
        """Every item's completion, from the fresh ones (kept for later calls unless they
        failed), the copies', the kept ones and those other calls generated."""
        with self._lock:
            for position, key in plan.keys.items():
                pending = self._pending.pop(key)
                pending.completion = fresh[position]
                if pending.completion.error is None:
                    self._done[key] = pending.completion
                    if len(self._done) > self.capacity:
                        self._done.popitem(last=False)
                pending.done.set()
        out = dict(fresh)
        out.update({p: fresh[rep] for p, rep in plan.copies.items()})
        out.update(plan.kept)
        for position, pending in plan.waits.items():
            pending.done.wait()
            if pending.failure is not None:
                raise pending.failure
            assert pending.completion is not None
            out[position] = pending.completion
        return out
