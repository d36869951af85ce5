"""From a config to the engine's settings: the CPU dtype rule."""

from pipeline.config import load_run_config
from pipeline.run.plan import STORE_SHARE, engine_kwargs, fit_to_store, resolve_dtype

from tests.helpers import REPO

JOB = REPO / "jobs" / "nightly_summarize.yaml"
LOCAL = REPO / "conf" / "local.yaml"
GPU = REPO / "conf" / "gpu.yaml"


def test_auto_on_a_cpu_is_bfloat16_only_where_the_cpu_computes_it_natively():
    config = load_run_config(JOB, LOCAL)
    assert config.profile.engine.dtype == "auto"
    for flags, dtype in ((["avx2"], "float32"), (["avx2", "avx512f"], "float32"),
                         (["avx512f", "avx512_bf16"], "bfloat16"), (["amx_bf16", "amx_tile"], "bfloat16")):
        resolved, decided = resolve_dtype(config, flags)
        assert resolved.profile.engine.dtype == dtype and decided["dtype"] == dtype, flags
        assert engine_kwargs("m", resolved.profile.engine, 0)["dtype"] == dtype
    _, decided = resolve_dtype(config, ["avx2"])
    assert decided["requested"] == "auto" and "emulated" in decided["why"]
    assert config.profile.engine.dtype == "auto"  # the loaded config itself is left as it was


def test_an_explicit_dtype_or_a_gpu_is_left_as_asked():
    pinned = load_run_config(JOB, LOCAL, ["engine.dtype=bfloat16"])
    assert resolve_dtype(pinned, ["avx2"]) == (pinned, None)
    gpu = load_run_config(JOB, GPU, ["engine.dtype=auto"])
    assert resolve_dtype(gpu, ["avx2"]) == (gpu, None)


def test_the_engine_core_runs_in_the_actors_process_on_a_cpu_and_apart_on_a_gpu():
    from pipeline.run.plan import engine_in_process, generate_settings, prepare_settings

    assert engine_in_process(load_run_config(JOB, LOCAL).profile)
    assert not engine_in_process(load_run_config(JOB, GPU).profile)
    assert not engine_in_process(load_run_config(JOB, LOCAL, ["engine.in_process=false"]).profile)
    assert engine_in_process(load_run_config(JOB, GPU, ["engine.in_process=true"]).profile)
    # Several devices per engine: its workers are processes of their own whatever is asked.
    assert not engine_in_process(load_run_config(JOB, GPU, ["engine.in_process=true",
                                                          "engine.tensor_parallel_size=2"]).profile)
    # A drill that kills the core needs a core process to kill; an OOM raised here does not.
    for kind, apart in (("engine_oom_death", True), ("engine_crash", True), ("oom", False)):
        drill = load_run_config(JOB, LOCAL, ["debug.inject_oom_at_batch=2", f"debug.inject_oom_kind={kind}"])
        assert engine_in_process(drill.profile) is not apart, kind
    config = load_run_config(JOB, LOCAL)
    settings = generate_settings(config, prepare_settings(config, "m", 2048), "run")
    assert settings.engine.in_process


def test_one_engine_in_its_actors_process_binds_itself_among_the_runs_cpus(monkeypatch):
    """As vLLM binds a worker of its own, the engine takes all but one of the CPUs the run
    may use (`claim_cpus`), and the run's other processes keep the rest (bench/README,
    *Engine steps*). Not with several engines in the run, a cluster, a GPU, the core
    apart, or the guard off."""
    import os

    from pipeline.run import plan

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    local = load_run_config(JOB, LOCAL)
    assert plan.engine_cpus(local.profile) == (0, 1, 2, 3)
    settings = plan.generate_settings(local, plan.prepare_settings(local, "m", 2048), "run")
    assert settings.engine.bind_cpus == (0, 1, 2, 3) and settings.engine.in_process
    for sets in (["hardware.num_engines=2"], ["hardware.ray_address=auto"], ["engine.in_process=false"],
                 ["hardware.isolate_engine_cpus=false"]):
        assert plan.engine_cpus(load_run_config(JOB, LOCAL, sets).profile) is None, sets
    assert plan.engine_cpus(load_run_config(JOB, GPU, ["engine.in_process=true"]).profile) is None
    # The driver keeps the others off the engine's cores where it is bound, or where the core runs apart.
    assert plan.keeps_engine_cpus_apart(local.profile)
    assert plan.keeps_engine_cpus_apart(load_run_config(JOB, LOCAL, ["engine.in_process=false"]).profile)
    assert not plan.keeps_engine_cpus_apart(load_run_config(JOB, LOCAL, ["hardware.num_engines=2"]).profile)
    assert not plan.keeps_engine_cpus_apart(load_run_config(JOB, LOCAL, ["hardware.isolate_engine_cpus=false"]).profile)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert plan.engine_cpus(local.profile) is None  # one CPU: none to spare


MiB = 2**20


def test_windows_and_blocks_are_cut_to_the_object_store_only_where_rows_are_large():
    # Small rows in a large store: every setting stands, and Ray Data's block size too.
    fit = fit_to_store(4096, 256, 128, row_bytes=2_000, store_bytes=7_000 * MiB, ray_block_bytes=128 * MiB)
    assert not fit.fitted and (fit.window_rows, fit.prepare_batch_rows, fit.block_bytes) == (4096, 256, None)
    # Unknown sizes (a streamed hub dataset): nothing to fit against.
    assert not fit_to_store(4096, 256, 128, None, 100 * MiB, 128 * MiB).fitted
    # 10 KB rows in a 100 MiB store (make bench-scale): a window holds a twentieth of it.
    fit = fit_to_store(4096, 500, 128, row_bytes=10_000, store_bytes=100 * MiB, ray_block_bytes=128 * MiB)
    share = int(100 * MiB * STORE_SHARE)
    assert fit.fitted and fit.window_rows == share // 10_000 == 524
    assert fit.prepare_batch_rows == 500 and fit.block_bytes == share
    assert fit.describe() == {"row_bytes": 10_000, "object_store_mib": 100.0, "fitted": True, "window_rows": 524,
                              "prepare_batch_rows": 500, "block_mib": 5.0}
    # Huge rows: a window still holds one engine block, and a tokenizing batch no more than a window.
    fit = fit_to_store(4096, 500, 128, row_bytes=1_000_000, store_bytes=100 * MiB, ray_block_bytes=128 * MiB)
    assert (fit.window_rows, fit.prepare_batch_rows) == (128, 128)
    # Ray Data's block size alone too large for the store: only it is lowered.
    fit = fit_to_store(64, 32, 16, row_bytes=100, store_bytes=100 * MiB, ray_block_bytes=128 * MiB)
    assert (fit.window_rows, fit.prepare_batch_rows, fit.block_bytes) == (64, 32, share)


def test_a_fit_applied_to_a_config_changes_only_its_window_and_tokenizing_batch():
    config = load_run_config(JOB, LOCAL)
    kept = fit_to_store(4096, 256, 128, row_bytes=2_000, store_bytes=7_000 * MiB, ray_block_bytes=128 * MiB)
    assert kept.applied_to(config) is config
    fit = fit_to_store(4096, 500, 128, row_bytes=10_000, store_bytes=100 * MiB, ray_block_bytes=128 * MiB)
    applied = fit.applied_to(config)
    assert applied.profile.bucketing.window_rows == 524 and applied.profile.batching.prepare_batch_rows == 500
    assert applied.profile.engine == config.profile.engine and applied.job == config.job
    assert config.profile.bucketing.window_rows == 4096  # the loaded config itself is left as it was


def write_config(folder, **fields):
    import json

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"num_attention_heads": 2, "num_hidden_layers": 2,
                                                    "hidden_size": 128, "dtype": "bfloat16", **fields}))
    return str(folder)


def test_a_decoders_kv_cache_per_token_comes_from_its_config(tmp_path):
    from pipeline.run.plan import kv_bytes_per_token

    tiny = write_config(tmp_path / "tiny", num_key_value_heads=1, head_dim=64)
    assert kv_bytes_per_token(tiny, "bfloat16") == 2 * 2 * 1 * 64 * 2 == kv_bytes_per_token(tiny, "auto")
    assert kv_bytes_per_token(tiny, "float32") == 1024
    # No KV heads: as many as attention heads; no head size: the hidden size over them.
    assert kv_bytes_per_token(write_config(tmp_path / "mha"), "bfloat16") == 2 * 2 * 2 * 64 * 2
    assert kv_bytes_per_token(str(tmp_path / "none"), "bfloat16") is None  # a GGUF file, a missing folder
    assert kv_bytes_per_token(tiny, "int4") is None


def test_on_a_cpu_the_kv_cache_is_no_larger_than_the_engine_can_fill(tmp_path, monkeypatch):
    """vLLM's CPU backend would take its share of the node's memory and write all of it at
    start-up; a run asks for max_num_seqs sequences at the whole context, where that is less."""
    from pipeline.config import EngineConfig
    from pipeline.run import plan

    monkeypatch.setattr(plan, "node_memory_bytes", lambda: 24 * 2**30)
    tiny = write_config(tmp_path / "tiny", num_key_value_heads=1, head_dim=64)  # 512 bytes a token
    engine = EngineConfig(gpu_memory_utilization=0.2, dtype="bfloat16")
    assert plan.cpu_kv_cache_bytes(tiny, engine, 16384) == 257 * 16384 * 512  # 2 GiB, under 0.2 x 24
    settings = plan.vllm_settings(tiny, engine, 0, cpu_context=16384)
    assert settings.kwargs["kv_cache_memory_bytes"] == 257 * 16384 * 512
    assert "kv_cache_memory_bytes" not in plan.vllm_settings(tiny, engine, 0).kwargs  # not on a GPU
    # In whole blocks of up to 1,024 tokens, with one sequence more than the engine runs.
    assert plan.cpu_kv_cache_bytes(tiny, engine.model_copy(update={"max_num_seqs": 1}), 1000) == 2 * 1024 * 512
    # The share is less anyway, or the profile sizes the cache itself: vLLM's own sizing.
    assert plan.cpu_kv_cache_bytes(tiny, engine, 65536) is None  # 8 GiB > 4.8 GiB
    for sized in ({"cpu_kvcache_space_gib": 1}, {"num_gpu_blocks_override": 100},
                  {"extra": {"kv_cache_memory_bytes": 2**30}}):
        assert plan.cpu_kv_cache_bytes(tiny, engine.model_copy(update=sized), 16384) is None, sized


def test_a_cpu_runs_engine_gets_the_sized_kv_cache_and_a_gpu_runs_does_not(tiny_model):
    from pipeline.run.plan import generate_settings, prepare_settings

    for profile, sized in ((LOCAL, True), (GPU, False)):
        config = load_run_config(JOB, profile, [f"model.name={tiny_model}", "engine.max_model_len=4096",
                                                "engine.dtype=bfloat16", "engine.gpu_memory_utilization=0.2"])
        prepare = prepare_settings(config, str(tiny_model), 4096)
        kwargs = generate_settings(config, prepare, "run").engine.kwargs
        assert ("kv_cache_memory_bytes" in kwargs) == sized, profile
        if sized:
            assert kwargs["kv_cache_memory_bytes"] == 257 * 4096 * 512


def test_the_engine_is_fed_mixed_over_the_blocks_it_serves_at_once_and_transformers_drains():
    """The job's default feed is `mixed`, its rows spread over as many blocks as an engine
    actor serves at once; the transformers backend's static batches always drain."""
    from pipeline.run.plan import generate_settings, prepare_settings

    config = load_run_config(JOB, LOCAL, ["batching.concurrent_batches=4"])
    settings = generate_settings(config, prepare_settings(config, "m", 2048), "run")
    assert settings.feed == "mixed" and settings.mix_span == 4.0
    assert load_run_config(JOB, LOCAL, ["engine.backend=transformers", "engine.memory_budget_gib=2"]).profile.feed() == "drain"


def test_a_windows_blocks_come_ascending_when_fed_mixed_and_interleaved_when_fed_continuous():
    """`bucketing.window_order: auto` (the default): the feeder fed `mixed` spreads a long
    bucket's rows itself, so the window keeps its buckets short to long; fed `continuous`,
    the window interleaves them. Asked for, either holds, but static batches keep ascending."""
    def order(*sets: str) -> str:
        return load_run_config(JOB, LOCAL, list(sets)).profile.window_order()

    assert order() == "ascending"
    assert order("batching.feed=continuous") == "interleaved"
    assert order("bucketing.window_order=interleaved") == "interleaved"
    assert order("batching.feed=continuous", "bucketing.window_order=ascending") == "ascending"
    assert order("engine.backend=transformers", "engine.memory_budget_gib=2",
                 "bucketing.window_order=interleaved") == "ascending"
