"""The benchmark's bookkeeping: medians, ranges, ratios to raw, the table, memory sampling."""

import sys

from pipeline.bench import markdown, run_process, summarize, table_rows


def run(system, wall, steady, driver=100.0):
    return {"system": system, "wall_s": wall, "wall_tok_s": 1000 / wall, "steady_tok_s": steady,
            "busy_fraction": None if system == "raw" else 0.99, "peak_driver_rss_mib": driver,
            "peak_workers_rss_mib": 500.0, "rows_ok": 10, "rows_error": 0, "output_tokens": 1000}


def test_medians_ranges_and_ratios_to_raw():
    runs = [run("raw", 10, 100), run("pipeline", 12, 95), run("raw", 11, 110), run("pipeline", 14, 90),
            run("raw", 12, 90), run("pipeline", 13, 99)]
    rows = {r["system"]: r for r in table_rows(summarize(runs))}
    assert rows["raw"]["steady_tok_s"] == 100 and rows["raw"]["steady_tok_s_range"] == (90, 110)
    assert rows["pipeline"]["steady_tok_s"] == 95 and rows["pipeline"]["steady_tok_s_vs_raw"] == 0.95
    assert rows["raw"]["busy_fraction"] is None and rows["pipeline"]["runs"] == 3
    md = markdown({"rows": 4000, "repeats": 3, "model": "m", "max_new_tokens": 32, "finished_at": "now",
                   "machine": {"cpu": "x", "cores": 2, "memory_gib": 24, "versions": {}},
                   "systems": list(rows.values()), "scaling": [
                       {"rows": 1000, "wall_s": 50.0, "wall_s_per_1k": 50.0, "steady_s_per_1k": 6.0,
                        "peak_driver_rss_mib": 290.0}]})
    assert "| pipeline | 13.0<br>12.0..14.0 |" in md and "| 0.950 |" in md and "| 1,000 | 50.0 |" in md
    assert "**0.950, met** (the target applies from 4,000 rows)" not in md  # rows=4000 here
    assert "**0.950, met**." in md


def test_peak_memory_is_sampled_for_the_process_and_its_children(tmp_path):
    # A parent holding ~60 MiB and a child holding ~120 MiB, each for a second.
    code = ("import subprocess, sys, time; x = bytearray(60 * 2**20); "
            "subprocess.run([sys.executable, '-c', 'import time; y = bytearray(120 * 2**20); time.sleep(1)'])")
    wall, peak = run_process([sys.executable, "-c", code], tmp_path / "log")
    assert wall > 0.9 and peak.samples >= 3
    assert peak.driver > 60 * 2**20 and peak.workers > 120 * 2**20
