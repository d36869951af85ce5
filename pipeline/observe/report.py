"""The run report: `_report.json` beside the output, and the table `run` prints.

Everything here is computed from the stats the writers returned, i.e. from
what actually reached the output files.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow.fs as pafs

from pipeline.observe.machine import versions
from pipeline.storage.fs import write_bytes
from pipeline.storage.output import REPORT_NAME


def median_of_counts(counts: dict[int, int]) -> float:
    """The median of a multiset given as {value: count} (as statistics.median would give)."""
    n = sum(counts.values())
    ordered = sorted(counts.items())

    def at(k: int) -> int:  # the k-th smallest value, 0-based
        seen = 0
        for value, c in ordered:
            seen += c
            if k < seen:
                return value
        raise IndexError(k)

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def bucket_table(prompt_tokens_by_bucket: dict[str, dict[int, int]], order: tuple[str, ...]) -> dict[str, Any]:
    """Rows and prompt-length min/median/max per bucket, from counts per length."""
    out = {}
    for name in order:
        counts = {int(k): v for k, v in (prompt_tokens_by_bucket.get(name) or {}).items() if v}
        if not counts:
            continue
        out[name] = {
            "rows": sum(counts.values()),
            "prompt_tokens": {"min": min(counts), "median": median_of_counts(counts), "max": max(counts)},
        }
    return out


def actor_summaries(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each actor's totals as of its last call (they are cumulative), with the time it
    sat idle: from its engine being up to the pool's last call, the time it served no
    call (waiting for input, for the other engines to start, or for the run to end)."""
    def progress(a: dict[str, Any]) -> tuple[float, ...]:
        return a.get("calls", 0), a["windows"], a["busy_s"]

    latest: dict[str, dict[str, Any]] = {}
    for c in calls:
        a = c.get("actor")
        if a and (a["actor"] not in latest or progress(a) >= progress(latest[a["actor"]])):
            latest[a["actor"]] = dict(a)
    actors = list(latest.values())
    pool_end = max((a.get("last_end_at") or 0.0 for a in actors), default=0.0)
    for a in actors:
        if a.get("ready_at") is not None and pool_end:
            a["idle_s"] = round(max(0.0, pool_end - a["ready_at"] - a.get("serving_s", 0.0)), 3)
    return actors


def pool_summary(calls: list[dict[str, Any]], actors: list[dict[str, Any]], rows_by_bucket: dict[str, int]
                 ) -> dict[str, Any]:
    """How the work was shared: each engine's share of the rows, and which engines served
    rows of each bucket (from the calls' records: the block assignment, not timing).
    Sets each actor's `rows`: the input rows it summarized (its `requests` also count
    annotation calls and map-reduce levels)."""
    rows = {a["actor"]: 0 for a in actors}
    by_bucket: dict[str, dict[str, int]] = {}
    for c in calls:
        if c.get("kind") == "rows" and c.get("actor"):
            who = c["actor"]["actor"]
            b = by_bucket.setdefault(c["bucket"], {})
            b[who] = b.get(who, 0) + c.get("rows", 0)
            rows[who] = rows.get(who, 0) + c.get("rows", 0)
    for a in actors:
        a["rows"] = rows.get(a["actor"], 0)
    total = sum(rows.values())
    largest = max(rows_by_bucket, key=lambda k: rows_by_bucket[k], default=None)
    return {
        "engines": len(actors),
        "share_of_rows": {a: round(n / total, 4) if total else None for a, n in rows.items()},
        "rows_by_bucket": by_bucket,
        "largest_bucket": largest,
        "engines_serving_largest_bucket": len(by_bucket.get(largest, {})) if largest else 0,
    }


def _weighted(pairs: list[tuple[float | None, float]]) -> float | None:
    pairs = [(v, w) for v, w in pairs if v is not None and w > 0]
    total = sum(w for _, w in pairs)
    return round(sum(v * w for v, w in pairs) / total, 4) if total > 0 else None


def bucket_batching(calls: list[dict[str, Any]], order: tuple[str, ...]) -> dict[str, Any]:
    """Per bucket: the batch-size trajectory, back-offs, peak pressure, busy fraction."""
    out: dict[str, Any] = {}
    for name in (*order, "mixed"):
        mine = [c for c in calls if c.get("bucket") == name]
        if not mine:
            continue
        wall = sum(c.get("wall_s", 0.0) for c in mine)
        busy = sum(c.get("busy_s", 0.0) for c in mine)
        out[name] = {
            "calls": len(mine),
            "trajectory": [
                {**step, "actor": c["actor"]["actor"]} for c in mine for step in c.get("trajectory", [])
            ],
            "backoffs": [{**b, "actor": c["actor"]["actor"]} for c in mine for b in c.get("backoffs", [])],
            "peak_pressure": max((c.get("peak_pressure", 0.0) for c in mine), default=0.0),
            "preemptions": sum(c.get("preemptions", 0) for c in mine),
            "busy_fraction": round(busy / wall, 4) if wall > 0 else None,
            # Time-weighted rows in flight over rows the policy allowed (and the queue could supply).
            "fill": _weighted([(c.get("fill"), c.get("busy_s", 0.0)) for c in mine]),
        }
    return out


@dataclass
class RunReport:
    """`_report.json`: one typed record of a run, in the order the file shows it.

    The nested sections stay plain JSON objects (their keys are pinned by
    tests/integration/test_report_schema.py). `passages` and `annotations` are
    left out of the file for jobs without them.
    """

    run_id: str
    job: str
    job_file: str
    profile_file: str
    model: str
    input: str
    output: str
    started_at: str
    wall_s: float
    rows_in: int | None
    rows_out: int
    status: dict[str, int]
    buckets: dict[str, Any]
    tokens: dict[str, int]
    output_tokens_per_s: float | None
    engine_s: float
    engine_output_tokens_per_s: float | None
    busy_fraction: float | None
    fill: float | None
    batching: dict[str, Any]
    engine: dict[str, Any]
    engine_calls: list[dict[str, Any]]
    files: list[str]
    versions: dict[str, str | None]
    date: str | None = None
    input_files: dict[str, Any] = field(default_factory=dict)
    passages: dict[str, Any] | None = None
    annotations: dict[str, Any] | None = None
    length: dict[str, Any] = field(default_factory=dict)
    plot_path: str | None = None
    report_path: str = ""
    publish: dict[str, Any] = field(default_factory=dict)
    # Unix times: first and last row prepared, first and last part written (streaming
    # shows as the first part written before the last row was prepared).
    timeline: dict[str, float | None] = field(default_factory=dict)
    # Passes over the input before generation, and what each cost.
    checks: dict[str, Any] = field(default_factory=dict)
    # A resumed run: the runs whose rows the output holds (lineage, this run last), what
    # was committed before and what this run generated.
    resume: dict[str, Any] | None = None
    # The transformers backend's static batches: prompt tokens padded against real, per bucket.
    padding: dict[str, Any] | None = None
    # Resume, engine restarts, stalls, engine deaths and failed starts: when, why, and the rows each affected.
    incidents: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for optional in ("passages", "annotations", "padding"):
            if out[optional] is None:
                del out[optional]
        return out


def padding_summary(actors: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Padded against real prompt tokens, over every engine, per bucket and in all; None
    where the engines do not pad (vLLM)."""
    from collections import Counter

    padded, real = Counter(), Counter()
    found = False
    for a in actors:
        p = a.get("padding")
        if not p:
            continue
        found = True
        padded["all"] += p["padded_tokens"]
        real["all"] += p["real_tokens"]
        for b, v in p["by_bucket"].items():
            padded[b] += v["padded_tokens"]
            real[b] += v["real_tokens"]
    if not found:
        return None

    def share(key: str) -> float:
        return round((padded[key] - real[key]) / padded[key], 4) if padded[key] else 0.0

    return {"padded_tokens": padded["all"], "real_tokens": real["all"], "padding_fraction": share("all"),
            "by_bucket": {b: {"padded_tokens": padded[b], "real_tokens": real[b], "padding_fraction": share(b)}
                          for b in padded if b != "all"}}


def build_report(
    *,
    run_id: str,
    config: Any,
    rows_in: int | None,
    written: dict[str, Any],
    wall_s: float,
    started_at: str,
    engine_settings: dict[str, Any],
    bucket_order: tuple[str, ...],
) -> RunReport:
    """What was written and how the engines did: every field the writers' stats decide."""
    calls = sorted(written["calls"].values(), key=lambda c: c.get("call", ""))
    engines = [c.pop("engine") for c in calls if "engine" in c]
    actors = actor_summaries(calls)
    # Calls of one engine overlap (a few blocks at once): its engine time is the time
    # it had any call open, not the sum of its calls' walls.
    engine_s = sum(a.get("serving_s", 0.0) for a in actors)
    busy_s = sum(a["busy_s"] for a in actors)
    batching = config.profile.batching
    return RunReport(
        run_id=run_id,
        job=config.job.name,
        job_file=config.job_file,
        profile_file=config.profile_file,
        model=config.profile.model.name,
        input=config.job.input.path,
        output=config.job.output.path,
        started_at=started_at,
        wall_s=round(wall_s, 3),
        rows_in=rows_in,
        rows_out=written["rows"],
        status=written["status"],
        buckets=bucket_table(written["prompt_tokens_by_bucket"], bucket_order),
        tokens={"prompt": written["prompt_tokens"], "output": written["output_tokens"]},
        output_tokens_per_s=round(written["output_tokens"] / wall_s, 2) if wall_s > 0 else None,
        # Wall time includes Ray and engine start-up; engine time is the calls alone.
        engine_s=round(engine_s, 3),
        engine_output_tokens_per_s=round(written["output_tokens"] / engine_s, 2) if engine_s > 0 else None,
        # Time with at least one request running, over the time the engines were in use.
        busy_fraction=(
            round(busy_s / sum(a["active_s"] for a in actors), 4)
            if actors and sum(a["active_s"] for a in actors) > 0 else None
        ),
        fill=_weighted([(c.get("fill"), c.get("busy_s", 0.0)) for c in calls]),
        batching={
            **batching.describe_policy(),
            "feed": config.profile.feed(),
            "backoffs": sum(len(c.get("backoffs", [])) for c in calls),
            "per_bucket": bucket_batching(calls, bucket_order),
        },
        engine={"settings": engine_settings, "engines": engines, "actors": actors, "calls": len(calls),
                "pool": pool_summary(calls, actors, {b: sum(c.values()) for b, c in
                                                     written["prompt_tokens_by_bucket"].items()})},
        engine_calls=[{k: v for k, v in c.items() if k not in ("trajectory", "backoffs", "actor")}
                     | {"actor": c.get("actor", {}).get("actor")} for c in calls],
        files=sorted(written["files"]),
        versions=versions(),
        timeline=written["timeline"],
    )


def write_beside(fs: pafs.FileSystem, folder: str, name: str, data: bytes) -> str:
    """Write `name` into `folder`, whole."""
    path = f"{folder}/{name}"
    write_bytes(fs, path, data)
    return path


def write_report(fs: pafs.FileSystem, folder: str, report: RunReport) -> str:
    return write_beside(fs, folder, REPORT_NAME, json.dumps(report.to_json(), indent=2).encode())
