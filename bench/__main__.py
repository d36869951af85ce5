"""`python -m bench` (`make bench`): the pipeline against raw vLLM, Ray Data LLM and its
own ablations. Not part of the installed package: run it from the repository root."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--rows", default=2000, show_default=True, type=click.IntRange(1),
              help="Rows of the synthetic corpus every system runs on.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1),
              help="Interleaved runs per system; the table shows medians and ranges.")
@click.option("--fixed", "fixed", multiple=True, type=click.IntRange(1), default=(),
              help="Fixed batch sizes (rows in flight) to run as ablations; repeatable (none by default).")
@click.option("--system", "systems", multiple=True,
              help="Run only these systems (raw, ray-data-llm, pipeline, pipeline-2, no-bucket, fixed-N); "
                   "repeatable or comma-separated.")
@click.option("--scaling", is_flag=True,
              help="Also run the full pipeline at 1k, 4k and 16k rows: time per 1,000 rows, peak driver and "
                   "worker memory.")
@click.option("--scaling-rows", default="1000,4000,16000", show_default=True,
              help="The row counts --scaling runs, comma-separated.")
@click.option("--out", default="bench/results/pipeline_vs_raw", show_default=True,
              help="Results as OUT.md and OUT.json.")
def bench(rows: int, repeats: int, fixed: tuple[int, ...], systems: tuple[str, ...], scaling: bool,
          scaling_rows: str, out: str) -> None:
    """The pipeline against raw vLLM, Ray Data LLM, and its own ablations.

    Runs raw vLLM (one LLM.generate), Ray Data LLM (its vLLM processor), the
    full pipeline with one engine and with two, the pipeline with bucketing off
    and, when asked, at fixed batch sizes, on the same synthetic corpus, model,
    prompts and sampling (jobs/nightly_summarize.yaml on conf/local.yaml),
    interleaved, --repeats times each. Writes a Markdown table with the goals
    met or missed, and JSON with the machine's details. See bench/compare.py
    for what is measured.
    """
    from bench.compare import bench as run_bench

    sizes = [int(x) for x in scaling_rows.split(",") if x.strip()] if scaling else None
    out_path = Path(out)
    result = run_bench(rows, repeats, list(fixed), out_path, scaling=sizes, systems=list(systems) or None,
                       log=lambda line: Console().print(line, soft_wrap=True))
    table = Table(title=f"pipeline bench · {rows:,} rows · medians of {repeats}", title_justify="left")
    for name in ("system", "wall s", "steady tok/s", "vs raw", "busy", "ok / error", "driver MiB", "workers MiB"):
        table.add_column(name, justify="left" if name == "system" else "right")
    for r in result["systems"]:
        def f(v: Any, spec: str = ",.0f") -> str:
            return "-" if v is None else format(v, spec)
        table.add_row(r["system"], f(r["wall_s"], ",.1f"), f(r["steady_tok_s"]), f(r["steady_tok_s_vs_raw"], ".3f"),
                      f(r["busy_fraction"], ".3f"), f"{f(r['rows_ok'])} / {f(r['rows_error'])}",
                      f(r["peak_driver_rss_mib"]), f(r["peak_workers_rss_mib"]))
    Console().print(table)
    Console().print(f"results: {out_path.with_suffix('.md')}  {out_path.with_suffix('.json')}", soft_wrap=True)


if __name__ == "__main__":
    bench()
