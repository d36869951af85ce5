"""Templates name columns and struct fields, nothing else; nulls render as `input.null_as`."""


import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import InputConfig
from pipeline.config import ConfigError, load_run_config
from pipeline.storage.inputs import InputError, check_inputs
from pipeline.stages.prepare import PrepareSettings, PrepareStage, Prompt, PromptRenderer

from tests.helpers import REPO  # noqa: E402
JOB = REPO / "jobs" / "nightly_summarize.yaml"
KB = REPO / "jobs" / "kb_ingest.yaml"
LOCAL = REPO / "conf" / "local.yaml"


@pytest.mark.parametrize("field, message", [
    ("{text.__class__.__mro__}", r"\{text\.__class__\.__mro__\}: attribute access is not allowed"),
    ("{text.__class__}", r"attribute access is not allowed"),
    ("{meta.a.b}", r"\{meta\.a\.b\}: attribute access is not allowed"),
    ("{text[0]}", r"\{text\[0\]\}: indexing is not allowed"),
    ("{text!r}", r"\{text!r\}: conversions \(!r\) are not allowed"),
    ("{text:>2000000000}", r"\{text:>2000000000\}: format specs \(:>2000000000\) are not allowed"),
    ("{text:{id}}", r"format specs \(:\{id\}\) are not allowed"),
])
def test_templates_refuse_all_but_columns_and_struct_fields(tmp_path, field, message):
    job = tmp_path / "job.yaml"
    job.write_text(JOB.read_text().replace("    {text}", f"    {field}"))
    with pytest.raises(ConfigError, match=rf"{job}: prompt\.template: .*{message}"):
        load_run_config(job, LOCAL)
    with pytest.raises(ConfigError, match=rf"annotations\.prompt\.template: .*{message}"):
        load_run_config(KB, LOCAL, [f"annotations.prompt.template=Tag {field}"])


def test_columns_and_struct_fields_are_allowed():
    cfg = load_run_config(JOB, LOCAL, ["prompt.template=From {meta.title} ({source}): {text} {{literal}}"])
    assert cfg.job.prompt.fields() == {"meta", "source", "text"}
    assert cfg.job.template_fields() == {"prompt.template": {"meta.title", "source", "text"}}
    assert cfg.job.input.null_as == ""
    assert load_run_config(JOB, LOCAL, ["input.null_as=(none)"]).job.input.null_as == "(none)"


def _meta(titles):
    return pa.array([None if t is ... else {"title": t, "year": 2020} for t in titles],
                    pa.struct([("title", pa.string()), ("year", pa.int64())]))


def test_struct_fields_are_checked_against_the_schema(tmp_path):
    f = tmp_path / "x.parquet"
    pq.write_table(pa.table({"id": ["a"], "text": ["t"], "meta": _meta(["T"])}), f)
    assert check_inputs(InputConfig(path=str(f)), {"prompt.template": {"text", "meta.title"}}).rows == 1
    with pytest.raises(InputError, match=r"jobs/x.yaml: prompt.template names \{meta.author\}, but struct column "
                                         r"'meta' of .* has no field 'author' \(fields: title, year\)"):
        check_inputs(InputConfig(path=str(f)), {"prompt.template": {"meta.author"}}, job_file="jobs/x.yaml")
    with pytest.raises(InputError, match=r"names \{text.title\}, but column 'text' of .* is string, not a struct"):
        check_inputs(InputConfig(path=str(f)), {"prompt.template": {"text.title"}})
    with pytest.raises(InputError, match=r"names \['info.title'\], which are not columns"):
        check_inputs(InputConfig(path=str(f)), {"prompt.template": {"info.title"}})


def stage_for(tiny_model, template, null_as=""):
    return PrepareStage(PrepareSettings(model_path=str(tiny_model), max_model_len=512, prompt=Prompt(template),
                                        max_new_tokens=16, null_as=null_as))


def prompts(stage, batch):
    out = stage(batch)
    return [stage.tokenizer.decode(ids) for ids in out.column("_prompt_token_ids").to_pylist()], out


def test_values_are_put_in_as_they_are_never_formatted(tiny_model):
    stage = stage_for(tiny_model, "[{text}] [{source}] [{meta.title}] {{x}}")
    texts, _ = prompts(stage, pa.table({"id": ["a"], "text": ["{source} {0} {text!r}"], "source": ["{meta}"],
                                       "meta": _meta(["%s {}"])}))
    assert "[{source} {0} {text!r}] [{meta}] [%s {}] {x}" in texts[0]


@pytest.mark.parametrize("null_as", ["", "(none)"])
def test_a_null_in_every_position_renders_as_null_as(tiny_model, null_as):
    stage = stage_for(tiny_model, "@{source}|{meta.title}|{meta.year}|{id}@", null_as)
    batch = pa.table({
        "id": ["a", "b", "c", "d"],
        "text": ["t", "t", "t", "t"],
        "source": [None, "s", "s", "s"],  # a null passthrough column
        "meta": _meta(["T", None, ..., "T"]),  # a null struct field; a null struct
    })
    texts, out = prompts(stage, batch)
    n = null_as
    assert [t.split("@")[1] for t in texts] == [f"{n}|T|2020|a", f"s|{n}|2020|b", f"s|{n}|{n}|c", "s|T|2020|d"]
    assert not any("None" in t for t in texts)
    assert out.column("status").to_pylist() == ["ok"] * 4


def test_a_null_text_is_still_a_row_error(tiny_model):
    _, out = prompts(stage_for(tiny_model, "{text}"), pa.table({"id": ["a"], "text": pa.array([None], pa.string())}))
    assert out.column("status").to_pylist() == ["error"] and out.column("error").to_pylist() == ["text is null"]


def test_rendering_without_a_chat_template_keeps_the_system_message(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = None
    r = PromptRenderer(tok, "Q: {text}", "Be brief.", null_as="-")
    assert r.render({"text": None}).text(tok) == "Be brief.\n\nQ: -"
