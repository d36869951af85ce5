"""Per-bucket limits learned in one run, kept for the next, so a nightly job starts warm.

The file holds one set of limits and the key it is valid for: model,
hardware, max_model_len and dtype. A file for another key, an unreadable one
or one older than `max_age_days` is ignored with a warning; the run then
learns afresh and replaces it.

The path is the profile's to choose, so the file carries a mark (`written_by`), and
only a file with it (or one of the shape this module always wrote) is ever replaced.
A path that holds anything else stops the run before Ray starts (exit 2): it is a
setting pointing at the wrong file (a profile, a result), and a run that went on
without its limits would start cold every night behind a warning nobody reads. If
the file changes hands during the run, the save is skipped with a warning in the
report, and the file is left alone.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import yaml

from pipeline.observe.machine import cpu_name
from pipeline.storage.ownership import MARK, OwnedFile

log = logging.getLogger(__name__)


def _is_limits_file(path: Path) -> bool:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and (data.get("written_by") == MARK or {"key", "limits", "saved_at"} <= set(data))


LIMITS_FILE = OwnedFile(
    "a learned-limits file", _is_limits_file,
    "Point batching.learned_limits at a new file (or one this pipeline wrote), or set it to null.",
)


def hardware_id(accelerator: str) -> str:
    """What the limits depend on: the GPU model, or the CPU model for the CPU backend."""
    if accelerator == "gpu":
        from pipeline.generation.memory import open_nvml

        nvml = open_nvml()
        return f"gpu:{nvml.name if nvml else 'unknown'}"
    return f"cpu:{cpu_name()}"


def limits_key(model: str, hardware: str, max_model_len: int, dtype: str, backend: str = "vllm") -> dict[str, Any]:
    """What learned limits hold for. vLLM's are KV-cache tokens, transformers' are memory:
    never one for the other (the backend is in the key when it is not vLLM, so keys saved
    before it existed still match)."""
    key = {"model": model, "hardware": hardware, "max_model_len": max_model_len, "dtype": dtype}
    return key if backend == "vllm" else {**key, "backend": backend}


def load_limits(path: str | None, key: dict[str, Any], max_age_days: float) -> dict[str, int]:
    """The limits saved for `key`, or {} (with a warning saying why) if none apply."""
    if path is None or not os.path.exists(path):
        return {}
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
        saved_key, limits, saved_at = data["key"], data["limits"], float(data["saved_at"])
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError) as e:
        log.warning("ignoring learned limits in %s: unreadable (%s)", path, e)
        return {}
    if saved_key != key:
        diff = {k: (saved_key.get(k), v) for k, v in key.items() if saved_key.get(k) != v}
        log.warning("ignoring learned limits in %s: made for another setup (saved, now): %s", path, diff)
        return {}
    age_days = (time.time() - saved_at) / 86400
    if age_days > max_age_days:
        log.warning("ignoring learned limits in %s: %.1f days old (limit %.0f)", path, age_days, max_age_days)
        return {}
    return {str(b): int(v) for b, v in limits.items()}


def save_limits(path: str, key: dict[str, Any], limits: dict[str, int]) -> None:
    """Replace the file whole, if it is ours (`NotOurs` otherwise). Every run writes its own
    temporary file (runs of one profile may finish together), and the last rename wins."""
    text = yaml.safe_dump({"written_by": MARK, "key": key, "saved_at": time.time(),
                           "limits": dict(sorted(limits.items()))})
    LIMITS_FILE.write(path, text.encode())


def merge_limits(per_actor: list[dict[str, int]]) -> dict[str, int]:
    """Engines of one run may learn different limits for a bucket: keep the smallest."""
    merged: dict[str, int] = {}
    for limits in per_actor:
        for bucket, value in limits.items():
            merged[bucket] = min(value, merged.get(bucket, value))
    return merged
