"""Offline stand-ins for the outside world: a synthetic corpus with real corpora's length
distribution, deterministic, so tests and `make run` need no network and give the same
bytes on every machine. (The tiny model is `pipeline.models.tiny`.)"""
