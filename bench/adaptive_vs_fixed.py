"""Adaptive batch sizing against fixed batch sizes, on the real engine.

Runs the nightly job on the sample corpus once per configuration, through the
CLI as a user would, and tabulates what each report says: output tokens/s
(over the wall and over engine time), busy fraction, back-offs, preemptions.

    .venv/bin/python bench/adaptive_vs_fixed.py [--rows 1000] [--profiles conf/local.yaml conf/local-small-kv.yaml]

Fixed sizes run as classic batches (`feed: drain`: each batch runs to its last
row before the next starts), which is what a hand-written batch loop does;
adaptive runs keep the engine fed. Results go to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench.compare import run_process
from pipeline.observe.machine import describe

REPO = Path(__file__).resolve().parents[1]
SYSTEMS = {
    "adaptive": [],  # each profile's own adaptive policy
    "fixed-8": ["batching.policy={kind: fixed, rows_per_call: 8}", "batching.feed=drain"],
    "fixed-32": ["batching.policy={kind: fixed, rows_per_call: 32}", "batching.feed=drain"],
    "fixed-128": ["batching.policy={kind: fixed, rows_per_call: 128}", "batching.feed=drain"],
}


def run(profile: str, corpus: Path, out: Path, sets: list[str]) -> dict:
    """One run through the CLI, as a user would; its report. The log lands beside the output."""
    cmd = [sys.executable, "-m", "pipeline", "run", "jobs/nightly_summarize.yaml", "--profile", profile,
           "--input", str(corpus), "--output", str(out)]
    for s in sets:
        cmd += ["--set", s]
    run_process(cmd, out.with_suffix(".log"))
    return json.loads((out / "_report.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--profiles", nargs="+", default=["conf/local.yaml", "conf/local-small-kv.yaml"])
    parser.add_argument("--out", default=str(REPO / "bench/results/adaptive_vs_fixed"))
    args = parser.parse_args()

    from pipeline.tools.dev.corpus import write_corpus

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_corpus(Path(tmp) / "corpus.parquet", rows=args.rows, seed=0)
        for profile in args.profiles:
            for name, sets in SYSTEMS.items():
                r = run(profile, corpus, Path(tmp) / f"{Path(profile).stem}-{name}", sets)
                per_bucket = r["batching"]["per_bucket"].values()
                rows.append({
                    "profile": profile, "system": name, "rows": r["rows_out"], "ok": r["status"].get("ok", 0),
                    "wall_s": r["wall_s"], "engine_s": r["engine_s"],
                    "output_tokens_per_s": r["output_tokens_per_s"],
                    "engine_output_tokens_per_s": r["engine_output_tokens_per_s"],
                    "busy_fraction": r["busy_fraction"], "fill": r["fill"], "backoffs": r["batching"]["backoffs"],
                    "preemptions": sum(b["preemptions"] for b in per_bucket),
                    "peak_pressure": max((b["peak_pressure"] for b in per_bucket), default=0.0),
                })
                print(json.dumps(rows[-1]), flush=True)

    Path(args.out + ".json").write_text(json.dumps({"machine": describe(), "results": rows}, indent=2))
    lines = [
        f"# Adaptive vs fixed batch sizes ({args.rows} rows, sample corpus, tiny model, vLLM CPU backend)",
        "",
        "| profile | system | ok rows | wall s | engine s | out tok/s (wall) | out tok/s (engine) | busy | fill | back-offs | preemptions | peak pressure |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for x in rows:
        lines.append(
            f"| {x['profile']} | {x['system']} | {x['ok']} | {x['wall_s']:.1f} | {x['engine_s']:.2f} | "
            f"{x['output_tokens_per_s']:.0f} | {x['engine_output_tokens_per_s']:.0f} | {x['busy_fraction']:.3f} | {x['fill']:.3f} | "
            f"{x['backoffs']} | {x['preemptions']} | {x['peak_pressure']:.2f} |"
        )
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
