"""Load a job file, a profile file and `--set` overrides into one checked RunConfig.

A job (`jobs/*.yaml`) says *what* to produce: input, output, prompt, sampling.
A profile (`conf/*.yaml`) says *where and how* it runs: model, engine,
hardware, batching. Both are checked here, before any model loads, and every
error names the file (or `--set`) and the dotted field it is about.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import warnings

import yaml
from pydantic import BaseModel, ValidationError

from pipeline.config.models import AdaptivePolicy, FixedPolicy, JobConfig, ProfileConfig, RunConfig, TunedPolicy


class ConfigError(ValueError):
    """A config file or override is wrong; the message names file and field."""


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


def _user_loc(loc: tuple[Any, ...], data: Any) -> str:
    """The dotted key as the user wrote it: pydantic puts a tagged union's tag into `loc`
    (batching.policy.tuned.rows), which names no key of the data; leave it out."""
    parts, node = [], data
    for p in loc:
        if isinstance(node, dict) and p not in node and node.get("kind") == p:
            continue  # the tag of a union told apart by `kind`, not a key
        parts.append(str(p))
        node = node.get(p) if isinstance(node, dict) else None
    return ".".join(parts)


def _format_errors(error: ValidationError, source_of: dict[str, str], data: Any = None) -> str:
    lines = []
    for err in error.errors():
        loc = _user_loc(err["loc"], data) if data is not None else ".".join(str(p) for p in err["loc"])
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
        raise ConfigError(_format_errors(e, source_of, data)) from None


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


class ConfigDeprecationWarning(FutureWarning):
    """A key written the old way: still read, and the warning says the new spelling."""


# The flat batching keys that moved under `batching.policy`: old key -> (new key, the
# policies that take it, the model that checks its value).
MOVED_TO_POLICY: dict[str, tuple[str, tuple[str, ...], type[BaseModel]]] = {
    "rows_per_call": ("rows_per_call", ("fixed", "tuned"), FixedPolicy),
    "tuned_rows": ("rows", ("tuned",), TunedPolicy),
    "initial_budget_tokens": ("initial_budget_tokens", ("adaptive",), AdaptivePolicy),
}


# Keys that moved as they are: old dotted key -> new dotted key.
MOVED: dict[str, str] = {
    "engine.startup_backoff": "engine.restart.startup_backoff",
    "engine.min_gpu_memory_utilization": "engine.restart.min_gpu_memory_utilization",
    "batching.bucket_boundaries": "bucketing.boundaries",
    "batching.bucket_grouping": "bucketing.grouping",
}


def _deprecated(message: str) -> None:
    warnings.warn(message, ConfigDeprecationWarning, stacklevel=4)


def _migrate_moved(data: dict[str, Any], source_of: dict[str, str]) -> None:
    """Move each key of MOVED written the old way to its new place, with a warning."""
    for old, new in MOVED.items():
        *old_path, old_key = old.split(".")
        node: Any = data
        for k in old_path:
            node = node.get(k) if isinstance(node, dict) else None
        if not isinstance(node, dict) or old_key not in node:
            continue
        value, origin = node.pop(old_key), _source(old, source_of)
        *new_path, new_key = new.split(".")
        target = data
        for k in new_path:
            target = target.setdefault(k, {})
            if not isinstance(target, dict):
                raise ConfigError(f"{origin}: {'.'.join(new_path)} is not a section")
        target[new_key] = value
        source_of[new] = origin
        _deprecated(f"{origin}: {old} is the old spelling; write {new}")


def _migrate_batching(profile: dict[str, Any], source_of: dict[str, str]) -> None:
    """Read the old flat spelling of the batch policy (`policy: fixed`, `rows_per_call: 8`
    beside it) into the new one (`policy: {kind: fixed, rows_per_call: 8}`), with a
    warning naming where each old key came from. A key for another policy than the
    one chosen is checked and ignored, as it always was, and now said so."""
    batching = profile.get("batching")
    if not isinstance(batching, dict):
        return
    policy = batching.get("policy")
    if isinstance(policy, str):
        origin = _source("batching.policy", source_of)
        _deprecated(f"{origin}: batching.policy: {policy} is the old spelling; write batching.policy.kind: {policy}")
        batching["policy"] = policy = {"kind": policy}
        source_of["batching.policy.kind"] = origin
    if not any(old in batching for old in MOVED_TO_POLICY):
        return
    if policy is None:
        batching["policy"] = policy = {"kind": "adaptive"}
    if not isinstance(policy, dict):
        return  # validation names what is wrong with it
    kind = policy.get("kind", "adaptive")
    for old, (new, kinds, model) in MOVED_TO_POLICY.items():
        if old not in batching:
            continue
        value, origin = batching.pop(old), _source(f"batching.{old}", source_of)
        if kind in kinds:
            policy[new] = value
            source_of[f"batching.policy.{new}"] = origin
            _deprecated(f"{origin}: batching.{old} is the old spelling; write batching.policy.{new}")
            continue
        try:
            model.model_validate({new: value})
        except ValidationError as e:
            err = next(x for x in e.errors() if x["loc"] and x["loc"][0] == new)
            raise ConfigError(f"{origin}: batching.{old}: {err['msg'].removeprefix('Value error, ')} "
                              f"(got {value!r})") from None
        _deprecated(f"{origin}: batching.{old} applies to the {' and '.join(kinds)} policy, "
                    f"not {kind}: ignored (write it as batching.policy.{new} with that policy)")


def _migrate_grouping(profile: dict[str, Any], source_of: dict[str, str]) -> None:
    """`bucketing.grouping: per_batch` split each Ray Data batch by bucket; `window` does that
    over a window of prepared rows, and replaces it."""
    bucketing = profile.get("bucketing")
    if isinstance(bucketing, dict) and bucketing.get("grouping") == "per_batch":
        origin = _source("bucketing.grouping", source_of)
        _deprecated(f"{origin}: bucketing.grouping: per_batch is replaced by window (it streams the same way, "
                    "over bucketing.window_rows prepared rows)")
        bucketing["grouping"] = "window"


def _migrate(profile: dict[str, Any], source_of: dict[str, str]) -> None:
    """Every old spelling of a profile key, read into the new one (idempotent)."""
    _migrate_batching(profile, source_of)
    _migrate_moved(profile, source_of)
    _migrate_grouping(profile, source_of)


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
    _migrate(profile, profile_src)  # the file first, so new-style --set keys find their sections

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

    _migrate(profile, profile_src)  # then old-style --set keys
    filled = _fill_date(job, date, job_src)
    job_cfg = _validate(JobConfig, job, job_src)
    profile_cfg = _validate(ProfileConfig, profile, profile_src)
    if job_cfg.annotations is not None and profile_cfg.engine.backend == "transformers":
        where = profile_src.get("engine.backend", str(profile_file))
        raise ConfigError(f"{job_file}: annotations need structured outputs, which engine.backend: transformers "
                          f"does not have ({where} sets it); use engine.backend: vllm for this job")
    return RunConfig(
        job=job_cfg, profile=profile_cfg, job_file=str(job_file), profile_file=str(profile_file), date=filled
    )
