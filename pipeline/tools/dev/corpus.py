"""The synthetic corpus as a Parquet file: ids, text from `pipeline.text.synthetic` (log-normal
lengths, about 1% outliers 10-50x the median) and a passthrough `source` column."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.storage.ownership import MARK, OwnedFile, json_mark
from pipeline.text.synthetic import document_lengths, synthetic_text, vocabulary

_SOURCES = ("changelog", "ticket", "email", "wiki", "report")


def make_corpus(rows: int, seed: int = 0, median_words: int = 90) -> pa.Table:
    """The corpus as a table: `id`, `text`, and a passthrough `source` column."""
    rng = np.random.default_rng(seed)
    words = vocabulary()
    lengths = document_lengths(rng, rows, median_words=median_words)
    texts = [synthetic_text(rng, words, int(n)) for n in lengths]
    return pa.table(
        {
            "id": pa.array([f"doc-{seed}-{i:07d}" for i in range(rows)], pa.string()),
            "text": pa.array(texts, pa.string()),
            "source": pa.array(rng.choice(_SOURCES, size=rows).tolist(), pa.string()),
        }
    )


def _is_sample_corpus(path: Path) -> bool:
    try:
        metadata = pq.read_metadata(path).metadata or {}
    except (OSError, pa.ArrowException):
        return False
    return json_mark(metadata.get(CORPUS_KEY, b"")) is not None


CORPUS_KEY = b"llm_corpus_pipeline"  # the Parquet key-value metadata that marks our corpus
SAMPLE_CORPUS = OwnedFile("a sample corpus written by `pipeline dev sample-corpus`", _is_sample_corpus,
                          "Choose another file name.")


def write_corpus(out: Path, rows: int, seed: int = 0) -> Path:
    """Write the corpus to `out` (a .parquet file) and return its path. An existing file is
    replaced only if it is a corpus written here (`NotOurs` otherwise)."""
    table = make_corpus(rows, seed)
    table = table.replace_schema_metadata({CORPUS_KEY: json.dumps({"written_by": MARK, "rows": rows, "seed": seed})})
    sink = pa.BufferOutputStream()
    # Fixed row groups and no timestamps in metadata: same seed, same bytes.
    pq.write_table(table, sink, row_group_size=1024, store_schema=True)
    SAMPLE_CORPUS.write(out, sink.getvalue().to_pybytes())
    return out


