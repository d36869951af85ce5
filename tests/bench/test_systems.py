"""The benchmark's own-process systems on the tiny model: raw vLLM (one LLM.generate) and Ray Data LLM."""

import pyarrow.compute as pc
import pyarrow.parquet as pq

from bench.compare import run_system
from pipeline.tools.dev.corpus import write_corpus


def test_raw_vllm_generates_every_prompt_and_reports_throughput(tmp_path, tiny_model):
    corpus = write_corpus(tmp_path / "corpus.parquet", rows=24, seed=41)
    r = run_system("raw", [], corpus, tmp_path)
    assert r["rows_ok"] == 24 and r["rows_error"] == 0
    assert r["output_tokens"] == 24 * 32  # the job's max_new_tokens; the tiny model never stops early
    assert r["steady_tok_s"] > 0 and r["wall_s"] > r["steady_s"]
    assert r["peak_driver_rss_mib"] > 100 and r["peak_workers_rss_mib"] > 100  # the engine core is a child
    written = pq.read_table(tmp_path / "raw-out")
    assert written.num_rows == 24 and written.column("summary").null_count == 0


def test_ray_data_llm_keeps_every_row_and_reports_throughput(tmp_path, tiny_model):
    corpus = write_corpus(tmp_path / "corpus.parquet", rows=20, seed=41)
    # Under `skip` the prepare stage refuses rows over 100 tokens (10 of these 20):
    # they come out as error rows with its reason, not lost.
    # Its engine actor and vLLM's workers outlive the process by 15-20 s: killed after 2 s here.
    r = run_system("ray-data-llm", ["length.policy=skip", "length.max_input_tokens=100"], corpus, tmp_path,
                   grace_s=2.0)
    assert r["rows_ok"] == 10 and r["rows_error"] == 10
    assert r["output_tokens"] == 10 * 32  # the job's max_new_tokens; the tiny model never stops early
    assert r["steady_from"] == "engine timestamps" and 0 < r["steady_s"] < r["execution_s"] < r["wall_s"]
    assert r["peak_workers_rss_mib"] > 100  # Ray's workers and the engine core are descendants
    assert r["lingering_s"] < 10  # what outlived it is gone before the next run
    written = pq.read_table(tmp_path / "ray-data-llm-out").sort_by("id")
    assert written.column("id").to_pylist() == pq.read_table(corpus).sort_by("id").column("id").to_pylist()
    ok = written.filter(pc.equal(written.column("status"), "ok"))
    refused = written.filter(pc.equal(written.column("status"), "skipped_too_long"))
    assert ok.num_rows == 10 and ok.column("summary").null_count == 0 and ok.column("error").null_count == 10
    assert refused.num_rows == 10 and refused.column("summary").null_count == 10
    assert refused.column("error").null_count == 0
