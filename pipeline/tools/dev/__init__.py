"""Offline stand-ins for the outside world: a tiny model and a synthetic corpus.

Both are deterministic, so tests and `make run` need no network and give the
same bytes on every machine.
"""
