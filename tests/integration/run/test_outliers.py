"""Messy input through the whole job, on real vLLM: nothing lost, every status as expected."""

from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.cli import EXIT_BAD_CONFIG, EXIT_ERROR_RATE
from pipeline.tools.dev.corpus import make_corpus
from tests.helpers import REPO
from tests.helpers.runs import JobRun, run_cli

JOB = REPO / "jobs/nightly_summarize.yaml"
LOCAL = REPO / "conf/local.yaml"

# id -> (text, expected status)
ADVERSARIAL = {
    "null-text": (None, "error"),
    "empty": ("", "error"),
    "blank": (" \n\t  ", "error"),
    "emoji-rtl-combining": ("Release 😀🎉 مرحبا بالعالم שלום e\u0301\u0301 n\u0303 — done.", "ok"),
    "nul-inside": ("before\x00after the NUL byte.", "ok"),
    "one-char": ("x", "ok"),
}


def adversarial_corpus(folder: Path) -> tuple[Path, dict[str | None, str]]:
    """A folder: one good file of messy rows, one corrupt file, one without a text column."""
    folder.mkdir(parents=True)
    normal = make_corpus(30, seed=21)
    big = "Line of a changelog that never ends. " * 57_000  # 2.1 MB
    long_doc = normal.column("text")[0].as_py() * 20  # several thousand tokens
    ids = normal.column("id").to_pylist() + list(ADVERSARIAL) + ["two-megabytes", "long", None]
    texts = normal.column("text").to_pylist() + [t for t, _ in ADVERSARIAL.values()] + [big, long_doc, "no id"]
    table = pa.table({
        "id": pa.array(ids, pa.string()),
        "text": pa.array(texts, pa.string()),
        "source": pa.array(["ticket"] * len(ids), pa.string()),
    })
    pq.write_table(table, folder / "part-0.parquet")
    (folder / "part-1.parquet").write_bytes(b"PAR1" + b"\x00" * 64 + b"PAR1")
    pq.write_table(pa.table({"id": ["q"], "body": ["wrong column"], "source": ["x"]}), folder / "part-2.parquet")
    expected = {i: "ok" for i in normal.column("id").to_pylist()}
    expected.update({i: status for i, (_, status) in ADVERSARIAL.items()})
    expected.update({"two-megabytes": "ok", "long": "ok", None: "error"})
    assert len(big.encode()) >= 2_000_000
    return folder, expected


@pytest.fixture(scope="module")
def adversarial(tmp_path_factory, tiny_model):
    folder, expected = adversarial_corpus(tmp_path_factory.mktemp("adversarial") / "in")
    out = folder.parent / "out"
    result = run_cli(JOB, LOCAL, "--input", str(folder), "--output", str(out), "--on-bad-file", "skip",
                     "--fail-on-error-rate", "0.01",
                     "--set", f"model.name={tiny_model}", "--set", "engine.max_model_len=2048",
                     "--set", "sampling.max_new_tokens=16", "--set", "batching.learned_limits=null")
    import json

    report = json.loads((out / "_report.json").read_text())
    return JobRun(pq.read_table(folder / "part-0.parquet"), out, result, report, pq.read_table(out)), expected


def test_output_ids_equal_input_ids_each_once(adversarial):
    run, _ = adversarial
    assert Counter(run.written.column("id").to_pylist()) == Counter(run.corpus.column("id").to_pylist())


def test_every_status_is_the_one_expected(adversarial):
    run, expected = adversarial
    got = {r["id"]: r for r in run.written.to_pylist()}
    assert {i: r["status"] for i, r in got.items()} == expected
    assert got["null-text"]["error"] == "text is null" and got["blank"]["error"] == "text is whitespace only"
    assert got[None]["error"] == "id is null"
    for doc in ("two-megabytes", "long"):
        assert got[doc]["truncated"] is True
        assert got[doc]["original_tokens"] > got[doc]["prompt_tokens"] and got[doc]["prompt_tokens"] <= 2048 - 16
        assert got[doc]["summary"] is not None
    assert got["nul-inside"]["text"] == "before\x00after the NUL byte."  # passthrough, byte for byte


def test_report_counts_match_the_output_and_list_skipped_files(adversarial):
    run, _ = adversarial
    assert run.report["status"] == dict(Counter(run.written.column("status").to_pylist()))
    assert run.report["rows_in"] == run.report["rows_out"] == run.written.num_rows
    assert run.report["length"]["truncated"] == 2
    skipped = {Path(s["file"]).name: s["reason"] for s in run.report["input_files"]["skipped"]}
    assert set(skipped) == {"part-1.parquet", "part-2.parquet"}
    assert "not a readable Parquet file" in skipped["part-1.parquet"]
    assert "text column 'text' is missing" in skipped["part-2.parquet"]


def test_error_rate_gate_exits_3_after_writing_everything(adversarial):
    run, _ = adversarial
    assert run.result.returncode == EXIT_ERROR_RATE
    last = run.result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: 4 of") and "--fail-on-error-rate 0.01" in last


def test_bad_files_and_duplicate_ids_stop_the_run_before_any_row_is_generated(tmp_path, tiny_model):
    folder, _ = adversarial_corpus(tmp_path / "in")
    r = run_cli(JOB, LOCAL, "--input", str(folder), "--output", str(tmp_path / "o"),
                "--set", f"model.name={tiny_model}")
    assert r.returncode == EXIT_BAD_CONFIG
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and f"{folder}/part-1.parquet: not a readable Parquet file: " in last
    dup = tmp_path / "dup.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "a", "c", "b"], "text": ["t"] * 5, "source": ["s"] * 5}), dup)
    r = run_cli(JOB, LOCAL, "--input", str(dup), "--output", str(tmp_path / "o"), "--set", f"model.name={tiny_model}")
    assert r.returncode == EXIT_BAD_CONFIG
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert errors and "2 ids occur more than once in column 'id', e.g. 'a', 'b'" in errors[-1]
    # Checked on the cluster while the engine starts: refused before it took a row.
    assert "Data sink ParquetParts finished" not in r.stderr
    assert not (tmp_path / "o").exists()


def test_chunk_policy_summarizes_long_documents_map_reduce(tmp_path, tiny_model):
    normal = make_corpus(12, seed=31)
    texts = normal.column("text").to_pylist()
    texts[0] = texts[0] * 12
    texts[5] = texts[5] * 30
    corpus = tmp_path / "c.parquet"
    pq.write_table(normal.set_column(1, "text", pa.array(texts, pa.string())), corpus)
    r = run_cli(JOB, LOCAL, "--input", str(corpus), "--output", str(tmp_path / "out"),
                "--set", f"model.name={tiny_model}", "--set", "engine.max_model_len=512",
                "--set", "sampling.max_new_tokens=16", "--set", "length.policy=chunk",
                "--set", "length.chunk_overlap=16", "--set", "batching.learned_limits=null",
                "--set", "length.outlier_percentile=75")
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    report = json.loads((tmp_path / "out" / "_report.json").read_text())
    cap = report["length"]["percentile_cap_tokens"]
    assert cap is not None and 0 < cap < 512  # the 75th percentile of twelve prompts, two of them huge
    rows = {x["id"]: x for x in pq.read_table(tmp_path / "out").to_pylist()}
    assert len(rows) == 12 and {x["status"] for x in rows.values()} == {"ok"}
    ids = normal.column("id").to_pylist()
    for long_id in (ids[0], ids[5]):
        assert rows[long_id]["chunks"] >= 2 and rows[long_id]["summary"] is not None
        assert rows[long_id]["original_tokens"] > 512 and rows[long_id]["truncated"] is False
    assert rows[ids[5]]["chunks"] > rows[ids[0]]["chunks"]
    for r in rows.values():  # chunked exactly when the prompt passed the cap
        assert (r["chunks"] is None) == (r["original_tokens"] is None)
        assert r["chunks"] is None or r["original_tokens"] > cap
        assert r["chunks"] is not None or r["prompt_tokens"] <= cap
    # Every chunk summary and reduce is generated and counted, beyond the rows' own tokens.
    levels = [c for c in report["engine_calls"] if c["kind"].startswith("chunk-level-")]
    assert {c["kind"] for c in levels} >= {"chunk-level-1", "chunk-level-2"}
    assert report["tokens"]["generated"] == sum(c["output_tokens"] for c in report["engine_calls"])
    assert report["tokens"]["generated"] > report["tokens"]["output"]
