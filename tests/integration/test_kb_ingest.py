"""jobs/kb_ingest.yaml end to end: JSONL in through `datasets`, passages, structured annotations."""

import json
from collections import Counter

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import load_run_config
from pipeline.dev.corpus import make_corpus
from tests.conftest import REPO
from tests.integration.conftest import run_cli

pytestmark = pytest.mark.integration

KB_JOB = REPO / "jobs/kb_ingest.yaml"
ANNOTATIONS = ("title", "keywords", "entities", "topics", "language")


def write_jsonl(path, table):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in table.to_pylist()))
    return path


def kb_run(tmp, tiny_model, corpus, *sets):
    source = write_jsonl(tmp / "in" / "docs.jsonl", corpus)
    result = run_cli(
        KB_JOB, REPO / "conf/local.yaml", "--input", str(source), "--output", str(tmp / "out"),
        "--set", f"model.name={tiny_model}", "--set", "engine.max_model_len=4096",
        "--set", "batching.learned_limits=null", "--set", "sampling.max_new_tokens=16", *sets,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((tmp / "out" / "_report.json").read_text()), pq.read_table(tmp / "out")


@pytest.fixture(scope="module")
def kb(tmp_path_factory, tiny_model):
    corpus = make_corpus(24, seed=21)
    # The first answer gets too little room for the JSON (about 320 tokens from the
    # tiny model), so the retry with more room is exercised on real vLLM too.
    report, written = kb_run(tmp_path_factory.mktemp("kb"), tiny_model, corpus,
                             "--set", "passages.tokens=96", "--set", "passages.overlap=16",
                             "--set", "annotations.max_new_tokens=200",
                             "--set", "annotations.retry_max_new_tokens=600")
    return corpus, report, written


def test_every_document_becomes_passages_that_map_back_to_its_text(kb):
    corpus, report, written = kb
    texts = dict(zip(corpus.column("id").to_pylist(), corpus.column("text").to_pylist()))
    rows = written.to_pylist()
    assert set(r["id"] for r in rows) == set(texts)
    per_doc = Counter(r["id"] for r in rows)
    assert max(per_doc.values()) > 1  # long documents are split
    for doc_id, n in per_doc.items():
        mine = sorted(r["passage_index"] for r in rows if r["id"] == doc_id)
        assert mine == list(range(n))  # once each, no gaps
    for r in rows:
        assert r["passage"] and texts[r["id"]][r["char_start"]:r["char_end"]] == r["passage"]
    assert report["passages"]["documents_in"] == len(texts) and report["rows_out"] == len(rows)
    assert report["input_files"]["format"] == "json"


def test_annotations_are_typed_columns_whose_values_validate(kb):
    _, report, written = kb
    types = {name: written.schema.field(name).type for name in ANNOTATIONS}
    assert types["title"] == pa.string() and types["language"] == pa.string()
    for name in ("keywords", "topics"):
        assert pa.types.is_list(types[name]) and types[name].value_type == pa.string()
    entity = types["entities"].value_type
    assert pa.types.is_list(types["entities"]) and pa.types.is_struct(entity)
    assert {entity.field(i).name: entity.field(i).type for i in range(entity.num_fields)} == {
        "name": pa.string(), "type": pa.string()}

    schema = load_run_config(KB_JOB, REPO / "conf/local.yaml").job.annotations.json_schema
    rows = written.to_pylist()
    assert Counter(r["status"] for r in rows) == {"ok": len(rows)}
    for r in rows:
        jsonschema.validate({k: r[k] for k in ANNOTATIONS}, schema)  # the values parse back to the schema
        assert r["raw_output"] is None and r["summary"] is not None
    a = report["annotations"]
    assert a["valid"] == len(rows) and a["invalid_output"] == 0
    assert a["retried"] >= 1  # 200 tokens cut the JSON off; the retry had room


def test_output_that_never_validates_is_kept_raw_with_status_invalid_output(tmp_path, tiny_model):
    corpus = make_corpus(3, seed=22)
    report, written = kb_run(tmp_path, tiny_model, corpus, "--set", "annotations.max_new_tokens=8",
                             "--set", "annotations.retry_max_new_tokens=16")
    rows = written.to_pylist()
    assert {r["status"] for r in rows} == {"invalid_output"}
    for r in rows:
        assert r["raw_output"].startswith("{") and "not valid JSON" in r["error"]
        assert r["summary"] is not None  # the summary stands; only the annotations failed
        assert all(r[k] is None for k in ANNOTATIONS)
    assert report["annotations"]["retried"] == len(rows) == report["status"]["invalid_output"]
