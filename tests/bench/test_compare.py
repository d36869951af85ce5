"""The benchmark's bookkeeping: medians, ranges, ratios, goals, the engine pool, scaling,
system choice, the real-model variant, Ray Data LLM's output rows, memory sampling."""

import json
import sys

import pyarrow as pa
import pytest

from bench import compare
from bench.compare import (
    GOALS,
    JOB,
    REAL,
    REPEATED,
    REPO,
    SYNTHETIC,
    Plan,
    Sampled,
    ablations,
    baseline,
    bench_result,
    check_plan,
    choose_systems,
    engine_request,
    engine_stats,
    goal_verdicts,
    markdown,
    output_table,
    pool_span_s,
    pool_speedup,
    run_process,
    run_system,
    summarize,
    summary_row,
    table_rows,
    trend,
    with_repeats,
)

MACHINE = {"cpu": "x", "cores": 2, "memory_gib": 24, "versions": {}}


def run(system, wall, steady, driver=100.0, engines=None, **extra):
    return {"system": system, "wall_s": wall, "wall_tok_s": 1000 / wall, "steady_tok_s": steady,
            "busy_fraction": None if system in ("raw", "ray-data-llm") else 0.99, "peak_driver_rss_mib": driver,
            "peak_workers_rss_mib": 500.0, "rows_ok": 10, "rows_error": 0, "output_tokens": 1000,
            "engines": engines or [], **extra}


def result(rows, runs, scaling=()):
    table = table_rows(summarize(runs))
    return {"rows": rows, "repeats": 3, "model": "m", "max_new_tokens": 32, "finished_at": "now",
            "machine": MACHINE, "systems": table, "pool_speedup": pool_speedup(table), "scaling": list(scaling)}


def test_medians_ranges_and_ratios_to_raw():
    runs = [run("raw", 10, 100), run("pipeline", 12, 95), run("raw", 11, 110), run("pipeline", 14, 90),
            run("raw", 12, 90), run("pipeline", 13, 99),
            run("ray-data-llm", 20, 80, lingering_processes=2, lingering_s=15.0)]
    rows = {r["system"]: r for r in table_rows(summarize(runs))}
    assert rows["raw"]["steady_tok_s"] == 100 and rows["raw"]["steady_tok_s_range"] == (90, 110)
    assert rows["pipeline"]["steady_tok_s"] == 95 and rows["pipeline"]["steady_tok_s_vs_raw"] == 0.95
    assert rows["raw"]["busy_fraction"] is None and rows["pipeline"]["runs"] == 3
    # Wall ratios: raw's wall over ours (11 / 13), ours over Ray Data LLM's (13 / 20).
    assert rows["pipeline"]["wall_vs_raw"] == 0.846 and rows["pipeline"]["wall_vs_ray_data_llm"] == 0.65
    assert rows["raw"]["wall_vs_ray_data_llm"] == 0.55 and rows["ray-data-llm"]["wall_vs_raw"] == 0.55
    md = markdown(result(4000, runs, [{"rows": 1000, "wall_s": 50.0, "wall_s_per_1k": 50.0, "steady_s_per_1k": 6.0,
                                        "peak_driver_rss_mib": 290.0}]))
    assert "| pipeline | 13.0<br>12.0..14.0 | 0.846 |" in md and "| 0.950 |" in md and "| 1,000 | 50.0 |" in md
    assert "not in its wall): ray-data-llm 2, gone after 15.0 s (medians)." in md


def test_goals_use_the_targets_for_the_runs_row_count():
    runs = [run("raw", 100, 1000), run("pipeline", 105, 980), run("ray-data-llm", 130, 900)]
    at_4k = {v["measure"]: v for v in goal_verdicts(table_rows(summarize(runs)), 4000)}
    wall, rdl, steady = (at_4k[g.measure] for g in GOALS)
    assert (wall["value"], wall["target"], wall["verdict"]) == (0.952, 0.90, "met")
    assert (rdl["value"], rdl["target"], rdl["verdict"]) == (0.808, 0.80, "missed")  # 0.808 > 0.80
    assert (steady["value"], steady["target"], steady["verdict"]) == (0.98, 0.98, "met")
    at_16k = {v["measure"]: v for v in goal_verdicts(table_rows(summarize(runs)), 16000)}
    wall, rdl, steady = (at_16k[g.measure] for g in GOALS)
    assert (wall["target"], wall["verdict"]) == (0.97, "missed")  # 0.952 < 0.97
    assert (rdl["target"], rdl["verdict"]) == (0.80, "missed")
    assert (steady["target"], steady["verdict"]) == (0.98, "met")
    # Between the sizes the smaller size's targets apply; below them, the smallest (indicative).
    assert {v["target_rows"] for v in goal_verdicts(table_rows(summarize(runs)), 8000)} == {4000}
    assert {v["target_rows"] for v in goal_verdicts(table_rows(summarize(runs)), 200)} == {4000}

    md = markdown(result(16000, runs))
    assert "| measure | target at 4,000 rows | target at 16,000 rows | pipeline |" in md
    assert "| wall vs raw (raw wall ÷ ours) | ≥ 0.90 | ≥ 0.97 | 0.952 **missed** |" in md
    assert "| our wall ÷ Ray Data LLM's wall | ≤ 0.80 | ≤ 0.80 | 0.808 **missed** |" in md
    assert "| steady output tokens/s vs raw | ≥ 0.98 | ≥ 0.98 | 0.980 **met** |" in md
    assert "so the targets at 16,000 rows apply." in md
    assert "indicative only" in markdown(result(200, runs))


def test_on_a_corpus_that_repeats_itself_the_pipeline_is_to_beat_raw_outright():
    runs = [run("raw", 100, 100), run("pipeline", 100, 100)]  # level: not beyond
    at_16k = goal_verdicts(table_rows(summarize(runs)), 16000, REPEATED.goals)
    assert [(v["value"], v["target"], v["verdict"]) for v in at_16k] == [(1.0, 1.0, "missed")]
    faster = goal_verdicts(table_rows(summarize([run("raw", 100, 100), run("pipeline", 98, 100)])), 16000,
                           REPEATED.goals)
    assert [v["verdict"] for v in faster] == ["met"]
    md = markdown({**result(16000, runs), "variant": "repeated", "profile": "conf/local.yaml", "repeat_share": 0.06})
    assert "| wall vs raw (raw wall ÷ ours) | (none) | > 1.00 | 1.000 **missed** |" in md
    assert "with 6% of its documents repeated under ids of their own" in md
    assert (REPEATED.rows, REPEATED.repeats, REPEATED.systems) == (16000, 3, ("raw", "pipeline"))


def test_a_repeated_corpus_keeps_every_id_and_repeats_the_share_asked():
    n = 1000
    corpus = pa.table({"id": [f"d{i}" for i in range(n)], "text": [f"text {i}" for i in range(n)],
                       "source": ["s"] * n})
    out = with_repeats(corpus, 0.06)
    assert out.column("id").to_pylist() == corpus.column("id").to_pylist()
    texts = out.column("text").to_pylist()
    assert n - len(set(texts)) == 60  # 60 rows carry another row's text; every original is kept once
    assert with_repeats(corpus, 0.06).equals(out)  # the same corpus every run


def test_a_goal_without_its_baseline_has_no_verdict():
    verdicts = goal_verdicts(table_rows(summarize([run("pipeline", 10, 100)])), 4000)
    assert {v["verdict"] for v in verdicts} == {None} and {v["system"] for v in verdicts} == {"pipeline"}
    assert "## Goals" in markdown(result(4000, [run("pipeline", 10, 100)]))
    assert "## Goals" not in markdown(result(4000, [run("raw", 10, 100)]))  # none of ours ran


REPORT_ENGINE = {
    "actors": [
        {"actor": "a", "rows": 488, "busy_fraction": 1.0, "idle_s": 0.131, "serving_s": 7.3366,
         "active_s": 7.3372, "last_end_at": 1000.236},
        {"actor": "b", "rows": 512, "busy_fraction": 0.9, "idle_s": 3.234, "serving_s": 5.5012,
         "active_s": 5.5011, "last_end_at": 998.422},
    ],
    "pool": {"engines": 2, "share_of_rows": {"a": 0.488, "b": 0.512}},
}


def test_engine_stats_from_the_report_most_rows_first():
    stats = engine_stats(REPORT_ENGINE)
    assert [(s["actor"], s["rows"], s["share"], s["busy_fraction"]) for s in stats] == [
        ("b", 512, 0.512, 0.9), ("a", 488, 0.488, 1.0)]
    assert stats[0]["idle_s"] == 3.234 and stats[1]["serving_s"] == 7.3366
    # Without the pool's shares (an older report), from the rows.
    assert [s["share"] for s in engine_stats({"actors": REPORT_ENGINE["actors"]})] == [0.512, 0.488]


def test_pool_span_runs_from_the_first_engines_start_to_the_last_ones_end():
    # a: 992.8988 .. 1000.236; b: 992.9209 .. 998.422
    assert pool_span_s(REPORT_ENGINE["actors"]) == pytest.approx(1000.236 - (1000.236 - 7.3372), abs=1e-3)
    staggered = [{"actor": "a", "active_s": 5.0, "last_end_at": 110.0},
                 {"actor": "b", "active_s": 5.0, "last_end_at": 107.0}]
    assert pool_span_s(staggered) == 8.0
    assert pool_span_s([{"actor": "a", "active_s": 4.5, "last_end_at": 10.0}]) == 4.5  # one engine: its span
    assert pool_span_s([]) is None


def test_pool_speed_up_and_per_engine_medians_in_the_markdown():
    one = [{"actor": "x", "rows": 1000, "share": 1.0, "busy_fraction": 0.98, "idle_s": 1.0, "serving_s": 40.0}]

    def two(busy):
        return [{"actor": "p", "rows": 520, "share": 0.52, "busy_fraction": busy, "idle_s": 2.0, "serving_s": 30.0},
                {"actor": "q", "rows": 480, "share": 0.48, "busy_fraction": 0.90, "idle_s": 4.0, "serving_s": 28.0}]

    runs = [run("pipeline", 100, 1000, engines=one), run("pipeline-2", 80, 1500, engines=two(0.95)),
            run("pipeline", 110, 1000, engines=one), run("pipeline-2", 90, 1300, engines=two(0.85))]
    rows = {r["system"]: r for r in table_rows(summarize(runs))}
    assert rows["pipeline-2"]["engines"][0] == {"engine": 1, "rows": 520, "share": 0.52,
                                                "busy_fraction": pytest.approx(0.90), "idle_s": 2.0, "serving_s": 30.0}
    assert rows["pipeline-2"]["engines"][1]["share"] == 0.48 and len(rows["pipeline"]["engines"]) == 1
    speedup = pool_speedup(list(rows.values()))
    assert speedup == {"base": "pipeline", "pool": "pipeline-2", "wall": 1.235, "steady": 1.4}
    assert pool_speedup([rows["pipeline"]]) is None

    md = markdown(result(4000, runs))
    assert "## The engine pool" in md
    assert "| pipeline-2 | 1 | 520 | 0.520 | 0.900 | 2.0 | 30.0 |" in md
    assert "| pipeline-2 | 2 | 480 | 0.480 | 0.900 | 4.0 | 28.0 |" in md
    assert "| pipeline | 1 | 1,000 | 1.000 | 0.980 | 1.0 | 40.0 |" in md
    assert "Speed-up of pipeline-2 over pipeline: wall **×1.235**" in md and "steady **×1.400**" in md
    assert "| pipeline-2 | 85.0<br>80.0..90.0 |" in md  # and a column in the goals table
    assert "| measure | target at 4,000 rows | target at 16,000 rows | pipeline | pipeline-2 |" in md


def test_scaling_says_whether_time_per_row_and_memory_are_flat():
    assert trend([(1000, 6.0), (4000, 6.2), (16000, 6.5)]) == ("flat", 1.083)
    assert trend([(1000, 300.0), (16000, 600.0)]) == ("growing", 2.0)
    assert trend([(1000, 8.0), (16000, 6.0)]) == ("falling", 0.75)
    assert trend([(1000, 8.0), (16000, None)]) is None
    scaling = [{"rows": n, "wall_s": w, "wall_s_per_1k": w / n * 1000, "steady_s_per_1k": s,
                "peak_driver_rss_mib": d, "peak_workers_rss_mib": k}
               for n, w, s, d, k in ((1000, 50.0, 6.0, 290.0, 2000.0), (16000, 150.0, 6.3, 300.0, 3000.0))]
    md = markdown(result(4000, [run("pipeline", 10, 100)], scaling))
    assert "| 16,000 | 150.0 | 9.38 | 6.30 | 300 | 3,000 |" in md
    assert "- Steady s per 1,000 rows: 6.00 at 1,000 rows, 6.30 at 16,000 rows (×1.05): **flat**" in md
    assert "- Peak driver RSS (MiB): 290 at 1,000 rows, 300 at 16,000 rows (×1.03): **flat**" in md
    assert "- Peak workers RSS (MiB): 2,000 at 1,000 rows, 3,000 at 16,000 rows (×1.50): **growing**" in md


def test_systems_default_named_or_comma_separated():
    assert list(choose_systems([64])) == ["raw", "ray-data-llm", "pipeline", "pipeline-2", "no-bucket", "fixed-64"]
    assert list(choose_systems([], ["raw,ray-data-llm", "pipeline-2"])) == ["raw", "ray-data-llm", "pipeline-2"]
    assert choose_systems([], ["pipeline-2"]) == {"pipeline-2": ["hardware.num_engines=2"]}
    assert choose_systems([], ["fixed-32"]) == {"fixed-32": ["batching.policy={kind: fixed, rows_per_call: 32}"]}
    with pytest.raises(ValueError, match="unknown system 'vllm'.*ray-data-llm"):
        choose_systems([64], ["raw", "vllm"])


def test_an_ablation_is_the_pipeline_with_its_sets_and_a_name_given_twice_gathers_both():
    assert ablations(["core-apart:engine.in_process=false", "asc:bucketing.window_order=ascending",
                      "asc: batching.feed=continuous"]) == {
        "core-apart": ["engine.in_process=false"],
        "asc": ["bucketing.window_order=ascending", "batching.feed=continuous"]}
    bad = ("engine.in_process=false", "x:engine", ":a=b", "pipeline:engine.in_process=false",
           "no-bucket:engine.in_process=false", "fixed-8:engine.in_process=false")  # a system's name
    for spec in bad:
        with pytest.raises(ValueError, match="NAME:KEY=VALUE"):
            ablations([spec])


REAL_SETS = ["sampling.max_new_tokens=64", "engine.max_model_len=1024"]  # `make run`'s RUN_SETS


def test_the_real_variant_runs_raw_and_the_pipeline_on_the_real_profile_with_make_runs_sets(tmp_path):
    assert (REAL.profile, REAL.corpus_kind, list(REAL.sets)) == ("conf/local-real.yaml", "python-docs", REAL_SETS)
    assert (REAL.rows, REAL.repeats, REAL.out, REAL.goals) == (40, 2, "bench/results/real_model", ())
    plan = Plan(REAL, REAL.rows, REAL.repeats, tmp_path / "real")
    assert check_plan(plan) == {"raw": REAL_SETS, "pipeline": REAL_SETS}
    # Others when named, and --fixed N beside the defaults; the variant's sets come first.
    assert check_plan(Plan(REAL, 40, 2, tmp_path / "real", systems=("ray-data-llm",))) == {"ray-data-llm": REAL_SETS}
    assert check_plan(Plan(REAL, 40, 2, tmp_path / "real", fixed=(64,)))["fixed-64"] == [
        *REAL_SETS, "batching.policy={kind: fixed, rows_per_call: 64}"]
    with pytest.raises(ValueError, match="--scaling runs the synthetic corpus"):
        check_plan(Plan(REAL, 40, 2, tmp_path / "real", scaling=(1000,)))
    # The synthetic variant is unchanged: every system, its own sets only.
    synthetic = check_plan(Plan(SYNTHETIC, 2000, 3, tmp_path / "synthetic"))
    assert list(synthetic) == ["raw", "ray-data-llm", "pipeline", "pipeline-2", "no-bucket"]
    assert synthetic["raw"] == [] and synthetic["pipeline-2"] == ["hardware.num_engines=2"]


def test_the_real_variants_config_is_the_real_model_with_64_tokens_and_a_1024_context():
    from pipeline.config import load_run_config

    config = load_run_config(REPO / JOB, REPO / REAL.profile, list(REAL.sets))
    assert config.profile.model.name == "smollm2-135m"
    assert config.job.sampling.max_new_tokens == 64 and config.profile.engine.max_model_len == 1024


def test_every_system_is_given_the_variants_profile(tmp_path, monkeypatch):
    seen = []

    def fake_run_process(cmd, log, grace_s=30.0):
        seen.append(cmd)
        if cmd[2] == "bench.compare":  # an own-process system: it writes its result
            (tmp_path / "raw.json").write_text(json.dumps({"rows_ok": 1, "rows_error": 0, "output_tokens": 8,
                                                           "steady_s": 1.0}))
        elif cmd[1:3] == ["-m", "pipeline"]:  # the pipeline: its run report
            (tmp_path / "pipeline-out").mkdir()
            (tmp_path / "pipeline-out" / "_report.json").write_text(json.dumps({
                "status": {"ok": 1}, "rows_out": 1, "tokens": {"output": 8}, "wall_s": 2.0, "busy_fraction": 1.0,
                "engine": {"actors": [{"actor": "a", "rows": 1, "active_s": 1.0, "last_end_at": 5.0}]}}))
        return 2.0, Sampled()

    monkeypatch.setattr(compare, "run_process", fake_run_process)
    for name in ("raw", "pipeline"):
        assert run_system(name, REAL_SETS, tmp_path / "c.parquet", tmp_path, profile=REAL.profile)["wall_s"] == 2.0
    raw, pipeline = seen
    assert raw[raw.index("--profile") + 1] == pipeline[pipeline.index("--profile") + 1] == "conf/local-real.yaml"
    assert raw[3:4] == ["--raw"] and "engine.max_model_len=1024" in raw and "engine.max_model_len=1024" in pipeline
    # The model is made ready (converted on first use) before any timed run, with the same profile.
    compare.warm_model(REAL.profile, REAL_SETS, tmp_path)
    warm = seen[-1]
    compile(warm[2], "warm_model", "exec")
    assert warm[-3:] == [str(REPO / REAL.profile), *REAL_SETS]


def test_the_own_process_entries_read_the_profile_after_the_sets(monkeypatch):
    calls = []
    monkeypatch.setattr(compare, "raw_vllm", lambda *a: calls.append(a))
    monkeypatch.setattr(compare, "llm_batch_defaults", lambda *a: calls.append(a))
    compare._main(["--raw", "c", "o", "r", "--set", "a=1", "--profile", "conf/local-real.yaml", "--set", "b=2"])
    compare._main(["--llm-batch-defaults", "r"])
    assert calls == [("c", "o", ["a=1", "b=2"], "r", "conf/local-real.yaml"), ([], "r", "conf/local.yaml")]
    with pytest.raises(SystemExit):
        compare._main(["--raw", "c", "o", "r", "--profile"])


def test_the_real_variants_result_has_the_baseline_cpu_flags_and_dtype_and_no_verdicts(tmp_path):
    from pipeline.config import load_run_config
    from pipeline.run.plan import resolve_dtype

    config, dtype = resolve_dtype(load_run_config(REPO / JOB, REPO / REAL.profile, list(REAL.sets)),
                                  flags=["avx", "avx2", "fma"])
    runs = [run("raw", 100, 1000), run("pipeline", 105, 980), run("raw", 110, 1000), run("pipeline", 115, 990)]
    r = bench_result(Plan(REAL, 40, 2, tmp_path / "real"), config, dtype, 40, runs, [])
    r["machine"] = {**MACHINE, "cpu_flags": ["avx", "avx2", "fma"]}
    assert r["goals"] == [] and r["goals_checked"] is False and r["profile"] == "conf/local-real.yaml"
    assert r["baseline"] == {"measure": "raw wall ÷ pipeline wall", "system": "pipeline", "value": 0.955,
                             "later_goal": 0.97, "checked": False}  # 105 / 110
    assert r["dtype"]["dtype"] == "float32" and r["sets"] == REAL_SETS and r["max_new_tokens"] == 64
    json.dumps(r)
    md = markdown(r)
    assert md.startswith("# Benchmark: raw vLLM against the pipeline, a real model on real text (40 rows)")
    assert "x (avx, avx2, fma), 2 cores" in md and "model smollm2-135m, 64 new tokens per row" in md
    assert ("Profile conf/local-real.yaml, the python-docs corpus, `--set sampling.max_new_tokens=64` "
            "`--set engine.max_model_len=1024` on every system; dtype float32 (the CPU has none of") in md
    assert "Raw wall ÷ pipeline wall (medians): **0.955**. The baseline for a later performance goal of ≥ 0.97" in md
    assert "Not checked: the goals are set for the tiny model" in md
    assert "**met**" not in md and "**missed**" not in md and "target at" not in md


def test_the_baseline_needs_raw_the_pipeline_and_a_later_goal():
    rows = table_rows(summarize([run("raw", 100, 1000), run("pipeline", 125, 900)]))
    assert baseline(rows, 0.97)["value"] == 0.8
    assert baseline(rows, None) is None
    assert baseline(table_rows(summarize([run("pipeline", 125, 900)])), 0.97) is None
    assert "## Baseline" not in markdown(result(4000, [run("raw", 100, 1000), run("pipeline", 125, 900)]))


def block(rows):
    """A block as Ray Data builds one from rows: a column per key of any row, None where a row lacks it."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows])


def test_ray_data_llm_rows_come_out_in_one_schema():
    # What the processor hands on: an ok row through the postprocess, an engine failure
    # and a row the prepare stage refused (error rows skip the postprocess).
    ok = summary_row(["id", "text"], {
        "id": "a", "text": "t", "status": "ok", "generated_text": "s", "num_generated_tokens": 3,
        "tokenized_prompt": [1, 2], "metrics": {"queued_ts": 10.0, "last_token_ts": 12.5}})
    assert ok == {"id": "a", "text": "t", "status": "ok", "summary": "s", "output_tokens": 3,
                  "engine_queued_ts": 10.0, "engine_last_token_ts": 12.5}
    failed = {"id": "b", "text": "t", "status": "ok", "prepare_error": None, "generated_text": "",
              "num_generated_tokens": 0, "__inference_error__": "EngineError: boom"}
    refused = {"id": "c", "text": "t", "status": "skipped_too_long", "prepare_error": "2,000 tokens > 1,024",
               "generated_text": "", "num_generated_tokens": 0, "__inference_error__": "ValidationError: no prompt"}
    batch = block([{**ok, "__inference_error__": ""}, failed, refused])
    schema = pa.schema([("id", pa.string()), ("text", pa.string()), ("summary", pa.string()),
                        ("output_tokens", pa.int32()), ("status", pa.string()), ("error", pa.string()),
                        ("engine_queued_ts", pa.float64()), ("engine_last_token_ts", pa.float64())])
    out = output_table(schema, batch)
    assert out.schema == schema
    assert out.column("status").to_pylist() == ["ok", "error", "skipped_too_long"]
    assert out.column("error").to_pylist() == [None, "EngineError: boom", "2,000 tokens > 1,024"]
    assert out.column("summary").to_pylist() == ["s", None, None]
    # A block of error rows only has none of the postprocess's columns.
    only_errors = output_table(schema, block([failed]))
    assert only_errors.schema == schema and only_errors.column("output_tokens").to_pylist() == [None]


def test_every_ray_data_llm_request_gets_its_own_sampling():
    params = {"max_tokens": 32, "temperature": 0.0, "top_p": 1.0, "seed": 0}
    a, b = engine_request(params, {"id": "a"}), engine_request(params, {"id": "b"})
    assert a == b == {"sampling_params": params}
    a["sampling_params"].pop("seed")  # the engine stage pops from it; the next row must not see that
    assert b["sampling_params"]["seed"] == 0 and params["seed"] == 0


def test_peak_memory_is_sampled_for_the_process_and_its_children(tmp_path):
    # A parent holding ~60 MiB and a child holding ~120 MiB, each for a second.
    code = ("import subprocess, sys, time; x = bytearray(60 * 2**20); "
            "subprocess.run([sys.executable, '-c', 'import time; y = bytearray(120 * 2**20); time.sleep(1)'])")
    wall, peak = run_process([sys.executable, "-c", code], tmp_path / "log")
    assert wall > 0.9 and peak.samples >= 3
    assert peak.driver > 60 * 2**20 and peak.workers > 120 * 2**20


def test_processes_a_run_leaves_behind_are_waited_for_then_killed(tmp_path):
    # The parent exits at once, leaving a child of its own that sleeps.
    code = ("import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep({})'], "
            "start_new_session=True)")
    wall, peak = run_process([sys.executable, "-c", code.format(1.5) + "; import time; time.sleep(0.6)"],
                             tmp_path / "log")
    assert peak.lingering == 1 and 0.5 < peak.lingering_s < 5
    wall, peak = run_process([sys.executable, "-c", code.format(60) + "; import time; time.sleep(0.6)"],
                             tmp_path / "log", grace_s=0.5)
    assert peak.lingering == 1 and peak.lingering_s < 5  # killed, not waited out
    assert all(not p.is_running() for p in peak.descendants.values())
