"""The Engine protocol is the real contract: every member the feeder, the generate stage
and the metrics use is declared there, and both engines (and the unit tests' fakes, so
they stay faithful) have each of them, methods with the protocol's parameters."""

import ast
import inspect

import pytest

from pipeline.generation import engine as contract
from pipeline.generation.hf import TransformersEngine
from pipeline.generation.server import ServerEngine
from pipeline.generation.vllm import VLLMEngine
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.fake_engine import FakeDevice

METHODS = {n for n, v in vars(contract.Engine).items() if callable(v) and not n.startswith("_")}
ATTRIBUTES = set(contract.Engine.__annotations__)


def instance_attributes(cls: type) -> set[str]:
    """Attributes the class sets on its class or on `self` anywhere in its methods."""
    names = {n for n in vars(cls) if not n.startswith("__")}
    for node in ast.walk(ast.parse(inspect.getsource(cls))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return names


def test_the_protocol_declares_what_its_callers_use():
    assert {"pads_batches", "padding", "kv_cache_tokens", "max_num_seqs", "max_model_len"} <= ATTRIBUTES
    assert {"submit", "step", "abort", "kv_gauges", "rebuild", "kill_core", "metric_families", "close"} <= METHODS
    assert "memory" in inspect.signature(contract.Engine.kill_core).parameters


@pytest.mark.parametrize("engine", [VLLMEngine, TransformersEngine, ServerEngine, FakeEngine, FakeDevice])
def test_every_engine_has_every_member_of_the_protocol(engine):
    assert ATTRIBUTES - instance_attributes(engine) == set()
    for name in METHODS:
        method = getattr(engine, name, None)
        assert callable(method), f"{engine.__name__}.{name}"
        want = [p for p in inspect.signature(getattr(contract.Engine, name)).parameters if p != "self"]
        have = [p for p in inspect.signature(method).parameters if p != "self"]
        assert len(have) == len(want), f"{engine.__name__}.{name}{tuple(have)} != {tuple(want)}"


def test_no_engine_is_told_about_buckets():
    """The engine knows prompts, not buckets: nothing sets attributes on it from outside."""
    assert "bucket_of" not in instance_attributes(TransformersEngine)
