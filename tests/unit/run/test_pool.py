"""What each engine actor asks Ray for, and what every node gets: the placement rules,
without a cluster (tests/integration/run/test_cluster.py runs them on a real one)."""

import pytest

from pipeline.config import HardwareConfig
from pipeline.run.pool import PACKAGE_DIR, EnginePool, engine_resources, runtime_env


def hw(**kw):
    return HardwareConfig(**{"accelerator": "gpu", **kw})


def test_the_engines_resources_are_one_bundle_each_packed_by_default():
    r = engine_resources(hw(engine_num_cpus=2))
    assert (r.num_cpus, r.num_gpus, r.bundle, r.strategy) == (2, 1.0, {"CPU": 2.0, "GPU": 1.0}, "PACK")
    cpu = engine_resources(hw(accelerator="cpu"))
    assert (cpu.num_gpus, cpu.bundle) == (0.0, {"CPU": 1.0})


def test_tensor_parallel_engines_reserve_their_gpus_in_one_bundle():
    r = engine_resources(hw(num_engines=3), tensor_parallel_size=4)
    assert r.num_gpus == 4.0 and r.bundle == {"CPU": 1.0, "GPU": 4.0}  # one bundle: one node
    assert r.strategy == "PACK"
    pool = EnginePool(hw(num_engines=3), tensor_parallel_size=4)
    assert pool.actor_options() == {"num_cpus": 1.0, "num_gpus": 4.0}  # before open(): no group yet


def test_engines_per_node_spreads_the_bundles():
    assert engine_resources(hw(engines_per_node=1)).strategy == "STRICT_SPREAD"
    assert engine_resources(hw(engines_per_node=2), tensor_parallel_size=2).strategy == "SPREAD"
    assert engine_resources(hw(accelerator="cpu", engines_per_node=1)).bundle == {"CPU": 1.0}


def test_tensor_parallel_on_cpu_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 needs hardware.accelerator: gpu"):
        engine_resources(hw(accelerator="cpu"), tensor_parallel_size=2)


def test_the_package_ships_to_every_node_only_on_a_cluster():
    env = {"VLLM_LOGGING_LEVEL": "WARNING"}
    assert runtime_env(hw(accelerator="cpu"), env) == {"env_vars": env}
    shipped = runtime_env(hw(accelerator="cpu", ray_address="ray://head:10001"), env)
    assert shipped["py_modules"] == [PACKAGE_DIR] and PACKAGE_DIR.endswith("pipeline")
    assert "py_modules" not in runtime_env(hw(ray_address="auto", ship_package=False), env)


def test_a_cluster_job_ships_an_empty_working_dir_so_the_shipped_package_wins():
    # Without a working_dir, Ray puts the driver's cwd first on every worker's sys.path,
    # and a node with a checkout at that path would import it instead of the shipped copy.
    env = runtime_env(hw(ray_address="auto"), {}, "/tmp/empty")
    assert env["working_dir"] == "/tmp/empty" and env["py_modules"] == [PACKAGE_DIR]


def test_the_engines_under_the_runs_actors_end_and_the_actors_are_left_to_ray():
    """An "actor" with two children as vLLM's core and worker: one that ends on SIGTERM, one
    that ignores it (killed after the grace); the actor itself, and a process that is no
    actor's, are left alone."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from pipeline.run.pool import end_engine_processes

    child = "import signal, time; {}; time.sleep(60)"
    actor = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {child.format('pass')!r}])\n"
        f"subprocess.Popen([sys.executable, '-c', {child.format('signal.signal(signal.SIGTERM, signal.SIG_IGN)')!r}])\n"
        "time.sleep(60)\n")])
    bystander = subprocess.Popen([sys.executable, "-c", child.format("pass")])
    try:
        deadline = time.monotonic() + 30
        while len(psutil.Process(actor.pid).children()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        engines = psutil.Process(actor.pid).children()
        assert len(engines) == 2
        time.sleep(1)  # both children past setting their signal handlers
        killed = end_engine_processes({actor.pid}, grace_s=1.0)
        assert len(killed) == 1  # the one that ignored SIGTERM
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in engines)
        assert actor.poll() is None and bystander.poll() is None
    finally:
        for p in (actor, bystander):
            p.send_signal(signal.SIGKILL)
            p.wait(10)


def test_a_node_lost_names_its_engine_and_the_rows_it_held_once():
    from pipeline.run.pool import PoolLog

    pool = PoolLog(engines=2)
    pool.place("a1", {"node": "n-dead", "host": "h1", "incarnation": "i1"})
    pool.place("a2", {"node": "n-live", "host": "h2", "incarnation": "i2"})
    pool.hold("a1", "b1", 16)
    pool.hold("a1", "b2", 16)
    pool.hold("a2", "b3", 16)
    pool.release("a1", "b2")
    assert pool.nodes_lost({"n-dead": "10.0.0.7"}) == 1
    [lost] = pool.events()
    assert (lost["kind"], lost["actor"], lost["node"], lost["blocks"], lost["rows"]) == ("node_lost", "a1", "n-dead", 1, 16)
    assert "10.0.0.7" in lost["cause"] and "engines left" in lost["cause"]
    assert pool.nodes_lost({"n-dead": "10.0.0.7"}) == 0  # noted once


def test_a_node_lost_whose_actor_restarted_elsewhere_counts_what_the_restart_took():
    from pipeline.run.pool import PoolLog

    pool = PoolLog(engines=1)
    pool.place("a1", {"node": "n-dead", "host": "h1", "incarnation": "i1"})
    pool.hold("a1", "b1", 32)
    pool.restarted({"at": 1.0, "kind": "restart", "actor": "a1", "incarnation": "i9"})
    pool.place("a1", {"node": "n-live", "host": "h2", "incarnation": "i9"})
    assert pool.nodes_lost({"n-dead": "10.0.0.7"}) == 1
    lost = [e for e in pool.events() if e["kind"] == "node_lost"]
    assert [(e["incarnation"], e["rows"], e["restarted_as"]) for e in lost] == [("i1", 32, "i9")]
