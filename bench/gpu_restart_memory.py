"""Does a killed engine give its GPU memory back in time for its restart?

A restarted engine actor preallocates its share of the GPU again
(`engine.gpu_memory_utilization`, 0.9 on GPU profiles). That only works if
the memory of the process that was killed (`kill -9` of the engine core, or
the watchdog ending a stopped one) is free by then. vLLM cannot be carried to
the GPU machine here (its wheel is over the transfer limit), so this measures
the same thing with torch alone, the way vLLM holds memory: a child process
takes `--share` of the GPU's memory in plain allocations, then is
- killed (SIGKILL), or
- stopped (SIGSTOP) and then killed, as the stall watchdog does;
and the parent measures how long until `cudaMemGetInfo` shows the memory free,
and whether a new process can then take the same share again.

    python3 bench/gpu_restart_memory.py --out DIR   # on a machine with an NVIDIA GPU

Writes DIR/gpu_restart_memory.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import time


def hold(share: float, ready: mp.Event) -> None:
    import torch

    free, total = torch.cuda.mem_get_info()
    want = int(total * share) - (total - free)
    blocks = []
    chunk = 1 << 30
    while want > 0:
        blocks.append(torch.empty(min(chunk, want), dtype=torch.uint8, device="cuda"))
        want -= chunk
    torch.cuda.synchronize()
    ready.set()
    while True:
        time.sleep(1)


def free_bytes() -> tuple[int, int]:
    import torch

    return torch.cuda.mem_get_info()


def trial(how: str, share: float) -> dict:
    ctx = mp.get_context("spawn")
    free_before, _ = free_bytes()
    ready = ctx.Event()
    child = ctx.Process(target=hold, args=(share, ready))
    started = time.monotonic()
    child.start()
    if not ready.wait(300):
        child.kill()
        return {"how": how, "error": "the holder never got its memory"}
    took_s = time.monotonic() - started
    free_held, total = free_bytes()
    if how == "stop-then-kill":
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(2)
    killed = time.monotonic()
    os.kill(child.pid, signal.SIGKILL)
    child.join(60)
    exited_s = time.monotonic() - killed
    back_s = None
    while time.monotonic() - killed < 120:
        free, _ = free_bytes()
        if free >= free_before - (1 << 30):  # all but a GiB of what the holder took is back
            back_s = time.monotonic() - killed
            break
        time.sleep(0.05)
    # A fresh process takes the same share again, as a restarted engine would.
    again = ctx.Event()
    second = ctx.Process(target=hold, args=(share, again))
    t = time.monotonic()
    second.start()
    ok = again.wait(300)
    retake_s = time.monotonic() - t
    second.kill()
    second.join(60)
    time.sleep(1)
    return {"how": how, "share": share, "total_gib": round(total / 2**30, 1),
            "free_while_held_gib": round(free_held / 2**30, 1), "allocate_s": round(took_s, 2),
            "process_gone_s": round(exited_s, 3), "memory_back_s": None if back_s is None else round(back_s, 3),
            "retaken": ok, "retake_s": round(retake_s, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--share", type=float, default=0.9)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    import torch

    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "trials": []}
    for _ in range(args.repeats):
        for how in ("kill", "stop-then-kill"):
            r = trial(how, args.share)
            print(json.dumps(r), flush=True)
            results["trials"].append(r)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_restart_memory.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
