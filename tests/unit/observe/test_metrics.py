"""Live metrics (`pipeline.observe.metrics`) and progress (`pipeline.observe.progress`) without engines:
a fake feeder and policy stand in for an engine actor's; the endpoint and the
Pushgateway are real (Debian's pushgateway, started by the test)."""

import io
import json
import threading
import time
import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.generation.feeder import FeederTotals
from pipeline.observe.metrics import EngineMeter, MeterSources, RunLabels, RunMetrics, RunState, Watch, merge
from pipeline.observe.progress import ProgressLines, summary_line


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of an exposition: (name, sorted labels) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


class Policy:
    def backoffs(self, bucket):
        return [{"reason": "preemption"}, {"reason": "oom"}] if bucket == "le256" else []


def meter(engine="e1", incarnation="i1", sent=None):
    calls = [("le256", 5, 12), ("le512", 0, 4)]
    totals = FeederTotals(busy_s=3.0, first_start=0.0, last_end=4.0, oom_retries=1)
    feeder = SimpleNamespace(open_calls=lambda: calls, totals=totals)
    vllm = [{"name": "vllm:num_requests_running", "type": "gauge", "doc": "running",
             "samples": [("vllm:num_requests_running", {"engine": "0", "model_name": "tiny"}, 5.0)]}]
    gauges = SimpleNamespace(kv_gauges=lambda: (0.42, 0), metric_families=lambda: vllm)
    sent = sent if sent is not None else []
    return EngineMeter(engine, incarnation, "node-a", lambda who, snap: sent.append((who, snap)),
                       MeterSources(feeder, Policy(), gauges))


def test_an_engine_snapshot_holds_its_rows_budgets_backoffs_and_vllms_own():
    m = meter()
    m.count(["ok", "ok", "error"], ["le256", "le256", None], prompt_tokens=300, output_tokens=48)
    s = m.snapshot()
    assert sorted(map(tuple, s["rows"])) == [("error", "none", 1), ("ok", "le256", 2)]
    assert (s["prompt_tokens"], s["output_tokens"], s["kv_cache_usage"], s["busy_ratio"]) == (300, 48, 0.42, 0.75)
    assert s["in_flight"] == {"le256": 5, "le512": 0} and s["budget_rows"] == {"le256": 12, "le512": 4}
    assert s["backoffs"] == {"preemption": 1, "oom": 1}
    json.dumps(s)  # it travels to the pool's log actor as plain data


def test_a_restarted_engine_keeps_what_its_dead_incarnation_counted():
    old, new = meter(incarnation="i1"), meter(incarnation="i2")
    old.count(["ok"] * 10, ["le256"] * 10, 1000, 160)
    new.count(["ok"] * 3, ["le256"] * 3, 300, 48)
    old.feeder.totals.finished_requests, new.feeder.totals.finished_requests = 14, 3  # a chunked row's 5 calls
    first = old.snapshot()
    time.sleep(0.01)
    state = RunState()
    merge([first, new.snapshot()], into=state)
    assert state.rows[("ok", "le256")] == 13 and (state.prompt_tokens, state.output_tokens) == (1300, 208)
    assert state.requests == 17
    assert [e["incarnation"] for e in state.engines] == ["i2"]  # gauges: the live incarnation's


def run_metrics(port=None, host="0.0.0.0", pushgateway=None, linger_s=0.0, **kw) -> RunMetrics:
    watch = Watch(metrics_port=port, metrics_host=host, pushgateway=pushgateway, metrics_linger_s=linger_s)
    m = RunMetrics(RunLabels("nightly_summarize", "run-1", "/data/out", "tiny"), watch, **kw)
    snaps = []
    for engine in ("e1", "e2"):
        x = meter(engine=engine, incarnation=engine + "-1")
        x.count(["ok"] * 40, ["le256"] * 40, 4000, 640)
        x.feeder.totals.finished_requests, x.feeder.totals.finished_output_tokens = 40, 640
        snaps.append(x.snapshot())
    pool = {"snapshots": snaps, "restarts": {"e2": 1}, "stalls": {"e2": 1}}
    m.expect(rows_in=100, resumed_rows=10)
    m.attach(lambda: pool)
    return m


def test_the_exposition_names_every_series_with_its_labels():
    m = run_metrics()
    m.refresh()
    got = samples(m.exposition().decode())
    assert got[("pipeline_input_rows", ())] == 100
    assert got[("pipeline_rows_done_total", (("bucket", "le256"), ("status", "ok")))] == 80
    assert got[("pipeline_rows_remaining", ())] == 10  # 100 - 10 resumed - 80 done
    assert got[("pipeline_output_tokens_total", ())] == 1280
    for engine in ("e1", "e2"):
        who = (("engine", engine), ("node", "node-a"))
        assert got[("pipeline_engine_kv_cache_usage_ratio", who)] == 0.42
        assert got[("pipeline_engine_budget_rows", (("bucket", "le256"), *who))] == 12
        assert got[("pipeline_engine_rows_in_flight", (("bucket", "le256"), *who))] == 5
        # vLLM's own, its `engine` label replaced by ours
        assert got[("vllm:num_requests_running", (*who[:1], ("model_name", "tiny"), who[1]))] == 5
    stall = (("engine", "e2"), ("node", "node-a"), ("reason", "stall"))
    assert got[("pipeline_engine_backoffs_total", stall)] == 1
    assert got[("pipeline_engine_restarts_total", (("engine", "e2"), ("node", "node-a")))] == 1
    assert ("pipeline_last_success_timestamp_seconds", ()) not in got  # only once the run succeeds


def test_the_rate_and_eta_follow_the_rows():
    m = run_metrics()
    m.refresh()
    m._history.appendleft((time.time() - 10, 40, 640, 30))  # ten seconds ago: 50 requests, 640 tokens fewer
    m.refresh()
    assert m.state.tokens_per_s == pytest.approx(64, rel=0.05)
    assert m.state.eta_s == pytest.approx(10 / 5, rel=0.05)  # 10 rows left at 5 rows/s


def test_chunk_and_reduce_calls_move_the_rate_and_the_eta_before_their_rows_are_out():
    """A long document's map-reduce makes many requests and its row comes out last: the
    line must not read 0 tok/s and ETA ? while they run."""
    m = RunMetrics(RunLabels("nightly_summarize", "run-1", "/data/out", "tiny"), Watch(metrics_linger_s=0.0))
    e = meter(engine="e1", incarnation="e1-1")
    m.expect(rows_in=12)
    m.attach(lambda: {"snapshots": [e.snapshot()]})
    m.refresh()  # the engines started, nothing generated yet
    assert m.state.tokens_per_s is None and m.state.eta_s is None
    e.feeder.totals.finished_requests, e.feeder.totals.finished_output_tokens = 3, 48  # no row out yet
    m.refresh()
    m._history[0] = (time.time() - 10, 0, 0, 0)
    m.refresh()
    assert m.state.done == 0 and m.state.eta_s == pytest.approx(12 / 0.3, rel=0.05)  # a request per row
    assert "0/12 rows (0%) · ok 0 · error 0 · 3 requests generated · 5 output tok/s" in summary_line(m.state)
    e.count(["ok"] * 8, ["le256"] * 8, 800, 128)
    e.feeder.totals.finished_requests, e.feeder.totals.finished_output_tokens = 8, 128
    m.refresh()
    m._history[0] = (time.time() - 10, 0, 0, 0)
    with e.mapping(3):  # 3 long documents: their chunk summaries finish, their rows do not
        e.feeder.totals.finished_requests, e.feeder.totals.finished_output_tokens = 48, 768
        m.refresh()
    assert m.state.done == 8 and m.state.map_reduce == 3
    assert m.state.tokens_per_s == pytest.approx(76.8, rel=0.05)
    # 4.8 requests/s, a row per 6 requests so far: 0.8 rows/s, 4 rows left
    assert m.state.eta_s == pytest.approx(4 / 0.8, rel=0.05)
    assert "48 requests generated · 3 long documents in map-reduce · 77 output tok/s · ETA 5s" in summary_line(m.state)
    m.attach(lambda: {"snapshots": [e.snapshot()]})
    m.refresh()
    assert m.state.map_reduce == 0 and "map-reduce" not in summary_line(m.state)


def test_the_endpoint_serves_while_the_run_goes_and_lingers_after_it():
    m = run_metrics(port=0, host="127.0.0.1", linger_s=1.0)
    m.start()
    url = f"http://127.0.0.1:{m.port}/metrics"
    time.sleep(1.3)  # a refresh
    with urllib.request.urlopen(url, timeout=5) as r:
        assert samples(r.read().decode())[("pipeline_rows_remaining", ())] == 10
    started = time.monotonic()
    import threading

    finish = threading.Thread(target=m.finish, args=(True,))
    finish.start()
    time.sleep(0.3)
    with urllib.request.urlopen(url, timeout=5) as r:  # still up, with the final values
        final = samples(r.read().decode())
    assert final[("pipeline_last_success_timestamp_seconds", ())] > 0
    finish.join()
    assert time.monotonic() - started >= 1.0
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=2)


def pushed(gateway: str, name: str) -> list[float]:
    with urllib.request.urlopen(f"{gateway}/metrics", timeout=5) as r:
        return [s.value for f in text_string_to_metric_families(r.read().decode()) for s in f.samples
                if s.name == name and s.labels.get("job") == "nightly_summarize"]


def test_the_pushgateway_keeps_the_last_success_through_a_failed_run(pushgateway):
    ok = run_metrics(pushgateway=pushgateway)
    ok.refresh()
    ok.finish(success=True)
    success = pushed(pushgateway, "pipeline_last_success_timestamp_seconds")
    assert len(success) == 1 and success[0] == pytest.approx(time.time(), abs=30)
    time.sleep(1.1)
    failed = run_metrics(pushgateway=pushgateway)
    failed.finish(success=False)
    assert pushed(pushgateway, "pipeline_last_success_timestamp_seconds") == success
    ended = pushed(pushgateway, "pipeline_run_end_timestamp_seconds")
    assert len(ended) == 1 and ended[0] > success[0]  # the failed run did push


def test_a_missing_pushgateway_is_a_warning_not_a_failure():
    m = run_metrics(pushgateway="http://127.0.0.1:9")  # nothing listens there
    m.finish(success=True)
    assert m.push_errors


def test_plain_progress_lines_come_at_the_interval_and_say_it_all():
    m = run_metrics()
    m.refresh()
    out = io.StringIO()
    lines = ProgressLines(interval_s=0.2, stream=out)
    lines(m.state)
    assert out.getvalue() == ""  # not before the first interval
    time.sleep(0.25)
    lines(m.state)
    lines(m.state)
    text = out.getvalue().splitlines()
    assert len(text) == 1
    assert text[0].startswith("progress 90/100 rows (90%) · ok 80 · error 0")
    assert "engine e1@node-a: le256 5/12 · KV 42%" in text[0]
    m.state.ended_at = time.time()
    lines(m.state)
    assert out.getvalue().splitlines()[-1].endswith("done")


def test_the_summary_gives_the_eta_while_the_run_goes():
    m = run_metrics()
    m.refresh()
    m.state.eta_s = 130
    assert summary_line(m.state).endswith("ETA 2m10s")


def test_the_pool_log_gives_every_incarnations_snapshot_and_restarts_per_engine():
    from pipeline.observe.metrics import engine_name
    from pipeline.run.pool import PoolLog

    log = PoolLog(engines=2)
    actor = "ab12cd34" + "0" * 24
    log.meter("i1", {"engine": engine_name(actor), "at": 1})
    log.meter("i2", {"engine": engine_name(actor), "at": 2})
    log.meter("i2", {"engine": engine_name(actor), "at": 3})  # the same incarnation again: its latest
    log.note({"at": 1, "kind": "stall", "actor": actor})
    log.restarted({"at": 2, "kind": "restart", "actor": actor})
    got = log.metrics()
    assert sorted(s["at"] for s in got["snapshots"]) == [1, 3]
    assert got["restarts"] == {"ab12cd34": 1} and got["stalls"] == {"ab12cd34": 1}


def test_the_pool_log_keeps_an_engines_newest_snapshot_whatever_order_they_arrive_in():
    from pipeline.run.pool import PoolLog

    log = PoolLog(engines=1)
    log.meter("i1", {"engine": "e1", "seq": 2, "rows": [["ok", "le256", 10]]})
    log.meter("i1", {"engine": "e1", "seq": 1, "rows": [["ok", "le256", 9]]})  # taken first, sent last
    assert [s["seq"] for s in log.metrics()["snapshots"]] == [2]


def test_an_engines_snapshots_go_out_in_the_order_they_were_taken_from_any_thread():
    """The timer's send and a batch's race: each snapshot is numbered and sent before the
    next is taken, so the last one out holds every row counted."""
    sent = []
    m = meter(sent=sent)

    def batches():
        for _ in range(50):
            m.count(["ok"], ["le256"], 1, 1)
            m.send()

    threads = [threading.Thread(target=batches) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seqs = [snap["seq"] for _, snap in sent]
    assert seqs == list(range(1, 201))
    assert sent[-1][1]["rows"] == [["ok", "le256", 200]]


def test_a_finished_run_waits_for_the_engines_last_snapshots_before_the_pool_goes():
    """The last batch's snapshot is sent without waiting: when every row is written, the
    metrics wait (a bounded time) for it, so the final values say 100%, not 90%."""
    m = run_metrics()
    last = meter(engine="e3", incarnation="e3-1")
    last.count(["ok"] * 10, ["le256"] * 10, 100, 16)
    arrived_at = time.monotonic() + 0.5
    pool = {"snapshots": [], "restarts": {}, "stalls": {}}
    early = m._source()["snapshots"]

    def source():
        late = [last.snapshot()] if time.monotonic() >= arrived_at else []
        return {**pool, "snapshots": early + late}

    m.attach(source)
    m.detach(settle_s=5.0)
    assert m.state.remaining == 0 and m.state.done == 100
    m2 = run_metrics()
    started = time.monotonic()
    m2.detach(settle_s=0.3)  # the rows never come: it gives up after the bound
    assert m2.state.remaining == 10 and time.monotonic() - started < 2
