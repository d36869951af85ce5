"""`pipeline bench`: the pipeline against raw vLLM and against its own ablations.

Every system runs in its own process on the same synthetic corpus, with the
same model, engine settings, prompts (the job's template and chat template,
rendered and tokenized by the job's own prepare stage) and sampling:

    raw        one `LLM.generate` over all the prompts, outputs written to Parquet:
               what a user would write instead, and the ceiling
    pipeline   `pipeline run` as shipped: Ray Data read, buckets, the adaptive actor, the sink
    no-bucket  the same with `bucketing.grouping: off`
    fixed-N    the same with a fixed N rows in flight instead of adaptive sizing

Runs are interleaved (raw, pipeline, no-bucket, fixed..., then again) so that
drift on the machine hits every system alike, `--repeats` times each; the
report gives medians and the spread (min..max).

Two throughputs are reported. *Wall* is output tokens over the whole process,
start-up included (Ray, about 20 s of engine start-up on CPU): what one run
costs. *Steady* is output tokens over the time the engine was generating,
from its first request to its last completion, gaps between batches included
(`LLM.generate` for raw; the engine actors' active span for the pipeline):
what the pipeline costs per token once started, which is what millions of
rows see. The target, pipeline/raw of at least 0.95, is on steady throughput.

Peak resident memory is sampled every 0.2 s: the driver process alone, and
the sum over its descendants (Ray's workers and the engine core; for raw, the
engine core).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from pipeline.machine import describe

REPO = Path(__file__).resolve().parents[1]
TARGET, TARGET_ROWS = 0.95, 4000  # pipeline / raw steady throughput, from this many rows
JOB = "jobs/nightly_summarize.yaml"
PROFILE = "conf/local.yaml"


@dataclass
class Sampled:
    """Peak RSS of a process and of its descendants, sampled while it runs."""

    driver: int = 0
    workers: int = 0
    samples: int = 0


def watch(proc: subprocess.Popen, peak: Sampled, stop: threading.Event, every: float = 0.2) -> None:
    try:
        root = psutil.Process(proc.pid)
    except psutil.NoSuchProcess:
        return
    while not stop.is_set():
        try:
            driver = root.memory_info().rss
            workers = 0
            for child in root.children(recursive=True):
                try:
                    workers += child.memory_info().rss
                except psutil.Error:
                    continue
        except psutil.Error:
            return
        peak.driver, peak.workers = max(peak.driver, driver), max(peak.workers, workers)
        peak.samples += 1
        stop.wait(every)


def run_process(cmd: list[str], log: Path) -> tuple[float, Sampled]:
    """Run `cmd`, sampling its memory; (wall seconds, peaks). Raises with the log's tail on failure."""
    peak, stop = Sampled(), threading.Event()
    started = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        watcher = threading.Thread(target=watch, args=(proc, peak, stop), daemon=True)
        watcher.start()
        code = proc.wait()
    wall = time.monotonic() - started
    stop.set()
    watcher.join()
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {code}:\n{log.read_text()[-3000:]}")
    return wall, peak


# --- the raw-vLLM system, run in its own process -------------------------------------


def raw_vllm(corpus: str, output: str, sets: list[str], result: str) -> None:
    """What a user would write: render the prompts, one `LLM.generate`, write the outputs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline import schema
    from pipeline.config import load_run_config
    from pipeline.plan import engine_kwargs, prepare_settings
    from pipeline.runner import resolve_model
    from pipeline.stages.prepare import PrepareStage, context_limit

    started = time.monotonic()
    config = load_run_config(REPO / JOB, REPO / PROFILE, sets, corpus, output)
    profile, sampling = config.profile, config.job.sampling
    model = resolve_model(config)
    table = pq.read_table(corpus)
    settings = prepare_settings(config, model, context_limit(model, profile.engine.max_model_len))
    prepared = PrepareStage(settings)(table)
    ok = [i for i, s in enumerate(prepared.column("status").to_pylist()) if s == "ok"]
    ids = prepared.column(schema.PROMPT_TOKEN_IDS).to_pylist()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if profile.engine.cpu_kvcache_space_gib is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(profile.engine.cpu_kvcache_space_gib)
    llm = LLM(**engine_kwargs(model, profile.engine, sampling.seed))
    params = SamplingParams(max_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                            top_p=sampling.top_p, seed=sampling.seed)
    gen_started = time.monotonic()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids[i]) for i in ok], params, use_tqdm=False)
    gen_s = time.monotonic() - gen_started
    summaries: list[str | None] = [None] * table.num_rows
    for i, out in zip(ok, outputs):
        summaries[i] = out.outputs[0].text
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    Path(output).mkdir(parents=True, exist_ok=True)
    pq.write_table(table.append_column("summary", pa.array(summaries, pa.string())), f"{output}/part-0.parquet")
    Path(result).write_text(json.dumps({
        "rows_ok": len(ok), "rows_error": table.num_rows - len(ok), "output_tokens": tokens,
        "steady_s": gen_s, "inner_wall_s": time.monotonic() - started, "busy_fraction": None,
    }))


# --- one run of each system -------------------------------------------------------------


def pipeline_systems(fixed: list[int]) -> dict[str, list[str]]:
    systems = {"pipeline": [], "no-bucket": ["bucketing.grouping=off"]}
    for n in fixed:
        systems[f"fixed-{n}"] = [f"batching.policy={{kind: fixed, rows_per_call: {n}}}"]
    return systems


def run_system(name: str, sets: list[str], corpus: Path, work: Path) -> dict[str, Any]:
    out = work / f"{name}-out"
    common = ["--set", "batching.learned_limits=null"]
    if name == "raw":
        result = work / f"{name}.json"
        cmd = [sys.executable, "-m", "pipeline.bench", "--raw", str(corpus), str(out), str(result)]
        wall, peak = run_process(cmd, work / f"{name}.log")
        r = json.loads(result.read_text())
    else:
        cmd = [sys.executable, "-m", "pipeline", "run", JOB, "--profile", PROFILE, "--input", str(corpus),
               "--output", str(out), *common]
        for s in sets:
            cmd += ["--set", s]
        wall, peak = run_process(cmd, work / f"{name}.log")
        report = json.loads((out / "_report.json").read_text())
        actors = report["engine"]["actors"]
        r = {
            "rows_ok": report["status"].get("ok", 0),
            "rows_error": report["rows_out"] - report["status"].get("ok", 0),
            "output_tokens": report["tokens"]["output"],
            "steady_s": max(a["active_s"] for a in actors) if actors else None,
            "inner_wall_s": report["wall_s"],
            "busy_fraction": report["busy_fraction"],
        }
    r.update(system=name, wall_s=round(wall, 3), peak_driver_rss_mib=round(peak.driver / 2**20, 1),
             peak_workers_rss_mib=round(peak.workers / 2**20, 1), memory_samples=peak.samples)
    r["wall_tok_s"] = round(r["output_tokens"] / wall, 2)
    r["steady_tok_s"] = round(r["output_tokens"] / r["steady_s"], 2) if r.get("steady_s") else None
    return r


@dataclass
class Summary:
    system: str
    runs: list[dict[str, Any]] = field(default_factory=list)

    def median(self, key: str) -> float | None:
        values = [r[key] for r in self.runs if r.get(key) is not None]
        return statistics.median(values) if values else None

    def spread(self, key: str) -> tuple[float, float] | None:
        values = [r[key] for r in self.runs if r.get(key) is not None]
        return (min(values), max(values)) if values else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, Summary]:
    out: dict[str, Summary] = {}
    for r in runs:
        out.setdefault(r["system"], Summary(r["system"])).runs.append(r)
    return out


KEYS = ("wall_s", "wall_tok_s", "steady_tok_s", "busy_fraction", "peak_driver_rss_mib", "peak_workers_rss_mib",
        "rows_ok", "rows_error", "output_tokens")


def table_rows(summaries: dict[str, Summary]) -> list[dict[str, Any]]:
    raw = summaries.get("raw")
    rows = []
    for name, s in summaries.items():
        row: dict[str, Any] = {"system": name, "runs": len(s.runs)}
        for key in KEYS:
            row[key] = s.median(key)
            row[key + "_range"] = s.spread(key)
        for key in ("wall_tok_s", "steady_tok_s"):
            base = raw.median(key) if raw else None
            row[key + "_vs_raw"] = round(row[key] / base, 3) if base and row[key] else None
        rows.append(row)
    return rows


def _fmt(v: Any, spec: str = ",.0f") -> str:
    return "-" if v is None else format(v, spec)


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"# Benchmark: the pipeline against raw vLLM ({result['rows']:,} rows)",
        "",
        f"{result['finished_at']} · {m['cpu']} ({', '.join(m.get('cpu_flags') or ['no AVX2/AVX-512'])}), "
        f"{m['cores']} cores, {m['memory_gib']} GiB · "
        f"vllm {m['versions'].get('vllm')}, ray {m['versions'].get('ray')}, torch {m['versions'].get('torch')} · "
        f"model {result['model']}, {result['max_new_tokens']} new tokens per row · "
        f"{result['repeats']} interleaved runs per system; medians, with the range (min..max) beneath.",
        "",
        "| system | wall s | wall tok/s | steady tok/s | steady vs raw | busy | rows ok / error | driver RSS MiB | workers RSS MiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["systems"]:
        def cell(key: str, spec: str = ",.0f") -> str:
            rng = r[key + "_range"]
            span = "" if not rng or rng[0] == rng[1] else f"<br>{_fmt(rng[0], spec)}..{_fmt(rng[1], spec)}"
            return _fmt(r[key], spec) + span
        lines.append(
            f"| {r['system']} | {cell('wall_s', ',.1f')} | {cell('wall_tok_s')} | {cell('steady_tok_s')} | "
            f"{_fmt(r['steady_tok_s_vs_raw'], '.3f')} | {cell('busy_fraction', '.3f')} | "
            f"{_fmt(r['rows_ok'], ',.0f')} / {_fmt(r['rows_error'], ',.0f')} | {cell('peak_driver_rss_mib')} | "
            f"{cell('peak_workers_rss_mib')} |"
        )
    pipeline = next((r for r in result["systems"] if r["system"] == "pipeline"), None)
    if pipeline and pipeline.get("steady_tok_s_vs_raw") is not None:
        ratio = pipeline["steady_tok_s_vs_raw"]
        verdict = "met" if ratio >= TARGET else "missed"
        scope = "" if result["rows"] >= TARGET_ROWS else f" (the target applies from {TARGET_ROWS:,} rows)"
        lines += ["", f"Target: pipeline ÷ raw ≥ {TARGET} in steady output tokens/s: **{ratio:.3f}, {verdict}**{scope}."]
    if result.get("scaling"):
        lines += ["", "## Scaling: the full pipeline at growing row counts", "",
                  "| rows | wall s | wall s per 1,000 rows | steady s per 1,000 rows | driver RSS MiB |",
                  "| ---: | ---: | ---: | ---: | ---: |"]
        for s in result["scaling"]:
            lines.append(f"| {s['rows']:,} | {s['wall_s']:,.1f} | {s['wall_s_per_1k']:,.2f} | "
                         f"{_fmt(s['steady_s_per_1k'], ',.2f')} | {s['peak_driver_rss_mib']:,.0f} |")
    lines += ["", "Wall: the whole process, start-up included. Steady: output tokens over the engine's "
              "generating span (first request to last completion, gaps between batches included). "
              "Written by `pipeline bench`; see pipeline/bench.py for what each system runs.", ""]
    return "\n".join(lines)


def bench(rows: int, repeats: int, fixed: list[int], out: Path, scaling: list[int] | None = None,
          systems: list[str] | None = None, log=print) -> dict[str, Any]:
    from pipeline.config import load_run_config
    from pipeline.dev.corpus import write_corpus

    config = load_run_config(REPO / JOB, REPO / PROFILE)
    chosen = {"raw": [], **pipeline_systems(fixed)}
    if systems:
        chosen = {k: v for k, v in chosen.items() if k in systems}
    runs: list[dict[str, Any]] = []
    scale: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pipeline-bench-") as tmp:
        work = Path(tmp)
        corpus = write_corpus(work / "corpus.parquet", rows=rows, seed=0)
        for rep in range(repeats):
            for name, sets in chosen.items():
                r = run_system(name, sets, corpus, work)
                r["repeat"] = rep
                runs.append(r)
                log(f"  {rep + 1}/{repeats} {name:>10}: wall {r['wall_s']:6.1f} s · steady "
                    f"{_fmt(r['steady_tok_s'])} tok/s · wall {r['wall_tok_s']:,.0f} tok/s · "
                    f"driver {r['peak_driver_rss_mib']:,.0f} MiB")
        for n in scaling or []:
            corpus_n = write_corpus(work / f"corpus-{n}.parquet", rows=n, seed=0)
            r = run_system("pipeline", [], corpus_n, work)
            scale.append({"rows": n, "wall_s": r["wall_s"], "wall_s_per_1k": round(r["wall_s"] / n * 1000, 3),
                          "steady_s_per_1k": round(r["steady_s"] / n * 1000, 3) if r.get("steady_s") else None,
                          "peak_driver_rss_mib": r["peak_driver_rss_mib"],
                          "peak_workers_rss_mib": r["peak_workers_rss_mib"], "output_tokens": r["output_tokens"]})
            log(f"  scaling {n:>6} rows: wall {r['wall_s']:.1f} s · driver {r['peak_driver_rss_mib']:,.0f} MiB")
    result = {
        "rows": rows, "repeats": repeats, "model": config.profile.model.name,
        "max_new_tokens": config.job.sampling.max_new_tokens, "job": JOB, "profile": PROFILE,
        "finished_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": describe(),
        "systems": table_rows(summarize(runs)), "runs": runs, "scaling": scale,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(markdown(result))
    return result


if __name__ == "__main__":
    # The raw system's own process: python -m pipeline.bench --raw CORPUS OUTPUT RESULT
    if len(sys.argv) == 5 and sys.argv[1] == "--raw":
        raw_vllm(sys.argv[2], sys.argv[3], [], sys.argv[4])
    else:
        raise SystemExit("usage: python -m pipeline.bench --raw CORPUS OUTPUT RESULT (use `pipeline bench`)")
