"""From one RunConfig to each stage's own small, frozen settings.

The stages never see the whole config: the prepare stage gets PrepareSettings,
the generate stage GenerateSettings, and the generation core plain Sampling
and VLLMSettings. This module is the one place that knows both sides, so a
config key that moves changes here and in the config models, nowhere else.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from pipeline.config import EngineConfig, ProfileConfig, RunConfig, SamplingConfig
from pipeline.generation.engine import Sampling
from pipeline.generation.hf import HFSettings
from pipeline.generation.merge import sampling_key
from pipeline.generation.result_key import INPUT_KEY_VERSION, KEY_VERSION, input_key_base, run_key_base
from pipeline.generation.server import ServerSettings
from pipeline.generation.vllm import VLLMSettings
from pipeline.models.digest import model_digest
from pipeline.observe.machine import cpu_flags
from pipeline.stages.generate import AnnotationSettings, GenerateSettings
from pipeline.stages.prepare import PrepareSettings, Prompt


# Where a CPU computes bfloat16 natively; elsewhere torch emulates it.
NATIVE_BF16 = ("avx512_bf16", "amx_bf16")


def resolve_dtype(config: RunConfig, flags: list[str] | None = None) -> tuple[RunConfig, dict[str, str] | None]:
    """`engine.dtype: auto` on a CPU, made concrete: bfloat16 where the CPU computes it
    natively (avx512_bf16 or amx_bf16), float32 where torch would emulate it (on this
    project's avx2-only machines the engine ran 2.6x faster in float32 on the tiny model,
    4.9x on SmolLM2-135M). On a GPU, auto stays vLLM's (the model's own dtype). Returns
    the config with the dtype set, and what was decided, for the report (None: nothing was)."""
    engine = config.profile.engine
    if engine.dtype != "auto" or config.profile.hardware.accelerator != "cpu":
        return config, None
    flags = cpu_flags() if flags is None else flags
    native = [f for f in NATIVE_BF16 if f in flags]
    dtype = "bfloat16" if native else "float32"
    why = (f"the CPU has {', '.join(native)}" if native
           else f"the CPU has none of {', '.join(NATIVE_BF16)}: bfloat16 would be emulated")
    profile = config.profile.model_copy(update={"engine": engine.model_copy(update={"dtype": dtype})})
    return config.model_copy(update={"profile": profile}), {"requested": "auto", "dtype": dtype, "why": why}


def engine_kwargs(model: str, engine: EngineConfig, seed: int | None) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM`, from the profile's engine section."""
    kwargs: dict[str, Any] = {
        "model": model,
        "dtype": engine.dtype,
        "gpu_memory_utilization": engine.gpu_memory_utilization,
        "enforce_eager": engine.enforce_eager,
        # Stats on: they are how the engine reports KV-cache use and preemptions.
        "disable_log_stats": False,
        "seed": seed if seed is not None else 0,
    }
    optional = {
        "max_model_len": engine.max_model_len,
        "num_gpu_blocks_override": engine.num_gpu_blocks_override,
        "max_num_seqs": engine.max_num_seqs,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    if engine.tensor_parallel_size > 1:
        # Inside its Ray actor, the engine's workers are processes on the GPUs the
        # actor reserved (one bundle, one node), not Ray tasks of their own.
        kwargs["tensor_parallel_size"] = engine.tensor_parallel_size
        kwargs["distributed_executor_backend"] = "mp"
    # JSON without free whitespace: a weak model otherwise pads it with newlines
    # until max tokens cut it off (seen with the tiny model: 700 tokens of "\n").
    kwargs["structured_outputs_config"] = {
        "backend": engine.structured_outputs_backend, "disable_any_whitespace": True,
    }
    kwargs.update(engine.extra)
    return kwargs


CORE_DRILLS = ("engine_oom_death", "engine_crash")  # debug faults that kill the engine core's process


def _local_cpu_vllm(profile: ProfileConfig) -> bool:
    """vLLM's CPU backend on a local Ray, with `hardware.isolate_engine_cpus` on: where the
    run keeps its engines' cores apart (`pipeline/run/affinity.py`)."""
    hw = profile.hardware
    return (hw.accelerator == "cpu" and not hw.ray_address and hw.isolate_engine_cpus
            and profile.engine.backend == "vllm")


def engine_cpus(profile: ProfileConfig) -> tuple[int, ...] | None:
    """The CPUs among which an engine in its actor's process binds itself
    (`VLLMSettings.bind_cpus`): every CPU this process may use. The engine takes all but
    one of them, the first that no other engine of the machine holds, and the run's other
    processes keep the rest, as vLLM's automatic binding keeps the last CPU for all but
    its worker. Only for one engine of a local CPU run with `hardware.isolate_engine_cpus`
    on (several of one run would share those cores: they stay unbound), and only with a
    CPU to spare."""
    if not (_local_cpu_vllm(profile) and profile.hardware.num_engines == 1 and engine_in_process(profile)):
        return None
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return tuple(cpus) if len(cpus) >= 2 else None


def keeps_engine_cpus_apart(profile: ProfileConfig) -> bool:
    """Whether the driver keeps the run's other processes off its engines' cores
    (`EngineCpuGuard`): an engine core apart has workers vLLM binds to cores of their own;
    one in its actor's process binds that process where it is the run's one engine
    (`engine_cpus`). Several in their actors' processes are bound to nothing."""
    return _local_cpu_vllm(profile) and (not engine_in_process(profile) or engine_cpus(profile) is not None)


def engine_in_process(profile: ProfileConfig) -> bool:
    """Whether vLLM's engine core runs in the actor's process (`engine.in_process`)."""
    engine = profile.engine
    if engine.tensor_parallel_size > 1 or any(kind in CORE_DRILLS for _, kind in profile.debug.faults()):
        return False
    return engine.in_process if engine.in_process is not None else profile.hardware.accelerator == "cpu"


def vllm_settings(model: str, engine: EngineConfig, seed: int | None, cpu_context: int | None = None) -> VLLMSettings:
    """`cpu_context`: on the CPU backend, the context the engine runs with; its KV cache is
    then no larger than it can ever fill (`cpu_kv_cache_bytes`)."""
    kwargs = engine_kwargs(model, engine, seed)
    if cpu_context is not None and (size := cpu_kv_cache_bytes(model, engine, cpu_context)) is not None:
        kwargs["kv_cache_memory_bytes"] = size
    return VLLMSettings(kwargs, startup_backoff=engine.restart.startup_backoff,
                        min_gpu_memory_utilization=engine.restart.min_gpu_memory_utilization,
                        cpu_kvcache_space_gib=engine.cpu_kvcache_space_gib)


# vLLM's own default for `LLM` on the CPU backend (`EngineArgs`, one worker).
VLLM_CPU_MAX_NUM_SEQS = 256
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}


def kv_bytes_per_token(model: str, dtype: str) -> int | None:
    """A decoder's KV cache per token, from its config.json: keys and values of every
    layer (layers x 2 x KV heads x head size x the dtype's bytes). None where the
    folder's config does not say (a GGUF file, an unknown dtype)."""
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text())
        config = config.get("text_config", config)
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        layers = int(config["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if dtype == "auto":
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "")
    size = DTYPE_BYTES.get(dtype)
    return layers * 2 * kv_heads * head_dim * size if size else None


def cpu_kv_cache_bytes(model: str, engine: EngineConfig, context: int) -> int | None:
    """The KV cache an engine on the CPU backend could ever fill: `max_num_seqs` sequences
    at the whole context each. vLLM's CPU backend otherwise takes `gpu_memory_utilization`
    of the node's memory and writes every byte of it at start-up: for the tiny model 4 GiB
    (8.3M tokens, where 256 x 16,384 is 4.2M), 6.5 s of a 9.3 s build on this project's
    2-core machines; at its 2 GiB the build took 3.2 s (bench/README). None, and vLLM's
    own sizing, where the profile sizes the cache itself, the model's config does not
    give its size per token, or the share is smaller anyway."""
    if (engine.cpu_kvcache_space_gib is not None or engine.num_gpu_blocks_override is not None
            or "kv_cache_memory_bytes" in engine.extra):
        return None
    per_token = kv_bytes_per_token(model, engine.dtype)
    if per_token is None:
        return None
    # Whole blocks: vLLM cuts the bytes into blocks of up to 1,024 tokens, and one sequence
    # of the whole context must fit whatever is left over.
    size = ((engine.max_num_seqs or VLLM_CPU_MAX_NUM_SEQS) + 1) * -(-context // 1024) * 1024 * per_token
    return size if size < engine.gpu_memory_utilization * node_memory_bytes() else None


def node_memory_bytes() -> int:
    """NUMA node 0's memory, which the CPU backend's `gpu_memory_utilization` is a share of
    (the machine's where there are no nodes to read)."""
    try:
        for line in Path("/sys/devices/system/node/node0/meminfo").read_text().splitlines():
            if "MemTotal:" in line:
                return int(line.split()[-2]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def hf_settings(model: str, engine: EngineConfig, seed: int | None) -> HFSettings:
    """The transformers backend's settings, from the same engine section."""
    return HFSettings(model=model, dtype=engine.dtype, max_model_len=engine.max_model_len,
                      max_num_seqs=engine.max_num_seqs or 256, memory_budget_gib=engine.memory_budget_gib, seed=seed)


def server_settings(model: str, engine: EngineConfig) -> ServerSettings | None:
    """The server backend's settings (None for the others); `model`: our tokenizer's folder."""
    s = engine.server
    if engine.backend != "server" or s is None:
        return None
    return ServerSettings(url=s.url, model=s.model, max_in_flight=s.max_in_flight,
                          start_in_flight=s.start_in_flight if s.feedback else s.max_in_flight, feedback=s.feedback,
                          ttft_slo_ms=s.ttft_slo_ms, priority=s.priority, unavailable_s=s.unavailable_s,
                          request_timeout_s=s.request_timeout_s, max_retries=s.max_retries,
                          metrics_interval_s=s.metrics_interval_s, probe_every_s=s.probe_every_s,
                          online_priority=s.online_priority, api_key_env=s.api_key_env, ca_file=s.ca_file,
                          tokenizer_path=model, max_model_len=engine.max_model_len)


def engine_description(model: str, engine: EngineConfig, seed: int | None) -> dict[str, Any]:
    """The engine's settings as the report gives them."""
    server = server_settings(model, engine)
    if server is not None:
        return {"backend": "server", **asdict(server)}
    if engine.backend == "transformers":
        return {"backend": "transformers", **asdict(hf_settings(model, engine, seed))}
    return engine_kwargs(model, engine, seed)


def sampling_of(sampling: SamplingConfig, max_new_tokens: int | None = None,
                json_schema: dict[str, Any] | None = None) -> Sampling:
    """The job's sampling as the generation core takes it."""
    return Sampling(max_new_tokens or sampling.max_new_tokens, sampling.temperature, sampling.top_p,
                    sampling.seed, json_schema)


def prepare_settings(config: RunConfig, model_path: str, max_model_len: int,
                     cap_tokens: int | None = None) -> PrepareSettings:
    job = config.job
    annotations = job.annotations
    return PrepareSettings(
        model_path=model_path,
        max_model_len=max_model_len,
        prompt=Prompt(job.prompt.template, job.prompt.system),
        max_new_tokens=job.sampling.max_new_tokens,
        id_column=job.input.id_column,
        text_column=job.input.text_column,
        null_as=job.input.null_as,
        length=job.length,
        bucket_boundaries=tuple(config.profile.bucketing.boundaries),
        passages=job.passages,
        annotation_prompt=None if annotations is None else Prompt(annotations.prompt.template,
                                                                 annotations.prompt.system),
        annotation_max_new_tokens=annotations.max_new_tokens if annotations else 0,
        cap_tokens=cap_tokens,
        delay_s=config.profile.debug.slow_prepare_s,
    )


def generate_settings(config: RunConfig, prepare: PrepareSettings, run_id: str,
                      quiet_warnings: bool = True) -> GenerateSettings:
    """The generate stage's settings; `prepare` is what the prepare stage ran with (map-reduce
    renders its prompts the same way), and names the model. `quiet_warnings`: each vLLM
    warning once per run (off with --verbose, to see every engine's)."""
    job, profile = config.job, config.profile
    batching, annotations = profile.batching, job.annotations
    return GenerateSettings(
        run_id=run_id,
        model_name=profile.model.name,
        engine=replace(vllm_settings(prepare.model_path, profile.engine, job.sampling.seed,
                                     prepare.max_model_len if profile.hardware.accelerator == "cpu" else None),
                       step_timeline=profile.debug.step_timeline, in_process=engine_in_process(profile),
                       bind_cpus=engine_cpus(profile)),
        backend=profile.engine.backend,
        hf=hf_settings(prepare.model_path, profile.engine, job.sampling.seed),
        server=server_settings(prepare.model_path, profile.engine),
        sampling=sampling_of(job.sampling),
        prepare=prepare,
        policy=batching.policy,
        memory_target=batching.memory_target,
        feed=profile.feed(),
        mix_span=float(batching.concurrent_batches),
        grouping=profile.bucketing.grouping,
        merge_identical_prompts=batching.merge_identical_prompts,
        annotations=None if annotations is None else AnnotationSettings(
            annotations.json_schema, annotations.max_new_tokens, annotations.retry_max_new_tokens,
            annotations.column_prefix),
        chunk_overlap=job.length.chunk_overlap,
        inject_faults=profile.debug.faults(),
        stall_timeout_s=profile.engine.stall_timeout_s,
        heap_trim_s=profile.engine.heap_trim_s,
        fail_on_start=profile.debug.engine_fails_on_start,
        quiet_warnings=quiet_warnings,
    )


def result_keys(config: RunConfig, prepare: PrepareSettings) -> dict[str, Any]:
    """The run's share of every row's result key (`pipeline.generation.result_key`), for
    the generate stage and the report: {version, model_digest, base, off, input_version,
    input_base}; `base` None and `off` saying why where the run's results cannot be keyed;
    `input_base` the share of every row's input key (None where `base` is). The model is digested by
    content (`pipeline.models.digest`: once per folder, then kept with its files' sizes
    and times)."""
    sampling = sampling_of(config.job.sampling)
    out: dict[str, Any] = {"version": KEY_VERSION, "model_digest": None, "base": None, "off": None,
                           "input_version": INPUT_KEY_VERSION, "input_base": None}
    if not Path(prepare.model_path).exists():
        out["off"] = f"model {config.profile.model.name!r} is a hub id: no files to key its results on"
        return out
    if sampling_key(sampling) is None:
        out["off"] = "sampling with a temperature and no seed: every result is its own"
        return out
    job, engine = config.job, config.profile.engine
    served = engine.server
    if engine.backend == "server" and served is not None and served.revision is None:
        out["off"] = (f"the server's weights can't be read from here: set engine.server.revision (what "
                      f"{served.url} runs) to key its results")
        return out
    out["model_digest"] = (model_digest(prepare.model_path) if served is None
                           else f"server:{served.model}@{served.revision}")
    out["base"] = run_key_base(
        out["model_digest"], sampling,
        {"backend": engine.backend, "dtype": engine.dtype, "max_model_len": prepare.max_model_len,
         "structured_outputs_backend": engine.structured_outputs_backend, "extra": engine.extra},
        {"prompt": prepare.prompt, "annotation_prompt": prepare.annotation_prompt, "annotations": job.annotations,
         "annotation_max_new_tokens": prepare.annotation_max_new_tokens, "length": job.length,
         "passages": job.passages, "null_as": prepare.null_as})
    out["input_base"] = input_key_base(out["base"], prepare.prompt_parts())
    return out


# Of the object store: the most that one window of rows (a block of the grouping step's
# input) may hold, and the most one block may. Ray Data budgets the store in bytes among
# its operators, about evenly, while windows and batches are counted in rows: rows of 10 KB
# in 4,096-row windows left a 100 MiB store's budgets full, and every stage waited for its
# output to drain (bench/README.md, `make bench-scale`: 297 s, the engine busy 31 s of them).
STORE_SHARE = 1 / 20


@dataclass(frozen=True)
class StoreFit:
    """Row counts that fit the object store: `window_rows` and `prepare_batch_rows` at
    most the configured ones, and `block_bytes` for Ray Data's target block size (None:
    its own default stands). `fitted`: whether any was lowered."""

    window_rows: int
    prepare_batch_rows: int
    block_bytes: int | None
    row_bytes: int | None
    store_bytes: int | None

    @property
    def fitted(self) -> bool:
        return self.block_bytes is not None

    def applied_to(self, config: RunConfig) -> RunConfig:
        """`config` with this fit's window and tokenizing batch (itself where nothing was cut)."""
        if not self.fitted:
            return config
        profile = config.profile
        bucketing = profile.bucketing.model_copy(update={"window_rows": self.window_rows})
        batching = profile.batching.model_copy(update={"prepare_batch_rows": self.prepare_batch_rows})
        return config.model_copy(update={"profile": profile.model_copy(update={"bucketing": bucketing,
                                                                               "batching": batching})})

    def describe(self) -> dict[str, Any]:
        mib = lambda b: None if b is None else round(b / 2**20, 1)  # noqa: E731
        return {"row_bytes": self.row_bytes, "object_store_mib": mib(self.store_bytes), "fitted": self.fitted,
                "window_rows": self.window_rows, "prepare_batch_rows": self.prepare_batch_rows,
                "block_mib": mib(self.block_bytes)}


def fit_to_store(window_rows: int, prepare_batch_rows: int, generate_batch_rows: int,
                 row_bytes: int | None, store_bytes: int | None, ray_block_bytes: int) -> StoreFit:
    """Windows and tokenizing batches cut to STORE_SHARE of the object store, where rows are
    large enough to need it; a window never holds less than one engine block's rows.
    `ray_block_bytes`: Ray Data's target block size now (lowered to the same share)."""
    keep = StoreFit(window_rows, prepare_batch_rows, None, row_bytes, store_bytes)
    if not row_bytes or not store_bytes:
        return keep
    share = int(store_bytes * STORE_SHARE)
    if window_rows * row_bytes <= share and ray_block_bytes <= share:
        return keep
    window = min(window_rows, max(generate_batch_rows, share // row_bytes))
    return StoreFit(window, min(prepare_batch_rows, window), min(ray_block_bytes, share), row_bytes, store_bytes)
