"""What the reuse lookup costs alone, with no engine: its index built from an earlier output
of N keyed rows, then N prepared rows looked up in it as a run looks them up (90% found).

For each N (a fresh process and a fresh local Ray each): the index build's seconds, the
lookup's seconds, and the peak memory of the driver, of each shard actor and of the
busiest other Ray worker, sampled every 0.2 s. The driver's must stay flat from 100k to
1M keys: it holds none of the index.

    .venv/bin/python -m bench.reuse_lookup [--keys 100000,1000000]

Results go to bench/results/reuse_lookup.{md,json}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq

from bench.compare import git_commit
from pipeline.observe.machine import describe

REPO = Path(__file__).resolve().parents[1]
PART_ROWS = 100_000
SUMMARY = "A short summary of the document, as the tiny model might write it: two sentences, no more. " * 2


def key(i: int) -> str:
    return "v1:" + hashlib.blake2b(str(i).encode(), digest_size=16).hexdigest()


def earlier_output(folder: Path, keys: int) -> None:
    """An output as the pipeline publishes it (its columns, its report), of `keys` ok rows."""
    from pipeline import schema

    folder.mkdir(parents=True)
    out_schema = schema.output_schema(pa.schema([("id", pa.string()), ("text", pa.string())]), "id", "text")
    files = []
    for p, start in enumerate(range(0, keys, PART_ROWS)):
        n = min(PART_ROWS, keys - start)
        values = {
            "id": [f"d{start + i}" for i in range(n)], "text": ["t"] * n, "summary": [SUMMARY] * n,
            "prompt_tokens": [120] * n, "output_tokens": [32] * n, "finish_reason": ["length"] * n,
            "truncated": [False] * n, "original_tokens": [None] * n, "chunks": [None] * n, "bucket": ["le128"] * n,
            "status": ["ok"] * n, "error": [None] * n, "notes": [None] * n, "latency_s": [0.5] * n,
            "model": ["tiny"] * n, "run_id": ["night1"] * n, "result_key": [key(start + i) for i in range(n)],
            "reused_from": [None] * n,
        }
        name = f"part-night1-{p:05d}.parquet"
        pq.write_table(pa.Table.from_pydict(values, schema=out_schema), folder / name)
        files.append(name)
    (folder / "_report.json").write_text(json.dumps({
        "run_id": "night1", "job": "nightly_summarize", "files": files, "started_at": "2026-12-01T01:00:00+00:00",
        "date": "2026-12-01", "rows_out": keys, "result_key": {"version": 1}, "engine_s": 100.0,
        "tokens": {"generated": keys * 32}}))


class Peaks:
    """Peak RSS of this process and of each process of the local Ray it started."""

    def __init__(self) -> None:
        self.driver = 0
        self.by_pid: dict[int, tuple[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from ray._private import worker

        me = psutil.Process()
        while not self._stop.is_set():
            self.driver = max(self.driver, me.memory_info().rss)
            node = worker._global_node
            for _, process in (node.live_processes() if node is not None else []):
                try:
                    root = psutil.Process(process.pid)
                    for p in [root, *root.children(recursive=True)]:
                        name, rss = " ".join(p.cmdline()[:1]) or p.name(), p.memory_info().rss
                        before = self.by_pid.get(p.pid, (name, 0))
                        self.by_pid[p.pid] = (name, max(before[1], rss))
                except psutil.Error:
                    continue
            self._stop.wait(0.2)

    def __enter__(self) -> Peaks:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def child(keys: int, work: Path) -> dict:
    """One measurement, in this process: build the index of `keys` keys, look up `keys` rows."""
    import ray
    import ray.data

    from pipeline.reuse.index import REUSED_FROM, ReuseIndex, look_up, result_columns
    from pipeline import schema

    earlier_output(work / "night1", keys)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    out_schema = schema.output_schema(pa.schema([("id", pa.string()), ("text", pa.string())]), "id", "text")
    columns = result_columns(out_schema)
    from pipeline.reuse.sources import find_earlier

    with Peaks() as peaks:
        t = time.monotonic()
        index = ReuseIndex(find_earlier([str(work / "night1")]), columns)
        indexed = index.keys  # every shard loaded
        build_s = time.monotonic() - t

        def keyed(batch: dict) -> dict:  # 90% of tonight's rows were there last night
            ids = batch["id"]
            return {"result_key": [key(int(i)) if i % 10 else key(keys + int(i)) for i in ids]}

        t = time.monotonic()
        ds = (ray.data.range(keys).map_batches(keyed, batch_format="numpy")
              .map_batches(look_up, fn_kwargs={"shards": index.shards, "columns": columns}, batch_format="pyarrow",
                           num_cpus=0.1)
              .map_batches(lambda b: pa.table({"found": [b.num_rows - b.column(REUSED_FROM).null_count]}),
                           batch_format="pyarrow"))
        found = sum(int(b["found"].sum()) for b in ds.iter_batches(batch_format="numpy"))
        lookup_s = time.monotonic() - t
        index.close()
    ray.shutdown()
    workers = {pid: v for pid, v in peaks.by_pid.items()}
    shards = [rss for name, rss in workers.values() if "KeyShard" in name]
    others = [rss for name, rss in workers.values() if "KeyShard" not in name and "ray::" in name]
    return {"keys": keys, "found": found, "index_keys": indexed, "shards": index.shard_count,
            "build_s": round(build_s, 2), "lookup_s": round(lookup_s, 2),
            "driver_peak_mib": round(peaks.driver / 2**20), "shard_peak_mib": [round(s / 2**20) for s in shards],
            "worker_peak_mib": round(max(others, default=0) / 2**20)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", default="100000,1000000")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(REPO / "bench/results/reuse_lookup"))
    args = parser.parse_args()
    if args.child:
        with tempfile.TemporaryDirectory() as tmp:
            print("RESULT " + json.dumps(child(args.child, Path(tmp))), flush=True)
        return
    results = []
    for n in (int(x) for x in args.keys.split(",")):
        done = subprocess.run([sys.executable, "-m", "bench.reuse_lookup", "--child", str(n)], cwd=REPO,
                              capture_output=True, text=True, timeout=1800)
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if done.returncode != 0 or line is None:
            raise RuntimeError(f"{n} keys: exit {done.returncode}\n{done.stderr[-3000:]}")
        results.append(json.loads(line[len("RESULT "):]))
        print(json.dumps(results[-1]), flush=True)
    machine = describe()
    Path(args.out + ".json").write_text(json.dumps({"machine": machine, "commit": git_commit(), "runs": results},
                                                   indent=2))
    lines = [
        "# The reuse lookup alone: the index of an earlier output's keys, then a night's rows looked up in it "
        "(90% found), no engine",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} logical cores, {machine['memory_gib']} GiB; CPU flags "
        f"{', '.join(machine['cpu_flags']) or 'none of note'}; commit {git_commit()}. "
        "`python -m bench.reuse_lookup` (make bench-reuse-lookup); one run each, a fresh local Ray each.",
        "",
        "| keys | shards | index build s | lookup s | per million rows s | driver peak MiB | each shard peak MiB "
        "| busiest other worker MiB |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
        *(f"| {r['keys']:,} | {r['shards']} | {r['build_s']:.1f} | {r['lookup_s']:.1f} | "
          f"{(r['build_s'] + r['lookup_s']) / r['keys'] * 1e6:.1f} | {r['driver_peak_mib']} | "
          f"{', '.join(map(str, r['shard_peak_mib']))} | {r['worker_peak_mib']} |" for r in results),
    ]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
