"""Parts and outputs as a run leaves them, without an engine: a written block of rows
(`block`), the writer's context (`Ctx`), an earlier run's output (`earlier_output`), and
a whole run's life cycle around the output (`stage`, `run`)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa

from pipeline import schema
from pipeline.storage.output import REPORT_NAME, OutputTarget


def block(ids, bucket, call, first_stats=None, status="ok", texts=None, summaries=None, finish=None,
          output_tokens=None, reused_from=None):
    n = len(ids)
    return pa.table({
        "id": ids, "text": texts or ["t"] * n, "summary": summaries or ["s"] * n,
        "prompt_tokens": pa.array(range(10, 10 + n), pa.int32()),
        "output_tokens": pa.array(output_tokens or [4] * n, pa.int32()),
        "finish_reason": pa.array(finish or [("length" if status == "ok" else None)] * n, pa.string()),
        "bucket": [bucket] * n,
        "truncated": [False] * n, "original_tokens": pa.array([None] * n, pa.int32()),
        "chunks": pa.array([None] * n, pa.int32()), "notes": pa.array([None] * n, pa.string()),
        "status": status if isinstance(status, list) else [status] * n, "error": pa.array([None] * n, pa.string()),
        "latency_s": [0.1] * n, "model": ["m"] * n, "run_id": ["r"] * n,
        "result_key": pa.array([None] * n, pa.string()),
        "input_key": pa.array([None] * n, pa.string()),
        "reused_from": pa.array(reused_from or [None] * n, pa.string()),
        schema.BUCKET_INDEX: pa.array([0] * n, pa.int32()),
        schema.ENGINE_CALL: pa.array([call] * n, pa.string()),
        schema.ENGINE_CALL_STATS: ([json.dumps([first_stats])] + [None] * (n - 1) if first_stats
                                   else pa.array([None] * n, pa.string())),
    })


JOB = "nightly_summarize"


class Ctx:
    def __init__(self, i):
        self.task_idx = i


def tree(root: Path) -> dict[str, bytes]:
    """Every file below root, by relative path, with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def earlier_output(folder: Path, run_id: str = "run0", job: str = JOB, parts: int = 2, plot: bool = True) -> list[str]:
    """What an earlier run of `job` left in `folder`: parts, plot, and the report listing them."""
    folder.mkdir(parents=True, exist_ok=True)
    names = [f"part-{run_id}-{i:05d}.parquet" for i in range(parts)]
    for n in names:
        (folder / n).write_bytes(b"PAR1 old " + n.encode())
    if plot:
        (folder / "_batching.png").write_bytes(b"png")
    report = {"run_id": run_id, "job": job, "files": names,
              "plot_path": f"/somewhere/else/{folder.name}/_batching.png" if plot else None}
    (folder / REPORT_NAME).write_text(json.dumps(report))
    return [*names, REPORT_NAME, *(["_batching.png"] if plot else [])]


def stage(target: OutputTarget, run_id: str, parts: int = 1) -> list[str]:
    """Do what a run does between `open` and `plan`: parts, then the report, into the staging."""
    names = [f"part-{run_id}-{i:05d}.parquet" for i in range(parts)]
    for n in names:
        with target.fs.open_output_stream(f"{target.staging.data}/{n}") as f:
            f.write(b"PAR1 new " + n.encode())
    report = {"run_id": run_id, "job": target.job, "files": names, "plot_path": None, **target.plan()}
    with target.fs.open_output_stream(f"{target.staging.data}/{REPORT_NAME}") as f:
        f.write(json.dumps(report).encode())
    return [*names, REPORT_NAME]


def run(output: str, run_id: str, fs=None, backup: bool = False, parts: int = 1) -> tuple[OutputTarget, list[str]]:
    """A whole run's life cycle around the output, without the engine."""
    target = OutputTarget(output, JOB, run_id, backup_existing=backup, filesystem=fs)
    target.open()
    try:
        names = stage(target, run_id, parts)
        target.publish()
    finally:
        target.close()
    return target, names
