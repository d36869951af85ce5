"""What vLLM's per-token detokenizer costs an engine in its actor's process.

One engine as the pipeline builds it on a CPU (`engine.in_process`, bound to every CPU
but the last) steps the same requests to their end, alternately with vLLM detokenizing
every token as it runs (as `LLM.generate` does) and with the engine decoding each
finished request's ids once (`pipeline.generation.detokenize`, what it does now). Only
the stepping is timed, not the submission. Prints each round and the medians.

    python -m bench.decode_once [--requests 1500] [--repeats 4]
"""

from __future__ import annotations

import os
import random
import statistics
import time

import click

from pipeline.config import EngineConfig
from pipeline.generation.engine import Sampling
from pipeline.generation.vllm import VLLMEngine
from pipeline.models.tiny import cached_tiny_model, ensure_tiny_model
from pipeline.observe.machine import cpu_flags, cpu_name
from pipeline.run.plan import vllm_settings


@click.command()
@click.option("--requests", default=1500, show_default=True, help="Requests stepped to their end per round.")
@click.option("--repeats", default=4, show_default=True, help="Rounds of each, alternating which goes first.")
@click.option("--new-tokens", default=32, show_default=True)
def main(requests: int, repeats: int, new_tokens: int) -> None:
    model = ensure_tiny_model(cached_tiny_model("tiny"), seed=0)
    settings = vllm_settings(str(model), EngineConfig(max_model_len=2048, dtype="bfloat16",
                                                      gpu_memory_utilization=0.2), seed=0)
    settings.in_process, settings.bind_cpus = True, tuple(sorted(os.sched_getaffinity(0)))
    engine = VLLMEngine(settings)
    decoder = engine._decoder
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 1000) for _ in range(rng.randrange(100, 300))] for _ in range(requests)]

    def stepped(decode_once: bool) -> float:
        engine._decoder = decoder if decode_once else None
        sampling = Sampling(max_new_tokens=new_tokens)  # a new one: its vLLM params are built again, for this decoder
        ids = [engine.submit(p, sampling) for p in prompts]
        started, done = time.perf_counter(), 0
        while done < len(ids):
            done += len(engine.step())
        return time.perf_counter() - started

    stepped(True)  # warm-up
    streamed, once = "vLLM's detokenizer", "decoded once"
    seconds: dict[str, list[float]] = {streamed: [], once: []}
    for k in range(repeats):
        order = [False, True] if k % 2 == 0 else [True, False]
        for decode_once in order:
            name = once if decode_once else streamed
            seconds[name].append(stepped(decode_once))
            click.echo(f"{k + 1}/{repeats} {name}: {seconds[name][-1]:.2f} s")
    engine.close()
    medians = {name: statistics.median(v) for name, v in seconds.items()}
    click.echo(f"{cpu_name()} ({', '.join(cpu_flags())}): {requests} requests of {new_tokens} new tokens, medians "
               + ", ".join(f"{name} {s:.2f} s" for name, s in medians.items())
               + f"; {once} ÷ {streamed} {medians[once] / medians[streamed]:.3f}")


if __name__ == "__main__":
    main()
