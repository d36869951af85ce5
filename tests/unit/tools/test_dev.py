"""The offline stand-ins are deterministic and shaped like what they stand in for."""

import numpy as np
import pytest
import pyarrow.parquet as pq

from pipeline.text.synthetic import document_lengths
from pipeline.tools.dev.corpus import make_corpus, write_corpus
from pipeline.models.tiny import build_tiny_model, fingerprint


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


@pytest.mark.parametrize("kind", ["llama", "bart"])
def test_the_tiny_models_write_words_to_the_token_limit_not_whitespace(tmp_path, kind):
    """Random weights decode greedily to one token forever; it was "\\n", so every summary was
    blank. With the blank tokens' logits pinned at 0, greedy decoding writes text, and never
    picks EOS, so every row runs to max_new_tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    out = build_tiny_model(tmp_path / kind, seed=0, kind=kind, **({"max_position_embeddings": 512} if kind == "bart"
                                                                  else {}))
    tok = AutoTokenizer.from_pretrained(out)
    model = (AutoModelForCausalLM if kind == "llama" else AutoModelForSeq2SeqLM).from_pretrained(out)
    for text in ["Ka lo mi ten sa ro vi del.", "x", "Tor al be qu in es ar on ma ne li ta co ra."]:
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            new = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
        new = new[0, ids.shape[1]:] if kind == "llama" else new[0, 1:]
        assert len(new) == 12 and tok.eos_token_id not in new.tolist()
        text = tok.decode(new, skip_special_tokens=True)
        assert text.strip() and "\ufffd" not in text  # words, not a lone byte of a character


def test_the_python_docs_corpus_is_real_text_of_many_lengths(tmp_path):
    from click.testing import CliRunner

    from pipeline.cli import main
    from pipeline.tools.dev.corpus import python_docs_corpus

    whole = python_docs_corpus()
    lengths = [len(t) for t in whole.column("text").to_pylist()]
    assert whole.num_rows == 79 and len(set(whole.column("id").to_pylist())) == 79
    assert min(lengths) < 300 and max(lengths) > 50_000  # short notes and documents past a small context
    some = python_docs_corpus(20)
    picked = [len(t) for t in some.column("text").to_pylist()]
    assert some.num_rows == 20 and min(picked) == min(lengths) and max(picked) == max(lengths)
    assert python_docs_corpus(20).equals(some)
    out = tmp_path / "docs.parquet"
    r = CliRunner().invoke(main, ["dev", "sample-corpus", str(out), "--kind", "python-docs", "--rows", "20"])
    assert r.exit_code == 0 and "20 rows" in r.output
    assert pq.read_table(out).select(["id", "text", "source"]).equals(some)
    # Its own file is replaced; the mark says what it is.
    r = CliRunner().invoke(main, ["dev", "sample-corpus", str(out), "--kind", "python-docs"])
    assert r.exit_code == 0 and pq.read_metadata(out).num_rows == 79


def test_the_python_paragraphs_are_short_real_rows(tmp_path):
    from click.testing import CliRunner

    from pipeline.cli import main
    from pipeline.tools.dev.corpus import python_paragraphs_corpus

    every = python_paragraphs_corpus()
    lengths = [len(t) for t in every.column("text").to_pylist()]
    assert every.num_rows > 400 and min(lengths) >= 250 and max(lengths) <= 600
    assert len(set(every.column("id").to_pylist())) == every.num_rows
    out = tmp_path / "paragraphs.parquet"
    r = CliRunner().invoke(main, ["dev", "sample-corpus", str(out), "--kind", "python-paragraphs", "--rows", "48"])
    assert r.exit_code == 0 and "48 rows" in r.output
    assert pq.read_table(out).select(["id", "text", "source"]).equals(python_paragraphs_corpus(48))
