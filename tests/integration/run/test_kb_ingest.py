"""jobs/kb_ingest.yaml end to end: JSONL in through `datasets`, passages, structured annotations."""

import json
from collections import Counter

import jsonschema
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from pipeline.config import load_run_config
from pipeline.tools.dev.corpus import make_corpus
from tests.helpers import REPO
from tests.helpers.runs import run_cli

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
    # The shares, as the output's own columns give them.
    tries = Counter(r["annotation_tries"] for r in rows)
    assert a["tries"]["first_try"] == tries[1] and a["tries"]["after_retry"] == tries[2] == a["retried"]
    assert a["tries"]["shares"]["after_retry"] == round(tries[2] / len(rows), 4)
    for column, strings in (("keywords", lambda v: v), ("entities", lambda v: [e["name"] for e in v])):
        values = [(s, r["passage"]) for r in rows for s in strings(r[column] or [])]
        found = sum(bool(s) and " ".join(s.split()).casefold() in " ".join(p.split()).casefold() for s, p in values)
        assert a["found_in_text"][column]["values"] == len(values)
        assert a["found_in_text"][column]["in_text"] == found


STOPPED_RUN = "20261101T000000Z-dead00"


def stop_a_run(written: pa.Table, output, documents: int) -> int:
    """A run of these passages that was killed with a part committed: that part holds
    the first passages, cut in the middle of a document. Returns the rows committed."""
    import time

    from pipeline import schema
    from pipeline.storage.commits import commit_part
    from pipeline.storage.output import OutputTarget
    from pipeline.storage.sink import _block_stats

    ids = written.column("id").to_pylist()
    cut = next(i for i in range(written.num_rows // 2, written.num_rows) if ids[i] == ids[i - 1])
    part = written.slice(0, cut)
    part = part.set_column(part.schema.get_field_index("run_id"), "run_id", pa.array([STOPPED_RUN] * cut))
    stopped = OutputTarget(str(output), "kb_ingest", STOPPED_RUN)
    stopped.open(rows_in=documents)
    name = f"part-{STOPPED_RUN}-00000.parquet"
    pq.write_table(part, f"{stopped.staging.data}/{name}")
    nulls = pa.array([None] * cut, pa.string())
    stats = _block_stats(part.append_column(schema.ENGINE_CALL, nulls).append_column(schema.ENGINE_CALL_STATS, nulls))
    commit_part(stopped.fs, stopped.staging.root, name, part.select(["id", "passage_index"]),
                {"file": name, **stats, "written_at": time.time()})
    stopped.close()  # as if killed: its lease gone, its staging left
    return cut


@pytest.fixture(scope="module")
def kb_resumed(kb, tmp_path_factory, tiny_model):
    """One run, two proofs: it resumes a stopped run of the first 4 documents (one cut
    mid-document; a `datasets` input), and every answer it generates is too short for the
    JSON (8 tokens, 16 on retry), so each of its rows ends `invalid_output`."""
    corpus, _, written = kb
    corpus = corpus.slice(0, 4)
    mine = written.filter(pc.is_in(written.column("id"), corpus.column("id")))
    mine = mine.sort_by([("id", "ascending"), ("passage_index", "ascending")])
    tmp = tmp_path_factory.mktemp("kb-resumed")
    committed = stop_a_run(mine, tmp / "out", corpus.num_rows)
    report, resumed = kb_run(tmp, tiny_model, corpus, "--resume", "--set", "passages.tokens=96",
                             "--set", "passages.overlap=16", "--set", "annotations.max_new_tokens=8",
                             "--set", "annotations.retry_max_new_tokens=16")
    return mine, committed, report, resumed


def test_a_stopped_kb_run_resumes_passage_by_passage(kb_resumed):
    before, committed, report, resumed = kb_resumed
    keys = lambda t: sorted(zip(t.column("id").to_pylist(), t.column("passage_index").to_pylist()))  # noqa: E731
    assert keys(resumed) == keys(before)  # every passage once
    assert report["resume"]["rows_committed_before"] == committed
    assert report["resume"]["rows_generated"] == before.num_rows - committed
    runs = Counter(resumed.column("run_id").to_pylist())
    assert runs == {STOPPED_RUN: committed, report["run_id"]: before.num_rows - committed}
    assert report["resume"]["lineage"] == [STOPPED_RUN, report["run_id"]] and report["rows_out"] == before.num_rows


def test_output_that_never_validates_is_kept_raw_with_status_invalid_output(kb_resumed):
    _, committed, report, resumed = kb_resumed
    rows = [r for r in resumed.to_pylist() if r["run_id"] == report["run_id"]]
    assert rows and {r["status"] for r in rows} == {"invalid_output"}
    for r in rows:
        assert r["raw_output"].startswith("{") and "not valid JSON" in r["error"]
        assert r["summary"] is not None  # the summary stands; only the annotations failed
        assert all(r[k] is None for k in ANNOTATIONS)
    assert report["annotations"]["retried"] == len(rows) == report["status"]["invalid_output"]
    assert report["status"]["ok"] == committed  # the stopped run's rows, as they were
