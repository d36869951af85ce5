"""The transformers engine (`pipeline.generation.hf`): real static batches on the tiny
Llama and a tiny BART, on CPU; the batch controller against a memory budget, with a
fake device that runs out of memory the way CUDA does; and the GPU check's logic
(`pipeline.tools.gpucheck`) on that fake device."""

import json
import subprocess
import sys

import pytest

from pipeline.generation.engine import Sampling
from pipeline.generation.feeder import EngineFeeder
from pipeline.generation.hf import HFSettings, PaddingTotals, TransformersEngine
from pipeline.generation.policy import BatchSizeController, ControllerSettings
from tests.helpers import REPO
from tests.helpers.fake_engine import FakeDevice


@pytest.fixture(scope="module")
def tiny_bart(tmp_path_factory):
    from pipeline.models.tiny import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "bart", seed=0, kind="bart")


def engine_for(model, **kw) -> TransformersEngine:
    return TransformersEngine(HFSettings(str(model), dtype="float32", memory_budget_gib=2.0, **kw))


def run(engine, prompts, max_new_tokens=12):
    ids = [engine.submit(p, Sampling(max_new_tokens=max_new_tokens)) for p in prompts]
    done = dict(engine.step())
    assert set(done) == set(ids)
    return [done[i] for i in ids]


@pytest.mark.parametrize("kind", ["llama", "bart"])
def test_a_row_comes_out_the_same_alone_and_padded_in_a_batch(kind, tiny_model, tiny_bart):
    engine = engine_for(tiny_model if kind == "llama" else tiny_bart)
    assert engine.encoder_decoder == (kind == "bart")
    short, longer = list(range(20, 60)), list(range(30, 230))
    alone = run(engine, [short])[0]
    batched = run(engine, [longer, short, longer[:120]])
    assert batched[1].text == alone.text and batched[1].output_tokens == alone.output_tokens
    assert all(0 < c.output_tokens <= 12 for c in batched) and all(c.text for c in batched)
    # The batch ran 3 x 200 prompt tokens for 360 real ones.
    assert engine.padding.padded == 40 + 3 * 200 and engine.padding.real == 40 + 200 + 40 + 120


def test_the_cpu_budget_is_estimated_from_a_calibrated_cost_per_token(tiny_model):
    engine = engine_for(tiny_model)
    assert engine.kv_gauges() == (0.0, 0) and engine.kv_cache_tokens is None
    run(engine, [list(range(10, 110))] * 4)
    run(engine, [list(range(10, 210))] * 16)
    assert engine.token_bytes and engine.token_bytes > 0
    assert engine.kv_cache_tokens == int((engine.budget_bytes - engine.weights_bytes) / engine.token_bytes)
    small = engine.kv_gauges()[0]
    run(engine, [list(range(10, 410))] * 32)
    expected = (engine.weights_bytes + engine.token_bytes * 32 * (400 + 12)) / engine.budget_bytes
    # The estimate, or what the batch was seen to take where that was more.
    assert engine.kv_gauges()[0] >= expected * 0.999 and engine.kv_gauges()[0] > small


class AllocatorStats:
    """torch.cuda's memory statistics as a caching allocator keeps them: tensors take
    `allocated`, the allocator's blocks `reserved` (more, by fragmentation); blocks stay
    cached until `empty_cache`."""

    def __init__(self, weights: int):
        self.calls: list[str] = []
        self.weights, self.cached = weights, 0

    def empty_cache(self):
        self.calls.append("empty_cache")
        self.cached = 0

    def reset_peak_memory_stats(self, device):
        self.calls.append("reset")

    def max_memory_allocated(self, device):
        return self.weights + 300 * 2**20

    def max_memory_reserved(self, device):
        self.cached = max(self.cached, 500 * 2**20)
        return self.weights + self.cached


def test_on_cuda_the_pressure_is_the_batch_s_reserved_peak_not_its_tensors(tiny_model):
    """The cap, like a full device, refuses the allocator's blocks: the pressure is their
    peak, from an emptied cache, and the tensors' own peak is kept beside it."""
    engine = engine_for(tiny_model)
    engine.cuda, engine.device_api = True, AllocatorStats(engine.weights_bytes)
    run(engine, [list(range(10, 110))] * 4)
    assert engine.device_api.calls[:2] == ["empty_cache", "reset"]  # the last batch's blocks don't count
    budget = engine.budget_bytes
    assert engine.kv_gauges()[0] == pytest.approx((engine.weights_bytes + 500 * 2**20) / budget)
    assert engine.peaks[-1]["allocated"] == round((engine.weights_bytes + 300 * 2**20) / budget, 4)
    assert engine.token_bytes == 500 * 2**20 / (4 * (100 + 12))  # learned from what was reserved


def test_too_long_and_structured_requests_are_refused(tiny_bart):
    engine = engine_for(tiny_bart)
    with pytest.raises(ValueError, match="longer than the model's context"):
        engine.submit(list(range(10, 4100)), Sampling(max_new_tokens=16))
    with pytest.raises(ValueError, match="engine.backend: vllm"):
        engine.submit([10, 11], Sampling(max_new_tokens=4, json_schema={"type": "object"}))


def test_a_cpu_engine_needs_a_budget(tiny_model):
    with pytest.raises(ValueError, match="memory_budget_gib is needed on CPU"):
        TransformersEngine(HFSettings(str(tiny_model)))


# --- a fake device: memory that grows with rows x padded length, and a real-looking OOM -----




def test_batches_grow_to_the_budget_back_off_on_oom_and_the_learned_limit_is_reused():
    device = FakeDevice()
    sampling = Sampling(max_new_tokens=16)
    rows = [(i, list(range(10, 10 + 200 + i % 40))) for i in range(6000)]
    controller = BatchSizeController(ControllerSettings(target=0.9, max_rows=device.max_num_seqs),
                                     kv_capacity_tokens=lambda: device.kv_cache_tokens)
    result = EngineFeeder(device, controller, feed="drain", stock_engine_queue=False).serve("le256", rows, sampling)
    assert len(result.completions) == 6000 and all(c.error is None for c in result.completions.values())
    steps = controller.trajectory("le256")["steps"]
    assert [s["action"] for s in steps[:3]] == ["start", "grow", "grow"]  # doubling from a small start
    pressures = [p["pressure"] for p in device.peaks if not p.get("oom")]
    assert 0.85 <= max(pressures) <= 0.95  # grown to the target, not past it
    # A smaller device: the learned budget overshoots it, a real OOM, halved, every row kept.
    learned = controller.learned_limits()
    small = FakeDevice(capacity=1.4e9)
    warm = BatchSizeController(ControllerSettings(target=0.9, max_rows=small.max_num_seqs), learned=learned)
    assert warm.trajectory("le256")["steps"] == []
    result = EngineFeeder(small, warm, feed="drain", stock_engine_queue=False).serve("le256", rows[:800], sampling)
    assert len(result.completions) == 800 and all(c.error is None for c in result.completions.values())
    steps = warm.trajectory("le256")["steps"]
    assert steps[0]["reason"] == "learned" and steps[0]["budget"] == learned["le256"]
    assert any(b["reason"] == "oom" for b in warm.trajectory("le256")["backoffs"])
    assert sum(p.get("oom", False) for p in small.peaks) >= 1


def test_fed_in_drain_mode_each_padded_batch_is_one_window_of_the_policy():
    """A padded batch admits fewer rows than the budget's mean row: were a window the
    budget's rows, it would span two batches and the policy would learn at half speed."""
    device = FakeDevice()
    rows = [(i, list(range(10, 10 + 100 + (0 if i % 2 else 150)))) for i in range(3000)]  # 100 and 250 tokens
    controller = BatchSizeController(ControllerSettings(target=0.9, max_rows=device.max_num_seqs),
                                     kv_capacity_tokens=lambda: device.kv_cache_tokens)
    EngineFeeder(device, controller, feed="drain", stock_engine_queue=False).serve("le256", rows, Sampling(16))
    observed = controller.trajectory("le256")["steps"][1:]  # after the start, one per window
    assert len(device.peaks) >= 5 and len(observed) == len(device.peaks)


def test_the_gpu_check_passes_on_a_device_that_behaves_and_says_so_in_one_result():
    from pipeline.tools.gpucheck import run_check, synthetic_corpus

    device = FakeDevice(capacity=2e9, per_token=30_000.0)
    result = run_check(device, synthetic_corpus(6000, vocab=1000, seed=1), max_new_tokens=16)
    assert result["ok"], {k: v for k, v in result.items() if k != "phases"}
    assert result["rows_done"] == result["rows_in"] == 6000
    assert result["ooms_caught"] >= 1 and [p["name"] for p in result["phases"]] == ["grow", "overshoot"]
    assert set(result["buckets_in_band"]) == set(result["buckets_judged"]) and len(result["buckets_judged"]) >= 3
    json.dumps(result)


def test_the_gpu_check_fails_when_batches_never_reach_the_band():
    from pipeline.tools.gpucheck import run_check, synthetic_corpus

    roomy = FakeDevice(capacity=4e9, per_token=30_000.0, max_num_seqs=8)  # 8 rows at most: memory never binds
    result = run_check(roomy, synthetic_corpus(600, vocab=1000, seed=1), max_new_tokens=16)
    assert not result["ok"] and result["buckets_in_band"] == []


def test_the_gpu_check_needs_only_torch_transformers_nvml_and_pyarrow():
    code = (
        "import sys\n"
        "for m in ('ray', 'vllm', 'pydantic', 'psutil', 'matplotlib', 'click', 'rich', 'yaml'):\n"
        "    sys.modules[m] = None  # importing any of them now fails\n"
        "import pipeline.tools.gpucheck, pipeline.generation.hf\n"
        "from pipeline.tools.gpucheck import run_check, synthetic_corpus\n"
        "from tests.helpers.fake_engine import FakeDevice\n"
        "print(run_check(FakeDevice(capacity=4e9, per_token=30_000.0), synthetic_corpus(300, 1000))['rows_done'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "300"


def test_buckets_cut_the_padding_of_the_sample_corpus_by_more_than_half(tiny_model, tmp_path):
    """The batch plan of `make run`'s corpus, as static batches of 64 rows, without
    generating: blocks of 128 rows, split into engine calls by bucket (bucket_runs)."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from pipeline.text.bucketing import LengthBucketer
    from pipeline.tools.dev.corpus import write_corpus
    from pipeline.generation.hf import padded_tokens
    from pipeline.stages.generate import bucket_runs

    texts = pq.read_table(write_corpus(tmp_path / "c.parquet", rows=1000, seed=0)).column("text").to_pylist()
    lengths = [len(ids) for ids in AutoTokenizer.from_pretrained(str(tiny_model))(texts)["input_ids"]]
    bucketer = LengthBucketer()
    index = [bucketer.index(n) for n in lengths]

    def plan(order: list[int], grouping: str, block: int = 128, batch: int = 64) -> list[list[int]]:
        batches = []
        for start in range(0, len(order), block):
            rows = order[start:start + block]
            for _, members in bucket_runs(list(range(len(rows))), [index[r] for r in rows], grouping, bucketer.names):
                batches += [[lengths[rows[m]] for m in members[k:k + batch]] for k in range(0, len(members), batch)]
        return batches

    arrival = list(range(len(lengths)))
    on = padded_tokens(plan(sorted(arrival, key=lambda r: index[r]), "global"))  # the global sort, then blocks
    off = padded_tokens(plan(arrival, "off"))
    assert on[1] == off[1] == sum(lengths)
    share_on, share_off = PaddingTotals.fraction(*on), PaddingTotals.fraction(*off)
    assert share_on <= 0.5 * share_off, (share_on, share_off)  # measured: 0.31 against 0.92
