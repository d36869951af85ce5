import json

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from pipeline.config import InputConfig
from pipeline.storage.inputs import InputError, check_inputs, detect_format, duplicate_ids, list_files


def table(n=3, **extra):
    cols = {"id": [f"i{k}" for k in range(n)], "text": ["t"] * n}
    cols.update(extra)
    return pa.table(cols)


def test_file_folder_and_glob(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    pq.write_table(table(), tmp_path / "d" / "a.parquet")
    pq.write_table(table(2), tmp_path / "d" / "sub" / "b.parquet")
    (tmp_path / "d" / "_report.json").write_text("{}")
    pq.write_table(table(), tmp_path / "d" / ".hidden.parquet")

    _, files = list_files(str(tmp_path / "d"))
    assert [f.rsplit("/", 1)[1] for f in files] == ["a.parquet", "b.parquet"]
    _, files = list_files(str(tmp_path / "d" / "*.parquet"))
    assert [f.rsplit("/", 1)[1] for f in files] == ["a.parquet"]
    found = check_inputs(InputConfig(path=str(tmp_path / "d")), {"text"})
    assert found.rows == 5
    # The rows' decoded size, from the footers' row groups: what the object-store fit weighs.
    decoded = sum(pq.ParquetFile(f).metadata.row_group(0).total_byte_size for f in found.paths)
    assert found.bytes == decoded > 0 and found.row_bytes() == decoded // 5
    assert len(list_files(str(tmp_path / "d" / "a.parquet"))[1]) == 1


def test_errors_name_file_and_column(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(InputError, match="no such file"):
        check_inputs(InputConfig(path=str(missing)), set())
    f = tmp_path / "x.parquet"
    pq.write_table(table(), f)
    with pytest.raises(InputError, match=rf"{f}: id column 'doc_id' is missing"):
        check_inputs(InputConfig(path=str(f), id_column="doc_id"), set())
    with pytest.raises(InputError, match=rf"jobs/x.yaml: prompt.template names \['title'\], which are not columns of {f}"):
        check_inputs(InputConfig(path=str(f)), {"prompt.template": {"text", "title"}}, job_file="jobs/x.yaml")
    g = tmp_path / "g.parquet"
    pq.write_table(pa.table({"id": ["a"], "text": [1]}), g)
    with pytest.raises(InputError, match=rf"{g}: text column .text. is int64, expected string \(or binary\)"):
        check_inputs(InputConfig(path=str(g)), set())
    corrupt = tmp_path / "c.parquet"
    corrupt.write_bytes(b"PAR1 not really")
    with pytest.raises(InputError, match=rf"{corrupt}: not a readable Parquet file"):
        check_inputs(InputConfig(path=str(corrupt)), set())
    with pytest.raises(InputError, match="matches no Parquet files"):
        check_inputs(InputConfig(path=str(tmp_path / "none-*.parquet")), set())
    with pytest.raises(InputError, match="no csv files"):
        check_inputs(InputConfig(path=str(tmp_path / "*.csv")), set())


def _rows(n: int = 6) -> list[dict]:
    return [{"id": f"d{i}", "text": f"Document {i}. It has two sentences.", "source": "wiki"} for i in range(n)]


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "saved"])
def test_datasets_sources_are_found_checked_and_read(tmp_path, kind):
    """JSON, JSONL and CSV through `datasets`' builders, and a save_to_disk folder."""
    import datasets
    import ray

    rows = _rows()
    if kind == "jsonl":
        path = tmp_path / "c.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "json":
        path = tmp_path / "c.json"
        path.write_text(json.dumps(rows))
    elif kind == "csv":
        path = tmp_path / "c.csv"
        pacsv.write_csv(pa.Table.from_pylist(rows), path)
    else:
        path = tmp_path / "saved"
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    assert detect_format(str(path)) == ("json" if kind == "jsonl" else kind)
    inputs = check_inputs(InputConfig(path=str(path)), {"text", "source"})
    assert inputs.rows == len(rows)
    assert inputs.schema.field("text").type in (pa.string(), pa.large_string())
    assert duplicate_ids(inputs, "id") == (0, [])
    ray.init(num_cpus=1, include_dashboard=False, ignore_reinit_error=True)
    try:
        read = inputs.read(blocks=2).to_arrow_refs()
        got = pa.concat_tables(ray.get(read))
    finally:
        ray.shutdown()
    assert sorted(got.column("id").to_pylist()) == sorted(r["id"] for r in rows)
    assert got.column("text").to_pylist()[0].startswith("Document")


def test_datasets_sources_name_the_path_and_column(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"doc": r["id"], "text": r["text"]}) + "\n" for r in _rows(2)))
    with pytest.raises(InputError, match=rf"{path}: id column 'id' is missing"):
        check_inputs(InputConfig(path=str(path)), set())
    dup = tmp_path / "dup.jsonl"
    dup.write_text("".join(json.dumps(r) + "\n" for r in _rows(2) * 2))
    assert duplicate_ids(check_inputs(InputConfig(path=str(dup)), set()), "id") == (2, ["d0", "d1"])
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    with pytest.raises(InputError, match=rf"{bad}: cannot load as json"):
        check_inputs(InputConfig(path=str(bad)), set())


def test_hub_names_are_detected_and_fail_clearly_offline(tmp_path, monkeypatch):
    import datasets
    import huggingface_hub

    # Both libraries read HF_HUB_OFFLINE at import; offline, they fail at once instead of retrying.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    assert detect_format("someone/some-dataset") == "hub"
    assert detect_format(str(tmp_path)) == "parquet"
    with pytest.raises(InputError, match=r"someone/some-dataset: cannot load as hub \(is the network reachable"):
        check_inputs(InputConfig(path="someone/some-dataset"), set())


def test_reading_a_parent_folder_skips_staging_and_underscore_folders(tmp_path):
    """A run's staging beside its output (`.out.RUN.staging/output/part-*.parquet`, and its
    commit markers in `commits/`, Parquet too) and other tools' `_temporary/` folders are
    never input, in folders and globs alike."""
    root = tmp_path / "outputs"
    (root / "day1").mkdir(parents=True)
    pq.write_table(table(), root / "day1" / "part-a.parquet")
    for hidden in (".day2.20261130T000000Z-abcdef.staging/output", ".day2.20261130T000000Z-abcdef.staging/commits",
                   "day1/_temporary/0", ".git/objects"):
        (root / hidden).mkdir(parents=True)
        pq.write_table(table(), root / hidden / "part-b.parquet")
    _, files = list_files(str(root))
    assert files == [str(root / "day1" / "part-a.parquet")]
    _, files = list_files(str(root / "**" / "*.parquet"))
    assert files == [str(root / "day1" / "part-a.parquet")]
    with pytest.raises(InputError, match="matches no Parquet files"):
        list_files(str(root / "*" / "*" / "*.parquet"))  # only hidden folders are that deep
    # Named outright, a hidden folder is read: the user asked for it.
    _, files = list_files(str(root / ".git" / "objects"))
    assert len(files) == 1


def test_duplicate_ids_across_parquet_files_are_found_on_the_cluster(tmp_path):
    """Split by a hash of the id and counted per split in Ray tasks: a repeat in another file
    lands in the same split. Nulls are not ids."""
    import ray

    pq.write_table(pa.table({"id": ["a", "b", "c", None], "text": ["t"] * 4}), tmp_path / "1.parquet")
    pq.write_table(pa.table({"id": ["d", "a", "e", "b", None], "text": ["t"] * 5}), tmp_path / "2.parquet")
    pq.write_table(pa.table({"id": ["f", "g"], "text": ["t"] * 2}), tmp_path / "3.parquet")
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        repeated, examples = duplicate_ids(check_inputs(InputConfig(path=str(tmp_path)), set()), "id")
        assert (repeated, sorted(examples)) == (2, ["a", "b"])
        assert duplicate_ids(check_inputs(InputConfig(path=str(tmp_path / "3.parquet")), set()), "id") == (0, [])
    finally:
        ray.shutdown()


def corrupt_page(path, column, fill=b"\xff", at=0.5):
    """Overwrite bytes in the middle of `column`'s chunk; the footer stays intact."""
    meta = pq.ParquetFile(path).metadata
    chunk = meta.row_group(0).column(meta.schema.to_arrow_schema().names.index(column))
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    with open(path, "r+b") as f:
        f.seek(start + int(chunk.total_compressed_size * at))
        f.write(fill * 64)


def long_table(n=500):
    return pa.table({"id": [f"i{k}" for k in range(n)], "text": [f"document {k} says this. " * 5 for k in range(n)]})


@pytest.mark.parametrize("column, compression", [("text", "snappy"), ("id", "none"), ("text", "none")])
def test_a_page_that_cannot_be_decoded_fails_the_check_naming_file_and_column(tmp_path, column, compression):
    """Its schema reads, so only decoding the pages finds it: before Ray starts, not midway."""
    f = tmp_path / "bad.parquet"
    pq.write_table(long_table(), f, compression=compression)
    corrupt_page(f, column)
    with pytest.raises(InputError, match=rf"^{f}: row group 0, column '{column}' cannot be decoded: "):
        check_inputs(InputConfig(path=str(f)), set())


def test_page_checksums_catch_bytes_that_still_decode(tmp_path):
    f = tmp_path / "crc.parquet"
    pq.write_table(long_table(), f, compression="none", write_page_checksum=True)
    data = f.read_bytes()
    f.write_bytes(data.replace(b"document 499 says", b"document 498 says"))
    assert pq.read_table(f).column("text")[499].as_py().startswith("document 498")  # decodes, wrongly
    with pytest.raises(InputError, match=rf"^{f}: row group 0, column 'text' cannot be decoded: .*CRC"):
        check_inputs(InputConfig(path=str(f)), set())


def test_with_skip_an_undecodable_file_is_left_out_and_listed(tmp_path):
    pq.write_table(long_table(), tmp_path / "bad.parquet")
    corrupt_page(tmp_path / "bad.parquet", "text")
    pq.write_table(table(), tmp_path / "good.parquet")
    inputs = check_inputs(InputConfig(path=str(tmp_path), on_bad_file="skip"), set())
    assert inputs.paths == [str(tmp_path / "good.parquet")] and inputs.rows == 3
    assert [s["file"] for s in inputs.skipped] == [str(tmp_path / "bad.parquet")]
    assert "column 'text' cannot be decoded" in inputs.skipped[0]["reason"]


def test_an_id_that_is_not_valid_utf8_makes_a_bad_file_naming_column_and_row(tmp_path):
    """Ids name the output rows: a repaired id would name a row the input lacks, so the
    file is bad (bad text only fails its row, later, in prepare)."""
    f = tmp_path / "ids.parquet"
    ids = pa.array([b"a", b"b", None, b"caf\xc3", b"e"], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"id": ids, "text": ["t"] * 5}), f, row_group_size=2)
    with pytest.raises(InputError, match=rf"^{f}: id column 'id' is not valid UTF-8 at row 3 \(row group 1\)"):
        check_inputs(InputConfig(path=str(f)), set())
    pq.write_table(table(), tmp_path / "good.parquet")
    inputs = check_inputs(InputConfig(path=str(tmp_path), on_bad_file="skip"), set())
    assert inputs.paths == [str(tmp_path / "good.parquet")]
    assert "at row 3" in inputs.skipped[0]["reason"]
    text = pa.array([b"ok", b"\xff"], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"id": ["a", "b"], "text": text}), f)
    assert check_inputs(InputConfig(path=str(f)), set()).rows == 2
