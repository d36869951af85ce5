"""An engine actor's life on Ray: which blocks it holds, and how it ends when its engine cannot go on.

An engine core that crashed (not of memory) or hangs is not to be trusted, nor
is anything in the process that drove it: the actor logs the incident with the
pool (`pipeline.run.pool.PoolGate`: time, cause, the blocks with rows to generate
it held, and their rows) and ends its own process, engine core first. Ray starts
the actor afresh, up to `engine.max_restarts` times, and retries every block it
held; none of their rows was written, so none is written twice. An actor killed
outright says nothing: its next incarnation reports the restart, and the pool knows
what the dead one held.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

from pipeline.generation.engine import EngineCrashed

log = logging.getLogger(__name__)


def actor_identity() -> tuple[str, bool]:
    """This actor's id, the same across its restarts, and whether this is a restart."""
    try:
        import ray

        if ray.is_initialized():
            ctx = ray.get_runtime_context()
            actor = ctx.get_actor_id()
            if actor is not None:
                with warnings.catch_warnings():
                    # Ray 2.60 reads this through its deprecated state API, and has no other.
                    warnings.simplefilter("ignore", DeprecationWarning)
                    return actor, bool(ctx.was_current_actor_reconstructed)
    except ImportError:
        pass
    return uuid.uuid4().hex, False


class Lifeline:
    """One incarnation of an engine actor. `gate`: the pool's log (None outside a pool);
    `exit_process`: how the process ends (tests pass one that returns)."""

    def __init__(self, gate: Any, exit_process: Callable[[int], Any] = os._exit):
        self.gate = gate
        self.exit_process = exit_process
        self.incarnation = uuid.uuid4().hex[:8]
        self.key, self.restarted = actor_identity()
        self._held: dict[str, int] = {}  # the blocks this incarnation is generating: id -> rows
        self._lock = threading.Lock()
        self._ending = False  # set by the one thread that ends the process
        self._exited = threading.Event()
        if self.restarted:
            self.incident("restart", "the actor's process had ended; started afresh", restarted=True)

    def incident(self, kind: str, cause: str, restarted: bool = False, **counts: int) -> None:
        event = {"at": round(time.time(), 3), "kind": kind, "actor": self.key, "incarnation": self.incarnation,
                 "pid": os.getpid(), "cause": cause, **counts}
        log.warning("engine actor %s: %s: %s", self.incarnation, kind, cause)
        if self.gate is not None:
            self.gate.note(event, restarted=restarted)

    def start_failed(self, error: Exception) -> None:
        """The engine would not start. A restarted actor whose start raises would be dead for
        good, and with it the blocks Ray retries on it: it ends its process instead, so the
        restart bound decides. A first start raises (Ray Data replaces it, within the bound)."""
        self.incident("start_failed", f"{type(error).__name__}: {error}")
        if self.restarted:
            self.exit_process(1)

    @contextmanager
    def serving(self, rows: int, generating: bool = True) -> Iterator[None]:
        """Hold a block while it is served; a crash inside ends the process (see `end`).
        Only a block with rows to generate (`generating`) is held, not one that only
        passes through: every row of it reused, it is served in milliseconds, and its
        two calls to the pool cost the engine's own process (the same core, the same
        interpreter) about 0.75 s of a night's 125 such blocks, mostly while vLLM imports
        and builds there (bench/README.md, "Incremental nightly runs")."""
        if not generating:
            yield
            return
        block = uuid.uuid4().hex[:8]
        with self._lock:
            self._held[block] = rows
        if self.gate is not None:
            self.gate.hold(self.key, block, rows)
        yield
        with self._lock:
            self._held.pop(block)
        if self.gate is not None:
            self.gate.release(self.key, block)

    def end(self, kind: str, cause: str, kill_core: Callable[[], None] | None) -> NoReturn:
        """End this process, engine core first. Every open call meets the crash: the first
        logs it and ends the process, the others wait for the end (an exception of theirs
        would fail the run, not restart the actor)."""
        with self._lock:
            blocks, rows = len(self._held), sum(self._held.values())
            ending, self._ending = self._ending, True
        if ending:
            self._exited.wait()  # in an actor, for good: the process is ending
            raise EngineCrashed(cause)  # only where exit_process returns (tests)
        self.incident(kind, cause, blocks=blocks, rows=rows)
        try:
            if kill_core is not None:
                kill_core()
        finally:
            try:
                self.exit_process(1)
            finally:
                self._exited.set()
        raise SystemExit(1)  # only where exit_process returns (tests)

    def watch(self, stalled_s: Callable[[], float], timeout_s: float,
              kill_core: Callable[[], None] | None) -> None:
        """Start the stall watchdog: a step that has run past `timeout_s` is a hung engine."""

        def run() -> None:
            while True:
                time.sleep(min(5.0, timeout_s / 5))
                stalled = stalled_s()
                if stalled > timeout_s:
                    try:
                        self.end("stall", f"an engine step ran {stalled:.0f} s without returning "
                                          f"(engine.stall_timeout_s {timeout_s:g}): the engine is hung", kill_core)
                    except SystemExit:  # only where exit_process returns (tests)
                        return

        threading.Thread(target=run, daemon=True, name="stall-watchdog").start()
