from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa
import pytest

from pipeline.config import ConfigError, load_run_config, parse_override

from tests.helpers import REPO  # noqa: E402
JOB = REPO / "jobs" / "nightly_summarize.yaml"
LOCAL = REPO / "conf" / "local.yaml"
GPU = REPO / "conf" / "gpu.yaml"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_shipped_job_and_profiles_load():
    for profile in (LOCAL, GPU):
        cfg = load_run_config(JOB, profile)
        assert cfg.job.name == "nightly_summarize"
        assert cfg.job.prompt.fields() == {"source", "text"}
    assert load_run_config(JOB, GPU).profile.hardware.accelerator == "gpu"
    assert load_run_config(JOB, LOCAL).profile.engine.gpu_memory_utilization == 0.2


def test_bad_yaml_names_file_and_line(tmp_path):
    bad = write(tmp_path, "job.yaml", "name: x\ninput: [unclosed\n")
    with pytest.raises(ConfigError) as e:
        load_run_config(bad, LOCAL)
    assert str(bad) in str(e.value) and "line" in str(e.value) and "invalid YAML" in str(e.value)


def test_unknown_key_names_file_and_field(tmp_path):
    profile = write(tmp_path, "p.yaml", LOCAL.read_text().replace("memory_target: 0.90", "memory_targt: 0.90"))
    with pytest.raises(ConfigError) as e:
        load_run_config(JOB, profile)
    assert f"{profile}: batching.memory_targt: unknown field" in str(e.value)


def test_wrong_type_names_file_and_field(tmp_path):
    job = write(tmp_path, "j.yaml", JOB.read_text().replace("max_new_tokens: 32", "max_new_tokens: lots"))
    with pytest.raises(ConfigError) as e:
        load_run_config(job, LOCAL)
    msg = str(e.value)
    assert msg.startswith(f"{job}: sampling.max_new_tokens:") and "'lots'" in msg


def test_missing_required_field(tmp_path):
    job = write(tmp_path, "j.yaml", "name: x\ninput: {path: a}\noutput: {path: b}\n")
    with pytest.raises(ConfigError, match=r"j.yaml: prompt: Field required"):
        load_run_config(job, LOCAL)


def test_overrides_are_typed_and_named_in_errors():
    cfg = load_run_config(
        JOB, LOCAL, ["sampling.max_new_tokens=8", "bucketing.boundaries=[64, 512]",
                     "engine.enforce_eager=false"], input_path="in.parquet", output_path="o",
    )
    assert cfg.job.sampling.max_new_tokens == 8
    assert cfg.profile.bucketing.boundaries == [64, 512]
    assert cfg.profile.engine.enforce_eager is False
    assert (cfg.job.input.path, cfg.job.output.path) == ("in.parquet", "o")
    with pytest.raises(ConfigError, match=r"--set sampling.max_new_tokens=-1: sampling.max_new_tokens"):
        load_run_config(JOB, LOCAL, ["sampling.max_new_tokens=-1"])
    with pytest.raises(ConfigError, match="unknown section 'nope'"):
        load_run_config(JOB, LOCAL, ["nope.x=1"])
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_override("sampling.max_new_tokens")


def test_bucket_boundaries_must_increase():
    with pytest.raises(ConfigError, match="bucketing.boundaries.*strictly increasing"):
        load_run_config(JOB, LOCAL, ["bucketing.boundaries=[512, 128]"])


def test_a_job_file_cannot_hold_profile_sections(tmp_path):
    job = write(tmp_path, "j.yaml", JOB.read_text() + "engine: {dtype: float32}\n")
    with pytest.raises(ConfigError, match=r"j.yaml: engine: unknown field"):
        load_run_config(job, LOCAL)


# --- issue 5: job-file checks that name the file and the key ------------------

KB = REPO / "jobs/kb_ingest.yaml"


@pytest.mark.parametrize("override, message", [
    ("annotations.schema.properties.title.type=strin",
     r"annotations\.schema\.properties\.title\.type: not valid JSON Schema"),
    ("annotations.schema.properties.entities.items.properties={}",
     r"annotations\.schema\.properties\.entities\.items: an object needs `properties`"),
    ("annotations.schema.properties.tags={type: array}",
     r"annotations\.schema\.properties\.tags: an array needs `items`"),
    ("annotations.schema.properties.n={type: [string, integer]}",
     r"annotations\.schema\.properties\.n: type \['string', 'integer'\] mixes types"),
    ("annotations.schema.type=array", r"annotations\.schema\.type: the annotation schema must describe an object"),
    ("prompt.template=Summarize {text", r"prompt\.template: not a valid template"),
    ("annotations.prompt.template=Tag {}", r"annotations\.prompt\.template: positional fields"),
    ("passages.overlap=300", r"passages: overlap \(300\) must be smaller than tokens \(256\)"),
    ("length.policy=chunk", r"length\.policy chunk summarizes in pieces"),
])
def test_bad_job_files_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(KB, REPO / "conf/local.yaml", [override])


def test_schema_errors_name_the_job_file(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(KB.read_text().replace("maxItems: 5}", "maxItems: 5}\n      extra: {type: object}"))
    with pytest.raises(ConfigError, match=rf"{job}: annotations\.schema\.properties\.extra: an object needs"):
        load_run_config(job, REPO / "conf/local.yaml")


def test_annotation_columns_follow_the_schema_types():
    fields = {f.name: f.type for f in load_run_config(KB, REPO / "conf/local.yaml").job.annotations.fields()}
    assert fields["title"] == pa.string()
    assert fields["entities"] == pa.list_(pa.struct([("name", pa.string()), ("type", pa.string())]))
    prefixed = load_run_config(KB, REPO / "conf/local.yaml", ["annotations.column_prefix=ann_"])
    assert [f.name for f in prefixed.job.annotations.fields()][:2] == ["ann_title", "ann_keywords"]


def test_date_fills_the_nightly_paths():
    cfg = load_run_config(REPO / "jobs/nightly_summarize.yaml", REPO / "conf/local.yaml", date="2026-11-29")
    assert cfg.date == "2026-11-29"
    assert cfg.job.input.path.endswith("dt=2026-11-29") and cfg.job.output.path.endswith("dt=2026-11-29")
    default = load_run_config(REPO / "jobs/nightly_summarize.yaml", REPO / "conf/local.yaml")
    assert default.date == (datetime.now(timezone.utc).date() - timedelta(days=1)).isoformat()
    with pytest.raises(ConfigError, match=r"--date 2026-02-30: expected a day as YYYY-MM-DD"):
        load_run_config(REPO / "jobs/nightly_summarize.yaml", REPO / "conf/local.yaml", date="2026-02-30")
    with pytest.raises(ConfigError, match=r"--date 2026-11-29: .*kb_ingest.yaml has no \{date\}"):
        load_run_config(KB, REPO / "conf/local.yaml", date="2026-11-29")


def test_tuned_policy_needs_rows_per_bucket():
    with pytest.raises(ConfigError, match=r"conf/local.yaml: batching.policy.rows: "
                                          r"needs rows \(bucket: rows\); `pipeline tune` writes them"):
        load_run_config(JOB, LOCAL, ["batching.policy.kind=tuned"])
    cfg = load_run_config(JOB, LOCAL, ["batching.policy={kind: tuned, rows: {le128: 32, le256: 16}}"])
    assert cfg.profile.batching.policy.rows == {"le128": 32, "le256": 16}
    assert cfg.profile.batching.describe_policy() == {
        "policy": "tuned", "memory_target": None, "rows_per_call": 64, "tuned_rows": {"le128": 32, "le256": 16}}


def test_fixed_policy_takes_per_bucket_rows():
    from pipeline.generation.policy import FixedBatchPolicy

    policy = FixedBatchPolicy(64, {"le128": 8})
    assert policy.rows_for("le128", 100.0) == 8 and policy.rows_for("le512", 100.0) == 64


def test_unquoted_off_means_off():
    assert load_run_config(JOB, LOCAL, ["bucketing.grouping=off"]).profile.bucketing.grouping == "off"


def test_the_restart_policy_has_its_own_section():
    cfg = load_run_config(JOB, LOCAL, ["engine.restart.startup_backoff=0.25"])
    assert cfg.profile.engine.restart.startup_backoff == 0.25
    with pytest.raises(ConfigError, match=r"--set engine.restart.startup_backoff=2: engine.restart.startup_backoff: "
                                          r"Input should be less than 1"):
        load_run_config(JOB, LOCAL, ["engine.restart.startup_backoff=2"])


def test_grouping_streams_by_window_by_default():
    profile = load_run_config(JOB, LOCAL).profile
    assert profile.bucketing.grouping == "window" and profile.bucketing.window_rows == 4096
    assert profile.batching.concurrent_batches == 8 and profile.batching.generate_batch_rows == 128
    assert load_run_config(JOB, LOCAL, ["bucketing.grouping=global"]).profile.bucketing.grouping == "global"
    with pytest.raises(ConfigError, match="bucketing.grouping"):
        load_run_config(JOB, LOCAL, ["bucketing.grouping=per_batch"])


def test_the_transformers_backend_is_checked_before_any_model_loads():
    cfg = load_run_config(JOB, LOCAL, ["engine.backend=transformers", "engine.memory_budget_gib=2"])
    assert cfg.profile.engine.backend == "transformers" and cfg.profile.feed() == "drain"
    with pytest.raises(ConfigError, match="memory_budget_gib is needed for engine.backend: transformers on CPU"):
        load_run_config(JOB, LOCAL, ["engine.backend=transformers"])
    kb = REPO / "jobs/kb_ingest.yaml"
    with pytest.raises(ConfigError, match=r"kb_ingest.yaml: annotations need structured outputs.*"
                                          r"--set engine.backend=transformers"):
        load_run_config(kb, LOCAL, ["engine.backend=transformers", "engine.memory_budget_gib=2"])


def test_faults_are_the_shorthand_and_the_list_in_batch_order():
    from pipeline.config.models import DebugConfig

    debug = DebugConfig(inject_oom_at_batch=3, more_faults=[{"at_batch": 6, "kind": "engine_oom_death"},
                                                            {"at_batch": 2, "kind": "engine_crash"}])
    assert debug.faults() == ((2, "engine_crash"), (3, "oom"), (6, "engine_oom_death"))
    assert DebugConfig().faults() == ()
    with pytest.raises(ValueError, match="at_batch"):
        DebugConfig(more_faults=[{"at_batch": 0}])


def test_the_nightly_job_reuses_its_own_partitions_of_any_date_and_the_cli_can_say_otherwise():
    job, local = REPO / "jobs/nightly_summarize.yaml", REPO / "conf/local.yaml"
    cfg = load_run_config(job, local, date="2026-11-29")
    assert cfg.job.reuse.paths == ["out/nightly_summarize/dt=*"] and cfg.job.reuse.lookback == 1
    moved = load_run_config(job, local, output_path="/data/out/dt={date}", date="2026-11-29")
    assert moved.job.reuse.paths == ["/data/out/dt=*"] and moved.job.output.path == "/data/out/dt=2026-11-29"
    named = load_run_config(job, local, reuse=["s3://b/out/dt=*", "/x"])
    assert named.job.reuse.paths == ["s3://b/out/dt=*", "/x"] and named.job.reuse.lookback is None
    assert load_run_config(job, local, reuse=False).job.reuse.enabled is False
    assert load_run_config(KB, local).job.reuse.paths == []  # no reuse unless a job names it


def test_the_server_backend_needs_its_server_and_keys_results_only_with_a_revision(tmp_path):
    from pipeline.run.plan import engine_description, prepare_settings, result_keys, server_settings

    server = REPO / "conf/local-server.yaml"
    cfg = load_run_config(JOB, server)
    assert cfg.profile.engine.backend == "server" and cfg.profile.engine.server.max_in_flight == 64
    settings = server_settings("/models/tiny", cfg.profile.engine)
    assert settings.url == "http://127.0.0.1:8000" and settings.tokenizer_path == "/models/tiny"
    assert engine_description("/models/tiny", cfg.profile.engine, 0)["backend"] == "server"
    fixed = server_settings("/m", load_run_config(JOB, server, ["engine.server.feedback=false"]).profile.engine)
    assert fixed.start_in_flight == fixed.max_in_flight == 64 and not fixed.feedback
    with pytest.raises(ConfigError, match="engine.backend: server needs engine.server"):
        load_run_config(JOB, LOCAL, ["engine.backend=server"])
    with pytest.raises(ConfigError, match="engine.server is set but engine.backend is 'vllm'"):
        load_run_config(JOB, server, ["engine.backend=vllm"])
    with pytest.raises(ConfigError, match="max_in_flight"):
        load_run_config(JOB, server, ["engine.server.max_in_flight=0"])

    off = result_keys(cfg, prepare_settings(cfg, str(tmp_path), 4096))
    assert off["base"] is None and "engine.server.revision" in off["off"]
    revised = load_run_config(JOB, server, ["engine.server.revision=img-2026-12"])
    keyed = result_keys(revised, prepare_settings(revised, str(tmp_path), 4096))
    assert keyed["model_digest"] == "server:tiny@img-2026-12" and keyed["base"] is not None
