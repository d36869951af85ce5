"""The key index's shards and the lookup's answer, without Ray (the shards are plain
objects here; tests/integration/run/test_nightly.py runs them as actors)."""

import pyarrow as pa

from pipeline.reuse.index import (INPUT_KEY, PREPARED, REUSED_FROM, REUSED_PREFIX, KeyShard, by_shard, keyed_look_up,
                                  look_up_inputs, result_columns, with_found)
from pipeline import schema
from tests.helpers.shards import Local


def source(keys, summaries, label, tokens=4):
    return pa.table({"result_key": keys, REUSED_FROM: [label] * len(keys),
                     REUSED_PREFIX + "summary": summaries,
                     REUSED_PREFIX + "output_tokens": pa.array([tokens] * len(keys), pa.int32())})


def test_a_shard_answers_in_order_and_the_newest_source_wins():
    shard = KeyShard()
    shard.add(source(["k1", "k2"], ["old one", "old two"], "night1"), rank=1)
    shard.add(source(["k2", "k3"], ["new two", "new three"], "night2"), rank=0)
    assert shard.size() == 3
    found = shard.look_up(["k3", "nope", "k2", "k1"]).to_pydict()
    assert found[REUSED_PREFIX + "summary"] == ["new three", None, "new two", "old one"]
    assert found[REUSED_FROM] == ["night2", None, "night2", "night1"]
    assert shard.asked() == 4  # every key asked about, found or not (a resumed run's count)


def test_answers_from_several_shards_line_up_with_the_batch_rows():
    shards = [KeyShard(), KeyShard()]
    keys = [f"v1:{i}" for i in range(6)]
    rows = by_shard(keys, 2)
    for s, members in rows.items():
        shards[s].add(source([keys[i] for i in members if i != 4], [f"s{i}" for i in members if i != 4], "n1"), 0)
    batch = pa.table({"id": list("abcdefg"), "result_key": [*keys, None]})
    rows = by_shard(batch.column("result_key").to_pylist(), 2)
    assert sorted(i for m in rows.values() for i in m) == list(range(6))  # no key, no shard
    found = [shards[s].look_up([batch.column("result_key")[i].as_py() for i in m]) for s, m in rows.items()]
    out = with_found(batch, list(rows.values()), found, ["summary", "output_tokens"]).to_pydict()
    assert out[REUSED_PREFIX + "summary"] == ["s0", "s1", "s2", "s3", None, "s5", None]
    assert out[REUSED_FROM] == ["n1"] * 4 + [None, "n1", None]


def test_a_shard_with_nothing_indexed_answers_with_nulls_of_the_right_type():
    empty, full = KeyShard(), KeyShard()
    full.add(source(["k1"], ["one"], "n1", tokens=7), 0)
    batch = pa.table({"result_key": ["k0", "k1"]})
    out = with_found(batch, [[0], [1]], [empty.look_up(["k0"]), full.look_up(["k1"])], ["summary", "output_tokens"])
    assert out.column(REUSED_PREFIX + "output_tokens").to_pylist() == [None, 7]
    assert out.schema.field(REUSED_PREFIX + "output_tokens").type == pa.int32()


def test_what_a_reused_row_takes_is_the_summary_its_annotations_and_how_they_ended():
    plain = schema.output_schema(pa.schema([("id", pa.string()), ("text", pa.string())]), "id", "text")
    assert result_columns(plain) == ["summary", "output_tokens", "finish_reason", "latency_s"]
    annotated = schema.output_schema(pa.schema([("id", pa.string()), ("text", pa.string())]), "id", "text",
                                     annotation_fields=[pa.field("title", pa.string())])
    assert result_columns(annotated) == ["summary", "output_tokens", "finish_reason", "latency_s", "title",
                                         "raw_output", "annotation_tries", "summary_finish_reason"]


def test_each_shard_loads_only_its_own_keyed_ok_rows_from_the_files(tmp_path):
    import pyarrow.parquet as pq

    keys = [f"v1:{i}" for i in range(40)]
    status = ["ok"] * 39 + ["error"]
    pq.write_table(pa.table({"result_key": keys + [None], "status": status + ["ok"], "summary": [f"s{i}" for i in range(41)],
                             "output_tokens": pa.array([4] * 41, pa.int32())}), tmp_path / "part.parquet")
    shards = [KeyShard(), KeyShard()]
    loaded = [s.load([(str(tmp_path / "part.parquet"), 0, "n1", False)], k, 2, ["summary", "output_tokens"])
              for k, s in enumerate(shards)]
    assert sum(n for n, _ in loaded) == 39  # the error row and the row without a key are not indexed
    for k, s in enumerate(shards):
        mine = [key for key in keys[:39] if by_shard([key], 2).get(k)]
        assert s.size() == len(mine) and s.look_up(mine).column(REUSED_FROM).null_count == 0
    assert shards[0].look_up(["v1:39"]).column(REUSED_FROM).to_pylist() == [None]


def test_a_window_puts_the_rows_to_generate_first_grouped_and_the_reused_after():
    from pipeline.run.job import group_window

    batch = pa.table({"id": list("abcdef"), schema.BUCKET_INDEX: pa.array([1, 0, 1, 0, 0, 1], pa.int32()),
                      REUSED_FROM: ["n1", None, None, "n1", None, None]})
    assert group_window(batch).column("id").to_pylist() == ["b", "e", "c", "f", "a", "d"]


def test_a_row_is_found_by_its_input_key_in_that_keys_shard_with_what_prepare_made_of_it(tmp_path):
    import pyarrow.parquet as pq

    n = 40
    table = pa.table({"result_key": [f"v1:{i}" for i in range(n)], "input_key": [f"i1:{i}" for i in range(n - 1)] + [None],
                      "status": ["ok"] * n, "summary": [f"s{i}" for i in range(n)],
                      "output_tokens": pa.array([4] * n, pa.int32()), "prompt_tokens": pa.array(range(n), pa.int32()),
                      "truncated": [False] * n, "original_tokens": pa.nulls(n, pa.int32()),
                      "chunks": pa.nulls(n, pa.int32()), "bucket": ["le256"] * n})
    pq.write_table(table, tmp_path / "part.parquet")
    shards = [KeyShard(), KeyShard()]
    for k, s in enumerate(shards):
        s.load([(str(tmp_path / "part.parquet"), 0, "n1", True)], k, 2, ["summary", "output_tokens"])
    assert sum(s.size() for s in shards) == n  # each result key once, as before
    for i in (0, 7, 38):
        shard = shards[by_shard([f"i1:{i}"], 2).popitem()[0]]
        row = shard.look_up_inputs([f"i1:{i}"]).to_pylist()[0]
        assert row[REUSED_FROM] == "n1" and row[REUSED_PREFIX + "summary"] == f"s{i}"
        assert {c: row[REUSED_PREFIX + c] for c in PREPARED} == {
            "prompt_tokens": i, "truncated": False, "original_tokens": None, "chunks": None, "bucket": "le256",
            "result_key": f"v1:{i}"}
    other = shards[1 - by_shard(["i1:0"], 2).popitem()[0]]
    assert other.look_up_inputs(["i1:0"]).column(REUSED_FROM).to_pylist() == [None]  # not its shard's
    asked = [s.inputs_asked() for s in shards]
    assert sum(a for a, _ in asked) == 4 and sum(f for _, f in asked) == 3


def test_the_lookup_after_prepare_keys_and_asks_only_the_rows_prepare_did_not_find(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", lambda refs: refs)
    base = "base"
    from pipeline.generation.result_key import result_key

    ids = [[3, 4], [1, 2], [5, 6], [7, 8], [9, 9]]
    shards = [KeyShard(), KeyShard()]
    for i in (2, 4):  # found by their result keys, in whichever shard each key falls in
        key = result_key(base, ids[i])
        shards[by_shard([key], 2).popitem()[0]].add(source([key], [f"by result key {i}"], "n1"), 0)
    # Rows 1 and 3 found before tokenizing (prepare's columns); 0, 2 and 4 not.
    batch = pa.table({"id": list("abcde"), "status": ["ok"] * 5,
                      schema.PROMPT_TOKEN_IDS: pa.array([ids[0], [], ids[2], [], ids[4]], pa.list_(pa.int32())),
                      schema.CHUNK_TEXTS: pa.nulls(5, pa.list_(pa.string())),
                      REUSED_FROM: [None, "n0", None, "n0", None],
                      REUSED_PREFIX + "summary": [None, "by input 1", None, "by input 3", None],
                      REUSED_PREFIX + "output_tokens": pa.array([None, 4, None, 4, None], pa.int32()),
                      REUSED_PREFIX + "prompt_tokens": pa.array([None, 9, None, 9, None], pa.int32()),
                      REUSED_PREFIX + "result_key": [None, "v1:b", None, "v1:d", None]})
    out = keyed_look_up(batch, base, [Local(s) for s in shards], ["summary", "output_tokens"]).to_pydict()
    assert out["id"] == list("abcde")  # in the batch's order
    assert out[REUSED_FROM] == [None, "n0", "n1", "n0", "n1"]
    assert out[REUSED_PREFIX + "summary"] == [None, "by input 1", "by result key 2", "by input 3", "by result key 4"]
    assert out["result_key"] == [result_key(base, ids[0]), "v1:b", result_key(base, ids[2]), "v1:d",
                                 result_key(base, ids[4])]
    assert sum(s.asked() for s in shards) == 3  # only the rows prepare did not find


def test_input_keys_found_nowhere_give_no_table(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", lambda refs: refs)
    shard = KeyShard()
    assert look_up_inputs(["i1:x", None], [Local(shard)]) is None
    assert look_up_inputs([None, None], [Local(shard)]) is None
