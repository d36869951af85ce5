"""The prepare and generate stages built from the repository's job and the local profile,
the generate stage on a given engine (a fake, or real vLLM)."""

from __future__ import annotations

from dataclasses import replace

from pipeline.config import load_run_config
from pipeline.run.plan import generate_settings, prepare_settings
from pipeline.stages.generate import GenerateStage
from pipeline.stages.prepare import PrepareStage
from tests.helpers import REPO


def stages(tiny_model, job, sets, engine, max_model_len=2048):
    config = load_run_config(REPO / job, REPO / "conf/local.yaml", ["batching.learned_limits=null", *sets])
    prepare = PrepareStage(prepare_settings(config, str(tiny_model), max_model_len))
    engine.max_model_len = max_model_len
    settings = generate_settings(config, prepare.settings, "run1")
    # No CPUs to bind the process to: an engine started later by a test (on demand, its
    # build replaced by a fake's) would otherwise bind the test process itself.
    settings = replace(settings, engine=replace(settings.engine, bind_cpus=None))
    return prepare, GenerateStage(settings, engine=engine)
