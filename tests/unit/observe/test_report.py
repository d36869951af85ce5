"""The pool's part of the report, from the calls' records: who served what, and who idled."""

from pipeline.observe.report import actor_summaries, pool_summary


def actor(name, calls, rows, serving_s, ready_at, last_end_at):
    return {"actor": name, "calls": calls, "windows": calls, "busy_s": serving_s, "rows": rows,
            "serving_s": serving_s, "ready_at": ready_at, "last_end_at": last_end_at}


def call(name, bucket, rows, totals, kind="rows"):
    return {"call": f"{name}-{totals['calls']}", "kind": kind, "bucket": bucket, "rows": rows, "actor": totals}


def test_each_engine_is_summarized_as_of_its_last_call_with_its_idle_time():
    a1, a2 = actor("a", 1, 100, 5.0, 1000.0, 1005.0), actor("a", 2, 150, 8.0, 1000.0, 1009.0)
    b1 = actor("b", 1, 50, 2.0, 1001.0, 1003.0)
    calls = [call("a", "le256", 100, a1), call("b", "le256", 50, b1), call("a", "le512", 50, a2)]
    actors = {a["actor"]: a for a in actor_summaries(calls)}
    # Idle: from its engine being up to the pool's last call (1009), the time it served nothing.
    assert actors["a"]["idle_s"] == 1.0 and actors["b"]["idle_s"] == 6.0

    pool = pool_summary(calls, list(actors.values()), {"le256": 150, "le512": 50})
    assert actors["a"]["rows"] == 150 and actors["b"]["rows"] == 50
    assert pool["share_of_rows"] == {"a": 0.75, "b": 0.25}
    assert pool["rows_by_bucket"] == {"le256": {"a": 100, "b": 50}, "le512": {"a": 50}}
    assert pool["largest_bucket"] == "le256" and pool["engines_serving_largest_bucket"] == 2


def test_annotation_calls_do_not_count_as_rows_served_twice():
    a = actor("a", 2, 10, 1.0, 0.0, 1.0)
    calls = [call("a", "le128", 10, a), call("a", "le128", 10, a, kind="annotations")]
    actors = actor_summaries(calls)
    assert pool_summary(calls, actors, {"le128": 10})["rows_by_bucket"] == {"le128": {"a": 10}}
    assert actors[0]["rows"] == 10


def test_the_prefix_cache_is_summed_over_the_engines_that_report_one():
    from pipeline.observe.report import prefix_cache

    assert prefix_cache([{"actor": "a"}, {"actor": "b", "prefix_cache": None}]) is None  # transformers: none
    both = [{"prefix_cache": {"queries": 1000, "hits": 256}}, {"prefix_cache": {"queries": 3000, "hits": 0}}]
    assert prefix_cache(both) == {"queries": 4000, "hits": 256, "hit_rate": 0.064}
    assert prefix_cache([{"prefix_cache": {"queries": 0, "hits": 0}}])["hit_rate"] is None


def test_a_live_servers_trajectory_is_joined_from_the_calls_and_plotted():
    """Each call carries the server's in-flight steps and back-offs since the last; the report
    joins them per engine, in time order, and the plot draws them."""
    from pipeline.observe.report import servers
    from pipeline.observe.report_plot import plot_trajectories
    from tests.helpers import drawn

    def server(steps, backoffs):
        return {"url": "http://127.0.0.1:8000", "ttft_ms": {"p50": 90.0, "p99": 300.0, "slo": 2000.0},
                "in_flight": {"started_at": 1000.0, "limit": 8, "max_in_flight": 64, "peak_in_flight": 32,
                              "steps": steps, "backoffs": backoffs}}

    def step(t, limit, reasons=None):
        return {"t": t, "limit": limit, "in_flight": limit, "running": limit, "waiting": 0, "foreign": 0,
                "ttft_ms": 100.0, **({"reasons": reasons} if reasons else {})}

    a1 = {**actor("a", 1, 100, 5.0, 1000.0, 1005.0), "server": server([step(0.5, 4), step(1.0, 6)], [])}
    a2 = {**actor("a", 2, 150, 8.0, 1000.0, 1009.0),
          "server": server([step(1.5, 3, ["online_ttft"]), step(2.0, 4)], [{"t": 1.5, "from": 6, "to": 3,
                                                                       "reasons": ["online_ttft"]}])}
    calls = [call("a", "le256", 100, a1), call("a", "le512", 50, a2)]
    (joined,) = servers(actor_summaries(calls))
    assert [s["t"] for s in joined["in_flight"]["steps"]] == [0.5, 1.0, 1.5, 2.0]
    assert [b["reasons"] for b in joined["in_flight"]["backoffs"]] == [["online_ttft"]]
    width, height, ink = drawn(plot_trajectories({"job": "j", "run_id": "r", "batching": {}, "server": [joined]}))
    assert height > 0 and ink > 0.03
