"""The reuse index's shards without Ray: a `KeyShard` called as its actor handle would
be, for unit tests that patch `ray.get` to pass values on."""

from types import SimpleNamespace
from typing import Any


class Local:
    """A shard's methods as a Ray handle's (`handle.method.remote(...)` returns the answer)."""

    def __init__(self, shard: Any):
        self.shard = shard

    def __getattr__(self, name: str) -> SimpleNamespace:
        return SimpleNamespace(remote=getattr(self.shard, name))
