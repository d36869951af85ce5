"""Classifying engine failures from what vLLM prints (no engine needed)."""

import pytest

from pipeline.generation.engine import EngineDead, is_oom
from pipeline.generation.vllm import VLLMEngine
from pipeline.generation.vllm_logs import mentions_memory_failure, root_cause

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
    cause = root_cause(CPU_STARTUP_LOG)
    assert cause.startswith("ValueError: Available memory on node 0")
    assert mentions_memory_failure(cause)


def test_other_start_up_failures_are_not_memory():
    log = "(EngineCore pid=1) ERROR [core.py:1] ValueError: Model architectures ['Foo'] are not supported\n"
    cause = root_cause(log)
    assert cause.startswith("ValueError: Model architectures") and not mentions_memory_failure(cause)
    assert root_cause("all fine\n") is None


def test_gpu_messages_are_memory_failures():
    for msg in ("ValueError: No available memory for the cache blocks. Try increasing gpu_memory_utilization",
                "ValueError: Free memory on device (3.1/79.2 GiB) on startup is less than desired GPU memory "
                "utilization (0.9, 71.3 GiB)"):
        assert mentions_memory_failure(msg)


def test_oom_during_generation():
    import torch

    assert is_oom(EngineDead("core died", memory=True)) and is_oom(torch.cuda.OutOfMemoryError("CUDA"))
    assert not is_oom(EngineDead("core died"))  # killed, or crashed: not a reason to shrink
    assert is_oom(MemoryError("injected")) and is_oom(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_oom(ValueError("sampler produced NaN"))

    class EngineDeadError(Exception):  # a class name is no proof of anything
        pass

    assert not is_oom(EngineDeadError())


def test_vllms_dead_engine_becomes_engine_dead():
    """The one place that knows vLLM's exception type; the feeder sees only EngineDead."""
    from vllm.v1.engine.exceptions import EngineDeadError

    class DeadCore:
        def step(self):
            raise EngineDeadError()

    class Refuses:
        def step(self):
            raise ValueError("sampler produced NaN")

    class Tail:  # the core's last words since start-up
        def __init__(self, text):
            self.text = text

        def drain(self, timeout_s):
            return self.text

    engine = object.__new__(VLLMEngine)
    engine._engine = DeadCore()
    engine._killed_of_memory, engine._tee = set(), Tail("")
    with pytest.raises(EngineDead) as died:  # killed: no word, not a memory failure
        engine.step()
    assert not died.value.memory
    engine._tee = Tail("(EngineCore_DP0 pid=7) ERROR 11-30 10:00:00 [core.py:710] "
                       "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    with pytest.raises(EngineDead) as died:
        engine.step()
    assert died.value.memory and "CUDA out of memory" in str(died.value)
    engine._engine = Refuses()
    with pytest.raises(ValueError):
        engine.step()


def test_a_request_to_a_dead_core_is_the_engines_death_not_the_prompts():
    """vLLM's add_request on a core that died between steps raises its dead-engine error:
    `submit` says EngineDead, so the feeder recovers the engine instead of failing the row;
    a prompt vLLM refuses for itself still raises as it was."""
    from vllm.v1.engine.exceptions import EngineDeadError

    class Renderer:
        def render_cmpl(self, prompts):
            return prompts

    class Core:
        renderer = Renderer()

        def __init__(self, error):
            self.error = error

        def add_request(self, request_id, prompt, params):
            raise self.error

    class Tail:
        def drain(self, timeout_s):
            return ""

    engine = object.__new__(VLLMEngine)
    engine._next_id, engine._killed_of_memory, engine._tee = 0, set(), Tail()
    engine._sampling_params = lambda sampling: None
    engine._engine = Core(EngineDeadError())
    with pytest.raises(EngineDead) as died:
        engine.submit([1, 2, 3], None)
    assert not died.value.memory
    engine._engine = Core(ValueError("prompt too long"))
    with pytest.raises(ValueError, match="prompt too long"):
        engine.submit([1, 2, 3], None)


def test_a_step_returns_the_finished_requests_with_vllms_first_token_time():
    """Outputs come back finished only (FINAL_ONLY); the time to the first token is the one
    vLLM's stats measured, and None where it measured none."""
    from types import SimpleNamespace as NS

    def output(rid, finished, latency):
        return NS(request_id=rid, finished=finished, metrics=NS(first_token_latency=latency) if latency else None,
                  outputs=[NS(text="a summary", token_ids=[5, 6, 7], finish_reason="length")])

    class Core:
        def step(self):
            return [output("req-0", True, 0.25), output("req-1", False, 0.1), output("req-2", True, None)]

    engine = object.__new__(VLLMEngine)
    engine._engine, engine._decoder = Core(), None  # vLLM's own text, where it has no fast tokenizer
    done = dict(engine.step())
    assert set(done) == {"req-0", "req-2"}
    assert done["req-0"].first_token_s == 0.25 and done["req-0"].output_tokens == 3
    assert done["req-2"].first_token_s is None and done["req-2"].text == "a summary"


def test_a_step_decodes_its_finished_requests_ids_less_the_token_that_stopped_them(tiny_model):
    """vLLM wrote no text (`detokenize=False`): the step decodes each finished request's ids
    after its prompt, leaving out the end-of-sequence or stop token id that ended it, as
    vLLM's detokenizer does; a request cut at its token limit keeps every id."""
    from types import SimpleNamespace as NS

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    prompt, words = tokenizer.encode("Summary:").ids, tokenizer.encode(" the fox").ids
    stop_id = tokenizer.token_to_id(".")

    def output(rid, ids, finish_reason, stop_reason=None):
        return NS(request_id=rid, finished=True, metrics=None, prompt_token_ids=prompt,
                  outputs=[NS(text="", token_ids=ids, finish_reason=finish_reason, stop_reason=stop_reason)])

    class Core:
        def step(self):
            return [output("eos", words + [tokenizer.token_to_id("</s>")], "stop"),
                    output("stop id", words + [stop_id], "stop", stop_reason=stop_id),
                    output("length", words + [stop_id], "length")]

    engine = object.__new__(VLLMEngine)
    engine._engine, engine._decoder = Core(), tokenizer
    done = dict(engine.step())

    assert done["eos"].text == done["stop id"].text == " the fox"
    assert done["length"].text == " the fox."
    assert [done[k].output_tokens for k in ("eos", "stop id", "length")] == [len(words) + 1] * 3


def test_a_rebuild_asks_for_a_smaller_kv_cache_where_it_was_sized_in_bytes():
    """On a CPU the run sizes the KV cache in bytes (`kv_cache_memory_bytes`), which wins
    over the memory fraction: a rebuild after an out-of-memory lowers both, by one factor."""
    from pipeline.generation.vllm import VLLMSettings

    engine = object.__new__(VLLMEngine)
    engine.settings = VLLMSettings({}, startup_backoff=0.64, min_gpu_memory_utilization=0.05)
    engine.kwargs = {"gpu_memory_utilization": 0.2, "kv_cache_memory_bytes": 2**31}
    engine.max_num_seqs, engine.rebuilds, engine.startup_s = 256, [], 1.0
    engine.close = lambda: None

    def build():
        engine.max_num_seqs = engine.kwargs["max_num_seqs"]

    engine._build = build
    engine.rebuild("engine_oom_death")
    (r,) = engine.rebuilds
    assert r["before"] == {"gpu_memory_utilization": 0.2, "max_num_seqs": 256, "kv_cache_memory_bytes": 2**31}
    assert r["after"] == {"gpu_memory_utilization": 0.16, "max_num_seqs": 128,
                          "kv_cache_memory_bytes": int(2**31 * 0.8)}
    del engine.kwargs["kv_cache_memory_bytes"]  # sized by the fraction alone: as before
    engine.rebuild("oom")
    assert engine.rebuilds[-1]["after"] == {"gpu_memory_utilization": 0.128, "max_num_seqs": 64}


def _last_words(go, words: bytes, pause: float) -> None:
    """A stand-in engine core: once told to go, its last words (a flood of lines first, as a
    core dumps its traceback), then death, or a wait to be killed."""
    import os
    import time

    go.wait()
    os.write(2, b"(EngineCore pid=1) INFO [core.py:1] step\n" * 4000 + words)
    time.sleep(pause)
    os._exit(1)


@pytest.mark.parametrize("how", ["said_oom", "killed_of_memory", "killed"])
def test_a_dead_cores_cause_is_read_from_its_ends_not_from_when_it_was_noticed(how):
    """The core's processes as vLLM holds them, really dying: its death is judged once each
    has ended and every line it wrote has been read through the tee, so a loaded machine
    that forwards its lines late cannot turn an out-of-memory into a crash (which would
    restart the engine just as large). A kill as a drill of memory is memory by its pid;
    a kill with no word is not."""
    import multiprocessing
    import os
    import signal
    import threading
    import time
    from types import SimpleNamespace as NS

    from vllm.v1.engine.exceptions import EngineDeadError

    from pipeline.generation.vllm_logs import EngineLogTee

    said = b"(EngineCore pid=1) ERROR [core.py:9] torch.OutOfMemoryError: CUDA out of memory.\n"
    context = multiprocessing.get_context("fork")
    go = context.Event()
    tee = EngineLogTee()
    # The tee forwards to a log that takes 100 KB/s, as a starved pump forwards on a loaded
    # machine: the core's 170 KB of last lines take it about 2 s, past the half second the
    # death was once given before its cause was read.
    slow_read, slow_write = os.pipe()
    tee._out = slow_write

    def slow_log() -> None:
        while chunk := os.read(slow_read, 1024):
            time.sleep(0.01)
        os.close(slow_read)

    threading.Thread(target=slow_log, daemon=True).start()
    try:
        # Started while the tee holds the descriptors, as vLLM starts its core; the tee then
        # gives them back and keeps the core's output as its tail.
        core = context.Process(target=_last_words,
                               args=(go, said if how == "said_oom" else b"", 0.0 if how == "said_oom" else 60.0))
        core.start()
        tee.stop()
        go.set()

        class DeadCore:
            engine_core = NS(resources=NS(engine_manager=NS(processes=[core])))

            def step(self):
                raise EngineDeadError()

        engine = object.__new__(VLLMEngine)
        engine._engine, engine._killed_of_memory, engine._tee = DeadCore(), set(), tee
        assert engine.core_pids() == [core.pid] or how == "said_oom"
        if how == "killed_of_memory":
            assert engine.kill_core(memory=True)
        elif how == "killed":
            os.kill(core.pid, signal.SIGKILL)
        with pytest.raises(EngineDead) as died:
            engine.step()
    finally:
        tee.stop()
    assert died.value.memory == (how != "killed"), died.value
    assert f"pid {core.pid} exit {1 if how == 'said_oom' else -9}" in str(died.value)
    assert ("CUDA out of memory" in str(died.value)) == (how == "said_oom")
    assert engine.core_pids() == []  # an ended core is no core to kill
