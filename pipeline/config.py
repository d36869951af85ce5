"""One typed config per run: a job file, a profile file and `--set` overrides.

A job (`jobs/*.yaml`) says *what* to produce: input, output, prompt, sampling.
A profile (`conf/*.yaml`) says *where and how* it runs: model, engine,
hardware, batching. Both are checked here, before any model loads, and every
error names the file (or `--set`) and the dotted field it is about.
"""

from __future__ import annotations

import string
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipeline.bucketing import DEFAULT_BOUNDARIES


class ConfigError(ValueError):
    """A config file or override is wrong; the message names file and field."""


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


class OutputConfig(_Section):
    path: str = Field(description="Folder the Parquet parts and _report.json are written to.")
    backup_existing: bool = Field(
        False,
        description="An output folder holding files this pipeline did not write (or another job's output): "
        "move it aside to <path>.backup-<UTC time> when the run publishes, instead of refusing to run.",
    )


class PromptConfig(_Section):
    system: str | None = Field(None, description="System message, when the chat template takes one.")
    template: str = Field(
        description="User message; `{field}` names a column of the row, e.g. `{text}`."
    )

    @field_validator("template")
    @classmethod
    def _parses(cls, template: str) -> str:
        try:
            names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
        except ValueError as e:
            raise ValueError(f"not a valid template ({e}); write a literal brace as {{{{ or }}}}") from None
        if "" in names or any(n.isdigit() for n in names):
            raise ValueError("positional fields ({} or {0}) name no column; write {column}")
        return template

    def fields(self) -> set[str]:
        """The row columns the template names (`{source}`, `{meta.title}` -> meta)."""
        names = (name for _, name, _, _ in string.Formatter().parse(self.template) if name)
        return {name.split(".")[0].split("[")[0] for name in names}


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
        from pipeline.annotations import check_schema

        check_schema(schema)
        return schema

    def fields(self) -> list[Any]:
        """The Arrow fields of the annotation columns, prefixed."""
        from pipeline.annotations import check_schema

        return [f.with_name(self.column_prefix + f.name) for f in check_schema(self.json_schema)]


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

    @model_validator(mode="after")
    def _annotations_need_one_text(self) -> JobConfig:
        if self.annotations is not None and self.length.policy == "chunk":
            raise ValueError("length.policy chunk summarizes in pieces, which annotations cannot follow; "
                             "use passages (one annotated row per passage) or policy truncate")
        return self

    def template_fields(self) -> dict[str, set[str]]:
        """Row columns each template names, by the job key that holds the template."""
        out = {"prompt.template": self.prompt.fields()}
        if self.annotations is not None:
            out["annotations.prompt.template"] = self.annotations.prompt.fields()
        return out


# --- the profile: where and how it runs ---------------------------------------


class ModelConfig(_Section):
    name: str = Field(description="Hugging Face model id or local folder.")
    tiny_model_seed: int | None = Field(
        None,
        description="Offline default: build the tiny random Llama at `name` with this seed if it is missing.",
    )


class EngineConfig(_Section):
    max_model_len: int | None = Field(None, gt=0, description="Context length; default: the model's.")
    dtype: str = Field("auto", description="Weights and activations dtype (auto, bfloat16, float16, float32).")
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
    max_num_batched_tokens: int | None = Field(None, gt=0)
    structured_outputs_backend: Literal["xgrammar", "guidance"] = Field(
        "xgrammar", description="Constrained decoding for annotations; any-whitespace JSON is disabled, "
        "so a weak model cannot pad the JSON with newlines until max tokens."
    )
    extra: dict[str, Any] = Field(default_factory=dict, description="Passed to vllm.LLM as keyword arguments.")
    startup_backoff: float = Field(
        0.5, gt=0.0, lt=1.0,
        description="On a memory failure at start-up, retry with gpu_memory_utilization times this.",
    )
    min_gpu_memory_utilization: float = Field(
        0.05, gt=0.0, le=1.0, description="Give up on start-up retries below this memory fraction."
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
    ray_address: str | None = Field(None, description="Ray cluster to join; none starts a local one.")
    ray_num_cpus: int | None = Field(
        None, gt=0, description="Local Ray only: logical CPUs to advertise (more than cores is fine)."
    )


class BatchingConfig(_Section):
    policy: Literal["adaptive", "fixed", "tuned"] = Field(
        "adaptive",
        description="adaptive: grow each bucket's token budget to the memory target; fixed: rows_per_call rows; "
        "tuned: the rows per bucket `pipeline tune` chose (tuned_rows), rows_per_call for other buckets.",
    )
    memory_target: float = Field(0.90, ge=0.5, le=0.98, description="Memory pressure the adaptive policy aims for.")
    initial_budget_tokens: int | None = Field(
        None, gt=0, description="Adaptive start, in tokens in flight; default: 0.9 x the engine's KV capacity."
    )
    feed: Literal["continuous", "drain"] = Field(
        "continuous",
        description="continuous: admit rows as others finish; drain: classic batches, each run to its last row.",
    )
    rows_per_call: int = Field(64, gt=0, description="Rows in flight under the fixed policy.")
    tuned_rows: dict[str, int] = Field(
        default_factory=dict, description="Rows in flight per bucket under the tuned policy (written by tune)."
    )
    bucket_boundaries: list[int] = Field(
        default_factory=lambda: list(DEFAULT_BOUNDARIES),
        description="Inclusive upper bounds of the prompt-length buckets, in tokens.",
    )
    bucket_grouping: Literal["global", "per_batch", "off"] = Field(
        "global",
        description=(
            "global: sort the corpus by bucket so engine calls are full and never mix buckets; "
            "per_batch: streaming, split each batch by bucket; off: no grouping (benchmark baseline)."
        ),
    )
    prepare_batch_rows: int = Field(256, gt=0, description="Rows per tokenizing batch.")
    generate_batch_rows: int = Field(
        4096, gt=0,
        description="Rows Ray Data hands an engine actor at once. Each batch's bucket runs start and end "
        "with the engine part-full; at 4,000 rows 1,024 cost 3% of throughput against 4,096.",
    )
    learned_limits: str | None = Field(
        None,
        description="File to start from and save per-bucket limits to, keyed by model, hardware, "
        "max_model_len and dtype; none: do not persist.",
    )
    learned_max_age_days: float = Field(30.0, gt=0, description="Older learned limits are ignored.")

    @model_validator(mode="after")
    def _tuned_has_rows(self) -> BatchingConfig:
        if self.policy == "tuned" and not self.tuned_rows:
            raise ValueError("policy tuned needs tuned_rows (bucket: rows); `pipeline tune` writes them")
        if any(v < 1 for v in self.tuned_rows.values()):
            raise ValueError("tuned_rows must be at least 1 row per bucket")
        return self

    @field_validator("bucket_grouping", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        # YAML 1.1 reads an unquoted `off` as false.
        return "off" if value is False else value

    @field_validator("bucket_boundaries")
    @classmethod
    def _boundaries_increase(cls, b: list[int]) -> list[int]:
        if not b or any(x <= 0 for x in b) or any(x >= y for x, y in zip(b, b[1:])):
            raise ValueError("must be positive and strictly increasing")
        return b


class DebugConfig(_Section):
    inject_oom_at_batch: int | None = Field(
        None, gt=0, description="Fault injection: an out-of-memory error in this engine batch (window), once."
    )
    inject_oom_kind: Literal["oom", "engine_death"] = Field(
        "oom", description="oom: raise CUDA-style OOM in-process; engine_death: kill the engine core process."
    )


class ProfileConfig(_Section):
    model: ModelConfig
    engine: EngineConfig = EngineConfig()
    hardware: HardwareConfig
    batching: BatchingConfig = BatchingConfig()
    debug: DebugConfig = DebugConfig()


class RunConfig(_Section):
    """A job and a profile together: everything one run needs."""

    job: JobConfig
    profile: ProfileConfig
    job_file: str
    profile_file: str
    date: str | None = None  # the {date} the job's paths were filled with


# --- loading ------------------------------------------------------------------

JOB_SECTIONS = frozenset(JobConfig.model_fields)
PROFILE_SECTIONS = frozenset(ProfileConfig.model_fields)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(f"{path}: {where}invalid YAML: {getattr(e, 'problem', e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections, got {type(data).__name__}")
    return data


def parse_override(item: str) -> tuple[list[str], Any]:
    """`sampling.max_new_tokens=16` -> (["sampling", "max_new_tokens"], 16).

    The value is read as YAML, so numbers, booleans, lists and null get their types.
    """
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item}: expected key=value, e.g. sampling.max_new_tokens=16")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def _apply(data: dict[str, Any], keys: list[str], value: Any, item: str) -> None:
    node = data
    for k in keys[:-1]:
        child = node.setdefault(k, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item}: {k} is not a section")
        node = child
    node[keys[-1]] = value


def _source(loc: str, source_of: dict[str, str]) -> str:
    """Where the value at `loc` came from: the longest override prefix, else the file."""
    keys = [k for k in source_of if k and (loc == k or loc.startswith(k + "."))]
    return source_of[max(keys, key=len)] if keys else source_of[""]


def _format_errors(error: ValidationError, source_of: dict[str, str]) -> str:
    lines = []
    for err in error.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
        inner = (err.get("ctx") or {}).get("error")
        if getattr(inner, "path", None):  # a key inside the value, e.g. a JSON Schema's
            loc, msg = f"{loc}.{inner.path}", msg.removeprefix(f"{inner.path}: ")
        elif err["type"] not in ("missing", "extra_forbidden"):
            got = repr(err["input"])
            msg = f"{msg} (got {got if len(got) <= 80 else got[:77] + '...'})"
        lines.append(f"{_source(loc, source_of)}: {loc}: {msg}")
    return "\n".join(lines)


def _validate(model: type[BaseModel], data: dict[str, Any], source_of: dict[str, str]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source_of)) from None


DATE_FIELD = "{date}"


def yesterday_utc() -> str:
    return (datetime.now(timezone.utc).date() - timedelta(days=1)).isoformat()


def _fill_date(job: dict[str, Any], date: str | None, job_src: dict[str, str]) -> str | None:
    """Put the date into input.path and output.path where they say {date}.

    Without `date`, a job that has the placeholder gets yesterday (UTC): the
    nightly run processes the day that just ended.
    """
    sections = [(k, job.get(k)) for k in ("input", "output")]
    templated = [(k, sec) for k, sec in sections
                 if isinstance(sec, dict) and isinstance(sec.get("path"), str) and DATE_FIELD in sec["path"]]
    if not templated:
        if date is not None:
            raise ConfigError(f"--date {date}: {job_src['']} has no {DATE_FIELD} in input.path or output.path")
        return None
    if date is None:
        date = yesterday_utc()
    else:
        try:
            if datetime.strptime(date, "%Y-%m-%d").date().isoformat() != date:
                raise ValueError
        except ValueError:
            raise ConfigError(f"--date {date}: expected a day as YYYY-MM-DD, e.g. 2026-11-29") from None
    for _, sec in templated:
        sec["path"] = sec["path"].replace(DATE_FIELD, date)
    return date


def load_run_config(
    job_file: str | Path,
    profile_file: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    input_path: str | None = None,
    output_path: str | None = None,
    date: str | None = None,
) -> RunConfig:
    """Load, merge and check a job and a profile; raise ConfigError naming the culprit."""
    job_file, profile_file = Path(job_file), Path(profile_file)
    job, profile = _read_yaml(job_file), _read_yaml(profile_file)
    job_src: dict[str, str] = {"": str(job_file)}
    profile_src: dict[str, str] = {"": str(profile_file)}

    for items, path in ((["input", "path"], input_path), (["output", "path"], output_path)):
        if path is not None:
            _apply(job, items, path, "=".join(items))
            job_src[".".join(items)] = f"--{items[0]}"
    for item in overrides:
        keys, value = parse_override(item)
        if keys[0] in JOB_SECTIONS:
            _apply(job, keys, value, item)
            job_src[".".join(keys)] = f"--set {item}"
        elif keys[0] in PROFILE_SECTIONS:
            _apply(profile, keys, value, item)
            profile_src[".".join(keys)] = f"--set {item}"
        else:
            raise ConfigError(
                f"--set {item}: unknown section {keys[0]!r}; job sections: "
                f"{', '.join(sorted(JOB_SECTIONS))}; profile sections: {', '.join(sorted(PROFILE_SECTIONS))}"
            )

    filled = _fill_date(job, date, job_src)
    job_cfg = _validate(JobConfig, job, job_src)
    profile_cfg = _validate(ProfileConfig, profile, profile_src)
    return RunConfig(
        job=job_cfg, profile=profile_cfg, job_file=str(job_file), profile_file=str(profile_file), date=filled
    )
