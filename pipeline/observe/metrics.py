"""Live metrics of a run, in Prometheus's terms: from every engine, wherever it runs, to
one endpoint on the driver, and to a Pushgateway.

Why prometheus-client on the driver, not `ray.util.metrics`: Ray's metrics go out
through a metrics agent on every node, which a Prometheus server must discover and
scrape node by node (Ray writes a service-discovery file for that); a run on a
laptop or a one-off cluster has no such server, and a batch job that ends before
the next scrape loses its last values. Here each engine actor sends a snapshot of
its state to the pool's log actor (`pipeline.run.pool`), which every engine already
reaches, on any node; the driver reads those snapshots once a second and serves
them, with the run's own figures, on one port (`--metrics-port`), and pushes them
to a Pushgateway (`--pushgateway`) during the run and at its end, as batch jobs do.

Names (one prefix, units in names, `_total` for counters):
- run: `pipeline_input_rows`, `pipeline_resumed_rows`, `pipeline_rows_done_total{status,bucket}`,
  `pipeline_rows_remaining`, `pipeline_prompt_tokens_total`, `pipeline_output_tokens_total`,
  `pipeline_output_tokens_per_second`, `pipeline_eta_seconds`, `pipeline_run_start_timestamp_seconds`,
  `pipeline_run_end_timestamp_seconds`, `pipeline_last_success_timestamp_seconds` (set on success
  only), `pipeline_run_info{job_name,run_id,output,model}`;
- per engine (labels `engine`, `node`): `pipeline_engine_kv_cache_usage_ratio`,
  `pipeline_engine_rows_in_flight{bucket}`, `pipeline_engine_budget_rows{bucket}`,
  `pipeline_engine_backoffs_total{reason}`, `pipeline_engine_busy_ratio`,
  `pipeline_engine_restarts_total`, and vLLM's own `vllm:*` metrics as the engine has them,
  with `engine` and `node` set to ours.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TextIO

log = logging.getLogger(__name__)

PREFIX = "pipeline_"
SNAPSHOT_INTERVAL_S = 2.0  # an engine's snapshot, at most this old (and after every batch)
RATE_WINDOW_S = 60.0  # tokens/s and the ETA: over this last stretch of the run
REASONS = ("oom", "preemption", "overshoot", "stall")  # back-offs, always exported (0 until one happens)


@dataclass(frozen=True)
class Watch:
    """How a run can be watched while it goes: the options of `pipeline run`."""

    metrics_port: int | None = None  # off by default: an open port is a choice (README)
    metrics_host: str = "0.0.0.0"
    metrics_linger_s: float = 15.0  # the endpoint after the run, so a scrape sees the final values
    pushgateway: str | None = None
    progress: str = "auto"  # live (a terminal), lines (anything else), off
    progress_interval_s: float = 30.0
    verbose: bool = False  # Ray's own progress, and every engine's warnings
    out: TextIO | None = None  # where progress goes (None: stdout); see `pipeline.observe.runlog`


@dataclass(frozen=True)
class RunLabels:
    """What every series of a run is labelled with."""

    job: str
    run_id: str
    output: str
    model: str


# --- the engine's side ------------------------------------------------------------------


def engine_name(actor_key: str) -> str:
    """An engine's name in metrics: short, and the same across its actor's restarts."""
    return actor_key[:8]


@dataclass(frozen=True)
class MeterSources:
    """What an engine's meter reads: the feeder (rows in flight and budgets per bucket, busy
    time), the batch policy (back-offs) and the engine (KV-cache use, its own metrics)."""

    feeder: Any = None
    policy: Any = None
    engine: Any = None


class EngineMeter:
    """What one engine actor reports: counted by the generate stage, read from the
    feeder, the policy and vLLM, and sent to the pool's log (`send`) every
    SNAPSHOT_INTERVAL_S and after every batch."""

    def __init__(self, engine: str, incarnation: str, node: str, send: Callable[[str, dict[str, Any]], None],
                 sources: MeterSources | None = None):
        self.engine, self.incarnation, self.node = engine, incarnation, node
        self._send = send
        self.attach(sources or MeterSources())
        self._lock = threading.Lock()
        self.rows: Counter[tuple[str, str]] = Counter()  # (status, bucket) -> rows out of this engine
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.budget_rows: dict[str, int] = {}  # the last budget seen per bucket
        self.map_reduce = 0  # documents of this engine in map-reduce now
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # One snapshot taken and sent at a time, numbered: the timer's and a batch's sends
        # otherwise race, and an older snapshot sent last hid the batch's rows for good
        # once the actor was gone (the final display said 90%, not 100%).
        self._sending = threading.Lock()
        self._seq = 0

    def attach(self, sources: MeterSources) -> None:
        """Read these from now on (an engine started on demand, after the meter)."""
        self.feeder, self.policy, self._engine = sources.feeder, sources.policy, sources.engine

    def count(self, status: list[str], buckets: list[str | None], prompt_tokens: int, output_tokens: int) -> None:
        with self._lock:
            self.rows.update(zip(status, [b or "none" for b in buckets]))
            self.prompt_tokens += prompt_tokens
            self.output_tokens += output_tokens

    @contextmanager
    def mapping(self, documents: int) -> Iterator[None]:
        """`documents` long documents of this engine are in map-reduce inside the block."""
        with self._lock:
            self.map_reduce += documents
        try:
            yield
        finally:
            with self._lock:
                self.map_reduce -= documents

    def snapshot(self) -> dict[str, Any]:
        in_flight: Counter[str] = Counter()
        if self.feeder is not None:
            for bucket, rows, allowed in self.feeder.open_calls():
                in_flight[bucket] += rows
                self.budget_rows[bucket] = allowed
        backoffs: Counter[str] = Counter()
        if self.policy is not None:
            for bucket in list(self.budget_rows):
                for b in self.policy.backoffs(bucket):
                    backoffs[str(b.get("reason", "unknown"))] += 1
        totals = getattr(self.feeder, "totals", None)
        generated = {"requests": getattr(totals, "finished_requests", 0),
                     "output_tokens": getattr(totals, "finished_output_tokens", 0)}
        with self._lock:
            rows = [[s, b, n] for (s, b), n in self.rows.items()]
            prompt, output, map_reduce = self.prompt_tokens, self.output_tokens, self.map_reduce
        return {
            "engine": self.engine, "incarnation": self.incarnation, "node": self.node, "at": time.time(),
            "rows": rows, "prompt_tokens": prompt, "output_tokens": output,
            # Every request the engine finished, chunk summaries and reduces too, as they finish:
            "generated": generated, "map_reduce": map_reduce,
            "kv_cache_usage": self._engine.kv_gauges()[0] if self._engine is not None else None,
            "busy_ratio": totals.busy_fraction() if totals is not None else None,
            "in_flight": dict(in_flight), "budget_rows": dict(self.budget_rows),
            "backoffs": dict(backoffs), "oom_retries": getattr(totals, "oom_retries", 0),
            "vllm": self._engine.metric_families() if self._engine is not None else [],
        }

    def send(self) -> None:
        try:
            with self._sending:
                self._seq += 1
                self._send(self.incarnation, {**self.snapshot(), "seq": self._seq})
        except Exception as e:  # metrics never cost a row
            log.debug("could not send engine metrics: %s", e)

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.wait(SNAPSHOT_INTERVAL_S):
                self.send()

        self._thread = threading.Thread(target=loop, name="engine-metrics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()


# --- the driver's side ------------------------------------------------------------------


@dataclass
class RunState:
    """The run's figures at one moment, from the engines' snapshots and the pool's log."""

    rows_in: int | None = None
    resumed_rows: int = 0
    rows: Counter[tuple[str, str]] = field(default_factory=Counter)
    prompt_tokens: int = 0
    output_tokens: int = 0  # of the rows out
    requests: int = 0  # engine requests finished: rows, chunk summaries, reduces, annotation retries
    generated_tokens: int = 0  # their output tokens, as they finish
    map_reduce: int = 0  # long documents in map-reduce now
    tokens_per_s: float | None = None
    eta_s: float | None = None
    started_at: float = 0.0
    ended_at: float | None = None
    last_success: float | None = None
    engines: list[dict[str, Any]] = field(default_factory=list)  # the newest snapshot per engine
    restarts: Counter[str] = field(default_factory=Counter)  # engine -> restarts
    stalls: Counter[str] = field(default_factory=Counter)

    @property
    def done(self) -> int:
        return self.resumed_rows + sum(self.rows.values())

    @property
    def remaining(self) -> int | None:
        return None if self.rows_in is None else max(0, self.rows_in - self.done)

    def by_status(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for (status, _), n in self.rows.items():
            out[status] += n
        return out


def merge(snapshots: list[dict[str, Any]], into: RunState) -> None:
    """Every incarnation's counts summed into `into` (a restarted engine's dead incarnation
    keeps what it counted), and the newest snapshot of each engine."""
    rows: Counter[tuple[str, str]] = Counter()
    prompt = output = requests = generated = 0
    newest: dict[str, dict[str, Any]] = {}
    for s in snapshots:
        rows.update({(st, b): n for st, b, n in s["rows"]})
        prompt += s["prompt_tokens"]
        output += s["output_tokens"]
        requests += s.get("generated", {}).get("requests", 0)
        generated += s.get("generated", {}).get("output_tokens", 0)
        if s["engine"] not in newest or s["at"] > newest[s["engine"]]["at"]:
            newest[s["engine"]] = s
    into.rows, into.prompt_tokens, into.output_tokens = rows, prompt, output
    into.requests, into.generated_tokens = requests, max(generated, output)
    into.engines = sorted(newest.values(), key=lambda s: s["engine"])
    into.map_reduce = sum(e.get("map_reduce", 0) for e in into.engines)


def rates(s: RunState, since: tuple[float, int, int, int], now: float) -> tuple[float | None, float | None]:
    """Output tokens/s and the ETA over the span from `since` (time, rows done, tokens,
    requests). Both count every engine request as it finishes, chunk summaries and reduces
    too: a long document's map-reduce moves them before its row is out. The ETA is the
    rows left at the request rate, times the rows a request has made so far."""
    t0, _, tokens0, requests0 = since
    span = now - t0
    if span <= 0:
        return s.tokens_per_s, s.eta_s
    tokens_per_s = (s.generated_tokens - tokens0) / span
    rows_done = s.done - s.resumed_rows
    if s.remaining is None or not s.requests:
        return tokens_per_s, None
    # Before the first row is out (a whole batch's rows come out with its last), a request per row.
    rows_per_s = (s.requests - requests0) / span * (min(1.0, rows_done / s.requests) if rows_done else 1.0)
    return tokens_per_s, (s.remaining / rows_per_s if rows_per_s > 0 else None)


class RunMetrics:
    """The run's metrics: the state, refreshed from the pool's log once a second by a
    thread of its own; a prometheus-client collector over it; the endpoint and the
    Pushgateway. `watchers` (the progress display) are called after each refresh."""

    def __init__(self, run: RunLabels, watch: Watch | None = None, push_interval_s: float = 15.0,
                 refresh_s: float = 1.0):
        watch = watch or Watch(metrics_linger_s=0.0)
        self.job, self.run_id, self.output, self.model = run.job, run.run_id, run.output, run.model
        self.port, self.host, self.pushgateway = watch.metrics_port, watch.metrics_host, watch.pushgateway
        self.push_interval_s, self.linger_s, self.refresh_s = push_interval_s, watch.metrics_linger_s, refresh_s
        self.state = RunState(started_at=time.time())
        self.watchers: list[Callable[[RunState], None]] = []
        self._source: Callable[[], dict[str, Any]] | None = None
        self._history: deque[tuple[float, int, int, int]] = deque()  # (time, rows done, tokens, requests)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._server: Any = None
        self._last_push = 0.0
        self.push_errors: list[str] = []
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    # --- life cycle -----------------------------------------------------------------

    def start(self) -> None:
        if self.port is not None:
            self._server = serve(self.registry, self.host, self.port)
            self.port = self._server.server_address[1]  # port 0: the one it got
            log.info("metrics on http://%s:%d/metrics", self.host, self.port)
        self._thread = threading.Thread(target=self._loop, name="run-metrics", daemon=True)
        self._thread.start()

    def expect(self, rows_in: int | None, resumed_rows: int = 0) -> None:
        """What the run is to do: the input's rows, and those a stopped run committed."""
        with self._lock:
            self.state.rows_in, self.state.resumed_rows = rows_in, resumed_rows

    def attach(self, source: Callable[[], dict[str, Any]]) -> None:
        """Where the engines' snapshots come from: the pool's log."""
        with self._lock:
            self._source = source

    def detach(self, settle_s: float = 0.0) -> None:
        """The pool is going away: one last refresh, then no more reads of it. `settle_s`:
        every row is written, so wait up to that long for the engines' last snapshots (each
        sent without waiting after its batch, so it may still be on its way) to say so."""
        self.refresh()
        deadline = time.monotonic() + settle_s
        while self.state.remaining and time.monotonic() < deadline:
            time.sleep(0.1)
            self.refresh()
        with self._lock:
            self._source = None

    def finish(self, success: bool) -> None:
        """The run ended: final values, the last push, and the endpoint kept for `linger_s`."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        now = time.time()
        with self._lock:
            self.state.ended_at = now
            if success:
                self.state.last_success = now
                self.state.eta_s = 0.0
        for watch in self.watchers:
            watch(self.state)
        self.push()
        if self._server is not None:
            if self.linger_s > 0:
                log.info("metrics stay on port %d for %.0f s (--metrics-linger-s)", self.port, self.linger_s)
                time.sleep(self.linger_s)
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # --- refreshing -------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self.refresh()
            if self.pushgateway and time.monotonic() - self._last_push >= self.push_interval_s:
                self.push()

    def refresh(self) -> None:
        with self._lock:
            source = self._source
        if source is None:  # the engines are not there yet: the display still says where the run is
            for watch in self.watchers:
                watch(self.state)
            return
        try:
            pool = source()
        except Exception as e:  # the pool is gone or busy: keep the last values
            log.debug("could not read engine metrics: %s", e)
            return
        now = time.time()
        with self._lock:
            s = self.state
            merge(pool.get("snapshots", []), into=s)
            s.restarts, s.stalls = Counter(pool.get("restarts", {})), Counter(pool.get("stalls", {}))
            if not s.requests and not s.generated_tokens:
                self._history.clear()  # the rates start with the first request, not with the engines' start-up
            self._history.append((now, s.done, s.generated_tokens, s.requests))
            while len(self._history) > 2 and now - self._history[0][0] > RATE_WINDOW_S:
                self._history.popleft()
            s.tokens_per_s, s.eta_s = rates(s, self._history[0], now)
        for watch in self.watchers:
            watch(self.state)

    def push(self) -> None:
        if not self.pushgateway:
            return
        from prometheus_client import pushadd_to_gateway

        self._last_push = time.monotonic()
        try:
            # pushadd: replaces only the names pushed now, so a failed run leaves the last
            # success's timestamp as it was.
            pushadd_to_gateway(self.pushgateway, job=self.job, grouping_key={"output": self.output},
                               registry=self.registry, timeout=5)
        except Exception as e:  # a missing gateway never fails a run
            if not self.push_errors:
                log.warning("could not push metrics to %s: %s", self.pushgateway, e)
            self.push_errors.append(str(e))

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def serve(registry: Any, host: str, port: int) -> Any:
    """An HTTP server for `/metrics` in a thread of its own; `shutdown()` stops it.

    Always Prometheus's classic text format: prometheus-client's own server answers a
    Prometheus that asks for OpenMetrics with colons escaped to underscores, so vLLM's
    `vllm:time_to_first_token_seconds` would be stored as `vllm_time_to_first_token_seconds`
    by a scrape and as `vllm:...` by a push; here it is `vllm:...` both ways, as vLLM names it."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] not in ("/", "/metrics"):
                self.send_error(404)
                return
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:  # a line per scrape otherwise
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server


class _Collector:
    """prometheus-client collector over a RunMetrics' state: every scrape or push reads it."""

    def __init__(self, metrics: RunMetrics):
        self.m = metrics

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        with self.m._lock:
            s = self.m.state
            yield from run_families(s, self.m)
            yield from engine_families(s)


def _gauge(name: str, doc: str, value: float | None, labels: dict[str, str] | None = None) -> Any:
    from prometheus_client.core import GaugeMetricFamily

    g = GaugeMetricFamily(PREFIX + name, doc, labels=list(labels or {}))
    g.add_metric(list((labels or {}).values()), math.nan if value is None else value)
    return g


def run_families(s: RunState, m: RunMetrics) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    info = GaugeMetricFamily(PREFIX + "run_info", "The run: job, run id, output and model.",
                             labels=["job_name", "run_id", "output", "model"])
    info.add_metric([m.job, m.run_id, m.output, m.model], 1)
    yield info
    yield _gauge("input_rows", "Rows in the input.", s.rows_in)
    yield _gauge("resumed_rows", "Rows a stopped run had committed, which this run skips.", s.resumed_rows)
    done = CounterMetricFamily(PREFIX + "rows_done", "Rows through the engines, by status and bucket.",
                               labels=["status", "bucket"])
    for (status, bucket), n in sorted(s.rows.items()):
        done.add_metric([status, bucket], n)
    yield done
    yield _gauge("rows_remaining", "Rows not yet through the engines.", s.remaining)
    yield CounterMetricFamily(PREFIX + "prompt_tokens", "Prompt tokens of the rows done.", value=s.prompt_tokens)
    yield CounterMetricFamily(PREFIX + "output_tokens", "Output tokens generated.", value=s.output_tokens)
    yield _gauge("output_tokens_per_second", f"Output tokens/s over the last {RATE_WINDOW_S:.0f} s.", s.tokens_per_s)
    yield _gauge("eta_seconds", "Estimated seconds to the last row, at the recent row rate.", s.eta_s)
    yield _gauge("run_start_timestamp_seconds", "When the run started (Unix time).", s.started_at)
    if s.ended_at is not None:
        yield _gauge("run_end_timestamp_seconds", "When the run ended, either way (Unix time).", s.ended_at)
    if s.last_success is not None:
        yield _gauge("last_success_timestamp_seconds", "When the job last succeeded (Unix time).", s.last_success)


def engine_families(s: RunState) -> Iterator[Any]:
    from prometheus_client import Metric
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    lab = ["engine", "node"]
    kv = GaugeMetricFamily(PREFIX + "engine_kv_cache_usage_ratio", "KV-cache usage, 0 to 1.", labels=lab)
    busy = GaugeMetricFamily(PREFIX + "engine_busy_ratio",
                             "Share of the engine's active time with rows in flight.", labels=lab)
    flight = GaugeMetricFamily(PREFIX + "engine_rows_in_flight", "Rows in the engine, by bucket.",
                               labels=[*lab, "bucket"])
    budget = GaugeMetricFamily(PREFIX + "engine_budget_rows", "Rows the batch policy allows in flight, by bucket.",
                               labels=[*lab, "bucket"])
    backoffs = CounterMetricFamily(PREFIX + "engine_backoffs", "Batch back-offs, by reason: oom, preemption, "
                                   "overshoot (memory past the target), stall (a hung step).", labels=[*lab, "reason"])
    restarts = CounterMetricFamily(PREFIX + "engine_restarts", "Times the engine actor was started afresh.",
                                   labels=lab)
    passthrough: dict[str, Any] = {}
    for e in s.engines:
        who = [e["engine"], e["node"]]
        kv.add_metric(who, math.nan if e["kv_cache_usage"] is None else e["kv_cache_usage"])
        busy.add_metric(who, math.nan if e["busy_ratio"] is None else e["busy_ratio"])
        for bucket in sorted(set(e["budget_rows"]) | set(e["in_flight"])):
            flight.add_metric([*who, bucket], e["in_flight"].get(bucket, 0))
            if bucket in e["budget_rows"]:
                budget.add_metric([*who, bucket], e["budget_rows"][bucket])
        reasons = Counter(e["backoffs"])
        reasons["stall"] += s.stalls.get(e["engine"], 0)
        for reason in sorted(set(REASONS) | set(reasons)):
            backoffs.add_metric([*who, reason], reasons.get(reason, 0))
        restarts.add_metric(who, s.restarts.get(e["engine"], 0))
        for fam in e["vllm"]:
            out = passthrough.get(fam["name"])
            if out is None:
                out = passthrough[fam["name"]] = Metric(fam["name"], fam["doc"], fam["type"])
            for name, labels, value in fam["samples"]:
                out.add_sample(name, {**labels, "engine": e["engine"], "node": e["node"]}, value)
    yield from (kv, busy, flight, budget, backoffs, restarts)
    yield from passthrough.values()
