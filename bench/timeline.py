"""`make bench-timeline`: every engine step of raw `LLM.generate` and of the pipeline, on
the same corpus, one above the other.

Both systems run as `make bench` runs them (`bench.compare.run_system`, each in its own
process, the same prompts, engine settings and sampling), with each engine step
recorded where vLLM records its own stats (`pipeline.generation.vllm_steps`): when the
step began, how long it took, the requests running and waiting after it, and the
prompt and generated tokens it scheduled. The plot shows, against time since the
first step, the requests running and waiting (what the scheduler had to work with)
and each step's duration; the table says where the generating span went: inside
steps, or in the gaps between them (the caller's own loop), and how full the steps
were. Results: OUT.json (every step), OUT.md and OUT.png.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from bench.compare import JOB, PROFILE, SYNTHETIC, git_commit, run_system, warm_model
from pipeline.observe.machine import describe

SYSTEMS = ("raw", "pipeline")


def summary(steps: dict[str, Any]) -> dict[str, Any]:
    """Where one engine's generating span went: the steps' own time, the gaps between them,
    and how many requests each step ran, on average and at the median."""
    start, seconds = steps["start"], steps["seconds"]
    if not start:
        return {"steps": 0}
    span = start[-1] + seconds[-1] - start[0]
    in_steps = sum(seconds)
    gaps = [start[k + 1] - (start[k] + seconds[k]) for k in range(len(start) - 1)]
    generated = sum(steps["generated_tokens"])
    return {
        "steps": len(start),
        "span_s": round(span, 3),
        "in_steps_s": round(in_steps, 3),
        "gaps_s": round(sum(g for g in gaps if g > 0), 3),
        "gap_share": round(1 - in_steps / span, 4) if span > 0 else None,
        "median_step_ms": round(statistics.median(seconds) * 1000, 3),
        "mean_running": round(statistics.fmean(steps["running"]), 1),
        "median_running": statistics.median(steps["running"]),
        "steps_with_waiting": sum(w > 0 for w in steps["waiting"]),
        "prompt_tokens": sum(steps["prompt_tokens"]),
        "generated_tokens": generated,
        "generated_tok_s_in_span": round(generated / span, 1) if span > 0 else None,
        "dropped": steps.get("dropped", 0),
    }


def plot(timelines: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """One panel per system, raw on top: requests running and waiting (left axis) and each
    step's duration (right axis), against seconds since that system's first step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(timelines), 1, figsize=(11, 3.4 * len(timelines)), sharex=True, squeeze=False)
    for ax, (name, engines) in zip(axes[:, 0], timelines.items()):
        twin = ax.twinx()
        for k, steps in enumerate(engines):
            if not steps["start"]:
                continue
            t0 = steps["start"][0]
            t = [s - t0 for s in steps["start"]]
            label = f" (engine {k + 1})" if len(engines) > 1 else ""
            ax.plot(t, steps["running"], lw=1, label=f"running{label}")
            ax.plot(t, steps["waiting"], lw=1, ls="--", label=f"waiting{label}")
            twin.scatter(t, [s * 1000 for s in steps["seconds"]], s=2, c="tab:red", alpha=0.4)
        ax.set_ylabel("requests")
        twin.set_ylabel("step ms", color="tab:red")
        ax.set_title(name)
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds since the system's first engine step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"# Engine steps: raw `LLM.generate` and the pipeline, {result['rows']:,} rows",
        "",
        f"Measured {result['finished_at']} at {result['commit']} on {m.get('cpu')}, {m.get('cores')} cores; "
        f"CPU flags {', '.join(m.get('cpu_flags') or []) or 'unknown'}. `make bench-timeline` "
        f"(`python -m bench.timeline --rows {result['rows']}"
        + "".join(f" --set {s}" for s in result.get("pipeline_sets", []))
        + f"`), one run each, {result['profile']}, the tiny model.",
        "",
        "![steps](" + Path(result["plot"]).name + ")",
        "",
        "| system | wall s | steps | span s | in steps s | gaps s | gap share | median step ms "
        "| mean running | steps with waiting | generated tok/s in span |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in result["systems"].items():
        for k, s in enumerate(r["engines"]):
            label = name + (f" (engine {k + 1})" if len(r["engines"]) > 1 else "")
            lines.append(f"| {label} | {r['wall_s']:.1f} | {s['steps']:,} | {s.get('span_s')} | {s.get('in_steps_s')} "
                         f"| {s.get('gaps_s')} | {s.get('gap_share')} | {s.get('median_step_ms')} "
                         f"| {s.get('mean_running')} | {s.get('steps_with_waiting')} "
                         f"| {s.get('generated_tok_s_in_span')} |")
    return "\n".join(lines) + "\n"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--rows", type=click.IntRange(1), default=4000, show_default=True, help="Rows of the synthetic corpus.")
@click.option("--out", default="bench/results/timeline_4k", show_default=True,
              help="Results as OUT.json, OUT.md and OUT.png.")
@click.option("--set", "pipeline_sets", multiple=True, metavar="KEY=VALUE",
              help="A profile setting for the pipeline's run only (repeatable), e.g. batching.concurrent_batches=8.")
def main(rows: int, out: str, pipeline_sets: tuple[str, ...]) -> None:
    """Every engine step of raw LLM.generate and of the pipeline, on the same corpus."""
    from pipeline.tools.dev.corpus import write_corpus

    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    sets = list(SYNTHETIC.sets)
    systems: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="pipeline-timeline-") as tmp:
        work = Path(tmp)
        corpus = write_corpus(work / "corpus.parquet", rows=rows, seed=0)
        warm_model(PROFILE, sets, work)
        for name in SYSTEMS:
            own = [*sets, *pipeline_sets] if name == "pipeline" else sets
            r = run_system(name, own, corpus, work, timeline=True)
            systems[name] = {"wall_s": r["wall_s"], "output_tokens": r["output_tokens"],
                             "engines": [summary(s) for s in r["step_timeline"]], "steps": r["step_timeline"]}
            click.echo(f"{name}: wall {r['wall_s']:.1f} s, " + "; ".join(
                f"{s['steps']} steps, gap share {s.get('gap_share')}" for s in systems[name]["engines"]))
    png = out_path.with_suffix(".png")
    plot({name: r["steps"] for name, r in systems.items()}, png)
    result = {"rows": rows, "job": JOB, "profile": PROFILE, "sets": sets, "pipeline_sets": list(pipeline_sets),
              "commit": git_commit(),
              "finished_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": describe(),
              "plot": str(png), "systems": systems}
    out_path.with_suffix(".json").write_text(json.dumps(result))
    out_path.with_suffix(".md").write_text(markdown(result))
    click.echo(f"results: {out_path.with_suffix('.md')}  {out_path.with_suffix('.json')}  {png}")


if __name__ == "__main__":
    main(sys.argv[1:])
