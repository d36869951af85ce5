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
