"""Night 2 of the nightly week, two ways, in turn against one night 1: what one setting
does to an incremental night, with the machine's drift spread over both.

Night 1 runs once (16,000 documents by default). Night 2's corpus is night 1's with 3%
edited, 1% new and 1% removed, as in `bench.nightly_week`; it then runs `--pairs` times
with each of the two settings, in the order A B B A A B ..., each reusing its own copy of
night 1's partition through the job's own `reuse:` default.

    .venv/bin/python -m bench.nightly_ab --a reuse.before_tokenizing=true --b reuse.before_tokenizing=false

Per run: wall, the first engine call after the launch, rows found before tokenizing, and
wall ÷ night 1's bound (its fixed start-up plus 10% of the rest: issue 27's goal).
Results go to `--out`.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

from bench.compare import git_commit
from bench.nightly_week import REPO, next_night, run_night
from pipeline.observe.machine import describe


def order(pairs: int) -> list[str]:
    """A B B A A B ...: each setting as often first as second."""
    return [v for k in range(pairs) for v in (("a", "b") if k % 2 == 0 else ("b", "a"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16_000)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--a", action="append", default=[], metavar="KEY=VALUE", help="setting A (repeatable)")
    parser.add_argument("--b", action="append", default=[], metavar="KEY=VALUE", help="setting B (repeatable)")
    parser.add_argument("--out", default=str(REPO / "bench/results/nightly_ab"))
    args = parser.parse_args()

    from pipeline.tools.dev.corpus import make_corpus

    sets = {"a": tuple(args.a), "b": tuple(args.b)}
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        corpus = make_corpus(args.rows, seed=0)
        first = work / "corpus-1.parquet"
        pq.write_table(corpus, first)
        one = run_night(1, first, work / "night1")
        print(json.dumps(one), flush=True)
        second = work / "corpus-2.parquet"
        pq.write_table(next_night(corpus, 2, make_corpus(args.rows, seed=1), 0.03, 0.01, 0.01, random.Random(0)),
                       second)
        bound = one["fixed_startup_s"] + 0.1 * (one["wall_s"] - one["fixed_startup_s"])
        for k, variant in enumerate(order(args.pairs)):
            out = work / f"run{k}-{variant}"
            shutil.copytree(work / "night1" / "dt=2026-12-01", out / "dt=2026-12-01")
            night = run_night(2, second, out, sets[variant]) | {"variant": variant}
            night["over_bound"] = round(night["wall_s"] / bound, 3)
            runs.append(night)
            print(json.dumps(night), flush=True)

    def median(variant: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["variant"] == variant)

    machine = describe()
    Path(args.out + ".json").write_text(json.dumps({"machine": machine, "commit": git_commit(), "args": vars(args),
                                                   "night1": one, "bound_s": round(bound, 2), "runs": runs},
                                                  indent=2))
    label = {v: " ".join(f"`{s}`" for s in sets[v]) or "(as shipped)" for v in sets}
    lines = [
        f"# Night 2 of the nightly week, two ways ({args.rows:,} documents; 3% edited, 1% new, 1% removed)",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} logical cores, {machine['memory_gib']} GiB; CPU flags "
        f"{', '.join(machine['cpu_flags']) or 'none of note'}; commit {git_commit()}. `python -m bench.nightly_ab`, "
        f"{args.pairs} pairs in turn (A B B A ...) against one night 1: wall {one['wall_s']:.1f} s, fixed start-up "
        f"{one['fixed_startup_s']:.1f} s, so night 2's bound is {bound:.1f} s.",
        "",
        "The engine actor's way, in seconds after the launch: its process born, vLLM imported, the lookup's "
        "first row to generate, the engine ready.",
        "",
        "| run | setting | wall s | born | imported | work found | ready | first engine call s | found before "
        "tokenizing | wall ÷ bound |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *(f"| {k + 1} | {r['variant'].upper()}: {label[r['variant']]} | {r['wall_s']:.1f} | "
          + " | ".join(str((r.get('engine_actor') or {}).get(p, '-')) for p in ("born_at", "imported_at",
                                                                              "work_found_at", "ready_at"))
          + f" | {r['fixed_startup_s']} | {r.get('found_before_tokenizing') or 0:,} | {r['over_bound']:.3f} |"
          for k, r in enumerate(runs)),
        "",
        "| setting | median wall s | median first engine call s | median wall ÷ bound |",
        "| --- | ---: | ---: | ---: |",
        *(f"| {v.upper()}: {label[v]} | {median(v, 'wall_s'):.1f} | {median(v, 'fixed_startup_s'):.1f} | "
          f"{median(v, 'over_bound'):.3f} |" for v in ("a", "b")),
    ]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
