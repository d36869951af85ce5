"""A quiet run: what Ray and vLLM print goes to the run's log file, the terminal keeps ours.

Ray's start-up notices, its execution plan, raylet warnings, and everything an actor
prints (vLLM's start-up, Triton, NUMA and oneDNN notices, Python warnings) reach the
driver through its file descriptors 1 and 2, some of them from C++. `quiet_output`
points both at the log file for the length of the run, and gives back streams to where
they pointed before (the terminal, or the pipe of whoever started us), for our progress
and our table. The pipeline's own warnings are written to both: they are meant to be acted on.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO


@dataclass(frozen=True)
class Terminal:
    """Where our own output goes while the run's chatter goes to the log."""

    out: TextIO
    err: TextIO


def _keep(stream: TextIO, fd: int) -> tuple[TextIO, bool]:
    """A stream to what `fd` points at now (a copy of the descriptor), if `stream` writes
    to `fd`; else `stream` itself (click's test runner, a captured stream), which moving
    `fd` does not touch. True when a copy was made (to be closed)."""
    try:
        if stream.fileno() != fd:
            return stream, False
    except (AttributeError, OSError, ValueError):
        return stream, False
    copy = os.fdopen(os.dup(fd), "w", buffering=1, encoding=getattr(stream, "encoding", None) or "utf-8",
                     errors="replace")
    return copy, True


@contextmanager
def quiet_output(path: Path) -> Iterator[Terminal]:
    """Descriptors 1 and 2 appended to `path` inside the block; what they were, as a `Terminal`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    out, own_out = _keep(sys.stdout, 1)
    err, own_err = _keep(sys.stderr, 2)
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    logger = logging.getLogger("pipeline")
    ours = logging.StreamHandler(err)
    ours.setLevel(logging.WARNING)
    kept = logging.StreamHandler(sys.stderr)  # the same warnings in the log, in their place
    kept.setLevel(logging.WARNING)
    propagate = logger.propagate
    with open(path, "ab", buffering=0) as log_file:
        for fd in (1, 2):
            os.dup2(log_file.fileno(), fd)
        logger.addHandler(ours)
        logger.addHandler(kept)
        logger.propagate = False
        try:
            yield Terminal(out, err)
        finally:
            logger.removeHandler(ours)
            logger.removeHandler(kept)
            logger.propagate = propagate
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
            for stream, own in ((out, own_out), (err, own_err)):
                if own:
                    stream.close()
                else:
                    stream.flush()
