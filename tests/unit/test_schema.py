import pyarrow as pa
import pytest

from pipeline import schema
from pipeline.schema import Status


def test_output_schema_order_and_types():
    inp = pa.schema([("text", pa.string()), ("id", pa.int64()), ("source", pa.string())])
    out = schema.output_schema(inp, "id", "text")
    assert out.names == [
        "id", "text", "source", "summary", "prompt_tokens", "output_tokens", "finish_reason", "truncated",
        "original_tokens", "chunks", "bucket", "status", "error", "notes", "latency_s", "model", "run_id",
        "result_key", "input_key", "reused_from",
    ]
    types = {f.name: f.type for f in out}
    assert types["id"] == pa.int64()  # the id keeps its own type
    assert types["prompt_tokens"] == types["output_tokens"] == types["original_tokens"] == types["chunks"] == pa.int32()
    assert types["truncated"] == pa.bool_() and not out.field("truncated").nullable
    assert types["latency_s"] == pa.float64()
    assert all(types[c] == pa.string() for c in ("summary", "finish_reason", "bucket", "status", "error", "notes", "model", "run_id",
                                                "result_key", "input_key", "reused_from"))
    assert not out.field("status").nullable and out.field("error").nullable


def test_every_status_is_documented_where_users_read_them():
    """The README's status table and `pipeline run --help` name every status a row can get;
    the failed ones are statuses."""
    from click.testing import CliRunner

    from pipeline.cli import main
    from pipeline.schema import FAILED_STATUSES
    from tests.helpers import REPO

    readme = (REPO / "README.md").read_text()
    help_text = " ".join(CliRunner().invoke(main, ["run", "--help"]).output.split())
    for status in Status:
        assert f"| `{status.value}` |" in readme and status.value in help_text, status
    assert set(FAILED_STATUSES) <= {s.value for s in Status}


@pytest.mark.parametrize("clash", ["summary", "status", "_secret"])
def test_input_columns_may_not_collide_with_generated_ones(clash):
    inp = pa.schema([("id", pa.string()), ("text", pa.string()), (clash, pa.string())])
    with pytest.raises(ValueError, match="collide"):
        schema.output_schema(inp, "id", "text")


def test_conform_drops_working_columns_and_casts():
    out_schema = pa.schema([("id", pa.string()), ("prompt_tokens", pa.int32())])
    t = pa.table({"prompt_tokens": pa.array([1, 2], pa.int64()), "id": ["a", "b"], "_engine_call": ["x", "y"]})
    c = schema.conform(t, out_schema)
    assert c.schema == out_schema and c.column("id").to_pylist() == ["a", "b"]


def test_passages_and_annotations_shape_the_output():
    from pipeline.text.annotations import check_schema

    fields = check_schema({"type": "object", "properties": {"title": {"type": "string"},
                                                            "tags": {"type": "array", "items": {"type": "string"}}}})
    s = schema.output_schema(pa.schema([("id", pa.int64()), ("text", pa.string()), ("source", pa.string())]),
                      "id", "text", passages=True, annotation_fields=fields)
    assert s.names[:6] == ["id", "passage_index", "char_start", "char_end", "passage", "source"]
    assert "text" not in s.names  # the document is not repeated on every passage row
    assert s.names[6:10] == ["summary", "title", "tags", "raw_output"]
    assert s.field("tags").type == pa.list_(pa.string())
    with pytest.raises(ValueError, match=r"\['title'\] collide .* or set annotations.column_prefix"):
        schema.output_schema(pa.schema([("id", pa.int64()), ("text", pa.string()), ("title", pa.string())]),
                      "id", "text", annotation_fields=fields)
