import platform

import pytest

from pipeline.generation.memory import HeapTrim, MemoryProbe


def probe(kv=0.0, preemptions=0, device=None, host=0.3, preallocated=True):
    p = MemoryProbe(kv_gauges=lambda: (kv, preemptions), preallocated=preallocated, use_nvml=False)
    p.device_fraction = lambda: device
    p.host_fraction = lambda: host
    return p


def test_kv_cache_is_the_signal_under_a_preallocating_engine():
    r = probe(kv=0.42, device=0.9, host=0.5).read()
    # NVML reads ~0.9 under vLLM whatever the batch: it must not pin the pressure there.
    assert r.pressure == 0.42 and r.device == 0.9


def test_device_and_host_memory_guard_past_the_guard_level():
    assert probe(kv=0.4, device=0.985).read().pressure == 0.985
    assert probe(kv=0.4, host=0.99).read().pressure == 0.99


def test_engines_that_allocate_as_they_go_use_device_memory_directly():
    assert probe(kv=0.1, device=0.6, preallocated=False).read().pressure == 0.6
    assert probe(kv=0.1, device=None, host=0.7, preallocated=False).read().pressure == 0.7


def test_real_host_memory_reading_is_a_fraction():
    r = MemoryProbe(kv_gauges=None, use_nvml=False).read()
    assert 0.0 < r.host < 1.0 and r.kv_cache is None and r.device is None


def test_kv_every_reading_device_and_host_at_most_every_interval():
    kv, host, reads = [0.1], [0.5], []
    p = MemoryProbe(kv_gauges=lambda: (kv[0], 0), preallocated=False, use_nvml=False, every_s=60.0)
    p.host_fraction = lambda: reads.append(1) or host[0]
    assert p.read().pressure == 0.5
    kv[0], host[0] = 0.8, 0.99
    r = p.read()  # the KV gauge is fresh; host memory is the last reading, within the interval
    assert r.kv_cache == 0.8 and r.host == 0.5 and len(reads) == 1
    p.every_s = 0.0
    assert p.read().pressure == 0.99 and len(reads) == 2  # past the interval: read again, and it guards


FRAGMENTED_HEAP = """
from pipeline.generation.memory import HeapTrim, resident_bytes
keep, drop = [], []
for i in range(60_000):  # 1 KB chunks, one in eight kept: the freed ones are holes glibc keeps
    (keep if i % 8 == 0 else drop).append(bytearray(1024))
del drop
freed = resident_bytes()
now = [0.0]
heap = HeapTrim(5.0, clock=lambda: now[0])
early = heap.maybe()
now[0] = 5.0
print(early, heap.maybe(), freed, resident_bytes(), heap.returned_bytes, heap.trims, len(keep))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's; elsewhere HeapTrim does nothing")
def test_the_heap_trim_gives_freed_holes_back_at_its_cadence():
    """Real glibc, in a process of its own: 52 MB of 1 KB chunks freed among kept ones stay
    resident (free() returns only the heap's top), and a trim gives back most of their
    pages; none before `every_s` has passed."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FRAGMENTED_HEAP], capture_output=True, text=True, check=True,
                         timeout=60)
    early, trimmed, freed, after, returned, trims, kept = out.stdout.split()
    assert (early, trimmed, trims, kept) == ("False", "True", "1", "7500")
    assert int(freed) - int(after) >= 10 * 2**20, out.stdout  # measured: 22 MiB of 52 MB freed
    assert int(returned) >= 10 * 2**20


def test_no_heap_trim_when_turned_off_nor_before_its_cadence():
    calls = []
    off = HeapTrim(None, clock=lambda: 1e9, trim=lambda: calls.append(1))
    assert not off.maybe() and off.trims == 0
    now = [0.0]
    on = HeapTrim(5.0, clock=lambda: now[0], trim=lambda: calls.append(1))
    now[0] = 4.9
    assert not on.maybe()
    now[0] = 5.0
    assert on.maybe() and not on.maybe() and on.trims == 1 and calls == [1]


def test_a_block_that_ends_during_a_trim_neither_waits_nor_trims_again():
    """Blocks end on several threads of the actor at once: while one trims, another's
    `maybe` returns at once, and the one trim is counted once."""
    import threading

    started, release = threading.Event(), threading.Event()
    calls = []

    def slow_trim():
        calls.append(1)
        started.set()
        release.wait(5)

    now = [0.0]
    heap = HeapTrim(5.0, clock=lambda: now[0], trim=slow_trim)
    now[0] = 10.0
    first = threading.Thread(target=heap.maybe)
    first.start()
    assert started.wait(5)
    assert not heap.maybe()  # returns while the first still trims
    release.set()
    first.join(5)
    assert calls == [1] and heap.trims == 1
