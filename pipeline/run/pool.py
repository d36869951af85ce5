"""The engine pool on Ray: what each engine actor reserves, where it is placed, how the
engines start together, and what every node needs to run them.

- Resources: an engine actor reserves `hardware.engine_num_cpus` CPUs and, on GPUs,
  `engine.tensor_parallel_size` GPUs. With `tensor_parallel_size > 1` those GPUs are
  one placement-group bundle, so they sit on one node, and vLLM's workers run as
  processes inside the actor on them.
- Placement: the engines' resources are reserved first, as one placement group with a
  bundle per engine, so the tasks that read, tokenize and check the input never hold
  what an engine needs while it waits to start (measured here: a concurrent id check
  held the engine's start back 9 s). `hardware.engines_per_node: 1` puts each bundle on
  a node of its own (STRICT_SPREAD); more spreads them best effort (SPREAD); otherwise
  PACK, best effort (one engine per GPU on GPUs, wherever Ray finds room).
- Start-up: engines wait for each other (`PoolGate`, over the `StartBarrier`), up to
  `hardware.pool_start_timeout_s`, before they take blocks. Ray Data hands blocks to
  the actors that are up; on a small corpus the first engine would otherwise take them all.
  They also wait for the driver's word: the unique-id check runs while they start.
- Every node: with `hardware.ray_address`, the job's runtime_env ships this package
  (`py_modules`), so each worker imports the driver's code.
- Incidents: the gate's actor, the pool's log (`PoolLog`), also keeps for the report
  what each engine actor holds (`BlockLedger`: blocks and their rows), and every
  restart, stall, engine death and failed start (`IncidentLog`), with its time and the
  rows it affected. An actor killed outright
  says nothing; its next incarnation reports the restart, and what the dead one held.
- Metrics: every engine actor sends it a snapshot of its state every 2 s and after each
  block (`pipeline.observe.metrics`); the driver reads them all from here, whichever node each
  engine is on, with the restarts and stalls per engine from the log above.
- Warnings: it also remembers which vLLM warnings the run has shown (`WarningMemory`),
  so that each shows once per run rather than once per engine.

The placement group and the gate are this run's: `EnginePool.close` removes exactly
them, by handle.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pipeline
from pipeline.config import HardwareConfig
from pipeline.observe.metrics import engine_name

PACKAGE_DIR = os.path.dirname(os.path.abspath(pipeline.__file__))  # the whole package, not this folder


@dataclass(frozen=True)
class EngineResources:
    """What one engine actor asks Ray for, and where its bundle goes."""

    num_cpus: float
    num_gpus: float
    bundle: dict[str, float]  # its placement-group bundle
    strategy: str  # the group's strategy: STRICT_SPREAD, SPREAD or PACK


def engine_resources(hw: HardwareConfig, tensor_parallel_size: int = 1) -> EngineResources:
    if tensor_parallel_size > 1 and hw.accelerator != "gpu":
        raise ValueError(f"engine.tensor_parallel_size: {tensor_parallel_size} needs hardware.accelerator: gpu "
                         "(vLLM's CPU backend runs one engine per actor)")
    gpus = float(tensor_parallel_size) if hw.accelerator == "gpu" else 0.0
    bundle = {"CPU": float(hw.engine_num_cpus), **({"GPU": gpus} if gpus else {})}
    strategy = {None: "PACK", 1: "STRICT_SPREAD"}.get(hw.engines_per_node, "SPREAD")
    return EngineResources(hw.engine_num_cpus, gpus, bundle, strategy)


def runtime_env(hw: HardwareConfig, env_vars: dict[str, str], empty_dir: str | None = None) -> dict[str, Any]:
    """The job's runtime_env on a cluster (`hardware.ray_address`): quiet workers, and this
    package for every node. A local instance needs none: its workers inherit the driver's
    environment (`pipeline.run.job.init_ray`).

    `empty_dir`, an empty folder, goes as the job's working_dir so that the shipped copy is
    the one workers import: a job without a working_dir has Ray put the driver's current
    directory first on every worker's sys.path, and a driver started in the repository root
    would have each node import whatever checkout sits at that path there."""
    env: dict[str, Any] = {"env_vars": dict(env_vars)}
    if hw.ray_address and hw.ship_package:
        env["py_modules"] = [PACKAGE_DIR]
        if empty_dir is not None:
            env["working_dir"] = empty_dir
    return env


class StartBarrier:
    """Engines start together, and only on the driver's word (the checks that run beside
    engine start-up): every engine waits in `arrive`, and all are let go within a tick, so
    Ray Data sees them ready together and deals blocks to each."""

    def __init__(self, engines: int) -> None:
        self.engines = engines
        self.arrived: set[str] = set()
        self.verdict: tuple[bool, str] | None = None

    async def arrive(self, who: str, timeout_s: float) -> tuple[bool, str]:
        import asyncio

        self.arrived.add(who)
        started = time.monotonic()
        while True:
            everyone = len(self.arrived) >= self.engines or time.monotonic() - started >= timeout_s
            if self.verdict is not None and (everyone or not self.verdict[0]):
                return self.verdict
            await asyncio.sleep(0.02)

    def decide(self, go: bool, why: str) -> None:
        self.verdict = (go, why)


class BlockLedger:
    """What each engine actor holds: its blocks and their rows, while it serves them."""

    def __init__(self) -> None:
        self.held: dict[str, dict[str, int]] = {}  # actor -> block -> rows

    def hold(self, actor: str, block: str, rows: int) -> None:
        self.held.setdefault(actor, {})[block] = rows

    def release(self, actor: str, block: str) -> None:
        self.held.get(actor, {}).pop(block, None)

    def take(self, actor: str) -> dict[str, int]:
        """What a dead incarnation of `actor` held (its next one retries it), forgotten."""
        return self.held.pop(actor, {})


class IncidentLog:
    """Every restart, stall, engine death and failed start, with its time and the rows it
    affected, for the report; and the restarts and stalls per engine, for the metrics."""

    def __init__(self) -> None:
        self.log: list[dict[str, Any]] = []

    def note(self, event: dict[str, Any]) -> None:
        self.log.append(event)

    def events(self) -> list[dict[str, Any]]:
        return sorted(self.log, key=lambda e: e["at"])

    def per_engine(self, kind: str) -> dict[str, int]:
        """How many incidents of `kind` each engine had, by the short name metrics use."""
        counts: dict[str, int] = {}
        for e in self.log:
            if e["kind"] == kind:
                counts[engine_name(e["actor"])] = counts.get(engine_name(e["actor"]), 0) + 1
        return counts


class WarningMemory:
    """The vLLM warnings the run has shown (by `warning_key`), so each shows once per run
    rather than once per engine. Past `MAX_WARNINGS` keys a new one is no longer
    remembered, so it shows every time: the set stays bounded, and what goes
    unremembered is shown too often rather than never."""

    MAX_WARNINGS = 10_000

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def first_time(self, key: str) -> bool:
        if key in self.seen:
            return False
        if len(self.seen) < self.MAX_WARNINGS:
            self.seen.add(key)
        return True


class PoolLog:
    """The pool's one actor, which every engine actor reports to, whichever node it is on:
    the start barrier, the block ledger, the incident log, the engines' latest metrics
    snapshots and the warnings shown. An async actor, so that every engine can wait at
    the barrier at once."""

    def __init__(self, engines: int) -> None:
        self.barrier = StartBarrier(engines)
        self.blocks = BlockLedger()
        self.incidents = IncidentLog()
        self.snapshots: dict[str, dict[str, Any]] = {}  # engine incarnation -> its latest metrics snapshot
        self.warnings = WarningMemory()
        self.cpus: dict[str, dict[int, list[int]]] = {}  # engine incarnation -> its workers' CPUs, by pid
        self.work = False  # a row to generate was found (reuse on: engines start on demand)
        self.placed: dict[str, dict[str, Any]] = {}  # engine incarnation -> its actor, node and host

    async def arrive(self, who: str, timeout_s: float) -> tuple[bool, str]:
        return await self.barrier.arrive(who, timeout_s)

    def decide(self, go: bool, why: str) -> None:
        self.barrier.decide(go, why)

    def hold(self, actor: str, block: str, rows: int) -> None:
        self.blocks.hold(actor, block, rows)

    def release(self, actor: str, block: str) -> None:
        self.blocks.release(actor, block)

    def note(self, event: dict[str, Any]) -> None:
        self.incidents.note(event)

    def restarted(self, event: dict[str, Any]) -> None:
        """A fresh incarnation of an actor: what the last one held is being retried."""
        held = self.blocks.take(event["actor"])
        self.incidents.note({**event, "blocks": len(held), "rows": sum(held.values())})

    def place(self, actor: str, where: dict[str, Any]) -> None:
        self.placed[where["incarnation"]] = {**where, "actor": actor}

    def nodes_lost(self, dead: dict[str, str]) -> int:
        """Engine actors whose node died (`dead`: node id -> its address), each an incident
        naming the node, with the blocks and rows it held: Ray Data serves those again, on
        the actor restarted elsewhere (whose `restart` incident counted them: named here as
        `restarted_as`) or on the engines left. How many were new."""
        new = 0
        for incarnation, where in self.placed.items():
            node, actor = where.get("node"), where["actor"]
            if node not in dead or where.get("lost"):
                continue
            where["lost"] = True
            later = [e for e in self.incidents.log if e["kind"] == "restart" and e.get("actor") == actor
                     and e.get("incarnation") != incarnation]
            if later:
                counts = {"blocks": later[0].get("blocks", 0), "rows": later[0].get("rows", 0),
                          "restarted_as": later[0].get("incarnation")}
                then = "it was started again elsewhere, and served the rows it held"
            else:
                held = self.blocks.take(actor)
                counts = {"blocks": len(held), "rows": sum(held.values())}
                then = "the engines left served the rows it held"
            self.incidents.note({
                "at": round(time.time(), 3), "kind": "node_lost", "actor": actor, "incarnation": incarnation,
                "node": node, "address": dead[node], "host": where.get("host"), **counts,
                "cause": f"node {dead[node]} ({node[:12]}) died, and the engine actor on it; {then}"})
            new += 1
        return new

    def events(self) -> list[dict[str, Any]]:
        return self.incidents.events()

    def first_time(self, key: str) -> bool:
        return self.warnings.first_time(key)

    def meter(self, incarnation: str, snapshot: dict[str, Any]) -> None:
        # The newest by the engine's own count: an async actor may run two sends out of order.
        last = self.snapshots.get(incarnation)
        if last is None or snapshot.get("seq", 0) >= last.get("seq", 0):
            self.snapshots[incarnation] = snapshot

    def engine_cpus(self, incarnation: str, workers: dict[int, list[int]]) -> None:
        self.cpus[incarnation] = workers

    def work_found(self) -> None:
        self.work = True

    def has_work(self) -> bool:
        return self.work

    async def await_work(self) -> bool:
        import asyncio

        while not self.work:
            await asyncio.sleep(0.05)
        return True

    def worker_cpus(self) -> dict[str, dict[int, list[int]]]:
        """Each engine incarnation's workers' CPUs, by pid."""
        return dict(self.cpus)

    def metrics(self) -> dict[str, Any]:
        """Every engine incarnation's latest snapshot (`pipeline.observe.metrics`), and the
        restarts and stalls per engine."""
        return {"snapshots": list(self.snapshots.values()), "restarts": self.incidents.per_engine("restart"),
                "stalls": self.incidents.per_engine("stall")}


class PoolGate:
    """Engines start together, and only once the driver says so: `wait` returns once
    `engines` actors have arrived (or after `timeout_s`: an engine that never starts must
    not stop the others) and the driver has decided. The decision is what lets a check
    that needs the cluster (unique ids) run while the engines start, and still stop the
    run before any row is generated."""

    def __init__(self, engines: int, timeout_s: float):
        import ray

        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.engines, self.timeout_s = engines, timeout_s
        # On the driver's node: the log must outlive any node the engines run on.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.log = ray.remote(num_cpus=0)(PoolLog).options(scheduling_strategy=here).remote(engines)

    def decide(self, go: bool, why: str = "") -> None:
        import ray

        ray.get(self.log.decide.remote(go, why))

    def wait(self) -> str | None:
        """None to go ahead; else why the run was refused."""
        import ray

        go, why = ray.get(self.log.arrive.remote(uuid.uuid4().hex, self.timeout_s))
        return None if go else why

    def work_found(self) -> None:
        """The reuse lookup found a row to generate: engines waiting for one start now,
        while the rest of the corpus is still read and looked up (fire and forget)."""
        self.log.work_found.remote()

    def await_work(self) -> None:
        """Return once a row to generate has been found (`work_found`)."""
        import ray

        ray.get(self.log.await_work.remote())

    def has_work(self) -> bool:
        """Whether a row to generate has been found yet."""
        import ray

        return ray.get(self.log.has_work.remote())

    def hold(self, actor: str, block: str, rows: int) -> None:
        self.log.hold.remote(actor, block, rows)  # fire and forget: one per block

    def release(self, actor: str, block: str) -> None:
        self.log.release.remote(actor, block)

    def place(self, actor: str, where: dict[str, Any]) -> None:
        """Where an engine actor runs (`where`: node, host, incarnation): fire and forget."""
        self.log.place.remote(actor, where)

    def nodes_lost(self) -> int:
        """Note every engine actor on a node Ray has declared dead (see `PoolLog.nodes_lost`)."""
        import ray

        dead = {n["NodeID"]: str(n.get("NodeManagerAddress", "?")) for n in ray.nodes() if not n.get("Alive")}
        return ray.get(self.log.nodes_lost.remote(dead)) if dead else 0

    def note(self, event: dict[str, Any], restarted: bool = False) -> None:
        """Log an incident, and wait (briefly) until it is logged: the caller may be about to exit."""
        import ray

        ref = (self.log.restarted if restarted else self.log.note).remote(event)
        ray.wait([ref], timeout=10)

    def events(self) -> list[dict[str, Any]]:
        import ray

        return ray.get(self.log.events.remote())

    def first_time(self, key: str) -> bool:
        """Whether a warning is new to the run; True when the pool cannot say (a warning is
        never hidden because the pool's actor is busy or gone)."""
        import ray

        try:
            return bool(ray.get(self.log.first_time.remote(key), timeout=5))
        except Exception:
            return True

    def meter(self, incarnation: str, snapshot: dict[str, Any]) -> None:
        self.log.meter.remote(incarnation, snapshot)  # fire and forget

    def engine_cpus(self, incarnation: str, workers: dict[int, list[int]]) -> None:
        """Where this engine's workers are bound (`pipeline.run.affinity`)."""
        self.log.engine_cpus.remote(incarnation, workers)  # fire and forget

    def worker_cpus(self) -> dict[str, dict[int, list[int]]]:
        import ray

        return ray.get(self.log.worker_cpus.remote(), timeout=10)

    def metrics(self) -> dict[str, Any]:
        import ray

        return ray.get(self.log.metrics.remote(), timeout=10)

    def close(self) -> None:
        import ray

        ray.kill(self.log)


def end_engine_processes(actors: set[int], grace_s: float = 3.0) -> list[int]:
    """The processes under this run's engine actors (by the pids the actors recorded:
    vLLM's engine core and its workers), ended now that every row is written, rather than
    when Ray's shutdown leaves them orphaned to notice it in their own time: SIGTERM (on
    which vLLM's core stops its workers), then SIGKILL after `grace_s`. Only under actors
    that are processes under this one (a local Ray instance's), never another's; the
    actors themselves are Ray's to end. The pids it had to kill."""
    import psutil

    procs: list[psutil.Process] = []
    for actor in psutil.Process().children(recursive=True):
        if actor.pid in actors:
            try:
                procs += actor.children(recursive=True)
            except psutil.NoSuchProcess:
                continue
    return [p.pid for p in end_processes(procs, grace_s)]


def end_processes(procs: list[Any], grace_s: float) -> list[Any]:
    """SIGTERM to each of `procs` (psutil processes), SIGKILL to those still running
    `grace_s` later, and a wait as long for those: the ones it had to kill. A zombie (ended,
    its parent yet to reap it) is gone, where psutil's own wait would count it running."""
    import psutil

    def living(ps: list[psutil.Process]) -> list[psutil.Process]:
        out = []
        for p in ps:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.NoSuchProcess:
                continue
        return out

    def wait(ps: list[psutil.Process]) -> list[psutil.Process]:
        deadline = time.monotonic() + grace_s
        while (ps := living(ps)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return ps

    def send(ps: list[psutil.Process], how: Callable[[psutil.Process], None]) -> None:
        for p in ps:
            try:
                how(p)
            except psutil.NoSuchProcess:
                continue

    send(procs, psutil.Process.terminate)
    stubborn = wait(procs)
    send(stubborn, psutil.Process.kill)
    wait(stubborn)
    return stubborn


class EnginePool:
    """This run's placement group (when the profile needs one) and start gate."""

    def __init__(self, hw: HardwareConfig, tensor_parallel_size: int = 1):
        self.hw = hw
        self.resources = engine_resources(hw, tensor_parallel_size)
        self.group: Any = None
        self.gate: PoolGate | None = None

    def open(self) -> None:
        import ray
        from ray.util.placement_group import placement_group

        # Always: the engines' resources are taken before anything else runs.
        self.group = placement_group([self.resources.bundle] * self.hw.num_engines,
                                     strategy=self.resources.strategy)
        timeout = self.hw.placement_timeout_s
        ready, _ = ray.wait([self.group.ready()], timeout=timeout)
        if not ready:
            cpus = [n.get("Resources", {}).get("CPU", 0) for n in ray.nodes() if n.get("Alive")]
            gpus = [n.get("Resources", {}).get("GPU", 0) for n in ray.nodes() if n.get("Alive")]
            self.close()
            raise RuntimeError(
                f"{self.hw.num_engines} engines of {self.resources.bundle} each ({self.resources.strategy}) "
                f"could not be placed in {timeout:.0f} s: the cluster has {len(cpus)} nodes "
                f"(CPUs per node {cpus}, GPUs per node {gpus}). Lower hardware.num_engines, or drop "
                "hardware.engines_per_node."
            )
        self.gate = PoolGate(self.hw.num_engines, self.hw.pool_start_timeout_s)

    def incidents(self) -> list[dict[str, Any]]:
        """The pool's log so far (see `PoolGate.events`), with any engine node lost; empty
        before `open`."""
        if self.gate is None:
            return []
        self.gate.nodes_lost()
        return self.gate.events()

    def actor_options(self) -> dict[str, Any]:
        """Ray remote options for each engine actor."""
        options: dict[str, Any] = {"num_cpus": self.resources.num_cpus, "num_gpus": self.resources.num_gpus}
        if self.group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.group, placement_group_capture_child_tasks=True)
        return options

    def close(self) -> None:
        import ray

        if self.gate is not None:
            self.gate.close()
            self.gate = None
        if self.group is not None:
            ray.util.remove_placement_group(self.group)
            self.group = None
