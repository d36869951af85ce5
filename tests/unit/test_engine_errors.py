"""Classifying engine failures from what vLLM prints (no engine needed)."""

from pipeline.engine import _root_cause, is_engine_oom, mentions_memory_failure

# What vLLM 0.32's CPU backend logs when gpu_memory_utilization asks for too much.
CPU_STARTUP_LOG = """\
(EngineCore pid=14817) INFO 11-29 23:12:41 [core.py:99] Initializing a V1 LLM engine
(VllmWorker-0 pid=14829) ERROR 11-29 23:12:42 [multiproc_executor.py:953] Traceback (most recent call last):
(VllmWorker-0 pid=14829) ERROR 11-29 23:12:42 [multiproc_executor.py:953] ValueError: Available memory on node 0 \
(21.47/22.96 GiB) on startup is less than desired CPU memory utilization (0.99, 22.73 GiB).
(EngineCore pid=14817) ERROR 11-29 23:12:42 [core.py:1510] Exception: WorkerProc initialization failed due to an \
exception in a background process. See stack trace for root cause.
"""


def test_the_memory_failure_is_the_root_cause_not_the_wrapper():
    cause = _root_cause(CPU_STARTUP_LOG)
    assert cause.startswith("ValueError: Available memory on node 0")
    assert mentions_memory_failure(cause)


def test_other_start_up_failures_are_not_memory():
    log = "(EngineCore pid=1) ERROR [core.py:1] ValueError: Model architectures ['Foo'] are not supported\n"
    cause = _root_cause(log)
    assert cause.startswith("ValueError: Model architectures") and not mentions_memory_failure(cause)
    assert _root_cause("all fine\n") is None


def test_gpu_messages_are_memory_failures():
    for msg in ("ValueError: No available memory for the cache blocks. Try increasing gpu_memory_utilization",
                "ValueError: Free memory on device (3.1/79.2 GiB) on startup is less than desired GPU memory "
                "utilization (0.9, 71.3 GiB)"):
        assert mentions_memory_failure(msg)


def test_oom_during_generation():
    class EngineDeadError(Exception):
        pass

    class OutOfMemoryError(RuntimeError):
        pass

    assert is_engine_oom(EngineDeadError()) and is_engine_oom(OutOfMemoryError("CUDA"))
    assert is_engine_oom(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_engine_oom(ValueError("sampler produced NaN"))
