"""`_report.json` pinned: its keys and the types of their values, from the shared real run.

Readers (scripts, dashboards, `pipeline bench`) index the report by key; a key that
moves or changes type breaks them silently. Change this test only together with
the README's description of the report."""


NUM = (int, float)
OPT_STR = (str, type(None))

TOP = {
    "run_id": str, "job": str, "job_file": str, "profile_file": str, "model": str, "input": str, "output": str,
    "started_at": str, "wall_s": NUM, "rows_in": int, "rows_out": int, "status": dict, "buckets": dict,
    "tokens": dict, "output_tokens_per_s": NUM, "engine_s": NUM, "engine_output_tokens_per_s": NUM,
    "busy_fraction": NUM, "fill": NUM, "batching": dict, "engine": dict, "engine_calls": list, "files": list,
    "versions": dict, "date": OPT_STR, "input_files": dict, "length": dict, "plot_path": OPT_STR,
    "report_path": str, "publish": dict, "timeline": dict, "checks": dict, "resume": (dict, type(None)),
    "incidents": list, "warnings": list, "result_key": dict, "reuse": dict,
}
REUSE = {"sources": list, "notes": list, "lookup": (dict, type(None)), "rows_reused": int, "rows_generated": int,
         "output_tokens_not_generated": int, "engine_s_saved": NUM, "engine_s_per_token": (float, type(None))}
BATCHING = {"policy": str, "feed": str, "memory_target": (float, type(None)), "rows_per_call": (int, type(None)),
            "tuned_rows": (dict, type(None)), "backoffs": int, "per_bucket": dict, "learned_limits": dict,
            "merge_identical_prompts": dict, "blocks": dict}
PER_BUCKET = {"calls": int, "trajectory": list, "backoffs": list, "peak_pressure": NUM, "preemptions": int,
              "busy_fraction": (float, type(None)), "fill": (float, type(None))}
CALL = {"call": str, "kind": str, "bucket": str, "buckets": list, "rows": int, "rows_written": int,
        "min_prompt_tokens": int, "max_prompt_tokens": int, "wall_s": NUM, "busy_s": NUM, "step_s": NUM,
        "fill": (float, type(None)), "output_tokens": int, "steps": int, "peak_pressure": NUM,
        "peak_kv_cache_usage": NUM, "preemptions": int, "rejected": int, "actor": str, "started_at": NUM}
ACTOR = {"actor": str, "host": str, "node": str, "pid": int, "package_path": str, "born_at": NUM,
         "imported_at": (float, type(None)), "work_found_at": (float, type(None)), "ready_at": NUM,
         "last_end_at": NUM, "calls": int, "requests": int, "rows": int, "output_tokens": int, "serving_s": NUM,
         "idle_s": NUM, "busy_s": NUM, "step_s": NUM, "active_s": NUM, "busy_fraction": (float, type(None)),
         "windows": int, "oom_retries": int, "bisections": int, "rebuilds": list, "merged": dict, "pids": list,
         "prefix_cache": (dict, type(None)), "heap_trims": dict,
         "learned": dict}
ENGINE = {"actor": str, "startup_s": NUM, "startup_attempts": list, "kv_cache_tokens": (int, type(None)),
          "max_model_len": int, "max_num_seqs": int}
STEP = {"t", "budget", "rows", "pressure", "throughput", "action", "reason", "actor"}


def check(record: dict, expected: dict, where: str) -> None:
    assert set(record) == set(expected), f"{where}: keys differ: {set(record) ^ set(expected)}"
    for key, kind in expected.items():
        assert isinstance(record[key], kind), f"{where}.{key} is {type(record[key]).__name__}"


def test_report_keys_and_types_are_pinned(job_run):
    r = job_run.report
    check(r, TOP, "report")
    check(r["batching"], BATCHING, "batching")
    # Small rows in Ray's default object store: windows and blocks as configured (pipeline.run.plan.fit_to_store).
    blocks = r["batching"]["blocks"]
    assert blocks["fitted"] is False and blocks["block_mib"] is None and blocks["row_bytes"] > 0
    assert blocks["window_rows"] == 40 and blocks["prepare_batch_rows"] == 20 and blocks["object_store_mib"] > 0
    for name, b in r["batching"]["per_bucket"].items():
        check(b, PER_BUCKET, f"batching.per_bucket.{name}")
        for step in b["trajectory"]:
            assert STEP <= set(step), f"a trajectory step lacks {STEP - set(step)}"
    assert set(r["engine"]) == {"settings", "engines", "actors", "calls", "pool", "prefix_cache", "cpus", "server"}
    assert r["engine"]["server"] is None  # engines of our own: no live server (tests/integration/generation/test_server_backend.py)
    cpus = r["engine"]["cpus"]  # where the engines' workers run, and the run's other processes (or None)
    assert cpus is None or (set(cpus) == {"engine", "others", "processes"} and not set(cpus["engine"]) & set(cpus["others"]))
    prefix = r["engine"]["prefix_cache"]  # vLLM's, summed over the engines: prompt tokens looked up and found
    assert set(prefix) == {"queries", "hits", "hit_rate"} and 0 <= prefix["hits"] <= prefix["queries"]
    assert prefix["queries"] >= r["tokens"]["prompt"]
    assert set(r["engine"]["pool"]) == {"engines", "share_of_rows", "rows_by_bucket", "largest_bucket",
                                        "engines_serving_largest_bucket"}
    assert set(r["timeline"]) == {"first_row_prepared_at", "last_row_prepared_at", "first_part_written_at",
                                  "last_part_written_at"} and all(isinstance(v, NUM) for v in r["timeline"].values())
    assert set(r["checks"]) >= {"duplicate_ids"} and isinstance(r["checks"]["duplicate_ids"]["seconds"], NUM)
    for c in r["engine_calls"]:
        check(c, CALL, f"engine_calls[{c['call']}]")
    for a in r["engine"]["actors"]:
        check(a, ACTOR, "engine.actors[]")
        assert set(a["heap_trims"]) == {"count", "returned_mib"} and a["heap_trims"]["count"] >= 0
    for e in r["engine"]["engines"]:
        check(e, ENGINE, "engine.engines[]")
    assert set(r["tokens"]) == {"prompt", "output", "generated"}
    assert set(r["result_key"]) == {"version", "model_digest", "base", "off", "input_version", "input_base"}
    # The nightly job reuses its own earlier partitions; the shared run's output has none.
    check(r["reuse"], REUSE, "reuse")
    assert r["reuse"]["sources"] == [] and r["reuse"]["rows_reused"] == 0 and r["reuse"]["lookup"] is None
    assert set(r["publish"]) == {"replaces_run", "replaces_files", "backup", "mode"}
    assert set(r["input_files"]) == {"format", "read", "skipped"}
    assert set(r["length"]) == {"policy", "max_input_tokens", "keep", "outlier_percentile", "chunk_overlap",
                                "percentile_cap_tokens", "truncated", "chunked"}
    for b in r["buckets"].values():
        assert set(b) == {"rows", "prompt_tokens", "generated"} and set(b["prompt_tokens"]) == {"min", "median", "max"}
        assert set(b["generated"]) == {"rows", "cut_at_limit", "empty_output", "copies_opening", "median_output_tokens"}
