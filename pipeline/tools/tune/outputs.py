"""What `pipeline tune` leaves behind: a terminal table, CSV and JSON of every
point, a PNG of the curves, and a profile whose per-bucket batch sizes `run` uses."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import yaml
from rich import box
from rich.table import Table

from pipeline.config import RunConfig
from pipeline.storage.ownership import MARK, OwnedFolder, json_mark
from pipeline.tools.tune.plot import plot_sweep
from pipeline.tools.tune.sweep import BucketResult

CSV_FIELDS = ("bucket", "batch", "throughput", "rows_per_s", "p50_ms", "p99_ms", "ttft_p50_ms",
              "peak_pressure", "preemptions", "oom", "spread", "repeats", "chosen")


def sweep_table(results: dict[str, BucketResult], title: str) -> Table:
    """One row per point; compact enough for an 80-column terminal (the CSV has everything)."""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1),
                  caption="P50, P99 (latency) and TTFT in ms; mem: peak memory pressure;\n"
                          "±: spread of throughput across windows",
                  caption_justify="left")
    for name in ("bucket", "batch", "tok/s", "P50", "P99", "TTFT", "mem", "preempt", "±", ""):
        table.add_column(name, justify="left" if name in ("bucket", "") else "right", no_wrap=True)
    for bucket, r in results.items():
        for k, p in enumerate(r.points):
            chosen = r.choice is not None and p.batch == r.choice.batch
            mark = "OOM" if p.oom else ("◀" if chosen else "")
            if r.choice is not None and p.batch == r.choice.best_batch and not chosen:
                mark = "max"
            table.add_row(
                bucket if k == 0 else "", str(p.batch), f"{p.throughput:,.0f}", f"{p.p50_ms:,.0f}",
                f"{p.p99_ms:,.0f}", "-" if p.ttft_p50_ms is None else f"{p.ttft_p50_ms:,.0f}",
                f"{p.peak_pressure:.2f}", str(p.preemptions), f"{p.spread:.0%}", mark,
                style="bold green" if chosen else None,
            )
        table.add_section()
    return table


def choice_lines(results: dict[str, BucketResult]) -> list[str]:
    lines = []
    for bucket, r in results.items():
        if r.choice is None:
            lines.append(f"{bucket}: no batch size chosen: {r.error}")
            continue
        stop = f" Sweep stopped: {r.stopped}" if r.stopped else ""
        lines.append(f"{bucket}: batch {r.choice.batch} ({r.choice.rule}). {r.choice.reason}{stop}")
    return lines


def to_csv(results: dict[str, BucketResult]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS)
    writer.writeheader()
    for bucket, r in results.items():
        for p in r.points:
            row = {k: v for k, v in p.to_dict().items() if k in CSV_FIELDS}
            writer.writerow({**row, "bucket": bucket, "chosen": r.choice is not None and p.batch == r.choice.batch})
    return buf.getvalue()


def tuned_profile(config: RunConfig, results: dict[str, BucketResult]) -> dict[str, Any]:
    """The profile the sweep ran with, batching set to the chosen rows per bucket."""
    profile = config.profile.model_dump(mode="json", exclude_defaults=True, by_alias=True)
    batching = profile.setdefault("batching", {})
    rows = {b: r.choice.batch for b, r in results.items() if r.choice is not None}
    # Buckets the sweep did not measure keep the rows a fixed policy had, else the default.
    default = getattr(config.profile.batching.policy, "rows_per_call", None)
    batching["policy"] = {"kind": "tuned", "rows": rows, **({"rows_per_call": default} if default else {})}
    return profile


def _listed(data: bytes) -> set[str] | None:
    """The files a sweep.json proves `pipeline tune` wrote: those it lists, or (written before
    it listed them) the four it always wrote."""
    sweep = json_mark(data)
    if sweep is None:
        return None
    if sweep.get("written_by") == MARK and isinstance(sweep.get("files"), list):
        return {str(f) for f in sweep["files"]}
    return set(FILES.values()) if {"tuned_at", "buckets"} <= set(sweep) else None


FILES = {"csv": "sweep.csv", "png": "sweep.png", "profile": "profile.yaml", "json": "sweep.json"}
# `--out`: written only where nothing is, an empty folder, or an earlier tune's files.
TUNE_OUT = OwnedFolder("pipeline tune", "sweep.json", _listed,
                       "Choose a new or empty --out folder, or one an earlier `pipeline tune` wrote.")


def write_outputs(out: Path, config: RunConfig, results: dict[str, BucketResult], meta: dict[str, Any]) -> dict[str, str]:
    """Write every artifact into `out` (sweep.json last: it lists the others); their paths by kind."""
    target = config.profile.batching.memory_target
    files: dict[str, bytes] = {FILES["csv"]: to_csv(results).encode()}
    plotted = {b: {"points": r.points, "choice": r.choice, "memory_target": target}
               for b, r in results.items() if r.choice is not None}
    if plotted:
        files[FILES["png"]] = plot_sweep(plotted)
    header = (
        f"# Written by `pipeline tune` ({meta['tuned_at']}) from {config.profile_file} and {config.job_file},\n"
        f"# on {meta['sample_rows']} sampled prompts. Per bucket: the batch size (rows in flight) it chose.\n"
        + "".join(f"#   {line}\n" for line in choice_lines(results))
    )
    files[FILES["profile"]] = (header + yaml.safe_dump(tuned_profile(config, results), sort_keys=False)).encode()
    files[FILES["json"]] = json.dumps(
        {"written_by": MARK, "files": sorted(files), **meta, "memory_target": target,
         "buckets": {b: r.to_dict() for b, r in results.items()}}, indent=2).encode()
    TUNE_OUT.write(out, files)
    return {k: str(out / name) for k, name in FILES.items() if name in files}
