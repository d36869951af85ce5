import pytest
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import schema
from pipeline.storage.output import OutputError, OutputTarget
from pipeline.observe.report import REPORT_NAME, write_beside
from pipeline.storage.sink import ParquetPartsSink, _block_stats, merge_stats
from tests.helpers.parts import Ctx, JOB, block






def write_json_report(fs, folder, report: dict) -> None:
    """An earlier run's `_report.json`, as much of it as publishing reads."""
    write_beside(fs, folder, REPORT_NAME, json.dumps(report).encode())




def test_parts_are_whole_and_stats_merge(tmp_path):
    out_schema = schema.output_schema(pa.schema([("id", pa.string()), ("text", pa.string())]), "id", "text")
    # An earlier run of this job: it stays readable, whole, until this run publishes.
    out = tmp_path / "out"
    out.mkdir()
    stale = out / "part-run0-00000.parquet"
    pq.write_table(pa.table({"x": [1]}), stale)
    (out / "_report.json").write_text(json.dumps({"job": JOB, "run_id": "run0", "files": [stale.name]}))
    target = OutputTarget(str(out), JOB, "run1")
    target.open()
    sink = ParquetPartsSink(target.staging, "run1", out_schema, ["id"])
    sink.on_write_start()
    r0 = sink.write([block(["a", "b"], "le128", "c0", {"call": "c0", "rows": 3})], Ctx(0))
    r1 = sink.write([block(["c"], "le128", "c0"), block(["d"], "le256", "c1", {"call": "c1", "rows": 1})], Ctx(1))
    assert sorted(os.listdir(out)) == ["_report.json", "part-run0-00000.parquet"]
    assert sorted(os.listdir(sink.root)) == ["part-run1-00000.parquet", "part-run1-00001.parquet"]

    class WR:
        write_returns = [r0, r1]

    sink.on_write_complete(WR())
    write_json_report(target.fs, sink.root, {"job": JOB, "run_id": "run1", "files": sink.summary["files"]})
    target.plan()
    target.publish()
    target.close()
    assert not stale.exists() and not os.path.exists(sink.root)
    assert sorted(os.listdir(tmp_path)) == ["out"]
    written = pq.read_table(out)
    assert written.schema == out_schema  # working columns dropped
    assert sorted(written.column("id").to_pylist()) == ["a", "b", "c", "d"]
    s = sink.summary
    assert s["rows"] == 4 and s["status"] == {"ok": 4}
    assert s["prompt_tokens_by_bucket"] == {"le128": {10: 2, 11: 1}, "le256": {10: 1}}
    # Call c0's rows span two parts; its range and row count merge.
    assert s["calls"]["c0"]["rows_written"] == 3 and s["calls"]["c0"]["rows"] == 3
    assert s["calls"]["c0"]["buckets"] == ["le128"]


def test_parts_without_a_report_are_not_ours_to_replace(tmp_path):
    """Once replaced by any run; now refused: nothing proves the pipeline wrote them."""
    out = tmp_path / "out"
    out.mkdir()
    pq.write_table(pa.table({"x": [1]}), out / "part-run0-00000.parquet")
    with pytest.raises(OutputError, match="part-run0-00000.parquet"):
        OutputTarget(str(out), JOB, "run1").open()
    assert os.listdir(out) == ["part-run0-00000.parquet"]


def test_merge_stats_of_empty_tasks():
    assert merge_stats([{"file": None, "rows": 0}])["rows"] == 0


def test_quality_counts_per_bucket_merge_across_parts_and_their_commit_markers():
    doc = "The quick brown fox jumps over the lazy dog. It was not amused by any of this."
    a = block(["a", "b", "c"], "le128", "c0", texts=[doc, doc, doc],
              summaries=["The quick brown fox jumps over the lazy dog.", "A fox annoys a dog.", "  "],
              status="ok", finish=["stop", "length", "stop"], output_tokens=[11, 32, 1])
    b = block(["d", "e"], "le256", "c1", status="error", finish=[None, None])
    first = _block_stats(pa.concat_tables([a]))
    assert first["quality"] == {"le128": {"rows": 3, "cut_at_limit": 1, "empty_output": 0, "copies_opening": 1,
                                          "output_tokens": {11: 1, 32: 1, 1: 1}}}
    assert _block_stats(b)["quality"] == {}  # error rows made no call
    # A commit marker holds the stats as JSON (int keys as strings); merging takes both.
    again = json.loads(json.dumps(_block_stats(block(["f"], "le128", "c2", output_tokens=[32]))))
    merged = merge_stats([{"file": "p0", **first}, {"file": "p1", **again}, {"file": "p2", **_block_stats(b)}])
    assert merged["quality"]["le128"] == {"rows": 4, "cut_at_limit": 2, "empty_output": 0, "copies_opening": 1,
                                          "output_tokens": {11: 1, 32: 2, 1: 1}}
    # Parts committed before quality was counted (a resumed run's) have none: they add nothing.
    old = {k: v for k, v in first.items() if k != "quality"}
    assert merge_stats([{"file": "p0", **old}])["quality"] == {}


def test_block_stats_counts_status():
    t = pa.concat_tables([block(["a"], "le128", "c0"), block(["b"], "le128", None, status="error")])
    stats = _block_stats(t)
    assert stats["status"] == {"ok": 1, "error": 1}
    assert list(stats["call_rows"]) == ["c0"]


def test_a_failed_run_leaves_the_previous_output_and_keeps_what_it_committed(tmp_path):
    out_schema = schema.output_schema(pa.schema([("id", pa.string()), ("text", pa.string())]), "id", "text")
    for run_id, ids, fails in (("run1", ["a"], False), ("run2", ["b"], True)):
        target = OutputTarget(str(tmp_path / "out"), JOB, run_id)
        target.open(rows_in=2)
        sink = ParquetPartsSink(target.staging, run_id, out_schema, ["id"])
        sink.on_write_start()
        written = sink.write([block(ids, "le128", "c0")], Ctx(0))
        if fails:
            assert target.stop() == "run run2 stopped at 50% (1 rows committed)"
        else:
            write_json_report(target.fs, sink.root, {"job": JOB, "run_id": run_id, "files": [written["file"]]})
            target.plan()
            target.publish()  # nothing there before: a plain rename
        target.close()
    assert sorted(os.listdir(tmp_path)) == [".out.run2.staging", "out"]
    assert pq.read_table(tmp_path / "out").column("id").to_pylist() == ["a"]


def test_a_folder_holding_other_files_is_moved_aside_never_replaced(tmp_path):
    """Once `old.txt` was deleted by publishing; now it stops the run, or with
    --backup-existing is moved aside whole."""
    final = tmp_path / "final"
    final.mkdir()
    (final / "old.txt").write_text("old")
    with pytest.raises(OutputError, match="old.txt"):
        OutputTarget(str(final), JOB, "run1").open()
    target = OutputTarget(str(final), JOB, "run1", backup_existing=True)
    target.open()
    write_json_report(target.fs, target.staging.data, {"job": JOB, "run_id": "run1", "files": []})
    plan = target.plan()
    target.publish()
    target.close()
    assert os.listdir(final) == ["_report.json"]
    assert open(os.path.join(plan["backup"], "old.txt")).read() == "old"
    assert sorted(os.listdir(tmp_path)) == ["final", os.path.basename(plan["backup"])]


@pytest.mark.parametrize("values", [[5], [3, 1, 2], [4, 1, 3, 2], [7, 7, 7, 1], [10, 11, 10, 12, 300, 2]])
def test_median_of_counts_matches_the_median_of_the_values(values):
    from collections import Counter
    from statistics import median

    from pipeline.observe.report import median_of_counts

    assert median_of_counts(dict(Counter(values))) == median(values)


def test_annotation_tries_and_values_found_in_the_text_are_counted_and_merged():
    text = "Ada Lovelace wrote the first program for Babbage's Analytical Engine in London."
    base = block(["a", "b", "c", "d"], "le128", "c0", texts=[text] * 4, summaries=["s"] * 4,
                 status=["ok", "ok", "invalid_output", "error"], finish=["stop", "stop", "length", None])
    at = base.column_names.index("summary") + 1
    columns = {
        "keywords": pa.array([["analytical engine", "first  program"], ["poetry"], None, None], pa.list_(pa.string())),
        "entities": pa.array([[{"name": "Ada Lovelace", "type": "person"}], [{"name": "Paris", "type": "place"}],
                              None, None],
                             pa.list_(pa.struct([("name", pa.string()), ("type", pa.string())]))),
        "title": pa.array(["t", "t", None, None]),  # not a list: nothing to look for
        "raw_output": pa.array([None, None, "{", None], pa.string()),
        "annotation_tries": pa.array([1, 2, 2, None], pa.int8()),  # d failed before its annotation call
        # a and b's summaries ran to sampling.max_new_tokens; c's annotation was cut instead
        "summary_finish_reason": pa.array(["length", "length", "stop", None], pa.string()),
    }
    t = base
    for k, (name, values) in enumerate(columns.items()):
        t = t.add_column(at + k, name, values)
    stats = _block_stats(t)
    assert stats["quality"]["le128"]["cut_at_limit"] == 2  # the summaries', not the row's last call's
    assert stats["quality"]["le128"]["annotations"] == {
        "first_try": 1, "after_retry": 1, "invalid_output": 1,
        "found": {"keywords": {"values": 3, "in_text": 2}, "entities": {"values": 2, "in_text": 1}}}
    again = json.loads(json.dumps(stats))
    merged = merge_stats([{"file": "p0", **stats}, {"file": "p1", **again}])
    assert merged["quality"]["le128"]["annotations"]["found"]["keywords"] == {"values": 6, "in_text": 4}
    assert merged["quality"]["le128"]["annotations"]["after_retry"] == 2


def test_reused_rows_are_counted_by_the_run_they_came_from():
    t = block(["a", "b", "c"], "le128", None, output_tokens=[4, 6, 8], reused_from=["r0 (2026-12-01)", None, "r0 (2026-12-01)"])
    stats = _block_stats(t)
    assert stats["reused"] == {"r0 (2026-12-01)": {"rows": 2, "output_tokens": 12}}
    merged = merge_stats([{"file": "p0", **stats}, {"file": "p1", **stats}, {"file": "p2", **_block_stats(block(["d"], "le128", "c1"))}])
    assert merged["reused"] == {"r0 (2026-12-01)": {"rows": 4, "output_tokens": 24}}
