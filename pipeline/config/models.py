"""The config models: a job (what to produce) and a profile (where and how it runs).

Every field carries a description and its bounds; the models check
themselves. Loading files and `--set` overrides, and naming the file and the
dotted field in errors, is `pipeline.config.load`.
"""

from __future__ import annotations

import string
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipeline.text.bucketing import DEFAULT_BOUNDARIES


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- the job: what to produce -------------------------------------------------


class InputConfig(_Section):
    path: str = Field(
        description="Parquet file, folder or glob; local path or URI (s3://, gs://); JSON, JSONL or CSV "
        "files; a `datasets` save_to_disk folder; or a Hugging Face hub dataset name. May hold {date}."
    )
    format: Literal["auto", "parquet", "json", "csv", "saved", "hub"] = Field(
        "auto",
        description="auto: by extension (.json/.jsonl, .csv), a save_to_disk folder, a hub name "
        "(owner/name that is not a local path), else Parquet. json, csv, saved and hub go through `datasets`.",
    )
    split: str = Field("train", description="`datasets` sources: the split to read.")
    subset: str | None = Field(None, description="Hub datasets: the configuration (subset) name.")
    id_column: str = Field("id", description="Column holding each row's unique id.")
    text_column: str = Field("text", description="Column holding the document text.")
    on_bad_file: Literal["fail", "skip"] = Field(
        "fail", description="A file that is unreadable or lacks the columns: stop the run, or skip it and report it."
    )
    null_as: str = Field(
        "", description="What a null column or struct field that a template names renders as (never `None`)."
    )


class OutputConfig(_Section):
    path: str = Field(description="Folder the Parquet parts and _report.json are written to.")
    backup_existing: bool = Field(
        False,
        description="An output folder holding files this pipeline did not write (or another job's output): "
        "move it aside to <path>.backup-<UTC time> when the run publishes, instead of refusing to run.",
    )


def parse_template(template: str) -> list[tuple[str, str | None]]:
    """The (column, struct field or None) each `{...}` of `template` names, in order.

    A field names a column (`{text}`) or one field of a struct column
    (`{meta.title}`), and nothing else: row data is text, so no indexing, no
    attribute chains, no conversions (`!r`) and no format specs (`:>9`, which
    would let a template, or a row, ask for gigabytes of padding). ValueError
    names the offending field.
    """
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"not a valid template ({e}); write a literal brace as {{{{ or }}}}") from None
    refs: list[tuple[str, str | None]] = []
    allowed = "a field is a column ({text}) or a field of a struct column ({meta.title})"
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        shown = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
        if name == "" or name.isdigit():
            raise ValueError("positional fields ({} or {0}) name no column; write {column}")
        if conversion:
            raise ValueError(f"{shown}: conversions (!{conversion}) are not allowed; {allowed}")
        if spec:
            raise ValueError(f"{shown}: format specs (:{spec}) are not allowed; {allowed}")
        if "[" in name or "]" in name:
            raise ValueError(f"{shown}: indexing is not allowed; {allowed}")
        parts = name.split(".")
        if len(parts) > 2 or any(not p or p.startswith("__") for p in parts):
            raise ValueError(f"{shown}: attribute access is not allowed; {allowed}")
        refs.append((parts[0], parts[1] if len(parts) == 2 else None))
    return refs


class PromptConfig(_Section):
    system: str | None = Field(
        None, description="System message, when the chat template takes one; literal text (no fields)."
    )
    template: str = Field(
        description="User message; `{column}` names a column of the row, e.g. `{text}`, and "
        "`{column.field}` a field of a struct column. Nothing else: no indexing, `!r` or `:spec`."
    )

    @field_validator("template")
    @classmethod
    def _parses(cls, template: str) -> str:
        parse_template(template)
        return template

    def fields(self) -> set[str]:
        """The row columns the template names (`{source}`, `{meta.title}` -> meta)."""
        return {column for column, _ in parse_template(self.template)}

    def references(self) -> set[str]:
        """What the template names, as written: `source`, `meta.title`."""
        return {column if f is None else f"{column}.{f}" for column, f in parse_template(self.template)}


class SamplingConfig(_Section):
    max_new_tokens: int = Field(128, gt=0, description="Most tokens generated per row.")
    temperature: float = Field(0.0, ge=0.0, description="0 is greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(0, description="Sampling seed; the same seed gives the same text.")


class LengthConfig(_Section):
    policy: Literal["truncate", "chunk", "skip"] = Field(
        "truncate",
        description="Text too long for the model: truncate it (flagged), summarize it in windows "
        "and then summarize the summaries (chunk), or give the row status skipped_too_long (skip).",
    )
    max_input_tokens: int | None = Field(
        None, gt=0, description="Cap on the text's tokens, below what the context allows."
    )
    keep: Literal["head", "head_tail"] = Field("head", description="What truncation keeps.")
    outlier_percentile: float | None = Field(
        None, gt=50.0, lt=100.0,
        description="Also cap at this percentile of the corpus's prompt lengths (e.g. 99.5).",
    )
    chunk_overlap: int = Field(64, ge=0, description="Tokens shared by consecutive windows.")


class PassagesConfig(_Section):
    """Knowledge-base ingestion: one output row per passage of each document."""

    tokens: int = Field(256, gt=0, description="Most tokens per passage (the model's tokenizer).")
    overlap: int = Field(32, ge=0, description="Tokens shared by consecutive passages.")

    @model_validator(mode="after")
    def _overlap_fits(self) -> PassagesConfig:
        if self.overlap >= self.tokens:
            raise ValueError(f"overlap ({self.overlap}) must be smaller than tokens ({self.tokens})")
        return self


class AnnotationsConfig(_Section):
    """Structured annotations: JSON generated against `schema`, written as typed columns."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    prompt: PromptConfig
    json_schema: dict[str, Any] = Field(
        alias="schema", description="JSON Schema of one object; each property becomes a typed column."
    )
    max_new_tokens: int = Field(512, gt=0, description="Room for the JSON.")
    retry_max_new_tokens: int | None = Field(
        None, gt=0, description="One retry with this much room when the JSON does not validate; default 2x."
    )
    column_prefix: str = Field("", description="Prefix for the annotation columns, e.g. `ann_`.")

    @field_validator("json_schema")
    @classmethod
    def _maps_to_arrow(cls, schema: dict[str, Any]) -> dict[str, Any]:
        from pipeline.text.annotations import check_schema

        check_schema(schema)
        return schema

    def fields(self) -> list[Any]:
        """The Arrow fields of the annotation columns, prefixed."""
        from pipeline.text.annotations import check_schema

        return [f.with_name(self.column_prefix + f.name) for f in check_schema(self.json_schema)]


class ReuseConfig(_Section):
    """Earlier outputs whose rows a run may take instead of generating them again: a row
    whose result key (`pipeline.generation.result_key`) an earlier `ok` row has."""

    paths: list[str] = Field(
        default_factory=list,
        description="Output folders of this pipeline to take results from: paths, globs (out/job/dt=*) or "
        "object-store prefixes. Each must hold its _report.json: another tool's Parquet there stops the run.",
    )
    lookback: int | None = Field(
        1, ge=1, description="Of the outputs `paths` names, the newest this many complete ones (by when their "
        "runs started); null: every one.",
    )
    enabled: bool = Field(True, description="Off: every row is generated (--no-reuse).")
    before_tokenizing: bool = Field(
        True, description="Look each row up by its input key before tokenizing it (a row found is never "
        "tokenized); off: by its result key only, after tokenizing, as `bench.nightly_ab` compares.",
    )


class JobConfig(_Section):
    name: str = Field(description="Job name, used in the report.")
    input: InputConfig
    output: OutputConfig
    prompt: PromptConfig
    sampling: SamplingConfig = SamplingConfig()
    length: LengthConfig = LengthConfig()
    passages: PassagesConfig | None = Field(
        None, description="Split each document into passages, one output row each (knowledge-base ingestion)."
    )
    annotations: AnnotationsConfig | None = None
    reuse: ReuseConfig = Field(
        ReuseConfig(), description="Take unchanged rows' results from earlier outputs (nightly runs).")

    @model_validator(mode="after")
    def _annotations_need_one_text(self) -> JobConfig:
        if self.annotations is not None and self.length.policy == "chunk":
            raise ValueError("length.policy chunk summarizes in pieces, which annotations cannot follow; "
                             "use passages (one annotated row per passage) or policy truncate")
        return self

    def template_fields(self) -> dict[str, set[str]]:
        """What each template names (`text`, `meta.title`), by the job key that holds the template."""
        out = {"prompt.template": self.prompt.references()}
        if self.annotations is not None:
            out["annotations.prompt.template"] = self.annotations.prompt.references()
        return out


# --- the profile: where and how it runs ---------------------------------------


class ModelConfig(_Section):
    name: str = Field(
        description="A local model folder (yours: only ever read, and checked before Ray starts), a Hugging Face "
        "model id, or `tiny` (`tiny-bart`): the offline tiny random model, built in the pipeline's cache "
        "($PIPELINE_CACHE_DIR) on first use. A folder named tiny is ./tiny."
    )
    tiny_model_seed: int | None = Field(
        None,
        description="The tiny model's seed (default 0). Set with a folder in `name` (the old spelling), the tiny "
        "model is built there only if the folder is absent, empty or already holds it; anything else stops the run.",
    )


class RestartConfig(_Section):
    """Not vLLM's: how this pipeline retries an engine start, or rebuilds a dead engine."""

    startup_backoff: float = Field(
        0.5, gt=0.0, lt=1.0,
        description="On a memory failure at start-up, retry with gpu_memory_utilization times this.",
    )
    min_gpu_memory_utilization: float = Field(
        0.05, gt=0.0, le=1.0, description="Give up on start-up retries below this memory fraction."
    )


class ServerConfig(_Section):
    """`engine.backend: server`: a live OpenAI-compatible server (vLLM's, say) that the job
    shares with online traffic. `model.name` is still the local folder whose tokenizer the
    prepare stage uses; `model` here is the name the server serves it under."""

    url: str = Field(description="The server's base URL, e.g. http://10.0.0.5:8000 (the /v1 paths are added).")
    model: str = Field(description="The model name the server serves (its /v1/models id).")
    api_key_env: str | None = Field(
        None, description="Environment variable holding the API key (sent as a bearer token); none: no key.")
    ca_file: str | None = Field(None, description="CA bundle to verify the server's TLS certificate with.")
    revision: str | None = Field(
        None, description="What the server runs, as you name it (an image tag, a model hash): results are "
        "keyed for reuse only with it, since the server's weights cannot be read from here.")
    max_in_flight: int = Field(64, gt=0, description="Hard cap on requests in flight, whatever the policy asks.")
    feedback: bool = Field(
        True, description="Size the requests in flight by the server's queue and latency (the in-flight policy). "
        "false: always max_in_flight, a fixed concurrency (as Ray Data LLM's HTTP processor), for comparison.")
    start_in_flight: int = Field(4, gt=0, description="Requests in flight to begin with; the policy grows it.")
    ttft_slo_ms: float = Field(
        2000.0, gt=0, description="Time-to-first-token target for the server's online requests: while others' "
        "traffic is there, the job backs off when a probe at the online priority waits longer for its first "
        "token (with no one else there: when ours do).")
    probe_every_s: float = Field(
        1.0, ge=0, description="Send a one-token probe at `online_priority` this often (and at every reading of "
        "/metrics while online traffic is there), to measure what an online request waits now (0: none; the "
        "job's own time to first token stands in).")
    online_priority: int = Field(0, description="The priority the server's online requests have (the probe's).")
    priority: int = Field(
        10, description="vLLM's request priority (under --scheduling-policy priority lower runs first; "
        "online requests default to 0, so a positive value yields to them).")
    unavailable_s: float = Field(
        120.0, gt=0, description="A server that serves nothing for this long (refused connections, 5xx, "
        "timeouts) stops the run, resumable.")
    request_timeout_s: float = Field(600.0, gt=0, description="One request's time limit, generation included.")
    max_retries: int = Field(8, ge=0, description="Retries of one request answered 429 or 503 before it is "
                             "that row's error.")
    metrics_interval_s: float = Field(0.5, gt=0, description="How often the server's /metrics are read.")


class EngineConfig(_Section):
    """The engine: vLLM's own settings (passed to `vllm.LLM`) and `restart`, or the
    transformers backend's (`backend`, `memory_budget_gib`, `dtype`, `max_num_seqs`),
    or a live server's (`server`)."""

    backend: Literal["vllm", "transformers", "server"] = Field(
        "vllm", description="vllm: continuous batching, preallocated KV cache (the default). transformers: "
        "static batches padded to their longest prompt, decoder-only or encoder-decoder models (BART, T5), "
        "batch size grown against real memory; no annotations. server: requests to a live OpenAI-compatible "
        "server (`engine.server`), as many in flight as its queue and latency allow.",
    )
    server: ServerConfig | None = Field(None, description="backend server: the server to send rows to.")
    memory_budget_gib: float | None = Field(
        None, gt=0, description="transformers backend: the memory one engine may use, weights included. "
        "Required on CPU (an out-of-memory there can't be caught, so batches grow against this); on a GPU "
        "default: the whole device.",
    )
    max_model_len: int | None = Field(None, gt=0, description="Context length; default: the model's.")
    dtype: str = Field(
        "auto", description="Weights and activations dtype (auto, bfloat16, float16, float32). auto: on a GPU the "
        "model's own; on a CPU bfloat16 where it is native (avx512_bf16, amx_bf16), else float32.",
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description="Share of device memory vLLM preallocates. On the CPU backend: share of NUMA node 0's memory.",
    )
    enforce_eager: bool = Field(False, description="Skip CUDA graph capture: faster start, slower steps.")
    num_gpu_blocks_override: int | None = Field(None, gt=0, description="Fix the KV cache size in blocks.")
    cpu_kvcache_space_gib: int | None = Field(
        None, gt=0, description="CPU backend: KV cache size in GiB (sets VLLM_CPU_KVCACHE_SPACE)."
    )
    max_num_seqs: int | None = Field(None, gt=0, description="Most requests the engine runs at once.")
    tensor_parallel_size: int = Field(
        1, gt=0,
        description="GPUs per engine for models too large for one: the engine actor reserves that many GPUs "
        "in one placement-group bundle on one node (untested on real GPUs here).",
    )
    max_num_batched_tokens: int | None = Field(None, gt=0)
    structured_outputs_backend: Literal["xgrammar", "guidance"] = Field(
        "xgrammar", description="Constrained decoding for annotations; any-whitespace JSON is disabled, "
        "so a weak model cannot pad the JSON with newlines until max tokens."
    )
    in_process: bool | None = Field(
        None, description="vLLM's engine core (its scheduler and, on one device, its worker) in the engine actor's "
        "own process rather than in processes of their own. None: in process on the CPU backend, where each "
        "process of its own starts by importing vLLM again (measured on 2 cores: the engine ready about 15 s "
        "sooner, the steps as fast); apart on a GPU, where the core schedules the next step while the actor reads "
        "the last. Drills that kill the core (debug faults engine_oom_death, engine_crash) always run it apart.",
    )
    extra: dict[str, Any] = Field(default_factory=dict, description="Passed to vllm.LLM as keyword arguments.")
    restart: RestartConfig = Field(default_factory=lambda: RestartConfig(),
                                   description="How an engine that runs out of memory is started again.")
    max_restarts: int = Field(
        3, ge=0,
        description="Times each engine actor is started afresh after its process or engine core died or "
        "stalled (and times in a row an engine may fail to start); past it the run stops, resumable.",
    )
    heap_trim_s: float | None = Field(
        30.0, gt=0,
        description="Seconds between giving the engine actor's freed heap back to the operating system "
        "(glibc's malloc_trim, after a block); null: never. Its heap in use stays flat as rows stream by, but "
        "glibc keeps what the feeder and vLLM free, and without it the actor's memory climbed with the rows "
        "(bench/README.md, a corpus larger than the object store).",
    )
    stall_timeout_s: float = Field(
        600.0, gt=0,
        description="An engine step that has not returned after this long is a hung engine: its core is "
        "killed and the actor started afresh (counts against max_restarts). Generous: the longest real "
        "step (a full batch of long prompts on a slow GPU) takes seconds.",
    )


class HardwareConfig(_Section):
    accelerator: Literal["cpu", "gpu"] = Field(description="gpu: one engine per GPU; cpu: vLLM's CPU backend.")
    num_engines: int = Field(1, gt=0, description="Generate actors, one vLLM engine each.")
    engine_num_cpus: float = Field(
        1.0,
        gt=0.0,
        description="Logical CPUs each engine actor reserves. Keep the total below the cluster's so reads can run.",
    )
    prepare_actors: int = Field(1, gt=0, description="Tokenizing actors.")
    ray_address: str | None = Field(
        None, description="Ray cluster to join (e.g. ray://head:10001 or auto); none starts a local one.")
    engines_per_node: int | None = Field(
        None, gt=0,
        description="1: each engine on its own node (a STRICT_SPREAD placement group, one bundle per engine); "
        "more: spread across nodes, best effort; none: wherever Ray finds room (one engine per GPU on GPUs).",
    )
    ship_package: bool = Field(
        True,
        description="With ray_address: send this package to every node in the job's runtime_env (py_modules), "
        "so workers run the driver's code, not whatever is installed there.",
    )
    placement_timeout_s: float = Field(
        120.0, gt=0,
        description="How long to wait for the cluster to place every engine (engines_per_node, "
        "tensor_parallel_size) before the run stops with an error naming what is missing.",
    )
    pool_start_timeout_s: float = Field(
        300.0, gt=0,
        description="Engines wait this long for each other to start before taking blocks, so the first "
        "to start does not take every block of a small corpus.",
    )
    ray_num_cpus: int | None = Field(
        None, gt=0, description="Local Ray only: logical CPUs to advertise (more than cores is fine)."
    )
    object_store_mb: int | None = Field(
        None, ge=80,
        description="Local Ray only: the object store's size in MiB (Ray's default: 30% of memory). Blocks past "
        "it spill to disk; a corpus larger than it streams through (make bench-scale).",
    )
    isolate_engine_cpus: bool = Field(
        True,
        description="Local Ray on the CPU backend: once the engines are up, the run's other processes keep off "
        "the cores vLLM bound its workers to, as vLLM advises (pipeline/run/affinity.py).",
    )


class AdaptivePolicy(_Section):
    """Grow each bucket's token budget until memory pressure reaches `batching.memory_target`;
    back off on out-of-memory and KV-cache preemption (pipeline/generation/policy/adaptive.py)."""

    kind: Literal["adaptive"] = "adaptive"
    initial_budget_tokens: int | None = Field(
        None, gt=0, description="Start, in tokens in flight; default: 0.9 x the engine's KV capacity."
    )

    def describe(self) -> dict[str, Any]:
        return {"rows_per_call": None, "tuned_rows": None}


class FixedPolicy(_Section):
    """The same number of rows in flight for every bucket."""

    kind: Literal["fixed"] = "fixed"
    rows_per_call: int = Field(64, gt=0, description="Rows in flight.")

    def describe(self) -> dict[str, Any]:
        return {"rows_per_call": self.rows_per_call, "tuned_rows": None}


class TunedPolicy(_Section):
    """The rows per bucket that `pipeline tune` chose, and `rows_per_call` for other buckets."""

    kind: Literal["tuned"] = "tuned"
    rows: dict[str, int] = Field(default_factory=dict, validate_default=True,
                                 description="Rows in flight per bucket (written by `pipeline tune`).")
    rows_per_call: int = Field(64, gt=0, description="Rows in flight for buckets tune did not measure.")

    @field_validator("rows")
    @classmethod
    def _has_rows(cls, rows: dict[str, int]) -> dict[str, int]:
        if not rows:
            raise ValueError("needs rows (bucket: rows); `pipeline tune` writes them")
        if any(v < 1 for v in rows.values()):
            raise ValueError("must be at least 1 row per bucket")
        return rows

    def describe(self) -> dict[str, Any]:
        return {"rows_per_call": self.rows_per_call, "tuned_rows": dict(self.rows)}


BatchPolicyConfig = Annotated[AdaptivePolicy | FixedPolicy | TunedPolicy, Field(discriminator="kind")]


class BucketingConfig(_Section):
    """Prompt-length buckets: which rows may share an engine call, and how rows are grouped."""

    boundaries: list[int] = Field(
        default_factory=lambda: list(DEFAULT_BOUNDARIES),
        description="Inclusive upper bounds of the prompt-length buckets, in tokens.",
    )
    grouping: Literal["window", "global", "off"] = Field(
        "window",
        description=(
            "window: streaming; each window of prepared rows is ordered by bucket, so engine calls never mix "
            "buckets and generation starts while later input is read; global: sort the whole corpus by bucket "
            "first (an all-to-all barrier, kept for comparison); off: no grouping (benchmark baseline)."
        ),
    )
    window_rows: int = Field(
        4096, gt=0,
        description="window grouping: prepared rows ordered by bucket together. More rows, fewer bucket "
        "boundaries; the window bounds what a stage holds at once.",
    )
    window_order: Literal["auto", "interleaved", "ascending"] = Field(
        "auto",
        description="window grouping: the order of a window's blocks. interleaved: each bucket's blocks spread "
        "evenly through the window, so a continuous-batching engine prefills long prompts beside short ones' "
        "decodes (vLLM only: the transformers backend's static batches keep ascending); ascending: short buckets "
        "first, the longest last; auto: interleaved where the engine is fed `continuous`, else ascending (fed "
        "`mixed`, the feeder spreads a long bucket's rows itself, and interleaved blocks cost 3-5% of the "
        "steady rate: bench/README.md, engine steps). Either way no block's call mixes buckets.",
    )

    @field_validator("grouping", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        # YAML 1.1 reads an unquoted `off` as false.
        return "off" if value is False else value

    @field_validator("boundaries")
    @classmethod
    def _boundaries_increase(cls, b: list[int]) -> list[int]:
        if not b or any(x <= 0 for x in b) or any(x >= y for x, y in zip(b, b[1:])):
            raise ValueError("must be positive and strictly increasing")
        return b


class BatchingConfig(_Section):
    policy: BatchPolicyConfig = Field(
        default_factory=AdaptivePolicy,
        description="How many rows each bucket has in flight: {kind: adaptive} grows to the memory target, "
        "{kind: fixed, rows_per_call: N}, or {kind: tuned, rows: {bucket: N}} from `pipeline tune`.",
    )
    memory_target: float = Field(
        0.90, ge=0.5, le=0.98,
        description="Memory pressure the adaptive policy aims for, and where `pipeline tune` stops.",
    )
    feed: Literal["mixed", "continuous", "drain"] = Field(
        "mixed",
        description="mixed: admit rows as others finish, a row at a time across the blocks an engine serves "
        "at once, so a long bucket's prompts reach the engine spread among short ones' decodes (each engine "
        "call still holds one bucket); continuous: the same, one block's rows after another's, the bucket the "
        "engine runs first; drain: classic batches, each run to its last row.",
    )
    prepare_batch_rows: int = Field(
        1024, gt=0,
        description="Rows per tokenizing batch, and per block of the reuse lookup after it. Each batch is a "
        "task or an actor call of its own on the stages before the engine: at 256, a night that reuses most "
        "rows spent longer passing them through those stages (bench/README.md, incremental nightly runs).",
    )
    generate_batch_rows: int = Field(
        128, gt=0,
        description="Rows per block an engine actor takes: small enough that every engine gets blocks of "
        "every large bucket. An actor serves `concurrent_batches` blocks at once in one engine, so a block "
        "boundary costs no drain.",
    )
    concurrent_batches: int = Field(
        8, gt=0,
        description="Blocks each engine actor serves at once (and the most Ray Data hands it ahead): enough "
        "rows to keep its engine full between blocks. At 4 x 128 rows vLLM's queue ran dry every few blocks "
        "(bench/README.md, engine steps); 8 keeps it stocked.",
    )
    learned_limits: str | None = Field(
        None,
        description="Adaptive policy: file to start from and save per-bucket limits to, keyed by model, "
        "hardware, max_model_len and dtype; none: do not persist.",
    )
    learned_max_age_days: float = Field(30.0, gt=0, description="Older learned limits are ignored.")
    merge_identical_prompts: bool = Field(
        True,
        description="Generate once for rows whose prompt token ids and sampling agree (greedy, or seeded "
        "sampling), and give each of them the result: per engine actor, over its last 16,384 distinct prompts.",
    )

    def describe_policy(self) -> dict[str, Any]:
        """The policy as the report has always shown it: policy, memory_target, rows_per_call, tuned_rows."""
        adaptive = isinstance(self.policy, AdaptivePolicy)
        return {"policy": self.policy.kind, "memory_target": self.memory_target if adaptive else None,
                **self.policy.describe()}

FaultKind = Literal["oom", "engine_oom_death", "engine_crash"]


class FaultConfig(_Section):
    at_batch: int = Field(gt=0, description="The engine batch (window) of each actor the fault strikes in, once.")
    kind: FaultKind = Field("oom", description="As `debug.inject_oom_kind`.")


class DebugConfig(_Section):
    inject_oom_at_batch: int | None = Field(
        None, gt=0, description="Fault injection: an out-of-memory error in this engine batch (window), once."
    )
    inject_oom_kind: FaultKind = Field(
        "oom", description="oom: raise CUDA-style OOM in-process; engine_oom_death: kill the engine core as if it "
        "ran out of memory (rebuilt smaller, in place); engine_crash: kill it with no cause (a fresh actor)."
    )
    more_faults: list[FaultConfig] = Field(
        [], description="Fault injection, several in one drill: more faults beside `inject_oom_at_batch`, each "
        "{at_batch, kind}, e.g. [{at_batch: 6, kind: engine_oom_death}]."
    )
    engine_fails_on_start: bool = Field(
        False, description="Drills: every engine start fails, to show the restart bound ending the run."
    )
    slow_prepare_s: float = Field(
        0.0, ge=0.0,
        description="Drills: each tokenizing batch takes this much longer, as reads from a slow store would "
        "(shows generation starting while input is still being read).",
    )
    hold_input_until_output_s: float = Field(
        0.0, ge=0.0,
        description="Drills, local outputs: after the first window of rows, hold each tokenizing batch until the "
        "run has committed its first part (at most this long), as input that arrives while generation runs. "
        "Shows streaming without a fixed delay; a run with a barrier would wait out the bound.",
    )
    hold_before_publish_s: float = Field(
        0.0, ge=0.0,
        description="Drills: once every row is written and the report staged, wait this long (logged) before "
        "publishing, so that a drill can stop the object store while the run publishes.",
    )
    kill_publish_at: Literal["journal", "backup", "swap", "clear", "cleared"] | None = Field(
        None, description="Drills, local outputs: kill the run (SIGKILL, as kill -9 would) right after this step "
        "of publishing: journal written, foreign output moved aside, swap done, first earlier file deleted, swapped-"
        "out folder removed. The next run of the output finishes that publish first.",
    )
    step_timeline: bool = Field(
        False, description="Profiling, vLLM engines: record every engine step (start, duration, requests running "
        "and waiting, tokens scheduled) into the report, under each engine actor's `step_timeline`.",
    )

    def faults(self) -> tuple[tuple[int, str], ...]:
        """Every injected fault as (batch, kind), in batch order."""
        first = [(self.inject_oom_at_batch, self.inject_oom_kind)] if self.inject_oom_at_batch is not None else []
        return tuple(sorted(first + [(f.at_batch, f.kind) for f in self.more_faults]))


# Object-store requests: each tried STORE_ATTEMPTS times in all (pyarrow's standard retry
# strategy, the one a filesystem keeps when pickled to a Ray worker); `pipeline.storage.fs`
# applies these in every process of a run.
STORE_ATTEMPTS = 3
STORE_DEFAULTS = {"request_timeout_s": 100.0, "connect_timeout_s": 10.0}


class StoreConfig(_Section):
    """Requests to object stores (s3:// inputs, outputs, reuse paths): each one is given up
    after `request_timeout_s` with no byte moving, and tried STORE_ATTEMPTS (3) times in
    all. A store that stops answering stops the run (exit 1, resumable) within about
    `bound_s` of its first stalled request: 5 minutes by default."""

    request_timeout_s: float = Field(
        STORE_DEFAULTS["request_timeout_s"], gt=0,
        description="A request that moves no byte for this long is given up (and tried again, 3 times in all).",
    )
    connect_timeout_s: float = Field(STORE_DEFAULTS["connect_timeout_s"], gt=0,
                                     description="A connection not made in this long is given up.")

    @property
    def bound_s(self) -> float:
        """How long a request to a store that stopped answering takes to fail."""
        return STORE_ATTEMPTS * max(self.request_timeout_s, self.connect_timeout_s)


class ProfileConfig(_Section):
    model: ModelConfig
    engine: EngineConfig = EngineConfig()
    hardware: HardwareConfig
    bucketing: BucketingConfig = BucketingConfig()
    batching: BatchingConfig = BatchingConfig()
    store: StoreConfig = StoreConfig()
    debug: DebugConfig = DebugConfig()

    def feed(self) -> str:
        """How the engines are fed: transformers' static batches always drain (one call's
        rows at a time, so a batch is one bucket, padded once)."""
        return "drain" if self.engine.backend == "transformers" else self.batching.feed

    def window_order(self) -> str:
        """The order of a window's blocks (`bucketing.window_order`). Interleaved only where
        an engine batches continuously (vLLM, a server) and asked or fed `continuous`: fed
        `mixed`, the feeder already spreads a long bucket's rows among the others', a row at
        a time, and interleaved blocks (long buckets in pieces, calls per piece) made the
        steady rate 3-5% lower than ascending ones (bench/README.md, engine steps); a static
        batch (transformers) is one call's rows, with nothing to overlap."""
        order = self.bucketing.window_order
        if self.engine.backend == "transformers":
            return "ascending"
        if order == "auto":
            return "interleaved" if self.feed() == "continuous" else "ascending"
        return order

    @model_validator(mode="after")
    def _transformers_on_cpu_needs_a_budget(self) -> ProfileConfig:
        e = self.engine
        if e.backend == "transformers" and self.hardware.accelerator != "gpu" and e.memory_budget_gib is None:
            raise ValueError("engine.memory_budget_gib is needed for engine.backend: transformers on CPU: an "
                             "out-of-memory there can't be caught, so batches grow against a budget instead")
        return self

    @model_validator(mode="after")
    def _server_backend_needs_a_server(self) -> ProfileConfig:
        e = self.engine
        if e.backend == "server" and e.server is None:
            raise ValueError("engine.backend: server needs engine.server (its url and model)")
        if e.backend != "server" and e.server is not None:
            raise ValueError(f"engine.server is set but engine.backend is {e.backend!r}: set backend: server to use it")
        return self

    @model_validator(mode="after")
    def _tensor_parallel_needs_gpus(self) -> ProfileConfig:
        if self.engine.tensor_parallel_size > 1 and self.hardware.accelerator != "gpu":
            raise ValueError(f"engine.tensor_parallel_size: {self.engine.tensor_parallel_size} needs "
                             "hardware.accelerator: gpu (vLLM's CPU backend runs one engine per actor)")
        return self


class RunConfig(_Section):
    """A job and a profile together: everything one run needs."""

    job: JobConfig
    profile: ProfileConfig
    job_file: str
    profile_file: str
    date: str | None = None  # the {date} the job's paths were filled with


