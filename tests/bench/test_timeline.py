"""`make bench-timeline`'s bookkeeping: where an engine's generating span went, and the
plot and table of raw and the pipeline, one above the other."""

from bench.timeline import markdown, plot, summary


def steps(starts, seconds, running, waiting=None, generated=None):
    n = len(starts)
    return {"start": starts, "seconds": seconds, "running": running, "waiting": waiting or [0] * n,
            "prompt_tokens": [0] * n, "generated_tokens": generated or running, "dropped": 0}


def test_the_span_splits_into_steps_and_the_gaps_between_them():
    # Three steps of 0.1 s with gaps of 0.05 s and 0.15 s between them: span 0.5 s.
    s = summary(steps([10.0, 10.15, 10.4], [0.1, 0.1, 0.1], [4, 8, 2], waiting=[3, 0, 0]))
    assert s["steps"] == 3 and s["span_s"] == 0.5
    assert s["in_steps_s"] == 0.3 and s["gaps_s"] == 0.2 and s["gap_share"] == 0.4
    assert s["median_step_ms"] == 100.0 and s["mean_running"] == 4.7 and s["steps_with_waiting"] == 1
    assert s["generated_tokens"] == 14 and s["generated_tok_s_in_span"] == 28.0


def test_an_engine_that_ran_no_step_says_so():
    assert summary(steps([], [], []))["steps"] == 0


def test_both_systems_are_drawn_and_tabled(tmp_path):
    raw = [steps([0.0, 0.1], [0.09, 0.09], [8, 8])]
    ours = [steps([5.0, 5.2], [0.1, 0.1], [4, 4]), steps([5.1, 5.3], [0.1, 0.1], [2, 2])]
    png = tmp_path / "t.png"
    plot({"raw": raw, "pipeline": ours}, png)
    assert png.read_bytes()[:4] == b"\x89PNG"
    table = markdown({"rows": 10, "finished_at": "now", "commit": "abc", "profile": "conf/local.yaml", "plot": str(png),
                      "machine": {"cpu": "x", "cores": 2, "cpu_flags": ["avx2"]},
                      "systems": {"raw": {"wall_s": 1.0, "engines": [summary(s) for s in raw]},
                                  "pipeline": {"wall_s": 2.0, "engines": [summary(s) for s in ours]}}})
    assert "| raw | 1.0 | 2 |" in table and "| pipeline (engine 2) | 2.0 | 2 |" in table and "avx2" in table
