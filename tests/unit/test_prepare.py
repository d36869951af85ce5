"""The prepare stage with the tiny model's real tokenizer (no engine)."""

import pyarrow as pa
import pytest

from pipeline import schema
from pipeline.config import load_run_config
from pipeline.stages.prepare import PrepareStage
from tests.conftest import REPO


@pytest.fixture(scope="module")
def stage(tiny_model):
    cfg = load_run_config(
        REPO / "jobs/nightly_summarize.yaml", REPO / "conf/local.yaml",
        ["batching.bucket_boundaries=[64, 96]", "sampling.max_new_tokens=16"],
    )
    return PrepareStage(cfg, str(tiny_model), max_model_len=256)


def test_renders_with_chat_template_and_counts_tokens(stage):
    batch = pa.table({"id": ["a"], "text": ["Short note."], "source": ["email"]})
    out = stage(batch)
    ids = out.column(schema.PROMPT_TOKEN_IDS).to_pylist()[0]
    rendered = stage.tokenizer.decode(ids)
    assert rendered.startswith("<|system|>\nYou write short")
    assert "Summarize this email in two sentences.\n\nShort note." in rendered
    assert rendered.endswith("<|assistant|>\n")
    assert out.column("prompt_tokens").to_pylist() == [len(ids)]
    assert out.column("status").to_pylist() == ["ok"]


def test_buckets_and_refuses_what_cannot_fit(stage):
    texts = ["x", "word " * 40, "word " * 300, None]
    batch = pa.table({"id": list("abcd"), "text": pa.array(texts, pa.string()), "source": ["wiki"] * 4})
    out = stage(batch).to_pylist()
    for r in out[:2]:
        assert r["bucket"] == stage.bucketer.name(r["prompt_tokens"])
        assert r["_bucket_index"] == stage.bucketer.index(r["prompt_tokens"])
    assert out[0]["bucket"] != out[1]["bucket"]
    too_long = out[2]
    assert too_long["status"] == "error" and "the context fits 240 with 16 left" in too_long["error"]
    assert too_long[schema.PROMPT_TOKEN_IDS] == []
    assert out[3]["status"] == "error" and out[3]["error"] == "text is null"
    # Passthrough columns are untouched.
    assert [r["source"] for r in out] == ["wiki"] * 4
