"""The prepare stage with the tiny model's real tokenizer (no engine)."""

import pyarrow as pa
import pytest

from pipeline import schema
from pipeline.config import load_run_config
from pipeline.run.plan import prepare_settings
from pipeline.stages.prepare import PrepareStage
from tests.helpers import REPO


@pytest.fixture(scope="module")
def stage(tiny_model):
    cfg = load_run_config(
        REPO / "jobs/nightly_summarize.yaml", REPO / "conf/local.yaml",
        ["bucketing.boundaries=[64, 96]", "sampling.max_new_tokens=16"],
    )
    return PrepareStage(prepare_settings(cfg, str(tiny_model), 256))


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


def make_stage(tiny_model, *sets, max_model_len=256, look_up=None):
    cfg = load_run_config(
        REPO / "jobs/nightly_summarize.yaml", REPO / "conf/local.yaml",
        ["bucketing.boundaries=[64, 96]", "sampling.max_new_tokens=16", *sets],
    )
    return PrepareStage(prepare_settings(cfg, str(tiny_model), max_model_len), look_up=look_up)


def batch_of(texts, ids=None):
    ids = ids or [f"r{i}" for i in range(len(texts))]
    return pa.table({"id": pa.array(ids, pa.string()), "text": pa.array(texts, pa.string()),
                     "source": ["wiki"] * len(texts)})


LONG = "Word after word goes on. " * 120  # far past 240 tokens


def test_buckets_rows_by_their_prompt(stage):
    out = stage(batch_of(["x", "word " * 12])).to_pylist()
    for r in out:
        assert r["bucket"] == stage.bucketer.name(r["prompt_tokens"])
        assert r["_bucket_index"] == stage.bucketer.index(r["prompt_tokens"])
        assert r["truncated"] is False and r["original_tokens"] is None
    assert out[0]["bucket"] != out[1]["bucket"]
    assert [r["source"] for r in out] == ["wiki", "wiki"]  # passthrough untouched


def test_truncate_flags_the_row_and_fits_the_context(stage):
    r = stage(batch_of([LONG])).to_pylist()[0]
    assert r["status"] == "ok" and r["truncated"] is True
    assert r["prompt_tokens"] <= 240 < r["original_tokens"]
    assert len(r[schema.PROMPT_TOKEN_IDS]) == r["prompt_tokens"]
    # head: the prompt keeps the document's opening
    assert "Word after word goes on." in stage.tokenizer.decode(r[schema.PROMPT_TOKEN_IDS])


def test_head_tail_keeps_both_ends(tiny_model):
    stage = make_stage(tiny_model, "length.keep=head_tail")
    text = "Opening line here. " + "middle " * 400 + "The final conclusion."
    r = stage(batch_of([text])).to_pylist()[0]
    decoded = stage.tokenizer.decode(r[schema.PROMPT_TOKEN_IDS])
    assert r["truncated"] and "Opening line here." in decoded and "The final conclusion." in decoded


def test_max_input_tokens_caps_below_the_context(tiny_model):
    stage = make_stage(tiny_model, "length.max_input_tokens=20")
    r = stage(batch_of(["word " * 60])).to_pylist()[0]
    overhead = len(stage.encode([stage.render({"source": "wiki"}, "")])[0])
    assert r["truncated"] and r["prompt_tokens"] <= overhead + 20 + 2


def test_skip_policy(tiny_model):
    r = make_stage(tiny_model, "length.policy=skip")(batch_of([LONG])).to_pylist()[0]
    assert r["status"] == "skipped_too_long" and "the limit is" in r["error"]
    assert r[schema.PROMPT_TOKEN_IDS] == [] and r["original_tokens"] == r["prompt_tokens"] > 240


def test_chunk_policy_cuts_windows_that_fit(tiny_model):
    stage = make_stage(tiny_model, "length.policy=chunk", "length.chunk_overlap=8")
    r = stage(batch_of([LONG])).to_pylist()[0]
    pieces = r[schema.CHUNK_TEXTS]
    assert r["status"] == "ok" and r["chunks"] == len(pieces) >= 2
    for piece in pieces:
        assert len(stage.encode([stage.render({"source": "wiki"}, piece)])[0]) <= 240
    assert pieces[0].startswith("Word after word") and LONG.rstrip().endswith(pieces[-1].rstrip())


def test_bad_rows_get_errors_with_reasons(stage):
    texts = [None, "", "  \n\t ", "fine", "ok too"]
    out = stage(batch_of(texts, ids=["a", "b", "c", None, "e"])).to_pylist()
    assert [(r["status"], r["error"]) for r in out] == [
        ("error", "text is null"), ("error", "text is empty"), ("error", "text is whitespace only"),
        ("error", "id is null"), ("ok", None),
    ]
    assert [r["bucket"] for r in out[:4]] == [None] * 4 and out[0]["prompt_tokens"] is None


def test_binary_text_is_decoded_and_noted(stage):
    batch = pa.table({"id": ["a"], "text": pa.array([b"caf\xc3\xa9 \xff ok"], pa.binary()), "source": ["x"]})
    r = stage(batch).to_pylist()[0]
    assert r["status"] == "ok" and "decoded as UTF-8 with 1 invalid" in r["notes"]


@pytest.fixture(scope="module")
def kb_stage(tiny_model):
    cfg = load_run_config(REPO / "jobs/kb_ingest.yaml", REPO / "conf/local.yaml",
                          ["passages.tokens=40", "passages.overlap=8"])
    return PrepareStage(prepare_settings(cfg, str(tiny_model), 2048))


def test_passages_map_back_to_the_exact_text_with_the_configured_overlap(kb_stage):
    from pipeline.text.synthetic import synthetic_text, vocabulary
    import numpy as np

    rng = np.random.default_rng(3)
    words = vocabulary()
    docs = [synthetic_text(rng, words, n) for n in (5, 60, 400)] + ["  Lead space.\n\n\nTrail  \n"]
    out = kb_stage(pa.table({"id": [1, 2, 3, 4], "text": docs, "source": ["wiki"] * 4}))
    assert "text" not in out.column_names
    rows = out.to_pylist()
    for doc_id, doc in enumerate(docs, start=1):
        mine = [r for r in rows if r["id"] == doc_id]
        assert [r["passage_index"] for r in mine] == list(range(len(mine)))
        for r in mine:
            assert doc[r["char_start"]:r["char_end"]] == r["passage"]
            assert r["passage"].strip() == r["passage"] != ""
            tokens = len(kb_stage.text_tokens(r["passage"])[0])
            assert tokens <= 40 + 1  # re-tokenizing a cut can merge one token differently
        # Consecutive passages overlap by about `overlap` tokens, and never leave a gap.
        for a, b in zip(mine, mine[1:]):
            assert b["char_start"] < a["char_end"]
            shared = len(kb_stage.text_tokens(doc[b["char_start"]:a["char_end"]])[0])
            assert 4 <= shared <= 10
        assert mine[0]["char_start"] == len(doc) - len(doc.lstrip())
        assert mine[-1]["char_end"] == len(doc.rstrip())
    assert len([r for r in rows if r["id"] == 3]) >= 10  # 400 words is many 40-token passages
    assert all(r["status"] == "ok" for r in rows)
    ann = out.column(schema.ANNOTATION_TOKEN_IDS).to_pylist()
    assert all(ids for ids in ann) and "Give the title" in kb_stage.tokenizer.decode(ann[0])


def test_a_bad_document_stays_one_error_row_among_passages(kb_stage):
    out = kb_stage(pa.table({"id": [1, 2], "text": ["   ", "Fine text here."], "source": ["a", "b"]}))
    rows = out.to_pylist()
    assert [(r["id"], r["passage_index"], r["status"]) for r in rows] == [(1, None, "error"), (2, 0, "ok")]
    assert rows[0]["passage"] is None and rows[0]["error"] == "text is whitespace only"


def test_the_stage_needs_only_its_own_settings_no_yaml(tiny_model):
    """Built from PrepareSettings alone: no job or profile file, no RunConfig."""
    from pipeline.stages.prepare import PrepareSettings, Prompt

    stage = PrepareStage(PrepareSettings(model_path=str(tiny_model), max_model_len=256,
                                         prompt=Prompt("Summarize: {body}"), max_new_tokens=16,
                                         id_column="key", text_column="body", bucket_boundaries=(64, 128)))
    out = stage(pa.table({"key": [1, 2], "body": ["A short note.", None]}))
    assert out.column("status").to_pylist() == ["ok", "error"]
    assert out.column("bucket").to_pylist()[0] == "le64"
    assert "Summarize: A short note." in stage.tokenizer.decode(out.column(schema.PROMPT_TOKEN_IDS)[0].as_py())


def test_the_hold_drill_releases_the_input_once_a_part_is_committed(tiny_model, tmp_path):
    """`debug.hold_input_until_output_s`: the first rows pass, the next batch waits for the
    run's first commit marker (and is released by it, not by the bound), then none waits."""
    import threading
    import time as clock
    from dataclasses import replace as changed

    import pyarrow as pa

    from pipeline.stages.prepare import PrepareSettings, PrepareStage, Prompt

    commits = tmp_path / "commits"
    settings = PrepareSettings(model_path=str(tiny_model), max_model_len=512, prompt=Prompt("{text}"),
                               max_new_tokens=8)
    stage = PrepareStage(changed(settings, hold_until=str(commits), hold_after_rows=2, hold_s=30.0))
    batch = pa.table({"id": ["a", "b"], "text": ["one", "two"]})
    started = clock.monotonic()
    stage(batch)  # within the first rows: no wait
    assert clock.monotonic() - started < 1
    threading.Timer(0.5, lambda: (commits.mkdir(), (commits / "part-0").write_text("{}"))).start()
    stage(batch)
    waited = clock.monotonic() - started
    assert 0.5 <= waited < 5  # released by the commit, long before the 30 s bound
    stage(batch)
    assert clock.monotonic() - started - waited < 1  # released once
    bounded = PrepareStage(changed(settings, hold_until=str(tmp_path / "never"), hold_after_rows=0, hold_s=0.5))
    t = clock.monotonic()
    bounded(batch)
    assert 0.5 <= clock.monotonic() - t < 3


def test_rows_found_by_their_input_key_are_not_tokenized_again(tiny_model, monkeypatch):
    """Night 1 writes each ok row's input key; on night 2 a row found by it takes what
    prepare made of it then, and only the others reach the tokenizer."""
    from dataclasses import replace

    import ray

    from pipeline.reuse.index import PREPARED, REUSED_FROM, REUSED_PREFIX, KeyShard
    from tests.helpers.shards import Local

    settings = replace(make_stage(tiny_model).settings, input_key_base="a run's base")
    batch = pa.table({"id": ["a", "b", "c", "d"], "source": ["email", "email", "web", "web"],
                      "text": ["Short note.", "A longer note about the weather today.", "", "Edited tonight."]})
    night1 = PrepareStage(settings)(batch)
    keys = night1.column("input_key").to_pylist()
    assert keys[0] and keys[1] and keys[3] and keys[2] is None  # the empty text is an error row: no key
    assert len(set(keys)) == 4
    # The index holds night 1's rows a and b (d was edited since: its text differs).
    held = night1.take([0, 1])
    shard = KeyShard()
    shard.add(pa.table({"result_key": ["v1:a", "v1:b"], "input_key": held.column("input_key"),
                        REUSED_FROM: ["night1"] * 2, REUSED_PREFIX + "summary": ["sum a", "sum b"],
                        **{REUSED_PREFIX + c: held.column(c) if c in held.column_names else pa.array(["v1:a", "v1:b"])
                           for c in PREPARED}}), 0)
    monkeypatch.setattr(ray, "get", lambda refs: refs)
    stage = PrepareStage(settings, shards=[Local(shard)])
    tokenized = []
    encode = stage.encode
    monkeypatch.setattr(stage, "encode", lambda prompts: tokenized.append(len(prompts)) or encode(prompts))
    night2 = stage(batch.set_column(2, "text", pa.array(["Short note.", "A longer note about the weather today.", "",
                                                         "Edited again."])))
    assert sum(tokenized) == 1  # prompts tokenized: d alone (a and b were found, c is an error)
    out = night2.to_pydict()
    assert out[REUSED_FROM] == ["night1", "night1", None, None]
    assert out[REUSED_PREFIX + "summary"] == ["sum a", "sum b", None, None]
    assert out["input_key"][:2] == keys[:2] and out["input_key"][3] != keys[3]
    for c in ("prompt_tokens", "truncated", "original_tokens", "chunks", "bucket", schema.BUCKET_INDEX):
        assert out[c][:2] == night1.column(c).to_pylist()[:2], c
    assert out["status"] == ["ok", "ok", "error", "ok"]
    assert out["prompt_tokens"][3] == len(out[schema.PROMPT_TOKEN_IDS][3]) > 0


def test_the_input_key_follows_the_tokenizer_libraries_and_the_rendered_template(tiny_model, monkeypatch):
    """The settings do not pin a prompt's token ids: the tokenizer libraries and what the
    chat template renders (a date, say) are in each stage's input-key base too."""
    from dataclasses import replace

    import transformers

    settings = replace(make_stage(tiny_model).settings, input_key_base="a run's base")
    batch = pa.table({"id": ["a"], "source": ["email"], "text": ["Short note."]})
    first = PrepareStage(settings)
    again = PrepareStage(settings)
    assert first.input_base == again.input_base != settings.input_key_base
    assert first(batch).column("input_key").to_pylist() == again(batch).column("input_key").to_pylist()
    monkeypatch.setattr(transformers, "__version__", "0.0.0-other")
    assert PrepareStage(settings)(batch).column("input_key").to_pylist() != first(batch).column("input_key").to_pylist()
    other = PrepareStage(replace(settings, prompt=replace(settings.prompt, system="Another system message.")))
    assert other.input_base != first.input_base


def test_with_reuse_each_prepared_batch_is_looked_up_before_it_leaves_the_stage(tiny_model):
    seen = []

    def look_up(batch):
        seen.append(batch)
        return batch.append_column("result_key", pa.array([f"k{i}" for i in range(batch.num_rows)]))

    out = make_stage(tiny_model, look_up=look_up)(batch_of(["A short note.", None]))
    (prepared,) = seen
    # It saw the batch as prepared (token ids, statuses), and what it answered is the stage's output.
    assert prepared.column("status").to_pylist() == ["ok", "error"]
    assert len(prepared.column(schema.PROMPT_TOKEN_IDS).to_pylist()[0]) > 0
    assert out.column("result_key").to_pylist() == ["k0", "k1"]
    assert out.drop_columns(["result_key"]).equals(prepared)
