"""Progress of a run in the terminal, in the same terms as its metrics (`pipeline.observe.metrics`):
rows done of the total, ok and error counts, output tokens/s, the ETA, and for each
engine the bucket it is serving with its rows in flight against the budget.

On a terminal: one live display (rich), redrawn in place. Off a terminal (a log file,
CI, cron): one plain line every `interval_s` seconds, and one at the end.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from pipeline.observe.metrics import RunState


def _duration(seconds: float | None) -> str:
    if seconds is None or seconds != seconds:  # None or NaN
        return "?"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def engines_line(state: RunState) -> list[str]:
    """Per engine: where it is, the bucket(s) it serves, in flight / budget rows, KV usage."""
    out = []
    for e in state.engines:
        buckets = [f"{b} {e['in_flight'].get(b, 0)}/{e['budget_rows'].get(b, '?')}"
                   for b in sorted(e["in_flight"]) if e["in_flight"][b]]
        kv = e.get("kv_cache_usage")
        out.append(f"engine {e['engine']}@{e['node']}: {', '.join(buckets) or 'idle'}"
                   + (f" · KV {kv:.0%}" if kv is not None else ""))
    return out


def summary_line(state: RunState) -> str:
    total = state.rows_in
    done = state.done
    share = f" ({done / total:.0%})" if total else ""
    statuses = state.by_status()
    parts = [f"{done:,}/{total:,} rows{share}" if total is not None else f"{done:,} rows",
             f"ok {statuses.get('ok', 0):,}", f"error {statuses.get('error', 0):,}"]
    other = {k: v for k, v in statuses.items() if k not in ("ok", "error")}
    parts += [f"{k} {v:,}" for k, v in sorted(other.items())]
    if state.ended_at is None and state.requests > state.done - state.resumed_rows:  # their batch not out yet
        parts.append(f"{state.requests:,} request{'s' if state.requests != 1 else ''} generated")
    if state.map_reduce:
        parts.append(f"{state.map_reduce:,} long document{'s' if state.map_reduce != 1 else ''} in map-reduce")
    if state.tokens_per_s is not None:
        parts.append(f"{state.tokens_per_s:,.0f} output tok/s")
    parts.append(f"ETA {_duration(state.eta_s)}" if state.ended_at is None else "done")
    return " · ".join(parts)


class ProgressLines:
    """Off a terminal: a plain line every `interval_s`, and the last one when the run ends."""

    def __init__(self, interval_s: float = 30.0, stream: TextIO | None = None):
        self.interval_s, self.stream = interval_s, stream or sys.stdout
        self._last = time.monotonic()  # the first line after one interval, not at once

    def __call__(self, state: RunState) -> None:
        now = time.monotonic()
        if state.ended_at is None and now - self._last < self.interval_s:
            return
        self._last = now
        line = "progress " + summary_line(state)
        engines = engines_line(state)
        if engines and state.ended_at is None:
            line += " | " + " | ".join(engines)
        print(line, file=self.stream, flush=True)

    def close(self) -> None:
        pass


class ProgressView:
    """On a terminal: a bar with the same figures, and a line per engine, redrawn in place."""

    def __init__(self, title: str, console: Any = None):
        from rich.console import Console, Group
        from rich.live import Live
        from rich.progress import BarColumn, Progress, TextColumn

        self.console = console or Console()
        self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[line]}"),
                            console=self.console)
        self.task = self.bar.add_task(title, total=None, line="starting")
        self.engines = Group()
        self.live = Live(Group(self.bar, self.engines), console=self.console, refresh_per_second=2,
                         transient=False)
        self.live.start()

    def __call__(self, state: RunState) -> None:
        from rich.console import Group
        from rich.text import Text

        self.bar.update(self.task, total=state.rows_in, completed=state.done, line=summary_line(state))
        self.engines = Group(*(Text("  " + line, style="dim") for line in engines_line(state)))
        self.live.update(Group(self.bar, self.engines))

    def close(self) -> None:
        self.live.stop()


def progress_for(title: str, mode: str, interval_s: float, stream: TextIO | None = None) -> Any:
    """The display a run gets: `live` on a terminal, `lines` off one (`auto` picks), or None."""
    stream = stream or sys.stdout
    if mode == "auto":
        mode = "live" if stream.isatty() else "lines"
    if mode == "live":
        from rich.console import Console

        return ProgressView(title, Console(file=stream))
    if mode == "lines":
        return ProgressLines(interval_s, stream)
    return None
