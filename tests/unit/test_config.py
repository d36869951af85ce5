from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_run_config, parse_override

REPO = Path(__file__).resolve().parents[2]
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
        JOB, LOCAL, ["sampling.max_new_tokens=8", "batching.bucket_boundaries=[64, 512]",
                     "engine.enforce_eager=false"], input_path="in.parquet", output_path="o",
    )
    assert cfg.job.sampling.max_new_tokens == 8
    assert cfg.profile.batching.bucket_boundaries == [64, 512]
    assert cfg.profile.engine.enforce_eager is False
    assert (cfg.job.input.path, cfg.job.output.path) == ("in.parquet", "o")
    with pytest.raises(ConfigError, match=r"--set sampling.max_new_tokens=-1: sampling.max_new_tokens"):
        load_run_config(JOB, LOCAL, ["sampling.max_new_tokens=-1"])
    with pytest.raises(ConfigError, match="unknown section 'nope'"):
        load_run_config(JOB, LOCAL, ["nope.x=1"])
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_override("sampling.max_new_tokens")


def test_bucket_boundaries_must_increase():
    with pytest.raises(ConfigError, match="batching.bucket_boundaries.*strictly increasing"):
        load_run_config(JOB, LOCAL, ["batching.bucket_boundaries=[512, 128]"])


def test_a_job_file_cannot_hold_profile_sections(tmp_path):
    job = write(tmp_path, "j.yaml", JOB.read_text() + "engine: {dtype: float32}\n")
    with pytest.raises(ConfigError, match=r"j.yaml: engine: unknown field"):
        load_run_config(job, LOCAL)
