"""The server engine against a fake OpenAI-compatible server (httpx's MockTransport): what
it sends, how it reads the stream, and what it does with each kind of answer. The real
vLLM server: tests/integration/generation/test_server_backend.py."""

import json
import time
from collections import Counter

import httpx
import pytest

from pipeline.generation.engine import Sampling
from pipeline.generation.server import PROBE_TEXT, ServerEngine, ServerSettings, ServerUnavailable, parse_metrics


class CharTokenizer:
    """One token per character."""

    def encode(self, text, add_special_tokens=True):
        return [ord(ch) for ch in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


class FakeServer:
    """Answers like vLLM's server. `tokenize`: 'same', 'other' or 'none' (no /tokenize).
    A prompt's first token picks the answer: 429 and 503 (`busy` times, then 200), 400, or
    200 with the prompt's length as text."""

    def __init__(self, tokenize="same", busy=2, priority=True, metrics=""):
        self.tokenize, self.busy, self.priority, self.metrics = tokenize, busy, priority, metrics
        self.bodies: list[dict] = []
        self.tries: Counter = Counter()
        self.down = False

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 512}]})
        if path == "/tokenize":
            if self.tokenize == "none":
                return httpx.Response(404, json={"detail": "Not Found"})
            body = json.loads(request.content)
            tokens = CharTokenizer().encode(body["prompt"])
            return httpx.Response(200, json={"tokens": tokens if self.tokenize == "same" else tokens[1:]})
        if path == "/metrics":
            return httpx.Response(200, text=self.metrics)
        body = json.loads(request.content)
        self.bodies.append(body)
        prompt = body["prompt"]
        key = json.dumps(prompt)
        self.tries[key] += 1
        if "priority" in body and not self.priority:
            return httpx.Response(400, json={"error": {"message": "Priority scheduling is not enabled."}})
        first = prompt[0] if isinstance(prompt, list) else ord(prompt[0])
        if first in (429, 503) and self.tries[key] <= self.busy:
            return httpx.Response(first, json={"error": {"message": "busy"}})
        if first == 400:
            return httpx.Response(400, json={"error": {"message": "This model's maximum context length is 512"}})
        chunks = [{"choices": [{"index": 0, "text": "len=", "finish_reason": None}]},
                  {"choices": [{"index": 0, "text": str(len(prompt)), "finish_reason": "length"}]},
                  {"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": 2}}]
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})


def engine(server: FakeServer, **settings) -> ServerEngine:
    defaults = dict(url="http://srv:8000", model="m", max_in_flight=8, unavailable_s=0.5, metrics_interval_s=0.05,
                    probe_every_s=0.0)
    return ServerEngine(ServerSettings(**{**defaults, **settings}), CharTokenizer(), httpx.MockTransport(server))


def run(e: ServerEngine, prompts: list[list[int]], sampling: Sampling = Sampling(8, seed=1), timeout=10.0):
    ids = [e.submit(p, sampling) for p in prompts]
    done = {}
    deadline = time.monotonic() + timeout
    while len(done) < len(ids) and time.monotonic() < deadline:
        done.update(e.step())
    return [done.get(i) for i in ids]


def test_prompts_go_as_token_ids_at_low_priority_where_the_tokenizers_agree():
    server = FakeServer()
    e = engine(server, priority=10)
    try:
        (c,) = run(e, [[1, 2, 3]], Sampling(8, temperature=0.5, seed=7, json_schema={"type": "object"}))
        assert e.prompt_as == "token_ids" and e.max_model_len == 512
        assert c.text == "len=3" and c.output_tokens == 2 and c.finish_reason == "length" and c.error is None
        assert c.first_token_s is not None and c.first_token_s >= 0
        body = server.bodies[0]
        assert body["prompt"] == [1, 2, 3] and body["priority"] == 10 and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["max_tokens"] == 8 and body["seed"] == 7 and body["temperature"] == 0.5
        assert body["structured_outputs"] == {"json": {"type": "object"}, "disable_any_whitespace": True}
    finally:
        e.close()


@pytest.mark.parametrize("tokenize, why", [("other", "differs from ours"), ("none", "no /tokenize")])
def test_prompts_go_as_text_where_the_tokenizer_cannot_be_checked(tokenize, why):
    server = FakeServer(tokenize=tokenize)
    e = engine(server)
    try:
        (c,) = run(e, [[104, 105]])
        assert e.prompt_as == "text" and why in e.report()["prompt_as_why"]
        assert server.bodies[0]["prompt"] == "hi" and c.text == "len=2"
    finally:
        e.close()


def test_429_and_503_are_retried_and_slow_the_job_down():
    server = FakeServer(busy=2)
    e = engine(server, start_in_flight=8)
    try:
        results = run(e, [[429, 1], [503, 1], [7, 1]])
        assert all(c is not None and c.error is None for c in results)
        assert server.tries[json.dumps([429, 1])] == 3 and server.tries[json.dumps([503, 1])] == 3
        assert e.report()["retries"] == {"429": 2, "503": 2}
        time.sleep(0.2)  # a sample or two
        assert any("throttled" in b["reasons"] for b in e.controller.backoffs)
    finally:
        e.close()


def test_throttling_past_the_retries_is_the_rows_error():
    server = FakeServer(busy=100)
    e = engine(server, max_retries=1)
    try:
        (c,) = run(e, [[429, 1]])
        assert c.text is None and "429" in c.error and server.tries[json.dumps([429, 1])] == 2
    finally:
        e.close()


def test_a_request_the_server_rejects_is_that_rows_error_alone():
    server = FakeServer()
    e = engine(server)
    try:
        bad, good = run(e, [[400, 1], [5, 6]])
        assert bad.text is None and "400" in bad.error and "maximum context length" in bad.error
        assert good.text == "len=2"
        assert e.report()["row_errors"] == 1 and e.report()["completed"] == 1
    finally:
        e.close()


def test_a_server_without_priority_scheduling_gets_requests_without_one_and_the_report_says_so():
    server = FakeServer(priority=False)
    e = engine(server)
    try:
        (c,) = run(e, [[1, 2]])
        assert c.text == "len=2" and "priority" not in server.bodies[-1]
        assert "--scheduling-policy priority" in e.report()["notes"][0]
    finally:
        e.close()


def test_a_server_gone_too_long_stops_the_engine_naming_the_url():
    server = FakeServer()
    e = engine(server, unavailable_s=0.3)
    try:
        run(e, [[1, 2]])
        server.down = True
        e.submit([3, 4], Sampling(8))
        with pytest.raises(ServerUnavailable, match=r"http://srv:8000 has served nothing"):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                e.step()
        assert e.report()["retries"]["connection"] >= 1
        assert server.tries[json.dumps([1, 2])] == 1  # the completed row was never sent again
    finally:
        e.close()


def test_a_server_that_is_back_in_time_finishes_the_rows():
    server = FakeServer()
    e = engine(server, unavailable_s=5.0)
    try:
        server.down = True
        e.submit([3, 4], Sampling(8))
        time.sleep(0.6)
        server.down = False
        deadline, done = time.monotonic() + 10, []
        while not done and time.monotonic() < deadline:
            done = e.step()
        assert done and done[0][1].text == "len=2"
    finally:
        e.close()


def test_the_probe_names_the_url_and_what_the_server_serves():
    with pytest.raises(RuntimeError, match=r"does not serve 'x'.*it serves: m"):
        engine(FakeServer(), model="x")
    down = FakeServer()
    down.down = True
    with pytest.raises(ServerUnavailable, match=r"the server at http://srv:8000 did not answer"):
        engine(down)


def test_no_more_than_the_limit_is_in_flight():
    import threading

    peak, now, lock = [0], [0], threading.Lock()
    inner = FakeServer()

    def counting(request):
        if request.url.path != "/v1/completions":
            return inner(request)
        with lock:
            now[0] += 1
            peak[0] = max(peak[0], now[0])
        time.sleep(0.01)
        try:
            return inner(request)
        finally:
            with lock:
                now[0] -= 1

    e = ServerEngine(ServerSettings(url="http://srv:8000", model="m", max_in_flight=3, start_in_flight=3,
                                    feedback=False), CharTokenizer(), httpx.MockTransport(counting))
    try:
        results = run(e, [[i, 1] for i in range(1, 30)])
        assert all(c is not None for c in results) and peak[0] <= 3
    finally:
        e.close()


def test_the_servers_metrics_are_read_summed_over_engines():
    text = """# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 5.0
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 4.0
# TYPE vllm:request_success counter
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 10.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 3.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_sum{engine="0",model_name="m"} 900.0
vllm:iteration_tokens_total_bucket{engine="0",le="+Inf",model_name="m"} 40.0
vllm:iteration_tokens_total_count{engine="0",model_name="m"} 40.0
vllm:iteration_tokens_total_count{engine="1",model_name="m"} 2.0
"""
    assert parse_metrics(text) == {"waiting": 3.0, "running": 5.0, "preemptions": 4.0, "done": 13.0,
                                   "kv_cache": 0.25, "steps": 42.0}


def test_the_live_metrics_carry_the_limit_the_queue_and_the_backoffs():
    server = FakeServer(metrics='# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine="0"} 2.0\n')
    e = engine(server, start_in_flight=6)
    try:
        run(e, [[1, 2]])
        time.sleep(0.2)
        e.controller.backoffs.append({"t": 0.0, "from": 6, "to": 3, "reasons": ["online_ttft", "queue"]})
        families = {f["name"]: f for f in e.metric_families()}
        value = {name: f["samples"][0][2] for name, f in families.items() if f["type"] == "gauge"}
        assert value["pipeline_server_in_flight_limit"] == e.controller.limit
        assert value["pipeline_server_requests_waiting"] == 2.0 and value["pipeline_server_ttft_slo_ms"] == 2000.0
        backoffs = families["pipeline_server_backoffs"]["samples"]
        want = Counter(r for b in e.controller.backoffs for r in b["reasons"])
        assert {labels["reason"]: n for _, labels, n in backoffs} == want and want["online_ttft"] == 1
    finally:
        e.close()


def test_a_probe_at_the_online_priority_measures_what_an_online_request_waits():
    done = [0]
    server = FakeServer()

    def counting(request):  # the server's finished count: every completion, the probes' too
        response = server(request)
        if request.url.path == "/v1/completions" and response.status_code == 200:
            done[0] += 1
        if request.url.path == "/metrics":
            return httpx.Response(200, text=f"# TYPE vllm:request_success counter\n"
                                            f'vllm:request_success_total{{engine="0"}} {done[0]}.0\n')
        return response

    e = ServerEngine(ServerSettings(url="http://srv:8000", model="m", metrics_interval_s=0.05, probe_every_s=0.1,
                                    priority=10, online_priority=0), CharTokenizer(), httpx.MockTransport(counting))
    try:
        run(e, [[1, 2], [3, 4]])
        time.sleep(0.5)
        probes = [b for b in server.bodies if b["max_tokens"] == 1]
        assert probes and all(b["priority"] == 0 and b["prompt"] == [ord(ch) for ch in PROBE_TEXT] for b in probes)
        assert any(x.get("probe_ttft_ms") is not None for x in e.controller.steps)
        assert e.totals.probes >= 1 and not e.controller.online_present  # probes are ours, not others'
    finally:
        e.close()


def test_the_api_key_comes_from_the_environment_and_a_missing_one_is_named(monkeypatch):
    seen = []
    inner = FakeServer()

    def recording(request):
        seen.append(request.headers.get("authorization"))
        return inner(request)

    monkeypatch.setenv("TEST_LLM_KEY", "s3cret")
    e = engine(FakeServer(), api_key_env="TEST_LLM_KEY")
    e.close()
    e = ServerEngine(ServerSettings(url="http://srv:8000", model="m", api_key_env="TEST_LLM_KEY", probe_every_s=0),
                     CharTokenizer(), httpx.MockTransport(recording))
    try:
        run(e, [[1, 2]])
        assert seen and set(seen) == {"Bearer s3cret"}
    finally:
        e.close()
    monkeypatch.delenv("TEST_LLM_KEY")
    with pytest.raises(RuntimeError, match=r"engine.server.api_key_env: \$TEST_LLM_KEY is not set"):
        engine(FakeServer(), api_key_env="TEST_LLM_KEY")


def test_others_finished_requests_are_told_from_ours_by_the_servers_histograms():
    """The server keeps histograms of finished requests' prompt and generated tokens (and
    here no total count): ours go in by the counts its answers gave, so ours are never taken
    for others', and one request of someone else's is seen."""
    server = FakeServer()
    finished: list[tuple[int, int]] = []  # (prompt tokens, generated tokens), the server's view

    def histogram(name: str, values: list[int]) -> str:
        lines = [f"# TYPE vllm:{name} histogram"]
        for le in (1, 2, 5, 10, 20, 50, 100, float("inf")):
            label = "+Inf" if le == float("inf") else f"{le:.1f}"
            lines.append(f'vllm:{name}_bucket{{engine="0",le="{label}"}} {sum(v <= le for v in values)}.0')
        return "\n".join(lines) + "\n"

    def metrics(request):
        if request.url.path == "/metrics":
            return httpx.Response(200, text=histogram("request_prompt_tokens", [p for p, _ in finished])
                                  + histogram("request_generation_tokens", [g for _, g in finished]))
        response = server(request)
        if request.url.path == "/v1/completions" and response.status_code == 200:
            finished.append((len(json.loads(request.content)["prompt"]), 2))
        return response

    e = ServerEngine(ServerSettings(url="http://srv:8000", model="m", metrics_interval_s=0.02, probe_every_s=0,
                                    max_in_flight=8), CharTokenizer(), httpx.MockTransport(metrics))
    try:
        results = run(e, [[7] * 30 for _ in range(200)])
        assert all(r is not None and r.error is None for r in results)
        time.sleep(0.3)
        assert not e.controller.online_present
        assert not any(s.get("online") for s in e.controller.steps)
        finished.append((12, 8))  # someone else's
        deadline = time.monotonic() + 5
        while not e.controller.online_present and time.monotonic() < deadline:
            time.sleep(0.02)
        assert e.controller.online_present
    finally:
        e.close()
