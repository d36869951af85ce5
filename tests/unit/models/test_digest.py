"""A model is known by its content: digested once per folder, kept while its files are as they were."""

import json
import os

from pipeline.models import digest
from pipeline.models.digest import model_digest


def folder(tmp_path, weights=b"\x00" * 1024):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"hidden_size": 64}))
    (model / "model.safetensors").write_bytes(weights)
    (model / "tokenizer.json").write_text("{}")
    return model


def test_new_weights_under_the_same_name_change_the_digest(tmp_path):
    model = folder(tmp_path)
    before = model_digest(model)
    assert model_digest(model) == before  # the same files: the same digest
    folder(tmp_path, weights=b"\x01" * 1024)  # same name, same size, new content
    assert model_digest(model) != before
    (model / "chat_template.jinja").write_text("{{ messages }}")  # a file more: the template counts
    assert len({before, model_digest(model)}) == 2


def test_the_digest_is_kept_in_the_pipelines_cache_not_in_the_users_folder(tmp_path, monkeypatch):
    model = folder(tmp_path)
    listing = sorted(p.name for p in model.iterdir())
    first = model_digest(model)
    assert sorted(p.name for p in model.iterdir()) == listing  # nothing written beside the weights
    hashed = []
    real_hash = digest._hash
    monkeypatch.setattr(digest, "_hash", lambda path, files: hashed.append(path) or real_hash(path, files))
    assert model_digest(model) == first and hashed == []  # sizes and times unchanged: not hashed again
    os.utime(model / "model.safetensors", ns=(1, 1))  # touched: hashed again
    assert model_digest(model) == first and len(hashed) == 1


def test_a_single_file_model_is_digested_as_its_file(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"\x00" * 100)
    first = model_digest(gguf)
    gguf.write_bytes(b"GGUF" + b"\x01" * 100)
    assert model_digest(gguf) != first
