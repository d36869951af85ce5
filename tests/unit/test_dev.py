"""The offline stand-ins are deterministic and shaped like what they stand in for."""

import numpy as np
import pyarrow.parquet as pq

from pipeline.dev.corpus import document_lengths, make_corpus, write_corpus
from pipeline.dev.tiny_model import build_tiny_model, fingerprint


def test_tiny_model_is_deterministic(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=3)
    b = build_tiny_model(tmp_path / "b", seed=3)
    c = build_tiny_model(tmp_path / "c", seed=4)
    assert fingerprint(a) == fingerprint(b)
    assert fingerprint(a) != fingerprint(c)


def test_tiny_model_fits_the_cpu_backend(tmp_path):
    import json

    from transformers import AutoTokenizer

    out = build_tiny_model(tmp_path / "m")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["hidden_size"] // cfg["num_attention_heads"] >= 32  # CPU attention rejects head_dim 16
    tok = AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template([{"role": "user", "content": "hi ✓"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|assistant|>\n")
    # Byte-level BPE: any text round-trips, nothing becomes <unk>.
    assert tok.decode(tok("ünïcødé ✓ 中文", add_special_tokens=False)["input_ids"]) == "ünïcødé ✓ 中文"


def test_corpus_is_deterministic(tmp_path):
    a = write_corpus(tmp_path / "a.parquet", rows=50, seed=7)
    b = write_corpus(tmp_path / "b.parquet", rows=50, seed=7)
    assert a.read_bytes() == b.read_bytes()
    assert not make_corpus(50, seed=8).equals(pq.read_table(a))


def test_corpus_shape():
    t = make_corpus(300, seed=1)
    assert t.column_names == ["id", "text", "source"]
    ids = t.column("id").to_pylist()
    assert len(set(ids)) == 300
    assert all(t.column("text").to_pylist())


def test_lengths_are_heavy_tailed():
    lengths = document_lengths(np.random.default_rng(0), 20000, median_words=90)
    median = np.median(lengths)
    assert 70 < median < 110
    outliers = np.mean(lengths >= 10 * 90)
    assert 0.008 < outliers < 0.02  # ~1% planted, plus the log-normal's own tail
    assert lengths.max() <= 50 * 90 * 1.1
