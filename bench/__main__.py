"""`python -m bench` (`make bench`, `make bench-real`): the pipeline against raw vLLM, Ray
Data LLM and its own ablations. Not part of the installed package: run it from the
repository root."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--real", is_flag=True,
              help="A real model on real text: SmolLM2-135M-Instruct (conf/local-real.yaml) on the Python "
                   "manual's topics, with `make run`'s sampling.max_new_tokens=64 and engine.max_model_len=1024; "
                   "raw and pipeline unless --system says otherwise. The goals are not checked; raw wall ÷ "
                   "pipeline wall is recorded as a baseline.")
@click.option("--repeated", is_flag=True,
              help="The synthetic corpus with 6% of its documents repeated under ids of their own, raw and "
                   "pipeline, 16,000 rows (bench/results/repeated_16k): the pipeline generates each repeat once.")
@click.option("--rows", type=click.IntRange(1),
              help="Rows of the corpus every system runs on.  [default: 2000; with --real 40 (of at most 79)]")
@click.option("--repeats", type=click.IntRange(1),
              help="Interleaved runs per system; the table shows medians and ranges.  [default: 3; with --real 2]")
@click.option("--fixed", "fixed", multiple=True, type=click.IntRange(1), default=(),
              help="Fixed batch sizes (rows in flight) to run as ablations; repeatable (none by default).")
@click.option("--system", "systems", multiple=True,
              help="Run only these systems (raw, ray-data-llm, pipeline, pipeline-2, no-bucket, fixed-N); "
                   "repeatable or comma-separated.")
@click.option("--ablation", "ablations", multiple=True, metavar="NAME:KEY=VALUE",
              help="Also run the pipeline with this --set, as system NAME (repeatable; a NAME given twice "
                   "gets both), e.g. core-apart:engine.in_process=false.")
@click.option("--scaling", is_flag=True,
              help="Also run the full pipeline at 1k, 4k and 16k rows: time per 1,000 rows, peak driver and "
                   "worker memory (not with --real).")
@click.option("--scaling-rows", default="1000,4000,16000", show_default=True,
              help="The row counts --scaling runs, comma-separated.")
@click.option("--out", help="Results as OUT.md and OUT.json.  "
                            "[default: bench/results/pipeline_vs_raw; with --real bench/results/real_model]")
def bench(real: bool, repeated: bool, rows: int | None, repeats: int | None, fixed: tuple[int, ...], systems: tuple[str, ...],
          ablations: tuple[str, ...], scaling: bool, scaling_rows: str, out: str | None) -> None:
    """The pipeline against raw vLLM, Ray Data LLM, and its own ablations.

    Runs raw vLLM (one LLM.generate), Ray Data LLM (its vLLM processor), the
    full pipeline with one engine and with two, the pipeline with bucketing off
    and, when asked, at fixed batch sizes, on the same synthetic corpus, model,
    prompts and sampling (jobs/nightly_summarize.yaml on conf/local.yaml),
    interleaved, --repeats times each. Writes a Markdown table with the goals
    met or missed, and JSON with the machine's details. With --real, raw vLLM
    and the pipeline on the real model and real text instead. See
    bench/compare.py for what is measured.
    """
    from bench.compare import REAL, REPEATED, SYNTHETIC, Plan
    from bench.compare import bench as run_bench

    if real and repeated:
        raise click.UsageError("--real and --repeated are two different corpora: choose one")
    variant = REAL if real else REPEATED if repeated else SYNTHETIC
    sizes = tuple(int(x) for x in scaling_rows.split(",") if x.strip()) if scaling else ()
    plan = Plan(variant, rows or variant.rows, repeats or variant.repeats, Path(out or variant.out),
                fixed=fixed, systems=systems, ablations=ablations, scaling=sizes)
    result = run_bench(plan, log=lambda line: Console().print(line, soft_wrap=True))
    show(result)
    out_path = plan.out
    Console().print(f"results: {out_path.with_suffix('.md')}  {out_path.with_suffix('.json')}", soft_wrap=True)


def show(result: dict[str, Any]) -> None:
    """The medians as a table on the terminal, and the baseline where there is one."""
    table = Table(title=f"pipeline bench · {result['rows']:,} rows · medians of {result['repeats']}",
                  title_justify="left")
    for name in ("system", "wall s", "steady tok/s", "vs raw", "busy", "ok / error", "driver MiB", "workers MiB"):
        table.add_column(name, justify="left" if name == "system" else "right")
    for r in result["systems"]:
        def f(v: Any, spec: str = ",.0f") -> str:
            return "-" if v is None else format(v, spec)
        table.add_row(r["system"], f(r["wall_s"], ",.1f"), f(r["steady_tok_s"]), f(r["steady_tok_s_vs_raw"], ".3f"),
                      f(r["busy_fraction"], ".3f"), f"{f(r['rows_ok'])} / {f(r['rows_error'])}",
                      f(r["peak_driver_rss_mib"]), f(r["peak_workers_rss_mib"]))
    Console().print(table)
    b = result.get("baseline")
    if b:
        value = "-" if b["value"] is None else f"{b['value']:.3f}"
        Console().print(f"baseline: {b['measure']} {value} (a later goal: ≥ {b['later_goal']:.2f}; not checked)",
                        soft_wrap=True)


if __name__ == "__main__":
    bench()
