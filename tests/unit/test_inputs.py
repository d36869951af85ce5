import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.inputs import InputError, check_inputs, list_files


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
    assert check_inputs(str(tmp_path / "d"), "id", "text", {"text"}).rows == 5
    assert len(list_files(str(tmp_path / "d" / "a.parquet"))[1]) == 1


def test_errors_name_file_and_column(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(InputError, match="no such file"):
        check_inputs(str(missing), "id", "text", set())
    f = tmp_path / "x.parquet"
    pq.write_table(table(), f)
    with pytest.raises(InputError, match=rf"{f}: id column 'doc_id' is missing"):
        check_inputs(str(f), "doc_id", "text", set())
    with pytest.raises(InputError, match=rf"{f}: the prompt template names \['title'\]"):
        check_inputs(str(f), "id", "text", {"text", "title"})
    g = tmp_path / "g.parquet"
    pq.write_table(pa.table({"id": ["a"], "text": [1]}), g)
    with pytest.raises(InputError, match=rf"{g}: text column .text. is int64, expected string \(or binary\)"):
        check_inputs(str(g), "id", "text", set())
    corrupt = tmp_path / "c.parquet"
    corrupt.write_bytes(b"PAR1 not really")
    with pytest.raises(InputError, match=rf"{corrupt}: not a readable Parquet file"):
        check_inputs(str(corrupt), "id", "text", set())
    with pytest.raises(InputError, match="matches no Parquet files"):
        check_inputs(str(tmp_path / "*.csv"), "id", "text", set())
