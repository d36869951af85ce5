"""A synthetic corpus with the length distribution real corpora have.

Document lengths (in words) are log-normal, so most rows are short and a few
are long, and about 1% are outliers 10-50x the median: the changelog or the
contract that lands in a nightly batch of short notes. Text is built from a
fixed syllable inventory, so the tiny model's tokenizer (trained on the same
generator) compresses it the way a real tokenizer compresses prose.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.ownership import MARK, OwnedFile, json_mark

_SYLLABLES = (
    "ka lo mi ten sa ro vi del an or pe ut ri mo na sel tor al be qu "
    "in es ar on ma ne li ta co ra de po si lu ve ga fi no ho"
).split()
_SOURCES = ("changelog", "ticket", "email", "wiki", "report")


def _vocabulary(size: int = 2000) -> list[str]:
    # One fixed vocabulary for every seed, so the tokenizer trained on it fits
    # every corpus the generator makes.
    rng = np.random.default_rng(20261129)
    words = []
    for _ in range(size):
        n = int(rng.integers(1, 4))
        words.append("".join(rng.choice(_SYLLABLES, size=n)))
    return words


def synthetic_text(rng: np.random.Generator, words: list[str], n_words: int) -> str:
    """`n_words` words in sentences of 6-18 words and paragraphs of 3-7 sentences."""
    # Zipf-like word frequencies, as in natural text.
    ranks = np.arange(1, len(words) + 1)
    weights = 1.0 / ranks
    weights /= weights.sum()
    picked = rng.choice(len(words), size=n_words, p=weights)
    paragraphs, sentences, sentence = [], [], []
    sentence_len = int(rng.integers(6, 19))
    paragraph_len = int(rng.integers(3, 8))
    for i, idx in enumerate(picked):
        sentence.append(words[idx])
        if len(sentence) == sentence_len or i == n_words - 1:
            text = " ".join(sentence)
            sentences.append(text[0].upper() + text[1:] + ".")
            sentence, sentence_len = [], int(rng.integers(6, 19))
            if len(sentences) == paragraph_len or i == n_words - 1:
                paragraphs.append(" ".join(sentences))
                sentences, paragraph_len = [], int(rng.integers(3, 8))
    return "\n\n".join(paragraphs)


def document_lengths(
    rng: np.random.Generator,
    rows: int,
    median_words: int = 90,
    sigma: float = 0.9,
    outlier_share: float = 0.01,
) -> np.ndarray:
    """Log-normal body; `outlier_share` of rows are 10-50x the median."""
    lengths = rng.lognormal(mean=np.log(median_words), sigma=sigma, size=rows)
    outliers = rng.random(rows) < outlier_share
    lengths[outliers] = median_words * rng.uniform(10, 50, size=int(outliers.sum()))
    return np.maximum(lengths.astype(np.int64), 1)


def make_corpus(rows: int, seed: int = 0, median_words: int = 90) -> pa.Table:
    """The corpus as a table: `id`, `text`, and a passthrough `source` column."""
    rng = np.random.default_rng(seed)
    words = _vocabulary()
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


def tokenizer_training_text(seed: int = 0, documents: int = 400) -> list[str]:
    """Text drawn from the same generator, to train the tiny model's tokenizer."""
    rng = np.random.default_rng(seed)
    words = _vocabulary()
    return [synthetic_text(rng, words, 200) for _ in range(documents)]
