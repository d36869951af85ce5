"""The benchmark's raw-vLLM system on the tiny model: one LLM.generate over the job's prompts."""

import pyarrow.parquet as pq
import pytest

from pipeline.bench import run_system
from pipeline.dev.corpus import write_corpus

pytestmark = pytest.mark.integration


def test_raw_vllm_generates_every_prompt_and_reports_throughput(tmp_path, tiny_model):
    corpus = write_corpus(tmp_path / "corpus.parquet", rows=24, seed=41)
    r = run_system("raw", [], corpus, tmp_path)
    assert r["rows_ok"] == 24 and r["rows_error"] == 0
    assert r["output_tokens"] == 24 * 32  # the job's max_new_tokens; the tiny model never stops early
    assert r["steady_tok_s"] > 0 and r["wall_s"] > r["steady_s"]
    assert r["peak_driver_rss_mib"] > 100 and r["peak_workers_rss_mib"] > 100  # the engine core is a child
    written = pq.read_table(tmp_path / "raw-out")
    assert written.num_rows == 24 and written.column("summary").null_count == 0
