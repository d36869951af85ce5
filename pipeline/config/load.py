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

import yaml
from pydantic import BaseModel, ValidationError

from pipeline.config.models import JobConfig, ProfileConfig, RunConfig


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


OUTPUT_FIELD = "{output}"


def _fill_reuse_paths(job: dict[str, Any]) -> None:
    """`{output}` in reuse.paths: the job's own output path, any date (its {date} as *):
    a nightly job's earlier partitions (the run's own is never taken: see `find_earlier`)."""
    reuse, output = job.get("reuse"), (job.get("output") or {}).get("path")
    if not isinstance(reuse, dict) or not isinstance(reuse.get("paths"), list) or not isinstance(output, str):
        return
    reuse["paths"] = [p.replace(OUTPUT_FIELD, output.replace(DATE_FIELD, "*")) if isinstance(p, str) else p
                      for p in reuse["paths"]]


def load_run_config(
    job_file: str | Path,
    profile_file: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    input_path: str | None = None,
    output_path: str | None = None,
    date: str | None = None,
    reuse: list[str] | bool | None = None,
) -> RunConfig:
    """Load, merge and check a job and a profile; raise ConfigError naming the culprit.
    `reuse`: --reuse's paths (every output they name, no lookback), False for --no-reuse."""
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

    if reuse is False:
        _apply(job, ["reuse", "enabled"], False, "reuse.enabled=false")
        job_src["reuse.enabled"] = "--no-reuse"
    elif reuse:
        _apply(job, ["reuse", "paths"], list(reuse), "reuse.paths")
        _apply(job, ["reuse", "lookback"], None, "reuse.lookback")
        job_src["reuse.paths"] = job_src["reuse.lookback"] = "--reuse"
    _fill_reuse_paths(job)
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
