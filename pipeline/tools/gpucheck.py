"""The GPU check: memory-driven batch growth with the transformers engine, on a real GPU,
with nothing but torch, transformers, nvidia-ml-py and pyarrow installed.

    python -m pipeline.tools.gpucheck --out gpucheck.json        # on the GPU machine, ~5 minutes
    python -m pipeline.tools.gpucheck --plot gpucheck.json out.png   # anywhere with matplotlib

It imports the generation core (feeder, batch controller, transformers engine) and
nothing of Ray, vLLM, pydantic, psutil or matplotlib. It:
1. builds a randomly initialised decoder-only model of about 1B parameters from a
   config, on the GPU, with no download;
2. caps this process's GPU memory (`torch.cuda.set_per_process_memory_fraction`) to the
   weights plus `--headroom-gib`, so batches reach the limit within minutes; the cap
   raises a real CUDA out-of-memory, as a full device would;
3. runs a synthetic heavy-tailed corpus, bucket by bucket, through the feeder and the
   batch controller (target 0.90 of the cap): each bucket's batch grows until its peak
   reserved memory (the allocator's blocks, which the cap counts) is within
   [0.85, 0.95] of the cap;
4. if no out-of-memory happened on the way, starts one more pass at 1.5x the memory's
   capacity (a target above 1.0): a real CUDA out-of-memory, caught, backed off, the
   same rows retried;
5. checks that every row came back, and prints one JSON result.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from typing import Any

from pipeline.generation.engine import Sampling
from pipeline.generation.feeder import EngineFeeder
from pipeline.generation.policy import BatchSizeController, ControllerSettings, static_batch_settings
from pipeline.storage.ownership import MARK, NotOurs, OwnedFile, marked_json, png_software
from pipeline.text.bucketing import LengthBucketer

BUCKETS = LengthBucketer((128, 256, 512, 1024, 2048, 4096))
BAND = (0.85, 0.95)


def synthetic_corpus(rows: int, vocab: int, seed: int = 0, median: int = 300, sigma: float = 0.9,
                     longest: int = 4000) -> list[list[int]]:
    """Prompts as token ids, lengths log-normal around `median` (a long tail of long
    documents), ids drawn uniformly from the vocabulary's non-special range."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        n = min(longest, max(16, int(rng.lognormvariate(math.log(median), sigma))))
        out.append([rng.randrange(10, vocab) for _ in range(n)])
    return out


def run_phase(engine: Any, name: str, settings: ControllerSettings, buckets: dict[str, list[tuple[int, list[int]]]],
              sampling: Sampling, initial: int | None = None) -> dict[str, Any]:
    """One pass of the buckets' rows through the feeder and a fresh controller: per bucket,
    every batch it ran (rows, pressure, OOM), whether one reached the band, its trajectory."""
    controller = BatchSizeController(settings, kv_capacity_tokens=lambda: engine.kv_cache_tokens,
                                     initial_budget_tokens=initial)
    feeder = EngineFeeder(engine, controller, feed="drain", stock_engine_queue=False)
    out: dict[str, Any] = {"name": name, "target": settings.target, "buckets": {}}
    for bucket in sorted(buckets, key=BUCKETS.names.index):
        rows = buckets[bucket]
        first = len(engine.peaks)
        result = feeder.serve(bucket, rows, sampling)
        batches = list(engine.peaks)[first:]
        done = [c for c in result.completions.values() if c.error is None]
        pressures = [b["pressure"] for b in batches if not b.get("oom")]
        peak = max(pressures, default=0.0)
        out["buckets"][bucket] = {
            "rows": len(rows), "done": len(done), "batches": batches, "peak_pressure": round(peak, 4),
            # Grown into the band: a batch within it (the controller holds the next ones near it).
            "in_band": any(BAND[0] <= p <= BAND[1] for p in pressures),
            "ooms": sum(1 for b in batches if b.get("oom")),
            "trajectory": controller.trajectory(bucket)["steps"],
        }
    out["ooms"] = sum(b["ooms"] for b in out["buckets"].values())
    return out


def run_check(engine: Any, prompts: list[list[int]], max_new_tokens: int = 32, target: float = 0.90,
              log: Any = None) -> dict[str, Any]:
    """Steps 3 to 5 on any engine with the transformers engine's interface (the unit tests
    pass a fake device's). The result says, per bucket, how its batches grew."""
    started = time.monotonic()
    sampling = Sampling(max_new_tokens=max_new_tokens)
    by_bucket: dict[str, list[tuple[int, list[int]]]] = {}
    for i, ids in enumerate(prompts):
        by_bucket.setdefault(BUCKETS.name(len(ids)), []).append((i, ids))
    settings = static_batch_settings(target, engine.max_num_seqs)
    phases = [run_phase(engine, "grow", settings, by_bucket, sampling)]
    if phases[0]["ooms"] == 0 and engine.kv_cache_tokens:
        # A target above 1.0: start one bucket's batch at 1.5x what the memory holds.
        # Its rows again, as many as twice the capacity takes, as fresh requests.
        bucket = max(by_bucket, key=lambda b: len(by_bucket[b]))
        pool = [ids for _, ids in by_bucket[bucket]]
        per_row = sum(map(len, pool)) / len(pool) + max_new_tokens
        needed = min(engine.max_num_seqs, math.ceil(2 * engine.kv_cache_tokens / per_row))
        rows = [(k, pool[k % len(pool)]) for k in range(needed)]
        phases.append(run_phase(engine, "overshoot", settings, {bucket: rows}, sampling,
                                initial=int(1.5 * engine.kv_cache_tokens)))
    for phase in phases:
        for bucket, v in phase["buckets"].items():
            (log or (lambda _m: None))(f"{phase['name']} {bucket}: {v['rows']} rows in {len(v['batches'])} batches, "
                                       f"peak {v['peak_pressure']:.2f} of the cap, {v['ooms']} out-of-memory")
    grow = phases[0]["buckets"]
    # A bucket too small to fill three batches at the band can't show its growth: not judged.
    capacity = engine.kv_cache_tokens or 0
    judged = {b: v for b, v in grow.items()
              if sum(len(ids) + max_new_tokens for _, ids in by_bucket[b]) >= 3 * BAND[0] * capacity}
    result = {
        "rows_in": len(prompts),
        "rows_done": sum(v["done"] for v in grow.values()),
        "buckets_in_band": sorted(b for b, v in judged.items() if v["in_band"]),
        "buckets_judged": sorted(judged),
        "ooms_caught": sum(p["ooms"] for p in phases),
        "phases": phases,
        "seconds": round(time.monotonic() - started, 1),
    }
    result["ok"] = (result["rows_done"] == result["rows_in"] and result["ooms_caught"] >= 1
                    and bool(judged) and len(result["buckets_in_band"]) == len(judged)
                    and all(v["done"] == v["rows"] for p in phases for v in p["buckets"].values()))
    return result


def build_model(params_b: float = 1.0, vocab: int = 32000, seed: int = 0) -> tuple[Any, Any]:
    """A random Llama of about `params_b` billion parameters, built on the GPU in bf16,
    and a tokenizer for its outputs (byte-level BPE over `vocab` ids, trained on
    synthetic text). No download."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    text = [" ".join(rng.choice(words) for _ in range(200)) for _ in range(500)]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>", "<pad>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    hidden, layers = 2048, max(1, round(16 * params_b))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=5632,
                         num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8,
                         max_position_embeddings=8192, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    return model, tokenizer


# What the check writes, only where nothing is or it wrote before (`pipeline.storage.ownership`).
RESULT = OwnedFile("a GPU check result", marked_json, "Choose another --out.")
PLOT = OwnedFile("a GPU check plot", lambda p: png_software(p) == MARK, "Choose another PNG path.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.tools.gpucheck", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpucheck.json")
    ap.add_argument("--rows", type=int, default=3000)
    ap.add_argument("--params-b", type=float, default=1.0, help="model size, billions of parameters")
    ap.add_argument("--headroom-gib", type=float, default=6.0, help="GPU memory for batches, beyond the weights")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--plot", nargs=2, metavar=("RESULT", "PNG"), help="draw a result (needs matplotlib)")
    args = ap.parse_args(argv)
    try:
        if args.plot:
            PLOT.check(args.plot[1])
            plot(json.loads(open(args.plot[0]).read()), args.plot[1])
            return 0
        RESULT.check(args.out)  # before minutes on the GPU
    except NotOurs as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import torch
    import transformers

    from pipeline.generation.hf import GIB, HFSettings, TransformersEngine

    def log(msg: str) -> None:
        print(f"[gpucheck {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    started = time.monotonic()
    model, tokenizer = build_model(args.params_b)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    total = torch.cuda.get_device_properties(0).total_memory
    cap = weights + args.headroom_gib * GIB
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    log(f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, {weights / GIB:.1f} GiB; "
        f"memory capped at {cap / GIB:.1f} of {total / GIB:.1f} GiB")
    engine = TransformersEngine(HFSettings(model="random-llama", max_num_seqs=4096, memory_budget_gib=cap / GIB),
                                model=model, tokenizer=tokenizer)
    prompts = synthetic_corpus(args.rows, len(tokenizer))
    result = run_check(engine, prompts, args.max_new_tokens, log=log)
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        nvml = {"name": pynvml.nvmlDeviceGetName(handle), "driver": pynvml.nvmlSystemGetDriverVersion(),
                "used_gib_at_end": round(pynvml.nvmlDeviceGetMemoryInfo(handle).used / GIB, 2)}
    except Exception as e:  # the guard's reading is a bonus, not the check
        nvml = {"error": str(e)}
    result.update({
        "device": torch.cuda.get_device_name(0), "nvml": nvml, "torch": torch.__version__,
        "transformers": transformers.__version__, "parameters": sum(p.numel() for p in model.parameters()),
        "weights_gib": round(weights / GIB, 2), "device_gib": round(total / GIB, 1), "cap_gib": round(cap / GIB, 2),
        "token_bytes": engine.token_bytes, "capacity_tokens": engine.kv_cache_tokens,
        "padding": engine.padding.to_json(), "wall_s": round(time.monotonic() - started, 1),
    })
    RESULT.write(args.out, (json.dumps({"written_by": MARK, **result}, indent=2, default=str) + "\n").encode())
    print(json.dumps({k: result[k] for k in ("ok", "device", "rows_in", "rows_done", "buckets_in_band",
                                             "buckets_judged", "ooms_caught", "wall_s")}))
    return 0 if result["ok"] else 1


def plot(result: dict[str, Any], png: str) -> None:
    """Each bucket's batches: rows per batch and peak memory over the cap, batch by batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    x0 = 0
    for p in result["phases"]:
        for bucket, v in p["buckets"].items():
            xs = list(range(x0, x0 + len(v["batches"])))
            label = f"{bucket}" + (" (overshoot)" if p["name"] == "overshoot" else "")
            top.plot(xs, [b["rows"] for b in v["batches"]], marker="o", label=label)
            line, = bottom.plot(xs, [b["pressure"] if not b.get("oom") else 1.0 for b in v["batches"]], marker="o")
            allocated = [(x, b["allocated"]) for x, b in zip(xs, v["batches"]) if "allocated" in b]
            if allocated:  # the tensors' own peak, under the allocator's
                bottom.plot(*zip(*allocated), ls=":", color=line.get_color())
            for x, b in zip(xs, v["batches"]):
                if b.get("oom"):
                    bottom.annotate("OOM", (x, 1.0), color="red", ha="center", va="bottom")
            x0 += len(xs) + 1
    bottom.axhspan(*BAND, color="green", alpha=0.15, label="target band")
    bottom.set_ylabel("peak reserved / cap\n(dotted: allocated)")
    top.set_ylabel("rows in the batch")
    bottom.set_xlabel("batch, bucket by bucket")
    top.legend(fontsize=7, ncol=4)
    bottom.legend(fontsize=7)
    fig.suptitle(f"{result.get('device', 'GPU')}: batches grow to the memory target; "
                 f"{result['ooms_caught']} out-of-memory caught, {result['rows_done']}/{result['rows_in']} rows")
    fig.tight_layout()
    fig.savefig(png, dpi=110, metadata={"Software": MARK})


if __name__ == "__main__":
    sys.exit(main())
