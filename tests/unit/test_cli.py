import subprocess
import sys

from click.testing import CliRunner

from pipeline.cli import EXIT_BAD_CONFIG, main
from tests.conftest import REPO


def test_help_says_what_a_user_needs():
    r = CliRunner().invoke(main, ["run", "--help"])
    assert r.exit_code == 0
    for word in ("--profile", "--input", "--output", "--set", "Exit status"):
        assert word in r.output
    dev = CliRunner().invoke(main, ["dev", "--help"])
    assert "tiny-model" in dev.output and "sample-corpus" in dev.output


def test_python_dash_m_works():
    r = subprocess.run([sys.executable, "-m", "pipeline", "--help"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and "run" in r.stdout


def test_bad_config_exits_2_with_the_reason_last(tmp_path):
    r = CliRunner().invoke(main, ["run", str(REPO / "jobs/nightly_summarize.yaml"), "--profile",
                                  str(REPO / "conf/local.yaml"), "--set", "batching.rows_per_call=zero"])
    assert r.exit_code == EXIT_BAD_CONFIG
    assert "batching.rows_per_call" in r.output.strip().splitlines()[-1]


def test_missing_input_exits_2_before_any_model_loads(tmp_path):
    r = CliRunner().invoke(main, ["run", str(REPO / "jobs/nightly_summarize.yaml"), "--profile",
                                  str(REPO / "conf/local.yaml"), "--input", str(tmp_path / "none.parquet")])
    assert r.exit_code == EXIT_BAD_CONFIG
    assert "no such file" in r.output
