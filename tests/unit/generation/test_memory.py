from pipeline.generation.memory import MemoryProbe


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
