"""vLLM warnings once per run, not once per engine (`pipeline.generation.vllm`, `pipeline.run.pool`)."""

import logging
import os

from pipeline.generation.vllm_logs import EngineLogTee, WarningFilter, WarningLines, warning_key
from pipeline.run.pool import PoolLog

ENGINE_A = ("(MapWorker(MapBatches(GenerateStage)) pid=28484) (EngineCore pid=29308) WARNING 12-01 02:36:15 "
            "[vllm.py:1703] Enforce eager set, disabling torch.compile and CUDAGraphs.")
ENGINE_B = ("(MapWorker(MapBatches(GenerateStage)) pid=28511) (EngineCore_DP0 pid=29377) WARNING 12-01 02:36:19 "
            "[vllm.py:1703] Enforce eager set, disabling torch.compile and CUDAGraphs.")
COLOURED = ("\x1b[0;36m(EngineCore pid=31000)\x1b[0;0m \x1b[33mWARNING\x1b[0m \x1b[90m12-01 02:37:01\x1b[0m "
            "\x1b[90m[vllm.py:1703]\x1b[0m Enforce eager set, disabling torch.compile and CUDAGraphs.")


class Once:
    """The pool's `first_time`, in memory; records what it was asked."""

    def __init__(self):
        self.seen, self.asked = set(), []

    def __call__(self, key):
        self.asked.append(key)
        new = key not in self.seen
        self.seen.add(key)
        return new


def test_the_same_warning_from_two_engines_has_one_key():
    assert warning_key(ENGINE_A) == warning_key(ENGINE_B) == warning_key(COLOURED)
    assert warning_key(ENGINE_A) == "[vllm.py:1703] Enforce eager set, disabling torch.compile and CUDAGraphs."
    # as the engine core writes it, before Ray's prefix
    assert warning_key(ENGINE_A.split(") ", 1)[1] + "\r") == warning_key(ENGINE_A)


def test_different_warnings_have_different_keys():
    other_line = ENGINE_A.replace("[vllm.py:1703]", "[vllm.py:1710]")
    other_text = ENGINE_A.replace("Enforce eager set", "Chunked prefill is enabled")
    keys = {warning_key(ENGINE_A), warning_key(other_line), warning_key(other_text)}
    assert len(keys) == 3


def test_only_warning_lines_have_keys():
    assert warning_key(ENGINE_A.replace(" WARNING ", " ERROR ")) is None
    assert warning_key(ENGINE_A.replace(" WARNING ", " INFO ")) is None
    assert warning_key("UserWarning: WARNING this is not vLLM's format") is None
    assert warning_key("Loading safetensors checkpoint shards: 100% Completed | 1/1") is None


def core(level, message, pid=29308, line=1703, at="02:36:15"):
    return f"(EngineCore pid={pid}) {level} 12-01 {at} [vllm.py:{line}] {message}\n".encode()


def test_lines_split_across_chunks_are_judged_whole():
    once = Once()
    lines = WarningLines(once)
    text = core("WARNING", "first") + core("INFO", "info") + core("WARNING", "first", pid=1, at="02:37:00")
    out = b"".join(lines.feed(text[i:i + 7]) for i in range(0, len(text), 7)) + lines.flush()
    assert out == core("WARNING", "first") + core("INFO", "info")
    assert once.asked == ["[vllm.py:1703] first"] * 2  # whole lines only, never a piece of one


def test_errors_and_other_lines_always_pass():
    lines = WarningLines(lambda key: False)  # every warning already shown
    text = (core("WARNING", "seen") + core("ERROR", "engine core failed") + b"Traceback (most recent call last):\n"
            + b"  File \"core.py\", line 1, in <module>\n" + b"RuntimeError: out of memory\n" + core("INFO", "up"))
    assert lines.feed(text) == text.replace(core("WARNING", "seen"), b"")


def test_a_partial_line_waits_for_its_end_then_the_rest_goes_out():
    lines = WarningLines(Once(), max_partial=16)
    assert lines.feed(b"(EngineCore pid=1) WARN") == b"(EngineCore pid=1) WARN"  # past max_partial: no wait
    lines = WarningLines(Once())
    assert lines.feed(b"Processed prompts: 50%") == b""
    assert lines.flush() == b"Processed prompts: 50%"


def test_a_pool_that_cannot_answer_hides_nothing():
    def broken(key):
        raise TimeoutError("pool busy")

    assert WarningLines(broken).feed(core("WARNING", "w")) == core("WARNING", "w")


def test_the_tee_forwards_each_warning_once_and_records_everything(capfd):
    tee = EngineLogTee(Once())
    chunks = [core("WARNING", "eager")[:30], core("WARNING", "eager")[30:] + core("WARNING", "eager", pid=2),
              core("ERROR", "boom") + core("ERROR", "boom")]
    for chunk in chunks:
        os.write(2, chunk)
    recorded = tee.stop(wait_s=5.0)
    assert recorded == b"".join(chunks).decode()
    assert capfd.readouterr().err == (core("WARNING", "eager") + core("ERROR", "boom") * 2).decode()


def test_without_warn_once_the_tee_forwards_everything(capfd):
    tee = EngineLogTee()
    text = core("WARNING", "eager") * 2
    os.write(2, text)
    tee.stop(wait_s=5.0)
    assert capfd.readouterr().err == text.decode()


def test_the_logging_filter_shows_a_warning_once_and_every_error():
    once = Once()
    logger = logging.getLogger("vllm.test_quiet_logs")
    shown = []
    handler = logging.Handler()
    handler.emit = lambda record: shown.append((record.levelname, record.getMessage()))
    vllm = logging.getLogger("vllm")
    vllm.addHandler(handler)
    level, propagate = vllm.level, vllm.propagate
    vllm.setLevel(logging.DEBUG)
    vllm.propagate = False
    quiet = WarningFilter(once)
    try:
        quiet.attach()
        for _ in range(2):
            logger.debug("detail")
            logger.info("starting %s", "engine")
            logger.warning("Enforce eager set")
            logger.error("engine failed")
            logger.critical("gone")
        quiet.detach()
        logger.warning("Enforce eager set")  # detached: not filtered
    finally:
        vllm.removeHandler(handler)
        vllm.setLevel(level)
        vllm.propagate = propagate
    assert shown == [("DEBUG", "detail"), ("INFO", "starting engine"), ("WARNING", "Enforce eager set"),
                     ("ERROR", "engine failed"), ("CRITICAL", "gone"),
                     ("DEBUG", "detail"), ("INFO", "starting engine"),
                     ("ERROR", "engine failed"), ("CRITICAL", "gone"),
                     ("WARNING", "Enforce eager set")]
    assert once.asked[0].startswith("[test_quiet_logs.py:") and once.asked[0].endswith("] Enforce eager set")
    assert len(once.asked) == 2  # only warnings are asked about


def test_the_logging_filter_key_matches_the_line_key():
    record = logging.LogRecord("vllm.config", logging.WARNING, "/x/vllm/config/vllm.py", 1703,
                               "Enforce eager set, %s.", ("disabling torch.compile and CUDAGraphs",), None)
    from pipeline.generation.vllm_logs import record_key

    assert record_key(record) == warning_key(ENGINE_A)


def test_the_pools_warning_memory_says_first_time_once_per_key():
    pool = PoolLog(engines=2)
    assert pool.first_time("[vllm.py:1703] Enforce eager set") is True
    assert pool.first_time("[vllm.py:1703] Enforce eager set") is False
    assert pool.first_time("[vllm.py:1710] Chunked prefill") is True
    assert pool.first_time("[vllm.py:1710] Chunked prefill") is False


def test_the_warning_memory_past_its_bound_shows_new_warnings_every_time():
    from pipeline.run.pool import WarningMemory

    memory = WarningMemory()
    memory.MAX_WARNINGS = 2
    assert memory.first_time("a") and memory.first_time("b")
    assert memory.first_time("c") is True
    assert memory.first_time("c") is True  # not remembered: shown again rather than never
    assert memory.first_time("a") is False  # what it remembers it still hides
    assert len(memory.seen) == 2


def test_pool_gate_first_time_says_true_when_the_pool_cannot_answer():
    from pipeline.run.pool import PoolGate

    gate = PoolGate.__new__(PoolGate)
    gate.log = None  # no actor: the call fails
    assert gate.first_time("[vllm.py:1] w") is True


def test_python_warnings_are_shown_once_per_run_whatever_the_process():
    import io
    import warnings

    from pipeline.generation.vllm_logs import python_warnings_once

    seen: set[str] = set()

    def first_time(key: str) -> bool:  # the pool's log, across every engine of the run
        new = key not in seen
        seen.add(key)
        return new

    shown, err = warnings.showwarning, io.StringIO()
    try:
        warnings.showwarning = lambda m, c, f, n, file=None, line=None: err.write(f"{f}:{n}: {c.__name__}: {m}\n")
        python_warnings_once(first_time)
        with warnings.catch_warnings():
            warnings.simplefilter("always")  # as two engine processes would each show it
            for _ in range(2):
                warnings.warn_explicit("reduce_op is deprecated", FutureWarning, "dispatcher.py", 138)
            warnings.warn_explicit("something else", FutureWarning, "dispatcher.py", 140)
    finally:
        warnings.showwarning = shown
    assert err.getvalue().count("reduce_op is deprecated") == 1 and "something else" in err.getvalue()


def test_a_warning_is_judged_once_however_many_handlers_show_it():
    once = Once()
    vllm = logging.getLogger("vllm")
    shown: list[str] = []
    handlers = []
    for name in ("vllm's own", "a test's"):
        h = logging.Handler()
        h.emit = lambda record, name=name: shown.append(name)
        handlers.append(h)
        vllm.addHandler(h)
    propagate, vllm.propagate = vllm.propagate, False
    quiet = WarningFilter(once)
    try:
        quiet.attach()
        for _ in range(2):  # one line of code: one warning
            logging.getLogger("vllm.x").warning("Enforce eager set")
    finally:
        quiet.detach()
        for h in handlers:
            vllm.removeHandler(h)
        vllm.propagate = propagate
    assert shown == ["vllm's own", "a test's"] and len(once.asked) == 2
