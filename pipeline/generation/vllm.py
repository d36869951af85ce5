"""vLLM as one engine of the generation core: token ids and sampling in, completions out.

The engine knows nothing about rows, templates or buckets. It takes prompts
that are already token ids (the prepare stage tokenized them, so the engine's
own tokenizer is not run twice) and drives vLLM's `LLMEngine` step by step.
Stepping by hand, rather than calling `LLM.generate`, is what lets it time
each request to its own completion, reject one bad prompt without failing the
call, and sample the engine's metrics while it works.

It implements `pipeline.generation.engine.Engine`: a dead engine core surfaces
as `EngineDead`, and sampling arrives as the core's plain `Sampling`. It takes
its settings as `VLLMSettings`, which the generate stage derives from the
profile; it reads no config file. `vllm` is imported inside the constructor so
that the CLI and config checks start without it.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pipeline.generation.detokenize import decode_outputs, fast_tokenizer
from pipeline.generation.engine import Completion, EngineDead, Sampling
from pipeline.generation.vllm_steps import StepTap, StepTimeline
from pipeline.generation.vllm_logs import EngineLogTee, WarnOnce, WarningFilter, mentions_memory_failure, root_cause

log = logging.getLogger(__name__)


@dataclass
class VLLMSettings:
    """What one engine is built with: `vllm.LLM`'s keyword arguments, and how to
    retry a start-up that runs out of memory."""

    kwargs: dict[str, Any]
    startup_backoff: float = 0.8  # each retry asks for this share of the last memory fraction
    min_gpu_memory_utilization: float = 0.05  # give up below this
    cpu_kvcache_space_gib: float | None = None
    step_timeline: bool = False  # record each step's start, duration and load (`StepTimeline`)
    in_process: bool = False  # the engine core in this process (`engine.in_process`), not in its own
    # In this process: the run's CPUs, all but one of which its model takes, where no other
    # engine of this machine holds them (`claim_cpus`; `pipeline.run.plan.engine_cpus`).
    bind_cpus: tuple[int, ...] | None = None


class EngineStartupError(RuntimeError):
    """The engine would not start even at the lowest memory fraction allowed."""


def vllm_families(registry: Any = None) -> list[dict[str, Any]]:
    """vLLM's own metrics in this process (its stat loggers register them in
    prometheus-client's default registry), as plain data to send to the driver."""
    if registry is None:
        from prometheus_client import REGISTRY as registry
    families = []
    for metric in registry.collect():
        if metric.name.startswith("vllm:"):
            families.append({"name": metric.name, "type": metric.type, "doc": metric.documentation,
                             "samples": [(s.name, dict(s.labels), s.value) for s in metric.samples]})
    return families


def bind_threads(pid: int, cpus: set[int]) -> bool:
    """Every thread of `pid` to `cpus`; False if the process is gone or not ours to change."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    done = False
    for tid in threads:
        try:
            os.sched_setaffinity(int(tid), cpus)
            done = True
        except OSError:  # a thread that ended meanwhile, or not ours
            continue
    return done


# One lock file per CPU, machine-wide: the engines that bound themselves to it.
CPU_CLAIMS = Path(tempfile.gettempdir()) / "pipeline-engine-cpus"


def claim_cpus(candidates: Sequence[int], count: int, claims: Path = CPU_CLAIMS) -> tuple[list[int], list[IO[str]]]:
    """Up to `count` of `candidates`, in order, that no other engine of this machine holds:
    an exclusive lock on a file per CPU, held as long as the files returned are open
    (the kernel drops it when the process ends, however it ends). Two runs at once on
    one machine then bind their engines to different cores, not both to the first (as
    vLLM's own binding does for engines it does not know of)."""
    import fcntl

    claims.mkdir(parents=True, exist_ok=True)
    got: list[int] = []
    held: list[IO[str]] = []
    for cpu in candidates:
        if len(got) == count:
            break
        f = open(claims / f"cpu{cpu}.lock", "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another engine's
            f.close()
            continue
        got.append(cpu)
        held.append(f)
    return got, held


_CLAIMED: tuple[list[int], list[IO[str]]] | None = None  # this process's CPUs (`bind_process`), once


def bind_process(run_cpus: Sequence[int]) -> list[int]:
    """This process, every thread of it, to all but one of `run_cpus` that no other engine
    of this machine holds (`claim_cpus`: claimed once per process, held while it lives;
    threads created later inherit them). The CPUs it is bound to; [] where none was free."""
    global _CLAIMED
    if _CLAIMED is None:
        _CLAIMED = claim_cpus(run_cpus, len(run_cpus) - 1)
    cpus = _CLAIMED[0]
    if not cpus:
        log.info("every CPU of this run is another engine's: the engine's process stays unbound")
        return []
    return list(cpus) if bind_threads(os.getpid(), set(cpus)) else []


@contextmanager
def every_cpu() -> Iterator[None]:
    """This thread on every CPU it may use, for the while: vLLM's engine core, started from
    it, inherits its CPUs and binds its CPU workers among them (vLLM's own choice), even
    where the run has since kept this process off the engine's cores
    (`pipeline.run.affinity`). Its own CPUs again after."""
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    mine = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))  # the kernel keeps it to the cpuset
    except OSError:
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)


def preload(warn_once: WarnOnce | None = None) -> None:
    """Import vLLM without starting an engine: about 10 s on 2 cores, which an engine that
    starts on demand (reuse on: once the lookup finds a row to generate) spends while it
    waits instead of after. What vLLM prints meanwhile is judged as at a start-up."""
    tee = EngineLogTee(warn_once)
    try:
        from vllm import LLM  # noqa: F401
    finally:
        tee.stop()


def first_token_s(output: Any) -> float | None:
    """Arrival to first token, as vLLM measured it for the request (its stats are on:
    `disable_log_stats` false); None where it did not."""
    latency = getattr(getattr(output, "metrics", None), "first_token_latency", None)
    return float(latency) if latency else None


def text_ids(output: Any) -> list[int]:
    """The ids of a completion's text: all but the token that stopped it (end of sequence,
    or a stop token id), as vLLM's detokenizer leaves that token out of the text too."""
    ids = list(output.token_ids)
    if output.finish_reason == "stop" and not isinstance(output.stop_reason, str) and ids:
        return ids[:-1]
    return ids


class VLLMEngine:
    """One vLLM engine, built once and reused for every call.

    `submit`, `step` and `abort` let a caller (the feeder) keep it fed,
    admitting new requests as others finish. `warn_once` (the pool's
    `first_time`) shows each vLLM warning once per run rather than once per
    engine; None shows them all.
    """

    pads_batches = False  # continuous batching: a row costs its own tokens
    padding = None

    def __init__(self, settings: VLLMSettings, warn_once: WarnOnce | None = None):
        if settings.cpu_kvcache_space_gib is not None:
            # Read by the CPU backend when the engine core starts.
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(settings.cpu_kvcache_space_gib)
        # Read by `LLM` as it builds the engine: 0 keeps the core (and a one-device worker) here.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if settings.in_process else "1"
        import vllm.envs

        vllm.envs.disable_envs_cache()  # an engine core built here before froze them
        self.settings = settings
        self.kwargs = dict(settings.kwargs)
        self._params: tuple[Sampling, Any] | None = None
        self.startup_attempts: list[dict[str, Any]] = []
        self.rebuilds: list[dict[str, Any]] = []
        self._tee: EngineLogTee | None = None
        self._warn_once = warn_once
        self._warnings = WarningFilter(warn_once) if warn_once is not None else None
        self._killed_of_memory: set[int] = set()  # core pids a drill killed as if of memory
        # debug.step_timeline: every step's time and load, across rebuilds too.
        self.timeline = StepTimeline() if settings.step_timeline else None
        self._bound: list[int] = []  # the CPUs this process was bound to (`bind_cpus`)
        self._build()

    # -- lifecycle ---------------------------------------------------------------

    def _build(self) -> None:
        """Start vLLM; on a memory failure at start-up retry with a lower memory
        fraction, down to `min_gpu_memory_utilization`, then fail clearly.

        While the tee holds this process's descriptors, it alone judges the warnings
        (this process's too, which reach it through them); the logging filter takes
        over after, so no warning is asked about twice and hidden by its own asking."""
        from vllm import LLM

        while True:
            started = time.monotonic()
            if self._warnings is not None:
                self._warnings.detach()
            tee = EngineLogTee(self._warn_once)
            try:
                with every_cpu():
                    self._llm = LLM(**self.kwargs)
            except Exception as e:
                util = self.kwargs["gpu_memory_utilization"]
                cause = root_cause(tee.stop(wait_s=2.0)) or f"{type(e).__name__}: {e}"
                self.startup_attempts.append({"gpu_memory_utilization": util, "error": cause[:500]})
                lower = round(util * self.settings.startup_backoff, 4)
                if not mentions_memory_failure(f"{e}\n{cause}") or lower < self.settings.min_gpu_memory_utilization:
                    tried = ", ".join(str(a["gpu_memory_utilization"]) for a in self.startup_attempts)
                    raise EngineStartupError(
                        f"vLLM did not start (gpu_memory_utilization tried: {tried}; floor "
                        f"{self.settings.min_gpu_memory_utilization}): {cause}"
                    ) from e
                log.warning("engine start-up failed at gpu_memory_utilization=%s; retrying at %s", util, lower)
                self._lower_memory(lower)
                continue
            tee.stop()
            self._tee = tee  # its pump goes on forwarding the core's output, and keeps its tail
            if self._warnings is not None:
                self._warnings.attach()
            self.startup_attempts.append({"gpu_memory_utilization": self.kwargs["gpu_memory_utilization"], "error": None})
            break
        self.startup_s = time.monotonic() - started
        self._engine = self._llm.llm_engine
        self._next_id = 0
        # Where vLLM's tokenizer is a fast one, finished requests' ids are decoded here, once
        # (`pipeline.generation.detokenize`), and vLLM is asked for no text as they run.
        self._decoder = fast_tokenizer(self._llm.get_tokenizer())
        config = self._engine.vllm_config
        cache = config.cache_config
        self.max_model_len: int = config.model_config.max_model_len
        self.max_num_seqs: int = config.scheduler_config.max_num_seqs
        self.kv_cache_tokens: int | None = (
            cache.num_gpu_blocks * cache.block_size if cache.num_gpu_blocks else None
        )
        self._steps = StepTap(self._engine, self.timeline)  # KV usage, preemptions, prefix cache: per step
        self._watch_for_death()
        if self.settings.in_process and self.settings.bind_cpus:
            self._bind(self.settings.bind_cpus)

    def _bind(self, run_cpus: Sequence[int]) -> None:
        """The model runs in this process: every thread of it to all but one of the run's
        CPUs that no other engine holds, as vLLM binds a worker of its own (threads created
        later inherit them; a rebuild binds the same again). Unbound, the step thread ran
        beside the run's other processes on every core, and each step took 1.13-1.16x raw
        vLLM's; bound, 0.93-1.03x (bench/README, *Engine steps*). The engine actor binds the
        same CPUs before vLLM's import (`GenerateStage`): the claim is the process's."""
        self._bound = bind_process(run_cpus)

    def _watch_for_death(self) -> None:
        """Turn a silently dead engine core into an error instead of a hang.

        When the engine core process is killed outright (SIGKILL, the kernel's
        OOM killer) it sends no last word. vLLM's monitor marks the client dead
        and stops its output thread, but a `step()` already waiting on the
        output queue waits forever. This thread puts EngineDeadError on that
        queue, so the waiting step raises and the feeder can rebuild.
        """
        core = self._engine.engine_core
        resources = getattr(core, "resources", None)
        outputs = getattr(core, "outputs_queue", None)
        if resources is None or outputs is None:  # in-process engine core: nothing to watch
            return

        def watch() -> None:
            from vllm.v1.engine.exceptions import EngineDeadError

            while self._engine is not None and self._engine.engine_core is core:
                if resources.engine_dead:
                    outputs.put_nowait(EngineDeadError())
                    return
                time.sleep(0.2)

        threading.Thread(target=watch, daemon=True, name="EngineDeathWatch").start()

    def rebuild(self, reason: str) -> None:
        """Replace a dead or out-of-memory engine with one that asks for less:
        a lower memory fraction and fewer concurrent sequences."""
        self.close()
        before = self._asked()
        self._lower_memory(max(self.settings.min_gpu_memory_utilization,
                               round(self.kwargs["gpu_memory_utilization"] * self.settings.startup_backoff ** 0.5, 4)))
        self.kwargs["max_num_seqs"] = max(1, self.max_num_seqs // 2)
        self.startup_attempts = []
        self._build()
        self.rebuilds.append({"reason": reason, "before": before, "after": self._asked(),
                              "startup_s": round(self.startup_s, 2)})

    def _asked(self) -> dict[str, Any]:
        """What the engine was built with that a rebuild lowers."""
        asked = {"gpu_memory_utilization": self.kwargs["gpu_memory_utilization"], "max_num_seqs": self.max_num_seqs}
        if "kv_cache_memory_bytes" in self.kwargs:
            asked["kv_cache_memory_bytes"] = self.kwargs["kv_cache_memory_bytes"]
        return asked

    def _lower_memory(self, utilization: float) -> None:
        """The memory fraction to `utilization`, and a KV cache sized in bytes (which wins
        over the fraction: `pipeline.run.plan.cpu_kv_cache_bytes`) by the same factor."""
        if "kv_cache_memory_bytes" in self.kwargs:
            factor = utilization / self.kwargs["gpu_memory_utilization"]
            self.kwargs["kv_cache_memory_bytes"] = int(self.kwargs["kv_cache_memory_bytes"] * factor)
        self.kwargs["gpu_memory_utilization"] = utilization

    def close(self) -> None:
        """Stop the engine core process now rather than at interpreter exit."""
        core = getattr(getattr(self, "_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            try:
                core.shutdown()
            except Exception:  # already dead: nothing left to stop
                pass
        self._llm = None
        self._engine = None
        gc.collect()

    def _core_processes(self) -> list[Any]:
        """The engine core's processes as vLLM started them: its process manager's
        handles, which know each one's pid and exit code whatever its title reads.
        None where the core runs in this process."""
        core = getattr(getattr(self, "_engine", None), "engine_core", None)
        manager = getattr(getattr(core, "resources", None), "engine_manager", None)
        return list(getattr(manager, "processes", None) or [])

    def core_pids(self) -> list[int]:
        """Processes of the engine core (vLLM runs it apart from this process) still running.
        From vLLM's own handles where it has them; else by title among this process's
        children, which a title read mid-change (empty, under load) can miss."""
        import psutil

        handles = self._core_processes()
        if handles:
            return [h.pid for h in handles if h.pid is not None and h.exitcode is None]
        found = []
        for p in psutil.Process().children(recursive=True):
            try:
                if "EngineCore" in " ".join(p.cmdline() or [p.name()]) or "EngineCore" in p.name():
                    found.append(p.pid)
            except psutil.Error:  # one that ended while being listed
                continue
        return found

    def worker_cpus(self) -> dict[int, list[int]]:
        """The CPUs each of the engine's worker processes (its core's children) is bound to,
        by pid: on the CPU backend vLLM binds them to cores of their own. In this process
        (`in_process`), this process and the CPUs it was bound to, if it was."""
        import psutil

        if self.settings.in_process:
            return {os.getpid(): self._bound} if self._bound else {}

        found: dict[int, list[int]] = {}
        for pid in self.core_pids():
            try:
                for worker in psutil.Process(pid).children(recursive=True):
                    found[worker.pid] = sorted(worker.cpu_affinity())
            except psutil.Error:  # a worker that ended while being listed: none to keep apart
                continue
        return found

    def kill_core(self, memory: bool = False) -> bool:
        """SIGKILL the engine core, so vLLM itself finds it dead: a fault injection
        (`memory`: as if it had said it ran out of memory), and how a stalled core ends.
        The pids killed of memory are kept: the death is judged by them, not by when
        vLLM notices it."""
        import signal

        pids = self.core_pids()
        if memory:
            self._killed_of_memory.update(pids)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        if pids:
            # vLLM's monitor sees the core gone and shuts its client down (the core's other
            # processes, its sockets) before the next step, or before a stalled actor ends.
            time.sleep(0.5)
        return bool(pids)

    def _death(self, wait_s: float = 30.0) -> tuple[str | None, dict[int, int | None], bool]:
        """Why the engine core died, once it is known: first its processes' ends (each
        waited for, up to `wait_s` in all), then every line they wrote read from the tee.
        (The cause, exit code by pid, whether it was memory.) Judged on what the core
        did, never on how soon this process noticed: a loaded machine forwards a dying
        core's lines late, and an out-of-memory read as a crash would restart the engine
        just as large."""
        deadline = time.monotonic() + wait_s
        ends: dict[int, int | None] = {}
        for handle in self._core_processes():
            handle.join(max(0.0, deadline - time.monotonic()))
            ends[handle.pid] = handle.exitcode
        tail = self._tee.drain(max(1.0, deadline - time.monotonic())) if self._tee is not None else ""
        cause = root_cause(tail)
        memory = bool(self._killed_of_memory & set(ends)) or (cause is not None and mentions_memory_failure(cause))
        return cause, ends, memory

    # -- driving it --------------------------------------------------------------

    def _sampling_params(self, sampling: Sampling) -> Any:
        """vLLM's SamplingParams for `sampling`, built once per Sampling object (a call
        submits many requests with the same one)."""
        if self._params is not None and self._params[0] is sampling:
            return self._params[1]
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        params = SamplingParams(
            max_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=sampling.seed,
            allowed_token_ids=None if sampling.allowed_token_ids is None else list(sampling.allowed_token_ids),
            structured_outputs=None if sampling.json_schema is None else StructuredOutputsParams(
                json=sampling.json_schema, disable_any_whitespace=True
            ),
            # Only the finished output, as `LLM.generate` asks: the default builds every
            # running request's output, its text so far included, at every step, in this
            # process, which shares the cores with the engine's.
            output_kind=RequestOutputKind.FINAL_ONLY,
            # Nor text token by token: `step` decodes a finished request's ids at once.
            detokenize=self._decoder is None,
            # Each request gets a shallow copy of these, not a deep one: a third of a
            # request's submission. Safe as vLLM's own server sets it: what vLLM changes
            # in a request's copy it sets anew, but for the end-of-sequence ids it adds to
            # a set, which are the same for every request of one model.
            skip_clone=True,
        )
        self._params = (sampling, params)
        return params

    def metric_families(self) -> list[dict[str, Any]]:
        """vLLM's own Prometheus metrics in this process, for the live metrics."""
        return vllm_families()

    def step_timeline(self) -> dict[str, Any] | None:
        return self.timeline.take() if self.timeline is not None else None

    def kv_gauges(self) -> tuple[float, int]:
        """(KV-cache usage 0..1 at the last step, preemptions so far)."""
        if self._steps.kv_usage is not None:
            return self._steps.kv_usage, self._steps.preemptions
        usage, preemptions = 0.0, 0
        for metric in self._llm.get_metrics():
            if metric.name == "vllm:kv_cache_usage_perc":
                usage = max(usage, float(metric.value))
            elif metric.name == "vllm:num_preemptions":
                preemptions += int(metric.value)
        return usage, preemptions

    def preempted(self) -> list[str] | None:
        return self._steps.take_preempted()

    def prefix_cache(self) -> dict[str, int]:
        """vLLM's prefix cache so far: prompt tokens looked up (`queries`) and found (`hits`)."""
        return {"queries": self._steps.prefix_queries, "hits": self._steps.prefix_hits}

    def submit(self, prompt_token_ids: list[int], sampling: Sampling) -> str:
        """Queue one request; raises if the engine refuses it (too long, say)."""
        request_id = f"req-{self._next_id}"
        self._next_id += 1
        try:
            # Rendered first (the token ids as they are: no template, no tokenizer), as vLLM
            # asks: a raw prompt handed to add_request is deprecated.
            (rendered,) = self._engine.renderer.render_cmpl([{"prompt_token_ids": prompt_token_ids}])
            self._engine.add_request(request_id, rendered, self._sampling_params(sampling))
        except Exception as e:
            # A core that died between steps refuses every request: the engine's death, not
            # this prompt's fault (the feeder recovers from it as from a failed step).
            self._raise_if_dead(e)
            raise
        return request_id

    def _raise_if_dead(self, e: Exception) -> None:
        """vLLM's dead-engine error as `EngineDead`, with the core's last words and whether
        they were about memory (`_death`); any other error is left to the caller."""
        from vllm.v1.engine.exceptions import EngineDeadError

        if isinstance(e, EngineDeadError):
            cause, ends, memory = self._death()
            codes = ", ".join(f"pid {pid} exit {code}" for pid, code in ends.items())
            raise EngineDead(f"{type(e).__name__}: {cause or e}" + (f" ({codes})" if codes else ""),
                             memory=memory) from e

    def step(self) -> list[tuple[str, Completion]]:
        """One engine step; the requests it finished, with latency left at 0 for the caller."""
        finished = []
        try:
            outputs = self._engine.step()
        except Exception as e:
            self._raise_if_dead(e)
            raise
        done = [out for out in outputs if out.finished]  # finished requests only (FINAL_ONLY)
        if self._decoder is not None and done:
            texts = decode_outputs(self._decoder, [out.prompt_token_ids or [] for out in done],
                                   [text_ids(out.outputs[0]) for out in done])
        else:
            texts = [out.outputs[0].text for out in done]
        for out, text in zip(done, texts):
            first = out.outputs[0]
            finished.append((out.request_id, Completion(text, len(first.token_ids), 0.0, first.finish_reason,
                                                        first_token_s=first_token_s(out))))
        return finished

    def abort(self, request_ids: list[str]) -> None:
        if request_ids and self._engine is not None:
            self._engine.abort_request(request_ids)
