"""The whole job with `engine.backend: transformers` (static padded batches), through the
CLI, on the tiny Llama and on a tiny random BART (an encoder-decoder vLLM does not
serve): every id once, summaries present, and the padding that buckets save, measured.

Three runs share the assertions: the Llama with buckets, the same without
(`bucketing.grouping: off`), both at a fixed 40 rows a batch so that their padding is
compared at equal batch sizes (grown against measured memory, the batches of two runs
differ with the machine's load, and small batches pad little whatever their mix), and
BART with batches grown against the memory budget."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from pipeline.tools.dev.corpus import write_corpus
from pipeline.models.tiny import ensure_tiny_model
from tests.helpers import REPO
from tests.helpers.runs import read_run, run_cli

PROFILE = REPO / "conf/local-transformers.yaml"


@dataclass
class Runs:
    corpus: object
    on: object
    off: object
    bart: object


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory) -> Runs:
    tmp = tmp_path_factory.mktemp("transformers")
    whole = pq.read_table(write_corpus(tmp / "whole.parquet", rows=400, seed=5))
    short = whole.filter(pc.less_equal(pc.utf8_length(whole.column("text")), 3000)).slice(0, 120)
    corpus = tmp / "short.parquet"
    pq.write_table(short, corpus)
    bart = ensure_tiny_model(tmp / "bart-model", seed=0, kind="bart")
    common = ("--input", str(corpus), "--set", "sampling.max_new_tokens=8", "--set", "batching.learned_limits=null",
              "--set", "batching.generate_batch_rows=40")

    def run(name: str, *sets: str):
        out = tmp / name
        return read_run(out, corpus, run_cli(REPO / "jobs/nightly_summarize.yaml", PROFILE, "--output", str(out),
                                             *common, *sets))

    fixed = ("--set", "batching.policy.kind=fixed", "--set", "batching.policy.rows_per_call=40")
    return Runs(
        short,
        run("on", "--set", f"model.name={tiny_model}", *fixed),
        run("off", "--set", f"model.name={tiny_model}", "--set", "bucketing.grouping=off", *fixed),
        run("bart", "--set", f"model.name={bart}", "--set", "model.tiny_model_seed=null",
            "--set", "engine.max_model_len=4096"),
    )


@pytest.mark.parametrize("which", ["on", "off", "bart"])
def test_every_id_comes_out_once_with_a_summary(runs, which):
    run = getattr(runs, which)
    written = run.written
    assert Counter(written.column("id").to_pylist()) == Counter(runs.corpus.column("id").to_pylist())
    assert set(written.column("status").to_pylist()) == {"ok"}
    assert pc.min(pc.utf8_length(written.column("summary"))).as_py() > 0
    assert 0 < pc.max(written.column("output_tokens")).as_py() <= 8
    report = run.report
    assert report["engine"]["settings"]["backend"] == "transformers" and report["batching"]["feed"] == "drain"


def test_batches_grow_against_the_memory_budget(runs):
    # The batch controller grew each bucket's batches against the memory budget, as for vLLM.
    per_bucket = runs.bart.report["batching"]["per_bucket"]
    assert per_bucket and all(b["trajectory"] for b in per_bucket.values())


def test_buckets_at_least_halve_the_padding(runs):
    assert runs.on.report["batching"]["policy"] == runs.off.report["batching"]["policy"] == "fixed"
    on, off = runs.on.report["padding"], runs.off.report["padding"]
    assert on["real_tokens"] == off["real_tokens"] == runs.on.report["tokens"]["prompt"]
    # Padding tokens: the batches' prompt tokens beyond the rows' own.
    assert on["padded_tokens"] - on["real_tokens"] <= 0.5 * (off["padded_tokens"] - off["real_tokens"]), (on, off)
    assert on["padding_fraction"] < off["padding_fraction"]
    assert set(on["by_bucket"]) <= set(runs.on.report["buckets"]) and list(off["by_bucket"]) == ["mixed"]
