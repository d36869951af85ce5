"""A row's result key: a digest of everything that determines its output, so that two
rows with equal keys have the same result, in one run or on two nights.

    base = run_key_base(model_digest, sampling, engine, job)     # once per run, in the driver
    key = result_key(base, prompt_ids, annotation_ids, chunks)   # per row, in the generate stage

What goes in (`run_key_base`, then the row's own part):
- the model by content (`pipeline.models.digest`): weights, config, tokenizer and chat
  template, every file of the folder, not its name;
- the sampling, every field (temperature, top_p, seed, max_new_tokens);
- the engine's backend and the settings that change outputs: dtype, the context
  length, the structured-output backend, and `engine.extra` whole (it reaches vLLM as
  it is, quantization included);
- the job's output-affecting settings: the prompt template and system message, the
  annotation prompt, schema and token rooms, the length policy and chunk overlap,
  the passages settings, how a null field renders;
- the row's prompt token ids after template and truncation, its annotation prompt's
  ids, and for a chunked document its windows' text (its map-reduce prompts are made
  from them with the settings above).

What stays out, and why it cannot change a result: batch sizes and the batch policy,
memory targets, the number of engines and where they run, `max_num_seqs` and
`max_num_batched_tokens`, the KV cache's size, restarts and timeouts, ids and paths.
They decide when and beside what a row is generated, not what the model computes for
it: up to the engine's batch invariance, which vLLM does not promise bit for bit; a
key promises the inputs were the same.

Sampling with a temperature and no seed makes every result its own: there is no key
(None), and nothing is reused. The key's text starts with its version
(`KEY_VERSION`): a change to what goes in gets a new version, and no old key matches.

A row's *input key* is found before it is tokenized, so that a later run skips
tokenizing the rows it reuses:

    ibase = input_key_base(base, prepare_parts)                # once per run
    key = input_key(ibase, text, fields)                       # per row, in the prepare stage

It digests the run's `base` (so every input of the result key's base is in it), every
prepare setting that shapes a prompt (`prepare_parts`: templates, the text column, the
length policy and limits, the corpus percentile cap, the bucket boundaries, how a null
renders), and the row's own inputs to its prompts: its text and the rendered value of
every field the prompt and annotation templates name. Each prepare stage adds what it makes
of the templates (their rendered skeletons: a chat template that renders the date changes
them) and the tokenizer libraries' versions (`PrepareStage._input_base`). The tokenizer's
files and chat template are in the model's digest, so equal input keys give equal token
ids, truncation, chunks and buckets: equal result keys. A job with a corpus percentile
cap (`length.outlier_percentile`) finds few rows this way: the cap is taken from each
night's corpus, and a cap that moves changes every input key. The converse need not hold (a change to a column no template
names leaves the prompt as it was); such a row is found by its result key after it is
tokenized, as before.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from dataclasses import asdict, is_dataclass
from typing import Any

from pipeline.generation.engine import Sampling
from pipeline.generation.merge import sampling_key

KEY_VERSION = 1
PREFIX = f"v{KEY_VERSION}:"
INPUT_KEY_VERSION = 1
INPUT_PREFIX = f"i{INPUT_KEY_VERSION}:"


def canonical(value: Any) -> Any:
    """Plain JSON-able data of a setting: dataclasses, pydantic models, tuples, dicts."""
    if hasattr(value, "model_dump"):
        return canonical(value.model_dump(mode="json"))
    if is_dataclass(value) and not isinstance(value, type):
        return canonical(asdict(value))
    if isinstance(value, dict):
        return {str(k): canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    return value


def run_key_base(model_digest: str | None, sampling: Sampling, engine: dict[str, Any],
                 job: dict[str, Any]) -> str | None:
    """What every row of a run shares in its key, as a digest; None where results cannot be
    reused: no content digest of the model (a hub id or a remote server without a
    revision), or sampling without a seed."""
    sampled = sampling_key(sampling)  # the merge's rule: None where each result is its own
    if model_digest is None or sampled is None:
        return None
    parts = {"version": KEY_VERSION, "model": model_digest, "sampling": sampled,
             "engine": canonical(engine), "job": canonical(job)}
    return hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=16).hexdigest()


def result_key(base: str | None, prompt_ids: list[int] | None, annotation_ids: list[int] | None = None,
               chunks: list[str] | None = None) -> str | None:
    """The row's key: `base`'s and its own inputs'; None with no base or no prompt (a row
    that failed before it was tokenized)."""
    if base is None or (prompt_ids is None and chunks is None):
        return None
    h = hashlib.blake2b(base.encode(), digest_size=16)

    def part(tag: bytes, data: bytes) -> None:  # tagged and sized: no two inputs hash alike
        h.update(tag + len(data).to_bytes(8, "little") + data)

    if prompt_ids is not None:
        part(b"p", array("q", prompt_ids).tobytes())
    if annotation_ids is not None:
        part(b"a", array("q", annotation_ids).tobytes())
    for chunk in chunks or ():
        part(b"c", chunk.encode("utf-8", "surrogatepass"))
    return PREFIX + h.hexdigest()


def keys_of_rows(base: str | None, prompt_ids: list[Any], annotation_ids: list[Any],
                 chunks: list[Any]) -> list[str | None]:
    """`result_key` of each row, from its columns as lists (all None where `base` is)."""
    if base is None:
        return [None] * len(prompt_ids)
    return [result_key(base, p, a, c) for p, a, c in zip(prompt_ids, annotation_ids, chunks)]


def input_key_base(base: str | None, prepare_parts: dict[str, Any]) -> str | None:
    """What every row of a run shares in its input key: the result key's `base` and the
    settings that turn a row into its prompts; None where `base` is."""
    if base is None:
        return None
    parts = {"version": INPUT_KEY_VERSION, "base": base, "prepare": canonical(prepare_parts)}
    return hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=16).hexdigest()


def input_key(base: str, text: str, fields: list[str]) -> str:
    """A row's input key: `base`'s, its text (as the prompt takes it, before truncation)
    and its templates' rendered field values, each tagged and sized."""
    h = hashlib.blake2b(base.encode(), digest_size=16)
    for tag, value in [(b"t", text), *((b"f", f) for f in fields)]:
        data = value.encode("utf-8", "surrogatepass")
        h.update(tag + len(data).to_bytes(8, "little") + data)
    return INPUT_PREFIX + h.hexdigest()
