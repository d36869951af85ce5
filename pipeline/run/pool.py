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
- Start-up: engines wait for each other (`PoolGate`), up to
  `hardware.pool_start_timeout_s`, before they take blocks. Ray Data hands blocks to
  the actors that are up; on a small corpus the first engine would otherwise take them all.
  They also wait for the driver's word: the unique-id check runs while they start.
- Every node: with `hardware.ray_address`, the job's runtime_env ships this package
  (`py_modules`), so each worker imports the driver's code.
- Incidents: the gate's actor also keeps the pool's log for the report: what each
  engine actor holds (blocks and their rows), and every restart, stall, engine death
  and failed start, with its time and the rows it affected. An actor killed outright
  says nothing; its next incarnation reports the restart, and what the dead one held.
- Metrics: every engine actor sends it a snapshot of its state every 2 s and after each
  block (`pipeline.observe.metrics`); the driver reads them all from here, whichever node each
  engine is on, with the restarts and stalls per engine from the log above.
- Warnings: it also remembers which vLLM warnings the run has shown (`first_time`),
  so that each shows once per run rather than once per engine.

The placement group and the gate are this run's: `EnginePool.close` removes exactly
them, by handle.
"""

from __future__ import annotations

import os
import time
import uuid
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
    """The job's runtime_env: quiet workers, and on a cluster this package for every node.

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


class _Arrivals:
    """What the engine actors report to once their engine is up, and the driver's word on
    whether they may start work (the checks that run beside engine start-up). An async
    actor: every engine waits in `arrive` at once, and all are let go within a tick, so
    Ray Data sees them ready together and deals blocks to each."""

    def __init__(self, engines: int) -> None:
        self.engines = engines
        self.arrived: set[str] = set()
        self.verdict: tuple[bool, str] | None = None
        self.held: dict[str, dict[str, int]] = {}  # actor -> block -> rows, while it serves them
        self.log: list[dict[str, Any]] = []
        self.meters: dict[str, dict[str, Any]] = {}  # engine incarnation -> its latest metrics snapshot
        self.warnings: set[str] = set()  # the vLLM warnings the run has shown, by `warning_key`

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

    def hold(self, actor: str, block: str, rows: int) -> None:
        self.held.setdefault(actor, {})[block] = rows

    def release(self, actor: str, block: str) -> None:
        self.held.get(actor, {}).pop(block, None)

    def note(self, event: dict[str, Any]) -> None:
        self.log.append(event)

    def restarted(self, event: dict[str, Any]) -> None:
        """A fresh incarnation of an actor: what the last one held is being retried."""
        held = self.held.pop(event["actor"], {})
        self.log.append({**event, "blocks": len(held), "rows": sum(held.values())})

    def events(self) -> list[dict[str, Any]]:
        return sorted(self.log, key=lambda e: e["at"])

    MAX_WARNINGS = 10_000

    def first_time(self, key: str) -> bool:
        """Whether this warning is new to the run. Past `MAX_WARNINGS` keys a new one is
        no longer remembered, so it shows every time: the set stays bounded, and what
        goes unremembered is shown too often rather than never."""
        if key in self.warnings:
            return False
        if len(self.warnings) < self.MAX_WARNINGS:
            self.warnings.add(key)
        return True

    def meter(self, incarnation: str, snapshot: dict[str, Any]) -> None:
        self.meters[incarnation] = snapshot

    def metrics(self) -> dict[str, Any]:
        """Every engine incarnation's latest snapshot (`pipeline.observe.metrics`), and the restarts
        and stalls per engine (by the short engine name the snapshots use)."""
        restarts: dict[str, int] = {}
        stalls: dict[str, int] = {}
        for e in self.log:
            short = engine_name(e["actor"])
            if e["kind"] == "restart":
                restarts[short] = restarts.get(short, 0) + 1
            elif e["kind"] == "stall":
                stalls[short] = stalls.get(short, 0) + 1
        return {"snapshots": list(self.meters.values()), "restarts": restarts, "stalls": stalls}


class PoolGate:
    """Engines start together, and only once the driver says so: `wait` returns once
    `engines` actors have arrived (or after `timeout_s`: an engine that never starts must
    not stop the others) and the driver has decided. The decision is what lets a check
    that needs the cluster (unique ids) run while the engines start, and still stop the
    run before any row is generated."""

    def __init__(self, engines: int, timeout_s: float):
        import ray

        self.engines, self.timeout_s = engines, timeout_s
        self.counter = ray.remote(num_cpus=0)(_Arrivals).remote(engines)

    def decide(self, go: bool, why: str = "") -> None:
        import ray

        ray.get(self.counter.decide.remote(go, why))

    def wait(self) -> str | None:
        """None to go ahead; else why the run was refused."""
        import ray

        go, why = ray.get(self.counter.arrive.remote(uuid.uuid4().hex, self.timeout_s))
        return None if go else why

    def hold(self, actor: str, block: str, rows: int) -> None:
        self.counter.hold.remote(actor, block, rows)  # fire and forget: one per block

    def release(self, actor: str, block: str) -> None:
        self.counter.release.remote(actor, block)

    def note(self, event: dict[str, Any], restarted: bool = False) -> None:
        """Log an incident, and wait (briefly) until it is logged: the caller may be about to exit."""
        import ray

        ref = (self.counter.restarted if restarted else self.counter.note).remote(event)
        ray.wait([ref], timeout=10)

    def events(self) -> list[dict[str, Any]]:
        import ray

        return ray.get(self.counter.events.remote())

    def first_time(self, key: str) -> bool:
        """Whether a warning is new to the run; True when the pool cannot say (a warning is
        never hidden because the pool's actor is busy or gone)."""
        import ray

        try:
            return bool(ray.get(self.counter.first_time.remote(key), timeout=5))
        except Exception:
            return True

    def meter(self, incarnation: str, snapshot: dict[str, Any]) -> None:
        self.counter.meter.remote(incarnation, snapshot)  # fire and forget

    def metrics(self) -> dict[str, Any]:
        import ray

        return ray.get(self.counter.metrics.remote(), timeout=10)

    def close(self) -> None:
        import ray

        ray.kill(self.counter)


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
        """The pool's log so far (see `PoolGate.events`); empty before `open`."""
        return self.gate.events() if self.gate is not None else []

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
