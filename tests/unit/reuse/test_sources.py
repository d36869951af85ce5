"""Which earlier outputs a run may take results from: only what this pipeline published,
proven by its report; the newest first, as many as the lookback keeps."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.reuse.sources import ReuseError, comparable, find_earlier


def published(folder, run_id, started_at, date=None, keyed=True, columns=("summary",), files=None):
    """An output as the pipeline publishes it: one part and a report listing it."""
    folder.mkdir(parents=True)
    table = pa.table({"id": ["a"], "status": ["ok"], "result_key": ["v1:x"] if keyed else [None],
                      **{c: ["s"] for c in columns}})
    pq.write_table(table, folder / "part-00000.parquet")
    report = {"run_id": run_id, "job": "nightly", "files": files or ["part-00000.parquet"],
              "started_at": started_at, "date": date, "rows_out": 1, "engine_s": 12.0,
              "tokens": {"generated": 400}}
    if keyed:
        report["result_key"] = {"version": 1}
    (folder / "_report.json").write_text(json.dumps(report))
    return folder


def test_a_published_output_is_read_from_its_report(tmp_path):
    published(tmp_path / "dt=2026-12-01", "r1", "2026-12-02T01:00:00+00:00", date="2026-12-01")
    [out] = find_earlier([str(tmp_path / "dt=2026-12-01")])
    assert out.run_id == "r1" and out.label == "r1 (2026-12-01)" and out.rows == 1
    assert out.files == (str(tmp_path / "dt=2026-12-01" / "part-00000.parquet"),)
    assert out.seconds_per_token() == pytest.approx(0.03)


def test_a_glob_keeps_the_newest_outputs_up_to_the_lookback_and_never_the_runs_own(tmp_path):
    for day in (1, 2, 3):
        published(tmp_path / f"dt=2026-12-0{day}", f"r{day}", f"2026-12-0{day + 1}T01:00:00+00:00", f"2026-12-0{day}")
    (tmp_path / "dt=2026-12-04").mkdir()  # an empty folder: passed over
    glob = str(tmp_path / "dt=*")
    assert [o.run_id for o in find_earlier([glob], lookback=1)] == ["r3"]
    assert [o.run_id for o in find_earlier([glob])] == ["r3", "r2", "r1"]
    assert [o.run_id for o in find_earlier([glob], lookback=2, exclude=str(tmp_path / "dt=2026-12-03"))] == ["r2", "r1"]
    assert find_earlier([str(tmp_path / "dt=2027-*")]) == []


def test_parquet_without_this_pipelines_report_is_refused(tmp_path):
    foreign = tmp_path / "theirs"
    foreign.mkdir()
    pq.write_table(pa.table({"id": [1]}), foreign / "data.parquet")
    with pytest.raises(ReuseError, match=r"theirs holds Parquet files \(data.parquet\) but no _report.json"):
        find_earlier([str(foreign)])
    published(tmp_path / "ours", "r1", "2026-12-02T01:00:00+00:00")
    pq.write_table(pa.table({"id": [1]}), tmp_path / "ours" / "added.parquet")
    with pytest.raises(ReuseError, match="does not list .*added.parquet"):
        find_earlier([str(tmp_path / "ours")])
    (tmp_path / "bad").mkdir()
    pq.write_table(pa.table({"id": [1]}), tmp_path / "bad" / "part.parquet")
    (tmp_path / "bad" / "_report.json").write_text("{}")
    with pytest.raises(ReuseError, match="not this pipeline's report"):
        find_earlier([str(tmp_path / "bad")])
    with pytest.raises(ReuseError, match="is a file"):
        find_earlier([str(foreign / "data.parquet")])


def test_outputs_without_keys_or_the_jobs_columns_are_left_out_with_a_note(tmp_path):
    published(tmp_path / "old", "r0", "2026-11-01T00:00:00+00:00", keyed=False)
    published(tmp_path / "other", "r1", "2026-11-02T00:00:00+00:00", columns=("title",))
    published(tmp_path / "good", "r2", "2026-11-03T00:00:00+00:00")
    found = find_earlier([str(tmp_path / "*")])
    keep, notes = comparable(found, ["summary"])
    assert [o.run_id for o in keep] == ["r2"]
    assert any("other: has no summary column" in n for n in notes)
    assert any("old: written before rows had result keys" in n for n in notes)
