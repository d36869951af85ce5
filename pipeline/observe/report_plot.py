"""The batch-size trajectory plot written beside the report (for a live server: the
requests in flight, the server's queue and our time to first token)."""

from __future__ import annotations

import io
from typing import Any


def png(fig: Any, axes: tuple[Any, ...], ncol: int) -> bytes:
    """The figure, its axes gridded and labelled, as PNG bytes; the figure is closed."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8, ncol=ncol)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def plot_trajectories(report: dict[str, Any]) -> bytes | None:
    """Budget (rows in flight) and memory pressure over time, one line per bucket,
    as PNG bytes; None when the run has no trajectory to show. A run on a live server
    (`report["server"]`: each engine's server record) gets `plot_server` instead."""
    if report.get("server"):
        return plot_server(report)
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
    return png(fig, (rows_ax, p_ax), ncol=2)


REASON_COLOURS = {"online_ttft": "tab:red", "queue": "tab:orange", "preempted": "tab:purple",
                  "throttled": "tab:gray"}


def plot_server(report: dict[str, Any]) -> bytes | None:
    """For each engine on a live server: the in-flight limit and ours in flight, the
    server's queue (running, waiting, and others' requests), and our time to first token
    against its target, over time; back-offs as vertical lines coloured by reason."""
    servers = [s for s in report["server"] if s["in_flight"]["steps"]]
    if not servers:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (n_ax, q_ax, t_ax) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    for k, s in enumerate(servers):
        traj = s["in_flight"]
        steps = traj["steps"]
        t = [x["t"] for x in steps]
        tag = f" ({k})" if len(servers) > 1 else ""
        n_ax.step(t, [x["limit"] for x in steps], where="post", label="limit" + tag)
        n_ax.plot(t, [x["in_flight"] for x in steps], ".", label="ours in flight" + tag)
        q_ax.plot(t, [x["running"] for x in steps], label="running" + tag)
        q_ax.plot(t, [x["waiting"] for x in steps], label="waiting" + tag)
        q_ax.plot(t, [x["foreign"] for x in steps], label="others'" + tag)
        ttft = [(x["t"], x["ttft_ms"]) for x in steps if x.get("ttft_ms") is not None]
        t_ax.plot([a for a, _ in ttft], [b for _, b in ttft], ".-", label="ours, highest per sample" + tag)
        probe = [(x["t"], x["probe_ttft_ms"]) for x in steps if x.get("probe_ttft_ms") is not None]
        t_ax.plot([a for a, _ in probe], [b for _, b in probe], "x-", label="an online request's (probe)" + tag)
        online = [x["t"] for x in steps if x.get("online")]
        q_ax.plot(online, [0] * len(online), "|", color="tab:red", markersize=12, label="online traffic there" + tag)
        for back in traj["backoffs"]:
            colour = REASON_COLOURS.get(back["reasons"][0], "black")
            for ax in (n_ax, q_ax, t_ax):
                ax.axvline(back["t"], color=colour, linestyle=":", alpha=0.5)
    t_ax.axhline(servers[0]["ttft_ms"]["slo"], color="black", linestyle="--", linewidth=1, label="target")
    n_ax.set_ylabel("requests in flight")
    n_ax.set_title(f"{report['job']} on {servers[0]['url']} · run {report['run_id']}  (dotted: back-offs; "
                   + ", ".join(f"{c.split(':')[1]} {r}" for r, c in REASON_COLOURS.items()) + ")", fontsize=9)
    q_ax.set_ylabel("the server's requests")
    t_ax.set_ylabel("time to first token, ms")
    t_ax.set_yscale("log")
    t_ax.set_xlabel("seconds since the engine started")
    return png(fig, (n_ax, q_ax, t_ax), ncol=3)
