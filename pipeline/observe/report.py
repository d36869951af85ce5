"""The run report: `_report.json` beside the output, and the table `run` prints.

Everything here is computed from the stats the writers returned, i.e. from
what actually reached the output files.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

import pyarrow.fs as pafs

from pipeline.generation.tasks import CallKind
from pipeline.generation.vllm_steps import joined
from pipeline.observe.machine import versions
from pipeline.storage.fs import write_bytes
from pipeline.storage.output import REPORT_NAME
from pipeline.text.quality import TRIES, add_annotation_counts, annotation_counts


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


def bucket_table(prompt_tokens_by_bucket: dict[str, dict[int, int]], order: tuple[str, ...],
                 quality: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Rows and prompt-length min/median/max per bucket, from counts per length; and, of
    the rows an engine call finished (`generated`), how many were cut at the limit, came
    out empty or copy the document's opening (`pipeline.text.quality`), and their median
    output tokens."""
    out = {}
    for name in order:
        counts = {int(k): v for k, v in (prompt_tokens_by_bucket.get(name) or {}).items() if v}
        if not counts:
            continue
        out[name] = {
            "rows": sum(counts.values()),
            "prompt_tokens": {"min": min(counts), "median": median_of_counts(counts), "max": max(counts)},
        }
        q = (quality or {}).get(name)
        if q:
            tokens = {int(k): v for k, v in q["output_tokens"].items() if v}
            out[name]["generated"] = {
                "rows": q["rows"], "cut_at_limit": q["cut_at_limit"], "empty_output": q["empty_output"],
                "copies_opening": q["copies_opening"],
                "median_output_tokens": median_of_counts(tokens) if tokens else None,
                **({"annotations": q["annotations"]} if "annotations" in q else {}),
            }
    return out


def actor_summaries(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each actor's totals as of its last call (they are cumulative), with the time it
    sat idle: from its engine being up to the pool's last call, the time it served no
    call (waiting for input, for the other engines to start, or for the run to end)."""
    def progress(a: dict[str, Any]) -> tuple[float, ...]:
        return a.get("calls", 0), a["windows"], a["busy_s"]

    latest: dict[str, dict[str, Any]] = {}
    steps: dict[str, list[dict[str, Any]]] = {}  # debug.step_timeline: each call carries the steps since the last
    served: dict[str, dict[str, list[dict[str, Any]]]] = {}  # a live server's in-flight steps and back-offs: as well
    for c in calls:
        a = c.get("actor")
        if a and "step_timeline" in a:
            steps.setdefault(a["actor"], []).append(a["step_timeline"])
        if a and a.get("server"):
            mine = served.setdefault(a["actor"], {"steps": [], "backoffs": []})
            for key in mine:
                mine[key].extend(a["server"]["in_flight"][key])
        if a and (a["actor"] not in latest or progress(a) >= progress(latest[a["actor"]])):
            latest[a["actor"]] = dict(a)
    actors = list(latest.values())
    for a in actors:
        if a["actor"] in steps:
            a["step_timeline"] = joined(steps[a["actor"]])
        if a["actor"] in served:
            a["server"] = {**a["server"], "in_flight": {**a["server"]["in_flight"], **{
                key: sorted(found, key=lambda x: x["t"]) for key, found in served[a["actor"]].items()}}}
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
        if c.get("kind") == CallKind.ROWS and c.get("actor"):
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
    tests/integration/run/test_report_schema.py). `passages` and `annotations` are
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
    # What every row's `result_key` is made of: its version, the model's content digest,
    # the run's share (`base`), or why there are no keys (`off`).
    result_key: dict[str, Any] = field(default_factory=dict)
    # What earlier outputs gave (`reuse:`, --reuse): the sources, the lookup's cost, the rows
    # reused and generated, the tokens not generated and the engine time they took then.
    reuse: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for optional in ("passages", "annotations", "padding", "reuse"):
            if out[optional] is None:
                del out[optional]
        return out


def padding_summary(actors: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Padded against real prompt tokens, over every engine, per bucket and in all; None
    where the engines do not pad (vLLM)."""
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


@dataclass
class RunContext:
    """What one run knows, gathered as it goes: the run fills it in, step by step, and
    `build_report` makes every section of the report from it, nothing set afterwards."""

    config: Any  # the RunConfig
    run_id: str
    started: float = field(default_factory=time.monotonic)
    started_at: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    # 1. Checked before the cluster starts.
    inputs: Any = None  # pipeline.storage.inputs.Inputs
    model_path: str = ""
    out_schema: Any = None
    # 3. Found once the model's context is known, and while generating.
    max_model_len: int = 0
    bucket_order: tuple[str, ...] = ()
    limits_key: dict[str, Any] = field(default_factory=dict)
    start_limits: dict[str, int] = field(default_factory=dict)
    percentile_cap: int | None = None
    engine_cpus: dict[str, Any] | None = None  # the engines' cores and the others' (`pipeline.run.affinity`)
    checks: dict[str, Any] = field(default_factory=dict)  # passes over the input, and their cost
    incidents: list[dict[str, Any]] = field(default_factory=list)
    written: dict[str, Any] | None = None  # the sink's merged stats: what reached the output files
    generated_rows: int = 0  # of them, the rows this run wrote (a resumed run's others were committed)
    # 4. Around the report: a resumed run's lineage, the side steps, what publishing replaces.
    resume: dict[str, Any] | None = None
    learned: dict[str, Any] = field(default_factory=dict)  # {"saved": limits, or None if saving failed}
    plot_path: str | None = None
    publish: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    result_key: dict[str, Any] = field(default_factory=dict)  # `pipeline.run.plan.result_keys`
    # Reuse: the earlier outputs (`pipeline.reuse.sources`), why some were left out, the index.
    reuse_sources: list[Any] = field(default_factory=list)
    reuse_notes: list[str] = field(default_factory=list)
    reuse_index: Any = None  # pipeline.reuse.index.ReuseIndex
    store_fit: Any = None  # pipeline.run.plan.StoreFit: windows and blocks against the object store

    def wall_s(self) -> float:
        return time.monotonic() - self.started


def build_report(ctx: RunContext, engine_settings: dict[str, Any]) -> RunReport:
    """Every section of the report, from what the run knows and what was written."""
    written, config = ctx.written, ctx.config
    if written is None:
        raise RuntimeError("the write finished without reporting what it wrote")
    job, profile = config.job, config.profile
    calls = engine_calls(written)
    engines = [c["engine"] for c in sorted(written["calls"].values(), key=lambda c: c.get("call", "")) if "engine" in c]
    actors = actor_summaries(calls)
    wall_s = ctx.wall_s()
    status = written["status"]
    generated = sum(a.get("output_tokens", 0) for a in actors)
    return RunReport(
        run_id=ctx.run_id, job=job.name, job_file=config.job_file, profile_file=config.profile_file,
        model=profile.model.name, input=job.input.path, output=job.output.path, started_at=ctx.started_at,
        wall_s=round(wall_s, 3), rows_in=ctx.inputs.rows, rows_out=written["rows"], status=status,
        buckets=bucket_table(written["prompt_tokens_by_bucket"], ctx.bucket_order, written.get("quality")),
        # output: the rows' (a map-reduce row counts its final call); generated: every engine
        # request of this run, chunk summaries and reduces included.
        tokens={"prompt": written["prompt_tokens"], "output": written["output_tokens"], "generated": generated},
        output_tokens_per_s=round(written["output_tokens"] / wall_s, 2) if wall_s > 0 else None,
        **engine_time(actors, generated),
        fill=_weighted([(c.get("fill"), c.get("busy_s", 0.0)) for c in calls]),
        batching=batching_section(ctx, calls, actors),
        engine={"settings": engine_settings, "engines": engines, "actors": actors, "calls": len(calls),
                "prefix_cache": prefix_cache(actors), "cpus": ctx.engine_cpus,
                "server": servers(actors) or None,
                "pool": pool_summary(calls, actors, {b: sum(c.values()) for b, c in
                                                     written["prompt_tokens_by_bucket"].items()})},
        engine_calls=[{k: v for k, v in c.items() if k not in ("trajectory", "backoffs", "actor")}
                     | {"actor": c.get("actor", {}).get("actor")} for c in calls],
        files=sorted(written["files"]), versions=versions(), timeline=written["timeline"],
        date=config.date, checks=ctx.checks, resume=ctx.resume, incidents=ctx.incidents,
        input_files={"format": ctx.inputs.format, "read": len(ctx.inputs.paths), "skipped": ctx.inputs.skipped},
        passages=None if job.passages is None else {
            **job.passages.model_dump(), "documents_in": ctx.inputs.rows, "passages_out": written["rows"]},
        annotations=None if job.annotations is None else annotations_section(
            job.annotations, status, calls, written.get("quality")),
        padding=padding_summary(actors),
        length={**job.length.model_dump(), "percentile_cap_tokens": ctx.percentile_cap,
                "truncated": written["truncated"], "chunked": written["chunked"]},
        plot_path=ctx.plot_path, report_path=f"{job.output.path.rstrip('/')}/{REPORT_NAME}",
        publish=ctx.publish, warnings=ctx.warnings, result_key=ctx.result_key,
        reuse=reuse_section(ctx, written, actors),
    )


def reuse_section(ctx: RunContext, written: dict[str, Any], actors: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What reuse saved: rows reused (by source) and generated, the output tokens not
    generated, and the engine time those tokens took in the runs that made them (each
    source's engine seconds per generated token). None where the job names no source."""
    reuse = ctx.config.job.reuse
    if not (reuse.enabled and reuse.paths):
        return None
    sources = {s.label: s for s in ctx.reuse_sources}
    by_source = written.get("reused", {})
    reused = sum(r["rows"] for r in by_source.values())
    tokens = sum(r["output_tokens"] for r in by_source.values())
    saved = sum(r["output_tokens"] * sources[k].seconds_per_token() for k, r in by_source.items() if k in sources)
    index = ctx.reuse_index
    notes = list(ctx.reuse_notes)
    if index is not None and not index.keys:
        notes.append("no earlier row to reuse: the sources hold no ok row with a result key")
    engine_s = engine_time(actors, 0)["engine_s"]
    generated = sum(a.get("output_tokens", 0) for a in actors)
    return {
        "sources": [{"path": s.path, "run_id": s.run_id, "date": s.date, "files": len(s.files),
                     "rows_reused": by_source.get(s.label, {}).get("rows", 0)} for s in ctx.reuse_sources],
        "notes": notes,
        "lookup": None if index is None else {"keys": index.keys, "shards": index.shard_count,
                                               "index_s": round(index.seconds, 3),
                                               "rows_looked_up": index.looked_up,
                                               # Found by their input key: never tokenized.
                                               "rows_found_before_tokenizing": (index.inputs_looked_up[1]
                                                   if index.inputs_looked_up is not None else None)},
        "rows_reused": reused,
        "rows_generated": written["rows"] - reused,
        "output_tokens_not_generated": tokens,
        "engine_s_saved": round(saved, 3),
        # Engine seconds per output token over every row of this output, the reused ones at
        # their cost when made: what a later night that reuses these rows counts as saved.
        "engine_s_per_token": (round((engine_s + saved) / (generated + tokens), 9) if generated + tokens else None),
    }


def servers(actors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each engine's record (from `actor_summaries`) of the live server it sent rows to
    (`engine.backend: server`): how prompts went, its in-flight trajectory and back-offs,
    retries, our time to first token. [] for engines of our own."""
    return [a["server"] for a in actors if a.get("server")]


def prefix_cache(actors: list[dict[str, Any]]) -> dict[str, Any] | None:
    """vLLM's prefix cache over the run's engines: prompt tokens looked up, found, and the
    share found (the chat template and system message every prompt shares, and repeats).
    None where no engine reports one (the transformers backend)."""
    seen = [a["prefix_cache"] for a in actors if a.get("prefix_cache")]
    if not seen:
        return None
    queries, hits = sum(p["queries"] for p in seen), sum(p["hits"] for p in seen)
    return {"queries": queries, "hits": hits, "hit_rate": round(hits / queries, 4) if queries else None}


def engine_calls(written: dict[str, Any]) -> list[dict[str, Any]]:
    """The engine calls the parts record, in order, without the engine settings each carries."""
    return [{k: v for k, v in c.items() if k != "engine"}
            for c in sorted(written["calls"].values(), key=lambda c: c.get("call", ""))]


def engine_time(actors: list[dict[str, Any]], output_tokens: int) -> dict[str, Any]:
    """Engine time and what it generated (`output_tokens`: every request's, chunk summaries
    and reduces too). Calls of one engine overlap (a few blocks at once): its engine time
    is the time it had any call open, not the sum of its calls' walls. Wall time includes
    Ray and engine start-up; engine time is the calls alone."""
    engine_s = sum(a.get("serving_s", 0.0) for a in actors)
    active_s = sum(a["active_s"] for a in actors)
    return {
        "engine_s": round(engine_s, 3),
        "engine_output_tokens_per_s": round(output_tokens / engine_s, 2) if engine_s > 0 else None,
        # Time with at least one request running, over the time the engines were in use.
        "busy_fraction": round(sum(a["busy_s"] for a in actors) / active_s, 4) if actors and active_s > 0 else None,
    }


def batching_section(ctx: RunContext, calls: list[dict[str, Any]],
                     actors: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The batching part of the report; `actors` (`actor_summaries(calls)` if not given)
    for the merged-row counts."""
    profile = ctx.config.profile
    actors = actor_summaries(calls) if actors is None else actors
    learned = {"path": profile.batching.learned_limits, "key": ctx.limits_key, "started_from": ctx.start_limits,
               **ctx.learned}
    return {
        **profile.batching.describe_policy(),
        "feed": profile.feed(),
        "backoffs": sum(len(c.get("backoffs", [])) for c in calls),
        "per_bucket": bucket_batching(calls, ctx.bucket_order),
        "learned_limits": learned,
        # Rows against the object store: windows and blocks, and whether large rows cut them.
        "blocks": None if ctx.store_fit is None else ctx.store_fit.describe(),
        # Rows whose prompt and sampling matched another's, given its result (pipeline/generation/merge.py).
        "merge_identical_prompts": {
            "enabled": profile.batching.merge_identical_prompts,
            "merged_rows": sum(a.get("merged", {}).get(CallKind.ROWS, 0) for a in actors),
            "merged_requests": sum(sum(a.get("merged", {}).values()) for a in actors)},
    }


def annotations_section(annotations: Any, status: dict[str, int], calls: list[dict[str, Any]],
                        quality: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The annotations' columns and calls; of the rows with an annotation call, the shares
    valid at the first try, after the retry, and `invalid_output`; and per list column,
    the share of extracted values that occur in the row's text (`pipeline.text.quality`)."""
    kinds = Counter(c.get("kind") for c in calls)
    total = annotation_counts()
    for q in (quality or {}).values():
        if "annotations" in q:
            add_annotation_counts(total, q["annotations"])
    tries, found = {k: total[k] for k in TRIES}, total["found"]
    annotated = sum(tries.values())
    return {
        "columns": [f"{f.name}: {f.type}" for f in annotations.fields()],
        "valid": status.get("ok", 0), "invalid_output": status.get("invalid_output", 0),
        "retried": sum(c.get("rows", 0) for c in calls if c.get("kind") == CallKind.ANNOTATIONS_RETRY),
        "calls": kinds.get(CallKind.ANNOTATIONS, 0) + kinds.get(CallKind.ANNOTATIONS_RETRY, 0),
        "tries": {**tries, "shares": {k: round(v / annotated, 4) for k, v in tries.items()} if annotated else None},
        "found_in_text": {column: {**f, "share": round(f["in_text"] / f["values"], 4) if f["values"] else None}
                          for column, f in found.items()},
    }


def write_beside(fs: pafs.FileSystem, folder: str, name: str, data: bytes) -> str:
    """Write `name` into `folder`, whole."""
    path = f"{folder}/{name}"
    write_bytes(fs, path, data)
    return path


def write_report(fs: pafs.FileSystem, folder: str, report: RunReport) -> str:
    return write_beside(fs, folder, REPORT_NAME, json.dumps(report.to_json(), indent=2).encode())
