"""A row's result key changes with every input that determines its result, and with
nothing that does not (`pipeline.generation.result_key`)."""

from dataclasses import replace

import pytest

from pipeline.config import load_run_config
from pipeline.generation.engine import Sampling
from pipeline.generation.result_key import PREFIX, result_key, run_key_base
from pipeline.run.plan import prepare_settings, result_keys
from tests.helpers import REPO

GREEDY = Sampling(max_new_tokens=32)
ENGINE = {"backend": "vllm", "dtype": "bfloat16", "max_model_len": 2048, "structured_outputs_backend": "xgrammar",
          "extra": {}}
JOB = {"prompt": {"template": "Summarize: {text}", "system": None}, "length": {"policy": "truncate"}}


def key(model="m1", sampling=GREEDY, engine=ENGINE, job=JOB, ids=(1, 2, 3), annotation=None, chunks=None):
    return result_key(run_key_base(model, sampling, engine, job), list(ids) if ids is not None else None,
                      annotation, chunks)


@pytest.mark.parametrize("change", [
    {"model": "m2"},
    {"ids": (1, 2, 4)},
    {"ids": (1, 2, 3, 0)},
    {"annotation": [7, 8]},
    {"chunks": ["first window", "second"]},
    {"sampling": replace(GREEDY, max_new_tokens=64)},
    {"sampling": replace(GREEDY, temperature=0.7, seed=1)},
    {"sampling": replace(GREEDY, top_p=0.9)},
    {"engine": {**ENGINE, "dtype": "float32"}},
    {"engine": {**ENGINE, "backend": "transformers"}},
    {"engine": {**ENGINE, "max_model_len": 1024}},
    {"engine": {**ENGINE, "extra": {"quantization": "fp8"}}},
    {"job": {**JOB, "prompt": {"template": "Summarize briefly: {text}", "system": None}}},
    {"job": {**JOB, "length": {"policy": "chunk"}}},
])
def test_each_input_to_the_key_changes_it(change):
    same = key()
    assert same == key() and same.startswith(PREFIX) and len(same) == len(PREFIX) + 32
    assert key(**change) != same


def test_windows_are_told_apart_however_their_text_is_split():
    assert key(ids=None, chunks=["ab", "c"]) != key(ids=None, chunks=["a", "bc"])


def test_a_seed_is_part_of_the_key_and_unseeded_sampling_has_none():
    seeded = replace(GREEDY, temperature=0.7, seed=1)
    assert key(sampling=seeded) != key(sampling=replace(seeded, seed=2))
    assert run_key_base("m1", replace(GREEDY, temperature=0.7), ENGINE, JOB) is None
    assert run_key_base(None, GREEDY, ENGINE, JOB) is None  # no content digest: no key
    assert result_key(None, [1, 2]) is None and result_key("base", None) is None  # no prompt, no key


def config(*sets):
    return load_run_config(REPO / "jobs/nightly_summarize.yaml", REPO / "conf/local.yaml", list(sets))


def test_settings_that_cannot_change_a_result_leave_the_runs_keys_as_they_are(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")

    def base(*sets):
        c = config(*sets)
        return result_keys(c, prepare_settings(c, str(model), 2048))["base"]

    plain = base()
    assert plain is not None
    for unrelated in ("batching.generate_batch_rows=32", "batching.concurrent_batches=2",
                      "batching.memory_target=0.5", "hardware.num_engines=2", "engine.max_num_seqs=64",
                      "engine.gpu_memory_utilization=0.3", "batching.policy={kind: fixed, rows_per_call: 8}",
                      "bucketing.window_rows=512", "engine.stall_timeout_s=30"):
        assert base(unrelated) == plain, unrelated
    for related in ("sampling.max_new_tokens=48", "sampling.seed=7", "engine.dtype=float32"):
        assert base(related) != plain, related


def test_a_run_without_model_files_or_a_seed_says_why_it_has_no_keys(tmp_path):
    hub = result_keys(config(), prepare_settings(config(), "someone/some-model", 2048))
    assert hub["base"] is None and "hub id" in hub["off"]
    (tmp_path / "w").write_bytes(b"w")
    sampled = config("sampling.temperature=0.8", "sampling.seed=null")
    off = result_keys(sampled, prepare_settings(sampled, str(tmp_path), 2048))
    assert off["base"] is None and "no seed" in off["off"]


# The input key: found before tokenizing, so it must change wherever the prompt could.

def test_a_rows_input_key_changes_with_its_text_and_each_field_told_apart():
    from pipeline.generation.result_key import INPUT_PREFIX, input_key

    same = input_key("b", "text", ["email", "x"])
    assert same == input_key("b", "text", ["email", "x"]) and same.startswith(INPUT_PREFIX)
    for other in (input_key("c", "text", ["email", "x"]), input_key("b", "text.", ["email", "x"]),
                  input_key("b", "text", ["emai", "lx"]), input_key("b", "text", ["email"]),
                  input_key("b", "textemail", ["x"])):
        assert other != same


def test_every_setting_that_shapes_a_prompt_changes_the_input_base_and_none_other(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")

    def keys(*sets, cap=None, **changes):
        c = config(*sets)
        prepare = replace(prepare_settings(c, str(model), 2048, cap_tokens=cap), **changes)
        return result_keys(c, prepare)

    plain = keys()
    assert plain["input_base"] is not None and plain["input_version"] == 1
    # Every input of the result key's base is one of the input key's too.
    for related in ("sampling.max_new_tokens=48", "engine.dtype=float32", "prompt.template='Say: {text}'",
                    "length.policy=chunk", "input.null_as=none", "bucketing.boundaries=[64, 128]"):
        assert keys(related)["input_base"] != plain["input_base"], related
    for change in ({"text_column": "body"}, {"max_model_len": 1024}):
        assert keys(**change)["input_base"] != plain["input_base"], change
    assert keys(cap=100)["input_base"] != plain["input_base"]  # the corpus percentile cap
    # Where the model lies, the debug drills and batch sizes change no prompt.
    assert keys("batching.prepare_batch_rows=7", "batching.generate_batch_rows=32", delay_s=1.0, hold_s=3.0,
                hold_until="/x")["input_base"] == plain["input_base"]
    hub = result_keys(config(), prepare_settings(config(), "someone/some-model", 2048))
    assert hub["input_base"] is None  # no result key, no input key
