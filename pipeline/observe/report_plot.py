"""The batch-size trajectory plot written beside the report."""

from __future__ import annotations

import io
from typing import Any


def plot_trajectories(report: dict[str, Any]) -> bytes | None:
    """Budget (rows in flight) and memory pressure over time, one line per bucket,
    as PNG bytes; None when the run has no trajectory to show."""
    per_bucket = report["batching"]["per_bucket"]
    if not any(b["trajectory"] for b in per_bucket.values()):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rows_ax, p_ax) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for name, b in per_bucket.items():
        steps = b["trajectory"]
        if not steps:
            continue
        t = [s["t"] for s in steps]
        (line,) = rows_ax.step(t, [s["rows"] for s in steps], where="post", label=name)
        # The start step has no reading yet; drain windows (the bucket's last rows) are hollow.
        seen = [s for s in steps if s["action"] != "start"]
        p_ax.plot([s["t"] for s in seen], [s["pressure"] for s in seen], color=line.get_color(), label=name)
        drain = [s for s in seen if s.get("reason") == "drain"]
        p_ax.scatter([s["t"] for s in seen if s not in drain], [s["pressure"] for s in seen if s not in drain],
                     s=10, color=line.get_color())
        p_ax.scatter([s["t"] for s in drain], [s["pressure"] for s in drain], s=18,
                     facecolors="none", edgecolors=line.get_color())
        for back in b["backoffs"]:
            rows_ax.axvline(back["t"], color=line.get_color(), linestyle=":", alpha=0.6)
    target = report["batching"].get("memory_target")
    if target:
        p_ax.axhline(target, color="black", linestyle="--", linewidth=1, label=f"target {target:.2f}")
    rows_ax.set_ylabel("rows admitted per window")
    rows_ax.set_yscale("log", base=2)
    rows_ax.set_title(
        f"{report['job']} · {report['batching']['policy']} batching · run {report['run_id']}"
        "  (dotted: back-offs; hollow: drain windows)"
    )
    p_ax.set_ylabel("peak memory pressure")
    p_ax.set_xlabel("seconds since the engine's first batch")
    p_ax.set_ylim(0, 1.05)
    for ax in (rows_ax, p_ax):
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8, ncol=2)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()
