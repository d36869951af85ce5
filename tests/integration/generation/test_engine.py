"""The engine wrapper on real vLLM (the tiny model, CPU backend), in this process."""

import pytest

from pipeline.config import EngineConfig, RestartConfig, SamplingConfig
from pipeline.generation.feeder import EngineFeeder
from pipeline.generation.policy import FixedBatchPolicy
from pipeline.generation.vllm import EngineStartupError, VLLMEngine
from pipeline.run.plan import sampling_of, vllm_settings


@pytest.fixture(scope="module")
def engine(tiny_model):
    # 0.99 of the NUMA node's memory is more than is ever free: the first start
    # fails the CPU worker's memory check, and the retry at 0.99 x 0.2 starts.
    e = VLLMEngine(vllm_settings(
        str(tiny_model),
        EngineConfig(max_model_len=512, dtype="bfloat16", gpu_memory_utilization=0.99,
                     restart=RestartConfig(startup_backoff=0.2), enforce_eager=True),
        seed=0,
    ))
    yield e
    e.close()


def test_start_up_memory_failure_is_retried_with_less(engine):
    first, second = engine.startup_attempts
    assert first["gpu_memory_utilization"] == 0.99 and "less than desired" in first["error"]
    assert second == {"gpu_memory_utilization": 0.198, "error": None}


def test_start_up_gives_up_clearly_at_the_floor(tiny_model):
    with pytest.raises(EngineStartupError, match=r"tried: 0.99; floor 0.5"):
        VLLMEngine(vllm_settings(str(tiny_model), EngineConfig(max_model_len=512, gpu_memory_utilization=0.99,
                                                               restart=RestartConfig(min_gpu_memory_utilization=0.5),
                                                               enforce_eager=True),
                                 seed=0))


def prompts(n, length=20):
    return [[5 + (i + k) % 300 for k in range(length)] for i in range(n)]


def generate(engine, batch, sampling):
    """The prompts as one call through the feeder the pipeline uses: completions in order, and the call's record."""
    served = EngineFeeder(engine, FixedBatchPolicy(len(batch))).serve("test", list(enumerate(batch)),
                                                                      sampling_of(sampling))
    return [served.completions[i] for i in range(len(batch))], served.record.to_json()


def test_one_completion_per_prompt_within_max_tokens(engine):
    out, stats = generate(engine, prompts(12), SamplingConfig(max_new_tokens=8))
    assert len(out) == 12
    assert all(c.error is None and 1 <= c.output_tokens <= 8 and c.latency_s > 0 for c in out)
    # Only finished outputs come back (FINAL_ONLY); the first token's time is vLLM's own.
    assert all(c.first_token_s is not None and 0 < c.first_token_s <= c.latency_s for c in out)
    assert stats["rows"] == 12 and stats["output_tokens"] == sum(c.output_tokens for c in out)
    assert stats["steps"] >= max(c.output_tokens for c in out)
    assert 0.0 < stats["peak_kv_cache_usage"] <= 1.0  # read from the step stats while requests ran


def test_greedy_is_deterministic(engine):
    a, _ = generate(engine, prompts(6), SamplingConfig(max_new_tokens=8, temperature=0.0))
    b, _ = generate(engine, prompts(6), SamplingConfig(max_new_tokens=8, temperature=0.0))
    assert [c.text for c in a] == [c.text for c in b]


def test_texts_decoded_when_done_are_vllms_own(engine, tiny_model):
    """vLLM is asked for token ids only (`detokenize=False`) and the engine decodes each finished
    request at once: the texts are those vLLM's own detokenizer writes for the same greedy run."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    batch = [tokenizer.encode(f"Note {i}: Ünïcödé ✓ café, the fox" * (i % 4 + 1)) for i in range(24)]
    out, _ = generate(engine, batch, SamplingConfig(max_new_tokens=24, temperature=0.0))
    own = engine._llm.generate([{"prompt_token_ids": p} for p in batch],
                               SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)

    assert engine._decoder is not None and engine._sampling_params(sampling_of(SamplingConfig())).detokenize is False
    assert [c.text for c in out] == [o.outputs[0].text for o in own]
    assert [c.output_tokens for c in out] == [len(o.outputs[0].token_ids) for o in own]


def test_a_rejected_prompt_does_not_fail_its_neighbours(engine):
    batch = prompts(3)
    batch.insert(1, [7] * 600)  # longer than max_model_len
    out, stats = generate(engine, batch, SamplingConfig(max_new_tokens=4))
    assert [c.error is None for c in out] == [True, False, True, True]
    assert "maximum context length" in out[1].error
    assert stats["rejected"] == 1
    assert engine.kv_cache_tokens and engine.max_model_len == 512


def test_a_run_whose_engine_writes_only_whitespace_reports_empty_output(engine, tiny_model):
    """Real vLLM, allowed to sample nothing but "\\n": the rows come out `empty_output`,
    with their text, and the report's counts say so (the sink's block stats feed it)."""
    from dataclasses import replace

    import pyarrow as pa
    from transformers import AutoTokenizer

    from pipeline.config import load_run_config
    from pipeline.run.plan import generate_settings, prepare_settings
    from pipeline.storage.sink import _block_stats
    from pipeline.stages.generate import GenerateStage
    from pipeline.stages.prepare import PrepareStage
    from tests.helpers import REPO

    newline = AutoTokenizer.from_pretrained(tiny_model).convert_tokens_to_ids("Ċ")  # byte-level BPE's "\n"
    config = load_run_config(REPO / "jobs/nightly_summarize.yaml", REPO / "conf/local.yaml",
                             ["batching.learned_limits=null", "sampling.max_new_tokens=6"])
    prepare = PrepareStage(prepare_settings(config, str(tiny_model), 512))
    settings = generate_settings(config, prepare.settings, "run1")
    generate = GenerateStage(settings, engine=engine)
    corpus = pa.table({"id": ["a", "b", "c"], "text": ["One note.", "Another note, longer.", "A third."],
                       "source": ["email"] * 3})
    normal = generate(prepare(corpus)).column("status").to_pylist()
    assert normal == ["ok"] * 3  # the tiny model writes words
    generate.sampling = replace(generate.sampling, allowed_token_ids=(newline,))
    out = generate(prepare(corpus))
    assert out.column("summary").to_pylist() == ["\n" * 6] * 3
    assert out.column("status").to_pylist() == ["empty_output"] * 3
    assert all("empty or only whitespace (6 tokens" in e for e in out.column("error").to_pylist())
    assert _block_stats(out)["status"] == {"empty_output": 3}

