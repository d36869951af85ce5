import logging
import time

import yaml

from pipeline.learned import load_limits, merge_limits, save_limits

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
