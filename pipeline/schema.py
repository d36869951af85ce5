"""The row contract, written down once.

Every stage and every test takes column names, Arrow types and status values
from here. Input columns are named by the job (`input.id_column`,
`input.text_column`); everything else a row carries is passthrough and comes
out untouched, before the columns the pipeline adds.
"""

from __future__ import annotations

from enum import StrEnum

import pyarrow as pa


class Status(StrEnum):
    """What happened to a row. Every input row gets exactly one."""

    # Generated. `truncated` and `chunks` say whether the whole text was read at once.
    OK = "ok"
    # The row could not be processed: the `error` column says why.
    ERROR = "error"
    # Longer than the model's context under `length.policy: skip`.
    SKIPPED_TOO_LONG = "skipped_too_long"
    # The annotation JSON did not validate against the job's schema, even after one
    # retry with more room; `raw_output` keeps the text and `error` says what failed.
    INVALID_OUTPUT = "invalid_output"
    # The engine ran, but the summary (or the annotation) it wrote is empty or only
    # whitespace: not a success. `summary` keeps the text, `error` says so.
    EMPTY_OUTPUT = "empty_output"


# Statuses that count as failed rows for `--fail-on-error-rate`.
FAILED_STATUSES = (Status.ERROR.value, Status.EMPTY_OUTPUT.value)


def is_empty(text: str | None) -> bool:
    """Empty or only whitespace: nothing a reader could use."""
    return text is not None and not text.strip()


# Columns the pipeline adds to every output row, in output order.
GENERATED_FIELDS: tuple[pa.Field, ...] = (
    pa.field("summary", pa.string()),
    pa.field("prompt_tokens", pa.int32()),
    pa.field("output_tokens", pa.int32()),
    # Why the row's last engine call ended: stop (end of sequence, or a stop string) or
    # length (cut at max_new_tokens); null where no call was made (an error row).
    pa.field("finish_reason", pa.string()),
    pa.field("truncated", pa.bool_(), nullable=False),
    pa.field("original_tokens", pa.int32()),  # the prompt before truncation or chunking
    pa.field("chunks", pa.int32()),  # windows summarized, under `length.policy: chunk`
    pa.field("bucket", pa.string()),
    pa.field("status", pa.string(), nullable=False),
    pa.field("error", pa.string()),
    pa.field("notes", pa.string()),  # what was done to the row's input, e.g. binary text decoded
    pa.field("latency_s", pa.float64()),
    pa.field("model", pa.string()),
    pa.field("run_id", pa.string(), nullable=False),
    # A digest of everything that determines the row's result, prefixed by its version
    # (`pipeline.generation.result_key`): equal keys, equal results. Null where there is
    # none: no prompt, sampling without a seed, or a model known only by its hub id.
    pa.field("result_key", pa.string()),
    # A digest of the row's inputs to its prompts and of every setting that makes them
    # (`pipeline.generation.result_key.input_key`): a later run finds the row by it before
    # tokenizing. Null where there is no result key, and in a passages job.
    pa.field("input_key", pa.string()),
    # The earlier run this row's results were taken from (`reuse:`, `--reuse`): its run id
    # and date. Null where this run generated the row.
    pa.field("reused_from", pa.string()),
)
GENERATED_COLUMNS: tuple[str, ...] = tuple(f.name for f in GENERATED_FIELDS)

# Knowledge-base ingestion (`passages:` in the job): one row per passage, after the id.
# text[char_start:char_end] of the source document is exactly `passage`.
PASSAGE_FIELDS: tuple[pa.Field, ...] = (
    pa.field("passage_index", pa.int32()),  # 0, 1, ... within the document; null if the document failed
    pa.field("char_start", pa.int64()),
    pa.field("char_end", pa.int64()),
    pa.field("passage", pa.string()),
)
# With `annotations:` in the job, the schema's columns follow `summary`, then this one.
RAW_OUTPUT = pa.field("raw_output", pa.string())  # the model's text when it did not validate
ANNOTATION_TRIES = pa.field("annotation_tries", pa.int8())  # 1, or 2 after the retry; null: no annotation call
# Why the summary's own call stopped: `finish_reason` is the row's last call's, the annotation's.
SUMMARY_FINISH = pa.field("summary_finish_reason", pa.string())

# Working columns that travel between stages and never reach the output. The
# leading underscore marks them; `output_schema` refuses input columns that use it.
PROMPT_TOKEN_IDS = "_prompt_token_ids"
CHUNK_TEXTS = "_chunk_texts"  # under `length.policy: chunk`: the windows' text
BUCKET_INDEX = "_bucket_index"
PREPARED_AT = "_prepared_at"  # Unix time the row's prepare batch ended, for the report's timeline
ENGINE_CALL = "_engine_call"
ENGINE_CALL_STATS = "_engine_call_stats"  # a batch's engine-call records (JSON list), on its first row
ANNOTATION_TOKEN_IDS = "_annotation_token_ids"
INTERNAL_PREFIX = "_"


def output_schema(input_schema: pa.Schema, id_column: str, text_column: str, passages: bool = False,
                  annotation_fields: tuple[pa.Field, ...] | list[pa.Field] = ()) -> pa.Schema:
    """The output schema for an input schema: id, [passage], passthrough, then generated.

    The text column is passthrough too: users join summaries to their source,
    and dropping it would make them read the corpus twice. With passages, the
    document's text is not repeated on every passage row; `passage` holds the
    row's own text and the offsets locate it in the document.
    """
    if id_column not in input_schema.names:
        raise KeyError(f"id column {id_column!r} is not in the input ({input_schema.names})")
    generated = list(GENERATED_FIELDS)
    if annotation_fields:
        generated[1:1] = [*annotation_fields, RAW_OUTPUT, ANNOTATION_TRIES, SUMMARY_FINISH]
    added = [f.name for f in generated] + ([f.name for f in PASSAGE_FIELDS] if passages else [])
    clash = [n for n in input_schema.names if n in added or n.startswith(INTERNAL_PREFIX)]
    if clash:
        raise ValueError(
            f"input columns {clash} collide with columns the pipeline writes "
            f"({', '.join(added)}) or use the reserved '_' prefix; rename them"
            + (" or set annotations.column_prefix" if set(clash) & {f.name for f in annotation_fields} else "")
        )
    id_field = input_schema.field(id_column)
    dropped = {id_column, text_column} if passages else {id_column}
    passthrough = [f for f in input_schema if f.name not in dropped]
    return pa.schema([id_field, *(PASSAGE_FIELDS if passages else ()), *passthrough, *generated])


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Select and cast `table`'s columns to `schema`, dropping working columns."""
    return pa.Table.from_arrays(
        [table.column(f.name).cast(f.type) for f in schema], schema=schema
    )
