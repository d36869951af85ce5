"""A corpus larger than the object store streams through: the nightly job on corpora of 1x,
2x and 4x a capped object store (`hardware.object_store_mb`, 100 MiB), each row a short
document beside a pass-through column of about 10 KB, so that generation stays cheap (4 new
tokens) while the data is large.

For each size, one run through the CLI (a fresh local Ray each): the peak memory of the
driver and of every other process of the run (Ray's workers, the engine, the raylet), as
RSS (sampled every 0.5 s) and as USS (what the process alone holds, where RSS counts the
object store's shared pages too; every 5 s, since it reads every mapping), and the most
bytes spilled to disk at once. Each role's peak USS is also split by what holds it
(`uss_kinds`): the process's own heap and anonymous memory, the object store's shared
pages that only it maps (a page of a mapped block counts as private until another process
maps it), Ray's files on disk (spilled or fallback objects) and libraries and other files. Spilling is
allowed, failing is not: every id must come out once. The driver's and every worker's
peak must stay flat from 1x to 4x.

    .venv/bin/python -m bench.scale [--cap-mb 100] [--sizes 1,2,4]

Results go to bench/results/scale.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq

from bench.compare import git_commit, set_args
from pipeline.observe.machine import describe

REPO = Path(__file__).resolve().parents[1]
ROW_BYTES = 10_000
FILE_ROWS = 2_000
USS_EVERY = 10  # samples: RSS every 0.5 s, USS and the spill every 5 s


def write_corpus(folder: Path, rows: int, seed: int) -> None:
    """`rows` short documents, each with `blob`: about ROW_BYTES of incompressible text."""
    from pipeline.tools.dev.corpus import make_corpus

    folder.mkdir(parents=True)
    rng = random.Random(seed)
    for f, start in enumerate(range(0, rows, FILE_ROWS)):
        n = min(FILE_ROWS, rows - start)
        part = make_corpus(n, seed=seed + f, median_words=40)
        ids = pa.array([f"r{start + i}" for i in range(n)], pa.string())
        part = part.set_column(part.schema.get_field_index("id"), "id", ids)
        blob = pa.array([rng.randbytes(ROW_BYTES * 3 // 4).hex()[:ROW_BYTES] for _ in range(n)], pa.string())
        pq.write_table(part.append_column("blob", blob), folder / f"part-{f:04d}.parquet")


def mapping_kind(path: str, ray_tmp: str) -> str:
    """What a mapping of `psutil`'s `memory_maps` is, for the split of USS."""
    if not path or path in ("[heap]", "[anon]") or path.startswith("[anon:"):
        return "heap and anonymous"
    if "plasma" in path or path.startswith("/dev/shm"):
        return "object store (shared memory)"
    if path.startswith(ray_tmp):
        return "Ray's files (spill, fallback)"
    if path.startswith("["):
        return "other"  # [stack], [vdso], ...
    return "libraries and files"


def uss_by_kind(p: psutil.Process, ray_tmp: str) -> dict[str, int]:
    """The process's USS (private clean and dirty pages) in bytes, by `mapping_kind`."""
    kinds: dict[str, int] = {}
    for m in p.memory_maps(grouped=True):
        k = mapping_kind(m.path, ray_tmp)
        kinds[k] = kinds.get(k, 0) + m.private_clean + m.private_dirty
    return kinds


def role(p: psutil.Process, driver: int) -> str:
    if p.pid == driver:
        return "driver"
    line = " ".join(p.cmdline())
    for pattern, name in ((r"GenerateStage", "engine actor"), (r"EngineCore", "engine core"),
                          (r"PrepareStage", "prepare actor"), (r"raylet", "raylet"), (r"gcs_server", "gcs"),
                          (r"ray::", "other Ray worker")):
        if re.search(pattern, line) or re.search(pattern, p.name()):
            return name
    return "other"


class Sampler:
    """Peak RSS and USS per role across a process tree, and the largest spill on disk."""

    def __init__(self, root: psutil.Process, ray_tmp: str) -> None:
        self.root, self.ray_tmp = root, ray_tmp
        self.peaks: dict[str, dict[str, int]] = {}
        # Each role's largest USS at each USS reading: (seconds since the start, bytes), to tell
        # a climb that lasts the whole run (something kept per row) from one that levels off.
        self.series: dict[str, list[tuple[float, int]]] = {}
        self._t0 = time.monotonic()
        self.spilled = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _spill_bytes(self) -> int:
        total = 0
        for dirpath, _, files in os.walk(self.ray_tmp):
            if "spill" in dirpath:
                for f in files:
                    try:
                        total += os.path.getsize(os.path.join(dirpath, f))
                    except OSError:
                        pass
        return total

    def _run(self) -> None:
        tick = 0
        while not self._stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                break
            full = tick % USS_EVERY == 0  # USS reads every mapping (smaps): costly on an engine's process
            now: dict[str, int] = {}
            for p in procs:
                try:
                    r = role(p, self.root.pid)
                    rss = p.memory_info().rss
                    kinds = uss_by_kind(p, self.ray_tmp) if full else {}
                except psutil.Error:
                    continue
                peak = self.peaks.setdefault(r, {"rss": 0, "uss": 0, "uss_kinds": {}})
                peak["rss"] = max(peak["rss"], rss)
                if full:
                    uss = sum(kinds.values())
                    if uss > peak["uss"]:
                        peak["uss"], peak["uss_kinds"] = uss, kinds
                    now[r] = max(now.get(r, 0), uss)
            for r, uss in now.items():
                self.series.setdefault(r, []).append((round(time.monotonic() - self._t0, 1), uss))
            if full:
                self.spilled = max(self.spilled, self._spill_bytes())
            tick += 1
            self._stop.wait(0.5)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def one(rows: int, cap_mb: int, work: Path, sets: tuple[str, ...] = ()) -> dict:
    corpus = work / "in"
    t = time.monotonic()
    write_corpus(corpus, rows, seed=rows)
    on_disk = sum(f.stat().st_size for f in corpus.iterdir())
    write_s = time.monotonic() - t
    ray_tmp = tempfile.mkdtemp(prefix="rs-", dir="/tmp")
    cmd = [sys.executable, "-m", "pipeline", "run", "jobs/nightly_summarize.yaml", "--profile", "conf/local.yaml",
           "--input", str(corpus), "--output", str(work / "out"), "--no-reuse",
           "--set", "batching.learned_limits=null", "--set", f"hardware.object_store_mb={cap_mb}",
           "--set", "sampling.max_new_tokens=4", "--set", f"batching.prepare_batch_rows={FILE_ROWS // 4}",
           "--progress", "off", *set_args(list(sets))]
    started = time.monotonic()
    with open(work / "run.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "RAY_TMPDIR": ray_tmp})
        with Sampler(psutil.Process(proc.pid), ray_tmp) as sampler:
            proc.wait(timeout=3600)
    wall = time.monotonic() - started
    shutil.rmtree(ray_tmp, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{rows} rows: exit {proc.returncode}\n{(work / 'run.log').read_text()[-3000:]}")
    out = pq.read_table(work / "out", columns=["id"]).column("id").to_pylist()
    if len(out) != rows or len(set(out)) != rows:
        raise RuntimeError(f"{rows} rows in, {len(out)} out ({len(set(out))} distinct)")
    report = json.loads((work / "out" / "_report.json").read_text())
    mib = lambda b: round(b / 2**20)  # noqa: E731
    return {"rows": rows, "input_mib": mib(on_disk), "times_cap": round(on_disk / (cap_mb * 2**20), 2),
            "wall_s": round(wall, 1), "engine_s": report["engine_s"], "corpus_write_s": round(write_s, 1),
            "spilled_peak_mib": mib(sampler.spilled), "rows_out": len(out),
            "peaks_mib": {r: {"rss": mib(v["rss"]), "uss": mib(v["uss"]),
                              "uss_kinds": {k: mib(b) for k, b in sorted(v["uss_kinds"].items(), key=lambda kv: -kv[1])}}
                          for r, v in sorted(sampler.peaks.items())},
            "uss_series_mib": {r: [(t, mib(b)) for t, b in v] for r, v in sorted(sampler.series.items())}}


def quarters(series: list[tuple[float, int]]) -> list[int]:
    """The largest USS read in each quarter of a role's readings: a climb that lasts the run
    rises quarter by quarter; one that levels off does not."""
    bounds = [len(series) * q // 4 for q in range(5)]  # fewer than 4 readings: a quarter takes one
    return [max(b for _, b in series[lo:max(hi, lo + 1)]) for lo, hi in zip(bounds, bounds[1:])] if series else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cap-mb", type=int, default=100)
    parser.add_argument("--sizes", default="1,2,4", help="corpus sizes, in multiples of the object store's cap")
    parser.add_argument("--out", default=str(REPO / "bench/results/scale"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting for every size's run (as `pipeline run --set`)")
    args = parser.parse_args()
    results = []
    for k in (float(x) for x in args.sizes.split(",")):
        rows = int(k * args.cap_mb * 2**20 / ROW_BYTES)
        with tempfile.TemporaryDirectory(prefix="scale-") as tmp:
            results.append(one(rows, args.cap_mb, Path(tmp), tuple(args.set)))
        print(json.dumps(results[-1]), flush=True)
    machine = describe()
    Path(args.out + ".json").write_text(json.dumps({"machine": machine, "commit": git_commit(), "sets": args.set,
                                                    "cap_mb": args.cap_mb, "runs": results}, indent=2))
    roles = sorted({r for x in results for r in x["peaks_mib"]})
    lines = [
        f"# A corpus larger than the object store (capped at {args.cap_mb} MiB): the nightly job, 4 new tokens a "
        f"row, each row carrying about {ROW_BYTES // 1000} KB in a pass-through column",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} logical cores, {machine['memory_gib']} GiB; CPU flags "
        f"{', '.join(machine['cpu_flags']) or 'none of note'}; commit {git_commit()}. "
        f"`python -m bench.scale` (make bench-scale){''.join(' ' + a for a in set_args(args.set))}; one run per "
        "size, a fresh local Ray each; RSS sampled "
        "every 0.5 s, USS every 5 s. USS is what a process alone holds; RSS also counts the object store's pages it "
        "maps.",
        "",
        "| rows | input MiB | x cap | wall s | engine s | spilled at most MiB | every id once |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | :---: |",
        *(f"| {r['rows']:,} | {r['input_mib']} | {r['times_cap']} | {r['wall_s']} | {r['engine_s']} | "
          f"{r['spilled_peak_mib']} | yes |" for r in results),
        "",
        "Peak memory per process, MiB, USS (RSS):",
        "",
        "| process | " + " | ".join(f"{r['times_cap']}x cap" for r in results) + " |",
        "| --- | " + " | ".join("---:" for _ in results) + " |",
        *(f"| {role_} | " + " | ".join(
            f"{r['peaks_mib'][role_]['uss']} ({r['peaks_mib'][role_]['rss']})" if role_ in r["peaks_mib"] else "-"
            for r in results) + " |" for role_ in roles),
        "",
        "What held each process's peak USS, MiB (sampled at that peak):",
        "",
        "| process | what | " + " | ".join(f"{r['times_cap']}x cap" for r in results) + " |",
        "| --- | --- | " + " | ".join("---:" for _ in results) + " |",
        *(f"| {role_} | {kind} | " + " | ".join(
            str(r["peaks_mib"].get(role_, {}).get("uss_kinds", {}).get(kind, "-")) for r in results) + " |"
          for role_ in roles
          for kind in sorted({k for r in results for k in r["peaks_mib"].get(role_, {}).get("uss_kinds", {})})),
        "",
        "USS over the run, MiB: the largest reading in each quarter of the run's readings (every 5 s):",
        "",
        "| process | " + " | ".join(f"{r['times_cap']}x cap" for r in results) + " |",
        "| --- | " + " | ".join("---" for _ in results) + " |",
        *(f"| {role_} | " + " | ".join(
            ", ".join(str(q) for q in quarters(r["uss_series_mib"].get(role_, []))) or "-"
            for r in results) + " |" for role_ in roles),
    ]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
