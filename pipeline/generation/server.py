"""A live OpenAI-compatible server as one engine of the generation core.

`engine.backend: server` sends rows to a server the job shares with online traffic
(vLLM's, or another that speaks `/v1/completions`), as streamed completion requests at a
low priority. It implements `pipeline.generation.engine.Engine`, so the feeder, the row
contract, commits, resume and the report work as for an engine of our own:
- `submit` queues a request here; a dispatcher sends queued requests while fewer than
  the in-flight limit are out. The limit is `InFlightController`'s
  (`pipeline.generation.policy.inflight`), sized from the server's `/metrics` (queue,
  preemptions) and our requests' time to first token, never above `max_in_flight`.
- `step` waits briefly for requests to finish and returns them.
- Prompts go as token ids (the prepare stage's, so truncation and buckets hold) where the
  server's tokenizer is ours, as a probe through its `/tokenize` shows; else as text,
  decoded with our tokenizer, and the report says why.

Errors: 429 and 503 back off and retry, up to `max_retries` (then the row's error); a
refused connection, a dropped stream or another 5xx retries until the server has served
nothing for `unavailable_s`, and then `step` raises `ServerUnavailable` (an `EngineDead`:
the actor ends, and the run stops resumable once its restarts, whose probes fail, are
spent); any other answer is that row's error. A request is sent again only while it has
not completed, so no completed row is generated twice.

The HTTP client is httpx's, on an asyncio loop in a thread of its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from pipeline.generation.engine import Completion, EngineDead, Sampling
from pipeline.generation.policy.inflight import InFlightController, ServerSample, others_by_bucket

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise

# Text whose token ids ours and the server's tokenizer must agree on: words, digits,
# punctuation, accents and a dash, as real documents have.
PROBE_TEXT = "Summarize: the café's 3 reports (2026-12-03) — naïve units, 17.5% faster; done."
STEP_WAIT_S = 0.05  # a step returns after this long if nothing finished
STREAMS_CATCH_UP_S = 0.05
# The server's histograms of finished requests, and what each counts: others' finished
# requests are told from ours bucket by bucket (`policy.inflight.others_by_bucket`).
HISTOGRAMS = {"vllm:request_prompt_tokens": "prompt_tokens", "vllm:request_generation_tokens": "completion_tokens"}


class ServerUnavailable(EngineDead):
    """The server refused connections, or served nothing, for longer than allowed."""


@dataclass
class ServerSettings:
    """What one server engine is built with (from `engine.server`)."""

    url: str
    model: str
    max_in_flight: int = 64
    start_in_flight: int = 4
    feedback: bool = True  # False: the limit stays at start_in_flight
    ttft_slo_ms: float = 2000.0
    priority: int | None = 10
    unavailable_s: float = 120.0
    request_timeout_s: float = 600.0
    max_retries: int = 8
    metrics_interval_s: float = 0.5
    probe_every_s: float = 1.0  # an online-priority probe request this often (0: none)
    online_priority: int = 0  # the probe's priority: what online requests send
    api_key_env: str | None = None
    ca_file: str | None = None
    tokenizer_path: str | None = None  # our tokenizer (the model folder), for the probe and text prompts
    max_model_len: int | None = None  # ours; the server's, if lower, wins
    hold: int = 2  # the controller's hold, in samples

    @property
    def base(self) -> str:
        return self.url.rstrip("/")


@dataclass
class _Request:
    id: str
    prompt: list[int]
    sampling: Sampling
    submitted: float
    task: asyncio.Task[Any] | None = None
    tries: int = 0
    began: bool = False  # this try's stream began: the server may count the request as finished
    usage: dict[str, int] | None = None  # the server's token counts, from the stream's last chunk


@dataclass
class ServerTotals:
    """What the server engine did, for the report."""

    sent: int = 0  # requests sent, retries included
    completed: int = 0
    probes: int = 0  # online-priority probes the server answered
    aborted: int = 0  # sent, then aborted by the feeder (the server counts them as finished)
    row_errors: int = 0
    retries: Counter[str] = field(default_factory=Counter)  # by cause: 429, 503, connection, ...
    ttft_ms: list[float] = field(default_factory=list)  # ours, each completed request's


def parse_metrics(text: str) -> dict[str, Any]:
    """The vLLM gauges and counters the controller reads, summed over their labels
    (several engines behind one server add up); under "histograms", the buckets of its
    histograms of finished requests (`HISTOGRAMS`' names -> upper bound -> cumulative count)."""
    from prometheus_client.parser import text_string_to_metric_families

    want = {"vllm:num_requests_waiting": "waiting", "vllm:num_requests_running": "running",
            "vllm:num_preemptions_total": "preemptions", "vllm:kv_cache_usage_perc": "kv_cache",
            "vllm:request_success_total": "done", "vllm:time_to_first_token_seconds_sum": "ttft_sum",
            "vllm:time_to_first_token_seconds_count": "ttft_count", "vllm:iteration_tokens_total_count": "steps"}
    out: dict[str, Any] = {}
    histograms: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = want.get(sample.name)
            if key is not None:
                out[key] = (max if key == "kv_cache" else (lambda a, b: a + b))(out.get(key, 0.0), sample.value)
            elif sample.name.endswith("_bucket") and sample.name[:-7] in HISTOGRAMS:
                buckets = histograms.setdefault(HISTOGRAMS[sample.name[:-7]], {})
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
    if histograms:
        out["histograms"] = histograms
    return out


class ServerEngine:
    """One OpenAI-compatible server, driven as a steppable engine (module docstring)."""

    pads_batches = False
    padding = None
    kv_cache_tokens = None

    def __init__(self, settings: ServerSettings, tokenizer: Any = None, transport: Any = None):
        """`tokenizer`: ours (the prepare stage's), for the probe and text prompts.
        `transport`: httpx's, in place of the network (the unit tests' fake server)."""
        self.settings = settings
        self._transport = transport
        self.tokenizer = tokenizer
        started = time.monotonic()
        self.max_num_seqs = settings.max_in_flight
        self.controller = InFlightController(settings.max_in_flight, settings.ttft_slo_ms,
                                             start=settings.start_in_flight, hold=settings.hold,
                                             adaptive=settings.feedback, probing=settings.probe_every_s > 0)
        self.startup_attempts: list[dict[str, Any]] = []
        self.rebuilds: list[dict[str, Any]] = []
        self.totals = ServerTotals()
        self.priority = settings.priority
        self.notes: list[str] = []
        self._reported = (0, 0)  # the trajectory's steps and back-offs reported so far
        self._lock = threading.Lock()
        self._finished: list[tuple[str, Completion]] = []
        self._done = threading.Condition(self._lock)
        self._pending: deque[_Request] = deque()
        self._out: dict[str, _Request] = {}
        self._ids = 0
        self._dead: ServerUnavailable | None = None
        self._down_since: float | None = None  # the first failure since the server last answered
        self._ttft_since_sample: list[float] = []
        self._throttled_since_sample = 0
        self._finished_since_sample = 0
        self._probe_ttfts: list[float] = []
        self._probed_at = 0.0
        self._gauges: dict[str, Any] = {}
        # Ours the server has finished, by the token counts it told us (HISTOGRAMS' values),
        # and how many it may have finished whose counts we do not know.
        self._ours_values: dict[str, Counter[int]] = {name: Counter() for name in HISTOGRAMS.values()}
        self._ours_unknown = 0
        self._ttft_seen = (0.0, 0.0)
        self._loop = asyncio.new_event_loop()
        self._wake: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run_loop, name="server-engine", daemon=True)
        self._thread.start()
        try:
            self.probe = self._call(self._probe())
        except BaseException as e:
            self.startup_attempts.append({"url": settings.base, "error": str(e)[:500]})
            self.close()
            raise
        self.max_model_len = min(x for x in (settings.max_model_len, self.probe.get("max_model_len"), 1 << 30) if x)
        self.prompt_as = self.probe["prompt_as"]
        self.startup_attempts.append({"url": settings.base, "error": None})
        self.startup_s = time.monotonic() - started
        self._call(self._start_tasks())

    # -- the loop thread ---------------------------------------------------------------

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _client(self) -> Any:
        import httpx

        s = self.settings
        headers = {}
        if s.api_key_env:
            key = os.environ.get(s.api_key_env)
            if not key:
                raise RuntimeError(f"engine.server.api_key_env: ${s.api_key_env} is not set")
            headers["Authorization"] = f"Bearer {key}"
        limits = httpx.Limits(max_connections=s.max_in_flight + 4, max_keepalive_connections=s.max_in_flight + 4)
        return httpx.AsyncClient(base_url=s.base, headers=headers, verify=s.ca_file or True, limits=limits,
                                 timeout=httpx.Timeout(s.request_timeout_s, connect=10.0), transport=self._transport)

    async def _probe(self) -> dict[str, Any]:
        """The server serves our model, and how prompts will go to it (token ids or text)."""
        import httpx

        s = self.settings
        self._http = self._client()
        try:
            r = await self._http.get("/v1/models")
        except httpx.HTTPError as e:
            raise ServerUnavailable(f"the server at {s.base} did not answer: {type(e).__name__}: {e}") from e
        if r.status_code != 200:
            raise ServerUnavailable(f"the server at {s.base} answered GET /v1/models with {r.status_code}: "
                                    f"{r.text[:300]}")
        models = {m.get("id"): m for m in r.json().get("data", [])}
        if s.model not in models:
            raise RuntimeError(f"the server at {s.base} does not serve {s.model!r} (engine.server.model); "
                               f"it serves: {', '.join(sorted(map(str, models))) or 'nothing'}")
        out: dict[str, Any] = {"url": s.base, "model": s.model, "max_model_len": models[s.model].get("max_model_len")}
        if self.tokenizer is None:
            out.update(prompt_as="text", why="no tokenizer of ours to compare with the server's")
            return out
        ours = list(self.tokenizer.encode(PROBE_TEXT, add_special_tokens=False))
        try:
            t = await self._http.post("/tokenize", json={"model": s.model, "prompt": PROBE_TEXT,
                                                         "add_special_tokens": False})
            theirs = t.json().get("tokens") if t.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            theirs = None
        if theirs is None:
            out.update(prompt_as="text", why=f"the server has no /tokenize to compare its tokenizer with ours")
        elif list(theirs) != ours:
            out.update(prompt_as="text", why=f"the server's tokenizer differs from ours on a probe ({len(theirs)} "
                                             f"tokens against {len(ours)}): prompts go as text")
        else:
            out.update(prompt_as="token_ids", why="the server's /tokenize matched ours on a probe")
        if out["prompt_as"] == "text":
            log.warning("server engine: prompts go to %s as text: %s", s.base, out["why"])
        return out

    async def _start_tasks(self) -> None:
        self._wake = asyncio.Event()
        self._tasks = [asyncio.ensure_future(self._dispatch()), asyncio.ensure_future(self._sample())]

    async def _dispatch(self) -> None:
        """Send queued requests while fewer than the limit are out."""
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending and len(self._out) < min(self.controller.limit, self.settings.max_in_flight):
                with self._lock:
                    if not self._pending:
                        break
                    req = self._pending.popleft()
                    self._out[req.id] = req
                req.task = asyncio.ensure_future(self._send(req))

    def _poke(self) -> None:
        if self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def _ours_done(self) -> int:
        """Our requests the server has finished (as far as we have read): rows, aborted, probes."""
        return self.totals.completed + self.totals.aborted + self.totals.probes

    async def _probe_online(self) -> None:
        """What an online request waits for its first token now: one token at the online
        priority (the policy holds it to the target while online traffic is there)."""
        prompt: Any = PROBE_TEXT
        if self.prompt_as == "token_ids" and self.tokenizer is not None:
            prompt = list(self.tokenizer.encode(PROBE_TEXT, add_special_tokens=False))
        body: dict[str, Any] = {"model": self.settings.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                                "stream": True, "stream_options": {"include_usage": True}}
        if self.priority is not None:
            body["priority"] = self.settings.online_priority
        sent = time.monotonic()
        first = None
        usage = None
        try:
            async with self._http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return
                try:
                    async for line in r.aiter_lines():
                        if first is None and line.startswith("data:") and '"choices"' in line:
                            first = time.monotonic()
                        if line.startswith("data:") and '"usage"' in line:
                            usage = json.loads(line[5:]).get("usage")
                except Exception:  # the stream broke: the server may have counted it
                    with self._lock:
                        self._ours_unknown += 1
                    return
        except Exception:  # no probe this time: the rows' requests say whether the server is there
            return
        with self._lock:
            self.totals.probes += 1
            self._count_finished(usage)
            if first is not None:
                self._probe_ttfts.append(1000 * (first - sent))

    async def _sample(self) -> None:
        """Read the server's /metrics every interval and let the controller set the limit."""
        while True:
            await asyncio.sleep(self.settings.metrics_interval_s)
            every = self.settings.probe_every_s
            # While online traffic is there, a probe each sample: the limit follows its wait.
            if every and (self.controller.online_present or time.monotonic() - self._probed_at >= every):
                self._probed_at = time.monotonic()
                asyncio.ensure_future(self._probe_online())
            with self._lock:
                ours_before = self._ours_done()
                values_before = {name: Counter(c) for name, c in self._ours_values.items()}
            try:
                r = await self._http.get("/metrics", timeout=5.0)
                g = parse_metrics(r.text) if r.status_code == 200 else {}
            except Exception:  # no metrics this time: the requests say whether the server is there
                g = {}
            # The server counts a request finished as it queues its last chunk to us: let the
            # streams read what has arrived before ours are counted against its count.
            await asyncio.sleep(STREAMS_CATCH_UP_S)
            with self._lock:
                ttfts, self._ttft_since_sample = self._ttft_since_sample, []
                throttled, self._throttled_since_sample = self._throttled_since_sample, 0
                finished, self._finished_since_sample = self._finished_since_sample, 0
                in_flight = len(self._out)
                ours_done = self._ours_done()
                values_after = {name: Counter(c) for name, c in self._ours_values.items()}
                unknown = self._ours_unknown
                probes, self._probe_ttfts = self._probe_ttfts, []
            server_ttft = None
            if "ttft_count" in g:
                count, total = g["ttft_count"] - self._ttft_seen[0], g["ttft_sum"] - self._ttft_seen[1]
                self._ttft_seen = (g["ttft_count"], g["ttft_sum"])
                server_ttft = round(1000 * total / count, 1) if count > 0 else None
            self._gauges = g
            before = self.controller.limit
            self.controller.observe(ServerSample(
                waiting=int(g.get("waiting", 0)), running=int(g.get("running", 0)),
                preemptions=int(g.get("preemptions", 0)), in_flight=in_flight,
                ttft_ms=round(max(ttfts), 1) if ttfts else None, throttled=throttled,
                probe_ttft_ms=round(max(probes), 1) if probes else None,
                kv_cache=g.get("kv_cache"), server_ttft_ms=server_ttft, finished=finished,
                server_done=int(g["done"]) if "done" in g else None,
                server_steps=int(g["steps"]) if "steps" in g else None, ours_done_before=ours_before,
                ours_done=ours_done, others_by_bucket=others_by_bucket(g["histograms"], values_before, values_after,
                                                                       unknown) if "histograms" in g else None))
            if self.controller.limit > before:
                self._poke()

    def _body(self, req: _Request) -> dict[str, Any]:
        sp = req.sampling
        prompt: Any = req.prompt
        if self.prompt_as == "text":
            prompt = self.tokenizer.decode(req.prompt) if self.tokenizer is not None else req.prompt
        body: dict[str, Any] = {
            "model": self.settings.model, "prompt": prompt, "max_tokens": sp.max_new_tokens,
            "temperature": sp.temperature, "top_p": sp.top_p, "stream": True,
            "stream_options": {"include_usage": True},
        }
        if sp.seed is not None:
            body["seed"] = sp.seed
        if self.priority is not None:
            body["priority"] = self.priority
        if sp.json_schema is not None:
            body["structured_outputs"] = {"json": sp.json_schema, "disable_any_whitespace": True}
        if sp.allowed_token_ids is not None:
            body["allowed_token_ids"] = list(sp.allowed_token_ids)
        return body

    async def _send(self, req: _Request) -> None:
        """One request to its end: a completion, the row's error, or (the server gone) nothing."""
        import httpx

        s = self.settings
        pause = 0.5
        while True:
            if req.began:  # the last try's stream began, then failed: the server may count it finished
                with self._lock:
                    self._ours_unknown += 1
                req.began = False
            req.tries += 1
            self.totals.sent += 1
            sent = time.monotonic()
            try:
                result = await self._stream(req, sent)
            except httpx.HTTPStatusError as e:
                status, text = e.response.status_code, e.response.text[:500]
                if status in (429, 503) and req.tries <= s.max_retries:
                    self._server_answered()
                    self.totals.retries[str(status)] += 1
                    with self._lock:
                        self._throttled_since_sample += 1
                    await asyncio.sleep(pause)
                    pause = min(pause * 2, 10.0)
                    continue
                if status >= 500 and status != 503:
                    if self._server_failed(f"{status}: {text}"):
                        return
                    self.totals.retries["5xx"] += 1
                    await asyncio.sleep(min(pause, 2.0))
                    continue
                self._server_answered()
                if status == 400 and self.priority is not None and "priorit" in text.lower():
                    self.priority = None
                    self.notes.append("the server does not schedule by priority (start vLLM with "
                                      "--scheduling-policy priority): requests went without one")
                    log.warning("server engine: %s: sending without a priority", self.notes[-1])
                    continue
                self._finish(req, Completion(None, 0, time.monotonic() - req.submitted, None,
                                             error=f"the server answered {status}: {text}"))
                return
            except (httpx.TransportError, httpx.StreamError, ValueError) as e:
                if self._server_failed(f"{type(e).__name__}: {e}"):
                    return
                self.totals.retries["connection"] += 1
                await asyncio.sleep(min(pause, 2.0))
                pause = min(pause * 2, 10.0)
                continue
            self._server_answered()
            self._finish(req, result)
            return

    async def _stream(self, req: _Request, sent: float) -> Completion:
        text: list[str] = []
        first: float | None = None
        finish: str | None = None
        tokens: int | None = None
        async with self._http.stream("POST", "/v1/completions", json=self._body(req)) as r:
            if r.status_code != 200:
                await r.aread()
                r.raise_for_status()
            req.began = True
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:  # an error after the stream began: the row's
                    raise httpx.HTTPStatusError(str(chunk["error"]), request=r.request, response=httpx.Response(
                        int(chunk["error"].get("code") or 400), text=json.dumps(chunk["error"])))
                for choice in chunk.get("choices") or ():
                    if first is None:
                        first = time.monotonic()
                        ttft = 1000 * (first - sent)
                        with self._lock:
                            self._ttft_since_sample.append(ttft)
                        self.totals.ttft_ms.append(round(ttft, 1))
                    text.append(choice.get("text") or "")
                    finish = choice.get("finish_reason") or finish
                usage = chunk.get("usage")
                if usage:
                    tokens = usage.get("completion_tokens")
                    req.usage = usage
        if finish is None:
            raise httpx.StreamError("the stream ended before the request finished")
        return Completion("".join(text), tokens if tokens is not None else 0, 0.0, finish,
                          first_token_s=None if first is None else first - sent)

    def _server_answered(self) -> None:
        self._down_since = None

    def _server_failed(self, why: str) -> bool:
        """A failure that says the server is not there; True once it has been gone too long."""
        now = time.monotonic()
        if self._down_since is None:
            self._down_since = now
            log.warning("server engine: %s failed (%s); retrying for up to %.0f s", self.settings.base, why,
                        self.settings.unavailable_s)
        if now - self._down_since < self.settings.unavailable_s:
            return False
        with self._lock:
            if self._dead is None:
                self._dead = ServerUnavailable(
                    f"the server at {self.settings.base} has served nothing for {now - self._down_since:.0f} s "
                    f"(engine.server.unavailable_s: {self.settings.unavailable_s:g}); last: {why}")
            self._done.notify_all()
        return True

    def _finish(self, req: _Request, c: Completion) -> None:
        with self._lock:
            if self._out.pop(req.id, None) is None:  # aborted meanwhile
                return
            self._finished.append((req.id, c))
            self._finished_since_sample += 1
            if c.error is None:
                self.totals.completed += 1
                self._count_finished(req.usage)
            else:
                self.totals.row_errors += 1
                if req.began:  # an error in the stream: the server may count it finished
                    self._ours_unknown += 1
            self._done.notify_all()
        self._poke()

    def _count_finished(self, usage: dict[str, int] | None) -> None:
        """One of ours the server finished, by the token counts it told us (under the lock)."""
        counts = [usage.get(key) for key in HISTOGRAMS.values()] if usage else []
        if not counts or None in counts:
            self._ours_unknown += 1
            return
        for key, n in zip(HISTOGRAMS.values(), counts):
            self._ours_values[key][n] += 1

    # -- the Engine protocol ----------------------------------------------------------

    def submit(self, prompt_token_ids: list[int], sampling: Sampling) -> str:
        with self._lock:
            if self._dead is not None:
                raise self._dead
            self._ids += 1
            req = _Request(f"srv-{self._ids}", list(prompt_token_ids), sampling, time.monotonic())
            self._pending.append(req)
        self._poke()
        return req.id

    def step(self) -> list[tuple[str, Completion]]:
        with self._lock:
            if not self._finished and self._dead is None:
                self._done.wait(STEP_WAIT_S)
            if self._dead is not None:
                raise self._dead
            finished, self._finished = self._finished, []
        return finished

    def abort(self, request_ids: list[str]) -> None:
        gone = set(request_ids)
        with self._lock:
            self._pending = deque(r for r in self._pending if r.id not in gone)
            cancelled = [self._out.pop(i) for i in list(self._out) if i in gone]
            self.totals.aborted += len(cancelled)
            self._ours_unknown += len(cancelled)  # the server may count them finished
            self._finished = [f for f in self._finished if f[0] not in gone]
        for req in cancelled:
            if req.task is not None:
                self._loop.call_soon_threadsafe(req.task.cancel)
        self._poke()

    def kv_gauges(self) -> tuple[float, int]:
        """(the server's KV-cache usage, its preemptions so far): the whole server's, ours
        and its online traffic's."""
        return float(self._gauges.get("kv_cache", 0.0)), int(self._gauges.get("preemptions", 0))

    def preempted(self) -> list[str] | None:
        return None

    def rebuild(self, reason: str) -> None:
        raise RuntimeError(f"a server engine cannot be rebuilt ({reason})")

    def kill_core(self, memory: bool = False) -> bool:
        return False  # the server is not ours to end

    def worker_cpus(self) -> dict[int, list[int]]:
        return {}

    def step_timeline(self) -> dict[str, Any] | None:
        return None

    def metric_families(self) -> list[dict[str, Any]]:
        """The in-flight limit, ours in flight, the server's queue and our time to first
        token against its target, and the back-offs by reason."""
        c, g = self.controller, self._gauges
        last_ttft = self.totals.ttft_ms[-1] if self.totals.ttft_ms else float("nan")

        def gauge(name: str, doc: str, value: float) -> dict[str, Any]:
            return {"name": f"pipeline_server_{name}", "type": "gauge", "doc": doc,
                    "samples": [(f"pipeline_server_{name}", {}, float(value))]}

        reasons = Counter(r for b in c.backoffs for r in b["reasons"])
        return [
            gauge("in_flight_limit", "Requests the job may have in flight on the server now.", c.limit),
            gauge("in_flight", "The job's requests in flight on the server.", len(self._out)),
            gauge("requests_waiting", "The server's requests waiting (all clients').", g.get("waiting", 0)),
            gauge("requests_running", "The server's requests running (all clients').", g.get("running", 0)),
            gauge("ttft_ms", "The job's last request's time to first token, ms.", last_ttft),
            gauge("ttft_slo_ms", "The time-to-first-token target, ms.", c.ttft_slo_ms),
            {"name": "pipeline_server_backoffs", "type": "counter", "doc": "In-flight back-offs, by reason.",
             "samples": [("pipeline_server_backoffs_total", {"reason": r}, float(n)) for r, n in sorted(reasons.items())]},
        ]

    def report(self) -> dict[str, Any]:
        """What the report shows of the server: how prompts went, the in-flight trajectory
        and back-offs since the last report, retries, and our time to first token."""
        t = self.totals
        ttft = sorted(t.ttft_ms)

        def pct(q: float) -> float | None:
            return ttft[min(len(ttft) - 1, int(q * len(ttft)))] if ttft else None

        traj = self.controller.trajectory()
        # Each report carries the steps and back-offs since the last (a call's actor totals
        # carry it, and calls are many): the run's report joins them (`actor_summaries`).
        seen_steps, seen_backoffs = self._reported
        self._reported = (len(traj["steps"]), len(traj["backoffs"]))
        traj["steps"], traj["backoffs"] = traj["steps"][seen_steps:], traj["backoffs"][seen_backoffs:]
        return {"url": self.settings.base, "model": self.settings.model, "prompt_as": self.prompt_as,
                "prompt_as_why": self.probe.get("why"), "priority": self.priority, "notes": list(self.notes),
                "sent": t.sent, "completed": t.completed, "probes": t.probes, "row_errors": t.row_errors,
                "retries": dict(t.retries),
                "ttft_ms": {"p50": pct(0.5), "p99": pct(0.99), "slo": self.settings.ttft_slo_ms},
                "in_flight": traj}

    def close(self) -> None:
        async def shut() -> None:
            for task in getattr(self, "_tasks", []):
                task.cancel()
            for req in list(self._out.values()):
                if req.task is not None:
                    req.task.cancel()
            http = getattr(self, "_http", None)
            if http is not None:
                await http.aclose()

        if self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(shut(), self._loop).result(timeout=10)
            except Exception:  # closing: what could not be closed goes with the loop
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
