"""The sweep plot `pipeline tune` writes beside its report: one panel pair per bucket.

Top: throughput (left axis, with each point's spread across repeats as an
error bar) and P99 latency (right axis) against batch size on a log2 axis;
the knee, the chosen batch and any out-of-memory batch are marked. Bottom:
peak memory pressure with the memory target.
"""

from __future__ import annotations

import io
from typing import Any

from pipeline.tools.tune.choice import Choice, SweepPoint

THROUGHPUT, LATENCY, PRESSURE, OOM, CHOSEN = "tab:blue", "tab:orange", "tab:purple", "tab:red", "tab:green"


def plot_sweep(results: dict[str, dict[str, Any]]) -> bytes:
    """PNG bytes for `results`: bucket name -> {"points": [SweepPoint, ...],
    "choice": Choice, "memory_target": float}."""
    # Figure, not pyplot: nothing is registered globally, so nothing leaks between calls.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not results:
        raise ValueError("plot_sweep needs at least one bucket")
    fig = Figure(figsize=(11, 4.6 * len(results) + 0.6))
    FigureCanvasAgg(fig)
    rows = fig.add_gridspec(len(results), 1, hspace=0.3)
    for row, (name, r) in enumerate(results.items()):
        cell = rows[row].subgridspec(2, 1, height_ratios=[3, 1], hspace=0.08)
        tp_ax = fig.add_subplot(cell[0])
        p_ax = fig.add_subplot(cell[1], sharex=tp_ax)
        lat_ax = tp_ax.twinx()
        # Throughput (and the chosen star) drawn over latency, which a twin axis would otherwise cover.
        tp_ax.set_zorder(lat_ax.get_zorder() + 1)
        tp_ax.patch.set_visible(False)
        points: list[SweepPoint] = sorted(r["points"], key=lambda p: p.batch)
        _curves(tp_ax, lat_ax, p_ax, points, r["memory_target"])
        _marks(tp_ax, p_ax, points, r["choice"])
        _axes(tp_ax, lat_ax, p_ax, points, r["choice"], name)
    _legend(fig, len(results))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def _curves(tp_ax: Any, lat_ax: Any, p_ax: Any, points: list[SweepPoint], target: float) -> None:
    """1. Throughput with its spread, and P99 latency, over the points that ran; pressure
    against the memory target."""
    ok = [p for p in points if not p.oom]
    b = [p.batch for p in ok]
    tp_ax.errorbar(b, [p.throughput for p in ok], yerr=[p.spread * p.throughput / 2 for p in ok],
                   color=THROUGHPUT, marker="o", capsize=3, zorder=3)
    lat_ax.plot(b, [p.p99_ms for p in ok], color=LATENCY, marker="s", linestyle="--", zorder=2)
    p_ax.plot(b, [p.peak_pressure for p in ok], color=PRESSURE, marker="o")
    p_ax.axhline(target, color="black", linestyle="--", linewidth=1)
    p_ax.text(1.005, target, f"target {target:.2f}", transform=p_ax.get_yaxis_transform(), va="center", fontsize=8)


def _marks(tp_ax: Any, p_ax: Any, points: list[SweepPoint], choice: Choice) -> None:
    """2. Marks: knee, chosen batch, OOMs."""
    if choice.knee is not None:
        for ax in (tp_ax, p_ax):
            ax.axvline(choice.knee, color="gray", linestyle=":", linewidth=1.5)
    tp_ax.plot([choice.batch], [choice.throughput], marker="*", markersize=18, color=CHOSEN,
               markeredgecolor="black", linestyle="none", zorder=4)
    tp_ax.annotate(f"batch {choice.batch}\n{choice.throughput:.0f} tok/s, P99 {choice.p99_ms:.0f} ms",
                   (choice.batch, choice.throughput), xytext=(0, -34), textcoords="offset points",
                   ha="center", va="top", fontsize=8,
                   bbox=dict(boxstyle="round", facecolor="white", edgecolor=CHOSEN, alpha=0.9))
    for p in points:
        if p.oom:
            for ax in (tp_ax, p_ax):
                ax.axvline(p.batch, color=OOM, linewidth=1.5, alpha=0.7)
            p_ax.plot([p.batch], [min(p.peak_pressure, 1.0) or 1.0], marker="X", markersize=10,
                      color=OOM, linestyle="none")
            tp_ax.text(p.batch, 0.5, " OOM", color=OOM, transform=tp_ax.get_xaxis_transform(),
                       rotation=90, va="center", ha="right", fontsize=9, fontweight="bold")


def _axes(tp_ax: Any, lat_ax: Any, p_ax: Any, points: list[SweepPoint], choice: Choice, name: str) -> None:
    """3. Axes: log2 batch with the batch sizes themselves as ticks; the bucket's title."""
    from matplotlib.ticker import FixedLocator, NullLocator

    ok = [p for p in points if not p.oom]
    every = [p.batch for p in points]
    tp_ax.set_xscale("log", base=2)
    tp_ax.xaxis.set_major_locator(FixedLocator(every))
    tp_ax.xaxis.set_minor_locator(NullLocator())
    tp_ax.set_xlim(min(every) / 1.4, max(every) * 1.4)
    p_ax.set_xticks(every, [str(x) for x in every])
    tp_ax.tick_params(labelbottom=False)
    tp_ax.set_ylim(0, 1.15 * max((p.throughput for p in ok), default=1.0))
    lat_ax.set_ylim(0, 1.15 * max((p.p99_ms for p in ok), default=1.0))
    tp_ax.set_ylabel("output tokens/s", color=THROUGHPUT)
    lat_ax.set_ylabel("P99 latency (ms)", color=LATENCY)
    p_ax.set_ylabel("peak memory\npressure", fontsize=9)
    p_ax.set_ylim(0, 1.1)
    p_ax.set_yticks([0, 0.5, 1])
    p_ax.set_xlabel("batch size (rows in flight, log2 scale)")
    tp_ax.grid(alpha=0.3)
    p_ax.grid(alpha=0.3)
    share = choice.throughput / choice.best_throughput if choice.best_throughput else 1.0
    tp_ax.set_title(f"bucket {name}: batch {choice.batch} chosen by {choice.rule}, {share:.0%} of "
                    f"the maximum {choice.best_throughput:.0f} tok/s (batch {choice.best_batch})",
                    fontsize=11, loc="left")


def _legend(fig: Any, buckets: int) -> None:
    """4. One legend for every bucket: the marks mean the same everywhere."""
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], color=THROUGHPUT, marker="o", label="throughput (bar: spread)"),
        Line2D([], [], color=LATENCY, marker="s", linestyle="--", label="P99 latency"),
        Line2D([], [], color=CHOSEN, marker="*", markersize=14, markeredgecolor="black",
               linestyle="none", label="chosen"),
        Line2D([], [], color="gray", linestyle=":", linewidth=1.5, label="knee"),
        Line2D([], [], color=OOM, marker="X", label="out of memory"),
        Line2D([], [], color=PRESSURE, marker="o", label="peak pressure"),
        Line2D([], [], color="black", linestyle="--", linewidth=1, label="memory target"),
    ]
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 1 - 0.05 / buckets))
    fig.subplots_adjust(left=0.08, right=0.9, top=1 - 0.5 / fig.get_figheight() - 0.04 / buckets,
                        bottom=0.45 / fig.get_figheight() + 0.05)
