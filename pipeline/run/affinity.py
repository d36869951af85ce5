"""Keep the run's other processes off the cores vLLM's CPU workers are bound to.

On its CPU backend vLLM binds each engine's worker (the process that runs the
model, with its OpenMP threads) to cores of its own, and leaves the rest for its
engine core and the process that drives it; its documentation asks that nothing
else run on the workers' cores. A run on one machine has more beside them: the
driver, Ray's own processes, the prepare actor, the write tasks. Measured on 2
cores (bench/README.md, "Engine steps"), they cost the engine a fifth of its
steady rate: the worker, preempted, ran at three quarters of its core.

An engine core in the actor's own process (`engine.in_process`, the CPU default)
has no worker of its own: there, where it is the run's one engine, the actor binds
its own process to all but one of the run's CPUs that no other engine of the machine
holds, as vLLM's automatic binding would bind its worker
(`pipeline.run.plan.engine_cpus`), and reports itself as the worker.

So once every engine is up (each reports where its workers are bound, through
the pool's log; not before the last, whose start must not be narrowed), a thread
of the driver narrows every other process of the run's
own Ray instance, every thread of each, to the CPUs the workers leave, every
`every_s`, for processes started since (a restarted engine actor, write tasks).
It never touches a process outside the driver's own tree, nor one whose CPUs are
already among the engines' (a worker that vLLM has bound but not yet reported), nor
one already narrowed. An engine apart starts on every CPU: the engines' start is
what it waits for. An engine in its actor's process is bound before vLLM's import and
build (`GenerateStage._bind_early`) and reports then: its import has its cores to itself
(on 2 cores beside a night's reused rows, 7.6-8.7 s instead of 8.6-10.8 s, bench/README).
Started on demand, it gives them back (reports none) if the import ends before the reuse
lookup has found work, and the guard widens the run's processes again, until it reports
them once more (a night with nothing to generate builds no engine, and keeps every CPU
once vLLM is imported). An engine started later (a restarted actor, a rebuilt engine) starts
narrowed, and widens only its starting thread (`pipeline.generation.vllm.every_cpu`),
so that vLLM binds its new worker as before.

Only a local instance (no `hardware.ray_address`) on the CPU backend, with
`hardware.isolate_engine_cpus` on, and only where the workers leave a CPU free.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pipeline.generation.vllm import bind_threads


@dataclass
class EngineCpuGuard:
    """The thread that keeps the run's other processes off the engines' cores."""

    workers: Callable[[], dict[str, dict[int, list[int]]]]  # each engine's workers' CPUs, by pid (the pool's log)
    engines: int = 1  # how many engines must have reported before anything moves
    every_s: float = 2.0
    engine_cpus: set[int] = field(default_factory=set)
    other_cpus: set[int] = field(default_factory=set)
    moved: set[int] = field(default_factory=set)  # pids narrowed so far
    allowed: set[int] = field(default_factory=lambda: set(os.sched_getaffinity(0)))  # the driver's, at start
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine-cpu-guard", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop, and give the driver its CPUs back (its process may go on: a test, a notebook)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if os.getpid() in self.moved:
            bind_threads(os.getpid(), self.allowed)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.once()
            except Exception:  # the pool's log gone at the end of the run: nothing left to keep apart
                continue

    def once(self) -> None:
        """One pass: the engines' CPUs as reported, and every other process of the tree narrowed."""
        reports = self.workers()
        if len(reports) < self.engines:
            return
        workers = {pid: cpus for report in reports.values() for pid, cpus in report.items()}
        engine = {cpu for cpus in workers.values() for cpu in cpus}
        if not engine:  # every engine gave its CPUs back (on demand, imported, no work yet)
            self.widen()
            return
        others = self.allowed - engine
        if not others:
            return
        self.engine_cpus, self.other_cpus = engine, others
        for pid, cpus in tree_cpus():
            if pid in workers or cpus <= others or cpus <= engine:  # done already, or among the engines' cores
                continue
            if bind_threads(pid, others):
                self.moved.add(pid)

    def widen(self) -> None:
        """Every process of the tree on the others' CPUs back on the driver's: those the guard
        narrowed, and those started since by one of them (a worker the raylet started
        inherits its CPUs). The engines' own are on theirs, and stay."""
        if not self.other_cpus:
            return
        for pid, cpus in tree_cpus():
            if cpus <= self.other_cpus:
                bind_threads(pid, self.allowed)
        self.moved.clear()
        self.engine_cpus, self.other_cpus = set(), set()

    def summary(self) -> dict[str, Any] | None:
        """For the report: the engines' CPUs, the others', and how many processes were moved."""
        if not self.engine_cpus:
            return None
        return {"engine": sorted(self.engine_cpus), "others": sorted(self.other_cpus), "processes": len(self.moved)}


def tree_cpus() -> Iterator[tuple[int, set[int]]]:
    """This process and every process under it, each with the CPUs it may run on (those
    gone or not ours to read are passed over)."""
    import psutil

    me = psutil.Process()
    for p in [me, *me.children(recursive=True)]:
        try:
            yield p.pid, set(p.cpu_affinity())
        except psutil.Error:
            continue
