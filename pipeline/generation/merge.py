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


def merge_key(ids: list[int], sampling: Sampling) -> Key | None:
    """What two requests must share to be merged: the prompt's token ids (a 128-bit
    digest) and every sampling setting; None where sampling without a seed makes each
    request's result its own."""
    if sampling.temperature > 0 and sampling.seed is None:
        return None
    digest = hashlib.blake2b(array("q", ids).tobytes(), digest_size=16).digest()
    return digest, json.dumps(asdict(sampling), sort_keys=True, default=list)


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
        with self._lock:
            for position, ids in items:
                key = merge_key(ids, sampling)
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

    def finish(self, plan: Plan, fresh: dict[int, Completion] | BaseException) -> dict[int, Completion]:
        """Every item's completion, from the fresh ones. `fresh` may instead be the error
        that ended their call: it is raised here, and in every call waiting on them, as the
        feeder fails every open call when the engine fails."""
        with self._lock:
            for position, key in plan.keys.items():
                pending = self._pending.pop(key)
                if isinstance(fresh, BaseException):
                    pending.failure = fresh
                else:
                    pending.completion = fresh[position]
                    if pending.completion.error is None:
                        self._done[key] = pending.completion
                        if len(self._done) > self.capacity:
                            self._done.popitem(last=False)
                pending.done.set()
        if isinstance(fresh, BaseException):
            raise fresh
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
