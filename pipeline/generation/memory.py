"""MemoryProbe: how close the engine is to running out of memory, as one number.

Pressure (0..1) is the largest of the signals that apply:

- **KV cache**: vLLM's `kv_cache_usage_perc`, the share of its preallocated KV
  blocks in use, and its preemption counter. Under vLLM this is *the* signal.
  It must be read while requests run: it falls to 0 once they finish.
- **Device memory** (NVML, `nvidia-ml-py`): used / total of the GPU the
  process sees. vLLM preallocates its share of the device at start-up
  (`gpu_memory_utilization`, 0.9 by default), so NVML reads ~0.9 whatever the
  batch size. For a preallocating engine it is therefore only a *guard*: it
  counts when it passes `guard_level`, a sign something else is allocating.
  For engines that allocate as they go it is the pressure itself.
- **Host memory** (psutil): used / total RAM. On vLLM's CPU backend the KV
  cache lives in host memory and is preallocated too, so the same rule holds:
  a guard under a preallocating engine, the signal otherwise.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

GUARD_LEVEL = 0.97


@dataclass(frozen=True)
class PressureReading:
    pressure: float
    kv_cache: float | None
    preemptions: int | None
    device: float | None
    host: float


def _meminfo_fraction() -> float:
    """Used / total host memory from /proc/meminfo (Linux), as psutil reads it."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0])
    return (fields["MemTotal"] - fields["MemAvailable"]) / fields["MemTotal"]


class _Nvml:
    """Device memory of the first GPU this process sees, via NVML."""

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
        self.handle = (
            pynvml.nvmlDeviceGetHandleByUUID(visible)
            if visible.startswith(("GPU-", "MIG-"))
            else pynvml.nvmlDeviceGetHandleByIndex(int(visible))
        )
        self.name = pynvml.nvmlDeviceGetName(self.handle)

    def used_fraction(self) -> float:
        info = self._nvml.nvmlDeviceGetMemoryInfo(self.handle)
        return info.used / info.total


def open_nvml() -> _Nvml | None:
    """NVML for this process's GPU, or None where there is no NVIDIA driver or package."""
    try:
        return _Nvml()
    except Exception:  # no pynvml, no driver, no device: the signal does not apply
        return None


class MemoryProbe:
    """Reads every signal that applies and combines them into one pressure."""

    def __init__(
        self,
        kv_gauges: Callable[[], tuple[float, int]] | None = None,
        preallocated: bool = True,
        guard_level: float = GUARD_LEVEL,
        use_nvml: bool = True,
        every_s: float = 0.25,
    ):
        self.kv_gauges = kv_gauges
        self.preallocated = preallocated
        self.guard_level = guard_level
        self.nvml = open_nvml() if use_nvml else None
        # Device and host memory are read at most this often (a system call and a parse
        # each, about 0.3 ms: a tenth of a tiny model's step on a CPU); the KV cache's
        # gauge, which the engine updates every step at no cost, every time.
        self.every_s = every_s
        self._memory: tuple[float, float | None, float] | None = None  # (read at, device, host)

    def device_fraction(self) -> float | None:
        return self.nvml.used_fraction() if self.nvml is not None else None

    @staticmethod
    def host_fraction() -> float:
        try:
            import psutil
        except ImportError:  # the GPU check runs where only torch and transformers are
            return _meminfo_fraction()
        vm = psutil.virtual_memory()
        return (vm.total - vm.available) / vm.total

    def _counted(self, value: float | None) -> float:
        if value is None:
            return 0.0
        if self.preallocated and value < self.guard_level:
            return 0.0
        return value

    def read(self) -> PressureReading:
        kv, preemptions = self.kv_gauges() if self.kv_gauges is not None else (None, None)
        now = time.monotonic()
        if self._memory is None or now - self._memory[0] >= self.every_s:
            self._memory = (now, self.device_fraction(), self.host_fraction())
        _, device, host = self._memory
        pressure = max(kv or 0.0, self._counted(device), self._counted(host))
        return PressureReading(pressure, kv, preemptions, device, host)


def resident_bytes() -> int:
    """This process's resident set, from /proc/self/statm (Linux); 0 elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _glibc_trim() -> Callable[[], object] | None:
    """glibc's `malloc_trim(0)`, or None where the C library is another (musl, macOS)."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim  # the C library this process already runs on
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


class HeapTrim:
    """Gives the process's freed heap back to the operating system, at most once every
    `every_s` seconds. The engine actor's heap in use stays flat as rows stream by
    (230-255 MiB through 1x and 4x the object store), but glibc keeps the chunks the
    feeder's and vLLM's per-request objects free (289-417 MiB there), so without this
    the actor's resident memory climbed with the rows (bench/README.md, a corpus
    larger than the object store). `malloc_trim(0)` returns the free pages, whole or
    inside the heap; it walks the arenas under their lock (110 ms for a 600 MB heap
    fragmented as the actor's is), hence a cadence of tens of seconds. A no-op off glibc."""

    def __init__(self, every_s: float | None, clock: Callable[[], float] = time.monotonic,
                 trim: Callable[[], object] | None = None) -> None:
        self.every_s = every_s
        self._clock = clock
        self._trim = trim if trim is not None else (_glibc_trim() if every_s is not None else None)
        self._last = clock()
        self._lock = threading.Lock()  # blocks end on several threads at once: one trims
        self.trims = 0
        self.returned_bytes = 0  # resident memory the trims gave back, summed

    def maybe(self) -> bool:
        """Trim if `every_s` has passed since the last; whether it did. A block that ends
        while another thread trims does not wait for it, nor trim again."""
        if self._trim is None or self.every_s is None or not self._lock.acquire(blocking=False):
            return False
        try:
            now = self._clock()
            if now - self._last < self.every_s:
                return False
            self._last = now
            before = resident_bytes()
            self._trim()
            self.trims += 1
            self.returned_bytes += max(0, before - resident_bytes())
            return True
        finally:
            self._lock.release()
