"""Synthetic prose with the shape real corpora have, from a fixed syllable inventory.

Document lengths (in words) are log-normal, so most rows are short and a few are long,
and about 1% are outliers 10-50x the median: the changelog or the contract that lands in
a nightly batch of short notes. Words follow Zipf-like frequencies in sentences and
paragraphs. The tiny model's tokenizer is trained on the same generator, so it
compresses this text the way a real tokenizer compresses prose. Pure: no I/O.
"""

from __future__ import annotations

import numpy as np

_SYLLABLES = (
    "ka lo mi ten sa ro vi del an or pe ut ri mo na sel tor al be qu "
    "in es ar on ma ne li ta co ra de po si lu ve ga fi no ho"
).split()


def vocabulary(size: int = 2000) -> list[str]:
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


def tokenizer_training_text(seed: int = 0, documents: int = 400) -> list[str]:
    """Text drawn from the same generator, to train the tiny model's tokenizer."""
    rng = np.random.default_rng(seed)
    words = vocabulary()
    return [synthetic_text(rng, words, 200) for _ in range(documents)]
