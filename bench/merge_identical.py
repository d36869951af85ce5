"""Identical prompts generated once, against every row its own request, on the real engine.

The sample corpus with a share of its documents repeated under ids of their own (a day
of real documents tried here held 6% exact duplicates), through the CLI as a user runs
it: `batching.merge_identical_prompts` on and off, interleaved, `--repeats` times each.
What the reports say: wall, engine time, requests, merged rows; medians.

    .venv/bin/python -m bench.merge_identical [--rows 2000] [--share 0.06] [--repeats 2]

Results go to bench/results/merge_identical.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from statistics import median

import pyarrow.parquet as pq

from bench.compare import git_commit, run_process, with_repeats
from pipeline.observe.machine import describe

REPO = Path(__file__).resolve().parents[1]
SYSTEMS = {"merged": "true", "every row its own": "false"}


def run(corpus: Path, out: Path, merge: str) -> dict:
    cmd = [sys.executable, "-m", "pipeline", "run", "jobs/nightly_summarize.yaml", "--profile", "conf/local.yaml",
           "--input", str(corpus), "--output", str(out), "--set", "batching.learned_limits=null",
           "--set", f"batching.merge_identical_prompts={merge}"]
    run_process(cmd, out.with_suffix(".log"))
    return json.loads((out / "_report.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--share", type=float, default=0.06)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "bench/results/merge_identical"))
    args = parser.parse_args()

    from pipeline.tools.dev.corpus import make_corpus

    runs: dict[str, list[dict]] = {name: [] for name in SYSTEMS}
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.parquet"
        table = with_repeats(make_corpus(args.rows, seed=0), args.share)
        pq.write_table(table, corpus)
        distinct = len(set(zip(table.column("text").to_pylist(), table.column("source").to_pylist())))
        for k in range(args.repeats):
            for name, merge in SYSTEMS.items():
                r = run(corpus, Path(tmp) / f"{merge}-{k}", merge)
                runs[name].append({
                    "wall_s": r["wall_s"], "engine_s": r["engine_s"], "ok": r["status"].get("ok", 0),
                    "requests": sum(a["requests"] for a in r["engine"]["actors"]),
                    "merged_rows": r["batching"]["merge_identical_prompts"]["merged_rows"],
                })
                print(name, json.dumps(runs[name][-1]), flush=True)

    summary = {name: {k: median(x[k] for x in rs) for k in rs[0]} for name, rs in runs.items()}
    Path(args.out + ".json").write_text(json.dumps(
        {"machine": describe(), "commit": git_commit(), "rows": args.rows, "share": args.share,
         "distinct_prompts": distinct, "runs": runs, "medians": summary}, indent=2))
    on, off = summary["merged"], summary["every row its own"]
    machine = describe()
    lines = [
        f"# Identical prompts generated once ({args.rows:,} rows, {args.share:.0%} repeated: {distinct:,} distinct; "
        f"tiny model, vLLM CPU backend, {args.repeats} interleaved runs each, medians)",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} logical cores, {machine['memory_gib']} GiB; CPU flags "
        f"{', '.join(machine['cpu_flags']) or 'none of note'}; commit {git_commit()}.",
        "",
        "| system | ok rows | requests | merged rows | engine s | wall s |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        *(f"| {name} | {s['ok']:,.0f} | {s['requests']:,.0f} | {s['merged_rows']:,.0f} | {s['engine_s']:.1f} | "
          f"{s['wall_s']:.1f} |" for name, s in summary.items()),
        "",
        f"Engine time merged ÷ every row its own: {on['engine_s'] / off['engine_s']:.3f}; "
        f"wall: {on['wall_s'] / off['wall_s']:.3f}.",
    ]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
