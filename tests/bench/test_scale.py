"""`make bench-scale`'s memory split: a process's USS by what holds it."""

import mmap
import os

import psutil

from bench.scale import mapping_kind, uss_by_kind


def test_each_mapping_is_put_under_what_holds_it():
    tmp = "/tmp/rs-abc"
    assert mapping_kind("[heap]", tmp) == mapping_kind("", tmp) == "heap and anonymous"
    assert mapping_kind("/dev/shm/plasmaXyZ (deleted)", tmp) == "object store (shared memory)"
    assert mapping_kind("/tmp/rs-abc/session_1/ray_spilled_objects/x", tmp) == "Ray's files (spill, fallback)"
    assert mapping_kind("/usr/lib/libc.so.6", tmp) == "libraries and files"
    assert mapping_kind("[stack]", tmp) == "other"


def test_the_split_adds_up_to_the_uss_and_sees_touched_shared_memory(tmp_path):
    # 8 MiB of a shared file mapping, touched by this process alone, is private to it.
    path = "/dev/shm/bench-scale-test-%d" % os.getpid()
    with open(path, "wb") as f:
        f.truncate(8 << 20)
    try:
        with open(path, "r+b") as f, mmap.mmap(f.fileno(), 8 << 20) as m:
            m[:] = b"x" * (8 << 20)
            p = psutil.Process()
            kinds = uss_by_kind(p, str(tmp_path))
            assert kinds["object store (shared memory)"] >= 8 << 20
            # Two readings of a live process, a moment apart (in a test worker that has
            # imported vLLM, a few MiB moved between them): equal within 2%.
            uss = p.memory_full_info().uss
            assert abs(sum(kinds.values()) - uss) <= max(4 << 20, uss // 50)
    finally:
        os.unlink(path)


def test_the_quarters_of_a_run_show_a_climb_and_a_plateau_apart():
    from bench.scale import quarters

    climbing = [(t, 100 + t) for t in range(8)]
    level = [(t, 100 + min(t, 2)) for t in range(8)]
    assert quarters(climbing) == [101, 103, 105, 107]
    assert quarters(level) == [101, 102, 102, 102]
    assert quarters([(0, 5)]) == [5, 5, 5, 5] and quarters([]) == []
