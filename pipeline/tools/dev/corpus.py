"""Sample corpora as Parquet files, both built offline:
- synthetic: ids, text from `pipeline.text.synthetic` (log-normal lengths, about 1% outliers
  10-50x the median) and a passthrough `source` column;
- python-docs: real English text that ships with Python, the reference manual's topics
  (`pydoc_data.topics`: 79 documents, median 1.7k characters, up to 62k, so they fill
  several buckets and a few pass a small model's context);
- python-paragraphs: the same manual's prose paragraphs of 250-600 characters (about 100
  prompt tokens each, 489 of them): short real rows whose outputs, not their prompts,
  fill the KV cache, as in the preemption drill of docs/batching.md."""

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


def python_docs_corpus(rows: int | None = None) -> pa.Table:
    """The Python reference manual's topics, one document each, in name order; `rows` of
    them (all 79 if None), spread evenly over their lengths, the shortest and longest kept."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    if rows is not None and rows < len(names):
        by_length = sorted(names, key=lambda n: (len(topics[n]), n))
        step = (len(by_length) - 1) / max(rows - 1, 1)
        names = sorted({by_length[round(k * step)] for k in range(rows)})
    return _pydoc_table([(f"pydoc-{name}", topics[name].strip()) for name in names],
                        "section of the Python reference manual")


def python_paragraphs_corpus(rows: int | None = None) -> pa.Table:
    """The manual's prose paragraphs of 250-600 characters (whitespace runs as one space,
    doctest examples left out), in topic order; `rows` of them (all if None), evenly spaced."""
    from pydoc_data.topics import topics

    paragraphs = [(f"pydoc-{name}-{k}", p) for name in sorted(topics)
                  for k, p in enumerate(" ".join(p.split()) for p in topics[name].split("\n\n"))
                  if 250 <= len(p) <= 600 and not p.startswith(">>>")]
    if rows is not None and rows < len(paragraphs):
        paragraphs = paragraphs[:: len(paragraphs) // rows][:rows]
    return _pydoc_table(paragraphs, "paragraph of the Python reference manual")


def _pydoc_table(documents: list[tuple[str, str]], source: str) -> pa.Table:
    """(id, text) pairs as a corpus: id, text, and `source` on every row."""
    return pa.table({
        "id": pa.array([i for i, _ in documents], pa.string()),
        "text": pa.array([t for _, t in documents], pa.string()),
        "source": pa.array([source] * len(documents), pa.string()),
    })


KINDS = ("synthetic", "python-docs", "python-paragraphs")


def _is_sample_corpus(path: Path) -> bool:
    try:
        metadata = pq.read_metadata(path).metadata or {}
    except (OSError, pa.ArrowException):
        return False
    return json_mark(metadata.get(CORPUS_KEY, b"")) is not None


CORPUS_KEY = b"llm_corpus_pipeline"  # the Parquet key-value metadata that marks our corpus
SAMPLE_CORPUS = OwnedFile("a sample corpus written by `pipeline dev sample-corpus`", _is_sample_corpus,
                          "Choose another file name.")


def write_corpus(out: Path, rows: int | None, seed: int = 0, kind: str = "synthetic") -> Path:
    """Write the corpus to `out` (a .parquet file) and return its path: `rows` synthetic
    rows, or `rows` of the Python manual's topics (`kind="python-docs"`) or paragraphs
    (`"python-paragraphs"`; `seed` unused for both).
    An existing file is replaced only if it is a corpus written here (`NotOurs` otherwise)."""
    if kind in ("python-docs", "python-paragraphs"):
        table = (python_docs_corpus if kind == "python-docs" else python_paragraphs_corpus)(rows)
        mark = {"written_by": MARK, "kind": kind, "rows": table.num_rows}
    else:
        table = make_corpus(rows, seed)
        mark = {"written_by": MARK, "rows": rows, "seed": seed}
    table = table.replace_schema_metadata({CORPUS_KEY: json.dumps(mark)})
    sink = pa.BufferOutputStream()
    # Fixed row groups and no timestamps in metadata: same seed, same bytes.
    pq.write_table(table, sink, row_group_size=1024, store_schema=True)
    SAMPLE_CORPUS.write(out, sink.getvalue().to_pybytes())
    return out


