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


# Columns the pipeline adds to every output row, in output order.
GENERATED_FIELDS: tuple[pa.Field, ...] = (
    pa.field("summary", pa.string()),
    pa.field("prompt_tokens", pa.int32()),
    pa.field("output_tokens", pa.int32()),
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
)
GENERATED_COLUMNS: tuple[str, ...] = tuple(f.name for f in GENERATED_FIELDS)

# Working columns that travel between stages and never reach the output. The
# leading underscore marks them; `output_schema` refuses input columns that use it.
PROMPT_TOKEN_IDS = "_prompt_token_ids"
CHUNK_TEXTS = "_chunk_texts"  # under `length.policy: chunk`: the windows' text
BUCKET_INDEX = "_bucket_index"
ENGINE_CALL = "_engine_call"
INTERNAL_PREFIX = "_"


def output_schema(input_schema: pa.Schema, id_column: str, text_column: str) -> pa.Schema:
    """The output schema for an input schema: id, passthrough, then generated.

    The text column is passthrough too: users join summaries to their source,
    and dropping it would make them read the corpus twice.
    """
    if id_column not in input_schema.names:
        raise KeyError(f"id column {id_column!r} is not in the input ({input_schema.names})")
    clash = [n for n in input_schema.names if n in GENERATED_COLUMNS or n.startswith(INTERNAL_PREFIX)]
    if clash:
        raise ValueError(
            f"input columns {clash} collide with columns the pipeline writes "
            f"({', '.join(GENERATED_COLUMNS)}) or use the reserved '_' prefix; rename them"
        )
    id_field = input_schema.field(id_column)
    passthrough = [f for f in input_schema if f.name != id_column]
    return pa.schema([id_field, *passthrough, *GENERATED_FIELDS])


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Select and cast `table`'s columns to `schema`, dropping working columns."""
    return pa.Table.from_arrays(
        [table.column(f.name).cast(f.type) for f in schema], schema=schema
    )
