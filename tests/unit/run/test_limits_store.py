import logging
import time

import yaml

from pipeline.run.limits import load_limits, merge_limits, save_limits

KEY = {"model": "m", "hardware": "cpu:x", "max_model_len": 4096, "dtype": "bfloat16"}


def test_round_trip(tmp_path):
    path = str(tmp_path / "l.yaml")
    save_limits(path, KEY, {"le256": 5000, "le128": 4000})
    assert load_limits(path, KEY, max_age_days=30) == {"le128": 4000, "le256": 5000}


def test_missing_file_is_a_cold_start(tmp_path):
    assert load_limits(str(tmp_path / "none.yaml"), KEY, 30) == {}
    assert load_limits(None, KEY, 30) == {}


def test_mismatched_key_is_ignored_with_a_warning(tmp_path, caplog):
    path = str(tmp_path / "l.yaml")
    save_limits(path, KEY, {"le256": 5000})
    with caplog.at_level(logging.WARNING):
        assert load_limits(path, {**KEY, "max_model_len": 8192}, 30) == {}
    assert "another setup" in caplog.text and "max_model_len" in caplog.text


def test_stale_and_unreadable_files_are_ignored(tmp_path, caplog):
    path = tmp_path / "l.yaml"
    path.write_text(yaml.safe_dump({"key": KEY, "saved_at": time.time() - 40 * 86400, "limits": {"a": 1}}))
    with caplog.at_level(logging.WARNING):
        assert load_limits(str(path), KEY, max_age_days=30) == {}
        path.write_text("key: [")
        assert load_limits(str(path), KEY, 30) == {}
    assert "days old" in caplog.text and "unreadable" in caplog.text


def test_merge_keeps_the_smallest_limit_per_bucket():
    assert merge_limits([{"a": 10, "b": 5}, {"a": 7}, {}]) == {"a": 7, "b": 5}


def _save_many(path: str, n: int, who: int, start: float) -> None:
    while time.time() < start:
        pass
    for i in range(n):
        save_limits(path, KEY, {"le128": who * 100_000 + i})


def test_runs_that_save_at_the_same_moment_both_succeed_and_leave_valid_yaml(tmp_path):
    """Two processes save the same profile's limits 300 times each, at once, while this
    one reads the file: every read is a whole, valid file, and no temporary file is left."""
    import multiprocessing

    path = str(tmp_path / "l.yaml")
    save_limits(path, KEY, {"le128": 1})
    ctx = multiprocessing.get_context("spawn")
    start = time.time() + 2.0
    writers = [ctx.Process(target=_save_many, args=(path, 300, who, start)) for who in (1, 2)]
    for w in writers:
        w.start()
    reads = 0
    while any(w.is_alive() for w in writers):
        data = yaml.safe_load(open(path).read())
        assert data["key"] == KEY and len(data["limits"]) == 1
        reads += 1
    for w in writers:
        w.join()
        assert w.exitcode == 0
    assert reads > 0
    final = yaml.safe_load(open(path).read())["limits"]["le128"]
    assert final in (100_299, 200_299)  # the last save of one of them, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["l.yaml"]
