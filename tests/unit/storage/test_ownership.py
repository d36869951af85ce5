"""Nothing a command writes lands on what the pipeline did not write: a user's model folder,
a tune folder, the learned limits, a corpus file, a result. Each refusal comes before any
expensive work, names the path and what is there, and leaves every byte as it was."""

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import EXIT_BAD_CONFIG, main
from pipeline.models.tiny import MARKER, cached_tiny_model, ensure_tiny_model
from pipeline.models.source import ModelError, check_local_model, resolve_model
from pipeline.storage.ownership import NotOurs, OwnedFile, OwnedFolder, json_mark
from tests.helpers import REPO

NIGHTLY, LOCAL = "jobs/nightly_summarize.yaml", "conf/local.yaml"


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` by relative path, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def safetensors(tensors: dict[str, int], cut: int = 0) -> bytes:
    """A safetensors file of uint8 tensors of these sizes (`cut`: bytes missing at the end)."""
    header, at = {}, 0
    for name, n in tensors.items():
        header[name] = {"dtype": "U8", "shape": [n], "data_offsets": [at, at + n]}
        at += n
    head = json.dumps(header).encode()
    data = struct.pack("<Q", len(head)) + head + bytes(at)
    return data[:len(data) - cut]


@pytest.fixture
def users_model(tmp_path) -> Path:
    """A folder shaped like a Hugging Face model, as a user converted it: config, tokenizer,
    and weights that are not weights (no real model is needed to show it is never touched)."""
    folder = tmp_path / "SmolLM2-135M-Instruct"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                    "hidden_size": 576, "num_hidden_layers": 30}))
    (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 8192}))
    (folder / "generation_config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"\x00" * 7 + b"not really 269 MB of weights")
    return folder


# --- the model folder --------------------------------------------------------------------


def test_the_reproduction_a_users_model_folder_exits_2_before_ray_with_every_byte_intact(tmp_path, users_model):
    """The issue's run, through the CLI: the local profile, model.name at the user's folder."""
    from pipeline.tools.dev.corpus import write_corpus

    corpus = write_corpus(tmp_path / "c.parquet", rows=30, seed=0)
    before = snapshot(users_model)
    started = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "pipeline", "run", NIGHTLY, "--profile", LOCAL, "--input", str(corpus),
         "--output", str(tmp_path / "out"), "--set", f"model.name={users_model}", "--set", "engine.dtype=float32"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    assert r.returncode == EXIT_BAD_CONFIG, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: model.name: {users_model}: model.safetensors is not a safetensors file")
    assert time.monotonic() - started < 30 and "Ray instance" not in r.stderr
    assert snapshot(users_model) == before
    assert sorted(os.listdir(tmp_path)) == ["SmolLM2-135M-Instruct", "c.parquet"]  # no output, lock or staging


def test_the_old_spelling_never_builds_over_a_folder_that_holds_something(tmp_path, users_model):
    """The profile as the issue's user had it: model.name a folder, model.tiny_model_seed set."""
    profile = tmp_path / "old.yaml"
    profile.write_text((REPO / LOCAL).read_text().replace("name: tiny", f"name: {users_model}\n  tiny_model_seed: 0"))
    before = snapshot(users_model)
    r = CliRunner().invoke(main, ["run", str(REPO / NIGHTLY), "--profile", str(profile),
                                  "--input", str(write_corpus_for(tmp_path)), "--output", str(tmp_path / "out")])
    assert r.exit_code == EXIT_BAD_CONFIG, r.output
    last = r.output.strip().splitlines()[-1]
    assert f"{users_model} is not a folder of the tiny random model" in last
    assert "config.json, generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json" in last
    assert "To run your own model, set model.name to its folder" in last and "model.name: tiny" in last
    assert snapshot(users_model) == before
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def write_corpus_for(tmp_path: Path) -> Path:
    from pipeline.tools.dev.corpus import write_corpus

    return write_corpus(tmp_path / "c.parquet", rows=10, seed=0)


def test_a_users_real_model_folder_is_only_read(tmp_path, tiny_model):
    """A whole model that is not ours (the tiny one, copied without our marker) resolves to
    itself, unchanged, whatever the profile's tiny_model_seed said before."""
    mine = tmp_path / "mine"
    shutil.copytree(tiny_model, mine)
    (mine / MARKER).unlink()
    before = snapshot(mine)
    assert resolve_model(str(mine)).path == str(mine) and resolve_model(str(mine)).kind == "local"
    with pytest.raises(NotOurs, match="not a folder of the tiny random model"):
        resolve_model(str(mine), tiny_model_seed=0)
    assert snapshot(mine) == before


def test_tiny_by_name_lives_in_the_cache_and_a_foreign_cache_folder_is_refused(tmp_path, monkeypatch, tiny_model):
    assert resolve_model("tiny").path == str(tiny_model) == str(cached_tiny_model("tiny"))
    monkeypatch.setenv("PIPELINE_CACHE_DIR", str(tmp_path / "cache"))
    squatter = cached_tiny_model("tiny")
    squatter.mkdir(parents=True)
    (squatter / "weights.bin").write_bytes(b"someone's")
    r = CliRunner().invoke(main, ["run", str(REPO / NIGHTLY), "--profile", str(REPO / LOCAL),
                                  "--input", str(write_corpus_for(tmp_path)), "--output", str(tmp_path / "out")])
    assert r.exit_code == EXIT_BAD_CONFIG
    assert f"{squatter} is not a folder of the tiny random model: it holds weights.bin" in r.output
    assert "PIPELINE_CACHE_DIR" in r.output and snapshot(squatter) == {"weights.bin": b"someone's"}


def test_the_tiny_model_is_built_only_where_nothing_is_or_it_is_already(tmp_path, tiny_model):
    empty = tmp_path / "empty"
    empty.mkdir()
    built = ensure_tiny_model(empty, seed=0)
    assert snapshot(built) == snapshot(tiny_model)  # same seed, same bytes; the marker lists every file
    assert json.loads((built / MARKER).read_text())["files"].keys() == set(snapshot(built)) - {MARKER}
    stamp = {p.name: p.stat().st_mtime_ns for p in built.iterdir()}
    ensure_tiny_model(built, seed=0)  # already there: nothing is written
    assert {p.name: p.stat().st_mtime_ns for p in built.iterdir()} == stamp
    with pytest.raises(NotOurs, match="holds the tiny llama model for seed 0, not the llama model for seed 1"):
        ensure_tiny_model(built, seed=1)
    (built / "my-notes.txt").write_text("mine")
    with pytest.raises(NotOurs, match=r"not the files it lists: my-notes.txt differ"):
        ensure_tiny_model(built, seed=0)
    assert (built / "my-notes.txt").read_text() == "mine"
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(NotOurs, match="is a file"):
        ensure_tiny_model(file)
    assert not [p for p in tmp_path.iterdir() if ".building-" in p.name]  # nothing half-built left beside


def test_an_older_build_of_the_tiny_model_is_ours_and_rebuilt_in_place(tmp_path, tiny_model):
    """The build before this one wrote only newlines, and marked its folder `{"seed": 0}`:
    rebuilt (every file in it is one it wrote); with a file of the user's in it, refused."""
    old = tmp_path / "old"
    shutil.copytree(tiny_model, old)
    (old / MARKER).write_text('{"seed": 0}')
    (old / "model.safetensors").write_bytes(b"the old weights")
    assert ensure_tiny_model(old, seed=0) == old
    assert snapshot(old) == snapshot(tiny_model) and sorted(os.listdir(tmp_path)) == ["old"]
    (old / MARKER).write_text('{"seed": 0}')
    (old / "thesis.tex").write_text("mine")
    with pytest.raises(NotOurs, match="holds an older build of the tiny model, and files it never wrote: thesis.tex"):
        ensure_tiny_model(old, seed=0)
    assert (old / "thesis.tex").read_text() == "mine"


@pytest.mark.parametrize("damage, message", [
    (lambda m: (m / "config.json").unlink(), "holds no config.json"),
    (lambda m: (m / "config.json").write_text("{"), "config.json is not valid JSON"),
    (lambda m: (m / "tokenizer.json").unlink(), "holds no tokenizer"),
    (lambda m: (m / "model.safetensors").unlink(), "holds no weights"),
    (lambda m: (m / "model.safetensors").write_bytes(safetensors({"w": 64}, cut=10)), "is cut short"),
    (lambda m: (m / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00" + b"[" * 16),
     "its header does not parse"),
    (lambda m: (m / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "b.safetensors"}})),
     "names shards that are not there: b.safetensors"),
])
def test_a_model_folder_that_cannot_load_is_a_clear_error(tmp_path, damage, message):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "tokenizer.json").write_text("{}")
    (model / "model.safetensors").write_bytes(safetensors({"a": 8, "b": 16}))
    check_local_model(model)  # whole, it passes
    damage(model)
    with pytest.raises(ModelError, match=message):
        check_local_model(model)


def test_a_missing_local_path_is_not_mistaken_for_a_hub_id(tmp_path):
    with pytest.raises(ModelError, match="no such folder"):
        resolve_model(str(tmp_path / "models" / "gone"))
    assert resolve_model("Qwen/Qwen2.5-1.5B-Instruct").kind == "hub"


# --- every other path a command writes ---------------------------------------------------


def test_tune_out_onto_a_folder_with_a_foreign_file_is_refused_before_any_engine(tmp_path):
    out = tmp_path / "tune"
    out.mkdir()
    (out / "results.csv").write_text("mine")
    started = time.monotonic()
    r = CliRunner().invoke(main, ["tune", str(REPO / NIGHTLY), "--profile", str(REPO / LOCAL), "--out", str(out),
                                  "--input", str(write_corpus_for(tmp_path))])
    assert r.exit_code == EXIT_BAD_CONFIG
    assert f"{out} holds files this pipeline did not write: results.csv" in r.output.strip().splitlines()[-1]
    assert time.monotonic() - started < 20 and snapshot(out) == {"results.csv": b"mine"}


def test_tune_out_replaces_only_what_an_earlier_tune_listed(tmp_path):
    from pipeline.tools.tune.outputs import TUNE_OUT

    out = tmp_path / "tune"
    TUNE_OUT.write(out, {"sweep.csv": b"1", "sweep.png": b"2", "sweep.json": json.dumps(
        {"written_by": "llm-corpus-pipeline", "files": ["sweep.csv", "sweep.json", "sweep.png"]}).encode()})
    # A second tune that drew no plot: its own earlier plot goes, the rest is replaced.
    TUNE_OUT.write(out, {"sweep.csv": b"3", "sweep.json": json.dumps(
        {"written_by": "llm-corpus-pipeline", "files": ["sweep.csv", "sweep.json"]}).encode()})
    assert sorted(os.listdir(out)) == ["sweep.csv", "sweep.json"]
    # A folder an older tune wrote (its sweep.json listed nothing) is still its own.
    old = tmp_path / "old"
    old.mkdir()
    (old / "sweep.json").write_text(json.dumps({"tuned_at": "2026-11-29", "buckets": {}}))
    (old / "profile.yaml").write_text("# Written by `pipeline tune`")
    assert TUNE_OUT.check(old) == {"sweep.json", "profile.yaml"}
    (old / "notes.md").write_text("mine")
    with pytest.raises(NotOurs, match="notes.md"):
        TUNE_OUT.check(old)


def test_sample_corpus_onto_a_foreign_file_is_refused_and_onto_its_own_replaces_it(tmp_path):
    theirs = tmp_path / "theirs.parquet"
    theirs.write_bytes(b"PAR1 someone's data")
    r = CliRunner().invoke(main, ["dev", "sample-corpus", str(theirs), "--rows", "5"])
    assert r.exit_code == EXIT_BAD_CONFIG and f"{theirs} holds a file this pipeline did not write" in r.output
    assert theirs.read_bytes() == b"PAR1 someone's data"
    ours = tmp_path / "ours.parquet"
    for rows in (5, 7):
        assert CliRunner().invoke(main, ["dev", "sample-corpus", str(ours), "--rows", str(rows)]).exit_code == 0
    import pyarrow.parquet as pq

    assert pq.read_metadata(ours).num_rows == 7


def test_dev_tiny_model_onto_a_foreign_folder_is_refused(tmp_path, users_model):
    before = snapshot(users_model)
    r = CliRunner().invoke(main, ["dev", "tiny-model", str(users_model)])
    assert r.exit_code == EXIT_BAD_CONFIG and "Choose a new or empty folder" in r.output
    assert snapshot(users_model) == before


def test_learned_limits_at_a_foreign_file_stop_the_run_before_ray(tmp_path):
    """Refused, not warned about: the path is a setting gone wrong (here, a profile), and a
    run that went on would start cold every night behind a warning."""
    theirs = tmp_path / "my-profile.yaml"
    theirs.write_text("model:\n  name: mine\n")
    r = CliRunner().invoke(main, ["run", str(REPO / NIGHTLY), "--profile", str(REPO / LOCAL),
                                  "--input", str(write_corpus_for(tmp_path)), "--output", str(tmp_path / "out"),
                                  "--set", f"batching.learned_limits={theirs}"])
    assert r.exit_code == EXIT_BAD_CONFIG
    assert f"{theirs} holds a file this pipeline did not write (it is not a learned-limits file)" in r.output
    assert theirs.read_text() == "model:\n  name: mine\n" and not (tmp_path / "out").exists()
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_learned_limits_replace_only_their_own_file(tmp_path):
    from pipeline.run.limits import load_limits, save_limits

    path = tmp_path / "limits.yaml"
    path.write_text("key: {model: m}\nsaved_at: 0\nlimits: {le128: 1}\n")  # written before the mark
    save_limits(str(path), {"model": "m"}, {"le128": 4096})
    assert load_limits(str(path), {"model": "m"}, 30) == {"le128": 4096}
    path.write_text("not: ours\n")
    with pytest.raises(NotOurs):
        save_limits(str(path), {"model": "m"}, {"le128": 1})
    assert path.read_text() == "not: ours\n"


def test_bench_and_gpu_check_results_are_not_written_over_foreign_files(tmp_path):
    from bench.__main__ import bench
    from pipeline.tools import gpucheck

    theirs = tmp_path / "result.json"
    theirs.write_text('{"mine": true}')
    r = CliRunner().invoke(bench, ["--out", str(tmp_path / "result"), "--repeats", "1"])
    assert r.exit_code == 2 and "did not write" in r.output and theirs.read_text() == '{"mine": true}'
    assert gpucheck.main(["--out", str(theirs)]) == 2 and theirs.read_text() == '{"mine": true}'
    png = tmp_path / "plot.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + b"someone's picture")
    assert gpucheck.main(["--plot", str(theirs), str(png)]) == 2


def test_owned_file_and_folder_refuse_the_wrong_shape(tmp_path):
    owned = OwnedFile("a thing", lambda p: p.read_bytes() == b"ours", "Choose again.")
    (tmp_path / "dir").mkdir()
    with pytest.raises(NotOurs, match=r"is a folder \(empty\), not a thing. Nothing was changed. Choose again."):
        owned.check(tmp_path / "dir")
    owned.write(tmp_path / "new" / "f", b"ours")
    owned.write(tmp_path / "new" / "f", b"ours")  # its own: replaced
    folder = OwnedFolder("a set", "list.json", lambda d: set((json_mark(d) or {}).get("files", [])) or None, "")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotOurs, match="is a file, not a folder"):
        folder.check(tmp_path / "file")
    many = tmp_path / "many"
    many.mkdir()
    for i in range(8):
        (many / f"f{i}").write_text("x")
    with pytest.raises(NotOurs, match=r"f0, f1, f2, f3, f4 and 3 more \(no list.json"):
        folder.check(many)
