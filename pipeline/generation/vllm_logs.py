"""What vLLM says, read and kept quiet: its engine core's log, teed from the core's
stderr so a failed start or a dead core can say why (`EngineLogTee`, `root_cause`,
`mentions_memory_failure`), and each warning once per run instead of once per engine
and step (`WarningFilter` for vLLM's Python logger, `WarningLines` for the core's
lines, `python_warnings_once` for Python warnings). `warn_once(key)` is the run's
memory of what was said: true the first time a key is seen.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import select
import struct
import sys
import termios
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

# Start-up failures that mean "ask for less memory", from vLLM's GPU and CPU workers.
STARTUP_MEMORY_ERRORS = (
    "No available memory for the cache blocks",
    "is less than desired GPU memory utilization",
    "is less than desired CPU memory utilization",
    "Free memory on device",
    "out of memory",
)


def mentions_memory_failure(text: str) -> bool:
    text = text.lower()
    return any(marker.lower() in text for marker in STARTUP_MEMORY_ERRORS)


def root_cause(log_text: str) -> str | None:
    """The exception line the engine core logged that explains a failed start:
    a memory failure if there is one, else the first exception line."""
    causes = []
    for raw in log_text.splitlines():
        line = raw.split("] ", 1)[-1].strip() if "] " in raw else raw.strip()
        head = line.split(":", 1)[0]
        if head.endswith(("Error", "Exception")) and " " not in head:
            causes.append(line)
    memory = [c for c in causes if mentions_memory_failure(c)]
    return (memory or causes or [None])[0]


# -- one warning per run ----------------------------------------------------------
#
# Every engine of a pool logs the same vLLM warnings (its own process and its engine
# core both), so a run of N engines showed each N times or more. `warn_once(key)`, the
# pool's `PoolGate.first_time`, says whether a warning is new to the run; a warning
# that is not is dropped here. Only warnings: errors, tracebacks, INFO lines and
# progress bars always pass, and with `--verbose` nothing is filtered.

WarnOnce = Callable[[str], bool]

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# vLLM's format: `[prefix](<process> pid=<pid>) WARNING MM-DD HH:MM:SS [file.py:N] message`,
# and Ray puts its own `(<actor> pid=<pid>)` in front on the driver.
_WARNING_LINE = re.compile(r"(?:^|\s)WARNING\s+\d\d-\d\d \d\d:\d\d:\d\d(?:[.,]\d+)?\s+(\[[^\]\s]+:\d+\])\s?(.*)$")


def warning_key(line: str) -> str | None:
    """`[file.py:N] message` for a vLLM WARNING line, else None. What tells two engines'
    lines apart (timestamps, pids, process names, colours) is left out, so the same
    warning from any engine gives the same key."""
    match = _WARNING_LINE.search(_ANSI.sub("", line).rstrip())
    return None if match is None else f"{match.group(1)} {match.group(2)}".rstrip()


def record_key(record: logging.LogRecord) -> str:
    """The key `warning_key` gives the line this record is formatted as (a one-line message)."""
    return f"[{record.filename}:{record.lineno}] {record.getMessage()}".rstrip()


def _first_time(warn_once: WarnOnce, key: str) -> bool:
    try:
        return bool(warn_once(key))
    except Exception:  # never hide a warning because it could not be asked about
        return True


class WarningLines:
    """The engine core's output with the warnings the run has already shown taken out.

    Fed the bytes as they come off the pipe; judges whole lines, so a line split across
    chunks waits for its end (a partial line longer than `max_partial`, a progress bar
    that never ends its line, goes through as it is)."""

    def __init__(self, warn_once: WarnOnce, max_partial: int = 65536):
        self.warn_once = warn_once
        self.max_partial = max_partial
        self._partial = b""

    def feed(self, chunk: bytes) -> bytes:
        """What of `chunk` (and the partial line before it) to pass on now."""
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        out = b"".join(line + b"\n" for line in lines if self._keep(line))
        if len(self._partial) > self.max_partial:
            out, self._partial = out + self._partial, b""
        return out

    def flush(self) -> bytes:
        """The last, unterminated line, at the end of the output."""
        line, self._partial = self._partial, b""
        return line if line and self._keep(line) else b""

    def _keep(self, line: bytes) -> bool:
        if b"WARNING" not in line:  # cheap: most lines are not warnings
            return True
        key = warning_key(line.decode(errors="replace"))
        return key is None or _first_time(self.warn_once, key)


def python_warnings_once(warn_once: WarnOnce) -> None:
    """This process's Python warnings (vLLM's and its libraries' deprecations, printed
    when each engine imports them) once per run too, through the same `warn_once`."""
    import warnings

    shown = warnings.showwarning

    def show(message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        key = f"[{os.path.basename(filename)}:{lineno}] {category.__name__}: {message}"
        if _first_time(warn_once, key):
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show


class WarningFilter(logging.Filter):
    """This process's vLLM warnings, once per run: on the `vllm` logger's handlers (a
    filter on the logger itself would miss its children's records). ERROR and above,
    and everything below WARNING, pass untouched."""

    def __init__(self, warn_once: WarnOnce):
        super().__init__()
        self.warn_once = warn_once
        self._handlers: list[logging.Handler] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if not logging.WARNING <= record.levelno < logging.ERROR:
            return True
        # Asked once per record: with several handlers, the second would otherwise find the
        # warning seen (by the first's asking) and drop it.
        decided = getattr(record, "_shown_once", None)
        if decided is None:
            try:
                decided = _first_time(self.warn_once, record_key(record))
            except Exception:  # a message its arguments do not fit: logging reports that itself
                decided = True
            record._shown_once = decided
        return decided

    def attach(self) -> None:
        """Onto the handlers vLLM has now: it replaces them when it configures logging
        (each engine start-up may), so this is done after every start-up."""
        self.detach()
        self._handlers = list(logging.getLogger("vllm").handlers)
        for handler in self._handlers:
            handler.addFilter(self)

    def detach(self) -> None:
        for handler in self._handlers:
            handler.removeFilter(self)
        self._handlers = []


class EngineLogTee:
    """Tee file descriptors 1 and 2 while the engine starts, to read why it failed.

    vLLM's engine core runs in its own process, and when it fails to start the
    client only says "see root cause above": the cause is in the core's log,
    which it writes to the descriptors it inherited. Those are pointed at a
    pipe for the start-up; a thread forwards everything to the real stderr
    (for as long as the core lives) and keeps a copy of what came during the
    start-up, so a memory failure can be told from any other.

    With `warn_once`, what it forwards leaves out the warnings the run has already
    shown (`WarningLines`); the copy it keeps is always the whole output.
    """

    def __init__(self, warn_once: WarnOnce | None = None) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        read_end, write_end = os.pipe()
        self._saved = {fd: os.dup(fd) for fd in (1, 2)}
        self._out = os.dup(2)  # the thread's own handle on the real stderr
        for fd in (1, 2):
            os.dup2(write_end, fd)
        os.close(write_end)
        self._chunks: list[bytes] = []
        self._recording = True
        self._lock = threading.Lock()
        self._read_end, self._open = read_end, True
        self._tail: deque[bytes] = deque(maxlen=64)  # what came after the start-up, for `tail`
        self._lines = WarningLines(warn_once) if warn_once is not None else None
        self._thread = threading.Thread(target=self._pump, args=(read_end,), daemon=True)
        self._thread.start()

    def _pump(self, read_end: int) -> None:
        """Forward the pipe until its last writer closes it. Each chunk is read and kept
        under the lock, so that `drain` sees either bytes still in the pipe or every
        byte kept."""
        with os.fdopen(read_end, "rb", buffering=0) as pipe:
            while True:
                select.select([read_end], [], [])
                with self._lock:
                    chunk = pipe.read(65536)
                    if not chunk:
                        self._open = False
                        break
                    (self._chunks if self._recording else self._tail).append(chunk)
                os.write(self._out, chunk if self._lines is None else self._lines.feed(chunk))
            if self._lines is not None:
                os.write(self._out, self._lines.flush())
        os.close(self._out)

    def drain(self, timeout_s: float = 10.0) -> str:
        """The tail (`tail`) once every byte written to the pipe so far has been read: a
        dead core's last words are whole here, however loaded the machine, since a process
        that has ended wrote all it will. Bounded by `timeout_s` should the pump be stuck."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._open or unread_bytes(self._read_end) == 0:
                    break
            time.sleep(0.01)
        return self.tail()

    def stop(self, wait_s: float = 0.0) -> str:
        """Give this process its descriptors back; return what was captured. With
        `wait_s`, first wait for the (dead) engine core's last lines. Once only: a
        second call returns the same."""
        sys.stdout.flush()
        sys.stderr.flush()
        saved, self._saved = self._saved, {}
        for fd, dup in saved.items():
            os.dup2(dup, fd)
            os.close(dup)
        if wait_s:
            self._thread.join(wait_s)
        with self._lock:
            self._recording = False
            return b"".join(self._chunks).decode(errors="replace")

    def tail(self) -> str:
        """The engine core's last lines since the start-up (it keeps the tee's pipe)."""
        with self._lock:
            return b"".join(self._tail).decode(errors="replace")


def unread_bytes(fd: int) -> int:
    """Bytes written to the pipe `fd` and not read yet."""
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
