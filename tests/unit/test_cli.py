import json
import os
import re
import shutil
import subprocess
import sys
import time

from click.testing import CliRunner

from pipeline.cli import EXIT_BAD_CONFIG, main
from pipeline.config import load_run_config
from tests.helpers import REPO


def test_every_command_and_option_is_documented_in_its_help():
    """Each option of every command carries help text and appears in `--help`; each
    command has a docstring that says what it does (not just a name)."""
    import click

    def commands(group, path=()):
        for name, cmd in group.commands.items():
            yield (*path, name), cmd
            if isinstance(cmd, click.Group):
                yield from commands(cmd, (*path, name))

    seen = 0
    for path, cmd in commands(main):
        r = CliRunner().invoke(main, [*path, "--help"])
        assert r.exit_code == 0, path
        assert cmd.help and len(cmd.help.split()) >= 5, f"{' '.join(path)}: no real description"
        for param in cmd.params:
            if isinstance(param, click.Option) and param.name != "help":
                assert param.help, f"{' '.join(path)} {param.opts[0]}: no help text"
                assert param.opts[0] in r.output, f"{' '.join(path)} {param.opts[0]} missing from --help"
                seen += 1
    assert seen >= 25
    run = CliRunner().invoke(main, ["run", "--help"]).output
    assert "Exit status" in run and "--backup-existing" in run


def test_python_dash_m_works():
    r = subprocess.run([sys.executable, "-m", "pipeline", "--help"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and "run" in r.stdout


def test_the_command_ends_after_the_exit_handlers_with_its_code_and_without_the_teardown():
    """`python -m pipeline` runs the atexit handlers (Ray's shutdown among them) and ends
    with the command's exit code, skipping the interpreter's teardown, where other
    libraries' bindings print their leak reports (triton's, after our summary) and a
    night's objects were swept for cycles. An object left in a module is never finalized."""
    script = ("import atexit, sys\n"
              "atexit.register(lambda: print('exit handler', flush=True))\n"
              "class Left:\n"
              "    def __del__(self): print('teardown', flush=True)\n"
              "left = Left()\n"
              "sys.argv = ['pipeline', 'run', 'missing.yaml', '--profile', 'missing.yaml']\n"
              "from pipeline.cli import entry\n"
              "entry()\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == EXIT_BAD_CONFIG
    assert r.stdout.splitlines() == ["exit handler"]
    assert r.stderr.splitlines()[-1] == "error: missing.yaml: cannot read: No such file or directory"


def test_bad_config_exits_2_with_the_reason_last(tmp_path):
    r = CliRunner().invoke(main, ["run", str(REPO / "jobs/nightly_summarize.yaml"), "--profile",
                                  str(REPO / "conf/local.yaml"), "--set", "batching.policy.rows_per_call=zero"])
    assert r.exit_code == EXIT_BAD_CONFIG
    assert "batching.policy" in r.output.strip().splitlines()[-1]


def test_missing_input_exits_2_before_any_model_loads(tmp_path):
    r = CliRunner().invoke(main, ["run", str(REPO / "jobs/nightly_summarize.yaml"), "--profile",
                                  str(REPO / "conf/local.yaml"), "--input", str(tmp_path / "none.parquet")])
    assert r.exit_code == EXIT_BAD_CONFIG
    assert "no such file" in r.output


def test_an_output_folder_of_foreign_files_exits_2_before_ray_and_keeps_every_byte(tmp_path, tiny_model):
    from pipeline.tools.dev.corpus import write_corpus

    corpus = write_corpus(tmp_path / "c.parquet", rows=20, seed=0)
    user = tmp_path / "user"
    (user / "notes" / "deep").mkdir(parents=True)
    files = {"thesis.tex": b"\\documentclass{article}", "notes/a.txt": b"a", "notes/deep/b.bin": bytes(range(256))}
    for name, data in files.items():
        (user / name).write_bytes(data)
    started = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "pipeline", "run", "jobs/nightly_summarize.yaml", "--profile", "conf/local.yaml",
         "--input", str(corpus), "--output", str(user), "--set", f"model.name={tiny_model}"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    assert r.returncode == EXIT_BAD_CONFIG, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {user} holds files this pipeline did not write: notes/, thesis.tex")
    assert time.monotonic() - started < 30 and "Ray instance" not in r.stderr
    assert {str(p.relative_to(user)): p.read_bytes() for p in user.rglob("*") if p.is_file()} == files
    assert sorted(os.listdir(tmp_path)) == ["c.parquet", "user"]  # no lock, no staging left


def test_a_context_above_the_models_positions_exits_2_before_ray_naming_both(tmp_path, tiny_model):
    """The user's report: max_model_len 16384 on an 8,192-position model failed the engine's
    start four times through Ray's restarts, then exit 1 with a traceback."""
    from pipeline.models.source import check_context
    from pipeline.tools.dev.corpus import write_corpus

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 8192
    (model / "config.json").write_text(json.dumps(config))
    corpus = write_corpus(tmp_path / "c.parquet", rows=4, seed=0)
    started = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "pipeline", "run", "jobs/nightly_summarize.yaml", "--profile", "conf/local.yaml",
         "--input", str(corpus), "--output", str(tmp_path / "out"), "--set", f"model.name={model}",
         "--set", "engine.max_model_len=16384"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    assert r.returncode == EXIT_BAD_CONFIG, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: engine.max_model_len 16,384 is above the 8,192 positions of the model at")
    assert "--set engine.max_model_len=8192" in last
    assert time.monotonic() - started < 30 and "Ray instance" not in r.stderr and not (tmp_path / "out").exists()
    check_context(str(model), 8192)  # at the limit, or unset, it passes
    check_context(str(model), None)
    config["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}  # scaled: the engine's to judge
    (model / "config.json").write_text(json.dumps(config))
    check_context(str(model), 16384)


def test_the_profile_tune_wrote_loads_with_no_warning(tmp_path):
    """bench/results/tune_local/profile.yaml, as `pipeline tune` writes a profile today."""
    r = CliRunner().invoke(main, ["run", str(REPO / "jobs/nightly_summarize.yaml"), "--profile",
                                  str(REPO / "bench/results/tune_local/profile.yaml"),
                                  "--input", str(tmp_path / "none.parquet")])
    assert r.exit_code == EXIT_BAD_CONFIG and "no such file" in r.output
    assert not any(line.startswith("warning: ") for line in r.output.splitlines())
    config = load_run_config(REPO / "jobs/nightly_summarize.yaml", REPO / "bench/results/tune_local/profile.yaml")
    assert config.profile.batching.policy.kind == "tuned" and config.profile.batching.policy.rows["le8192"] == 8


def test_gc_lists_then_deletes_a_stopped_run_and_resume_excludes_restart(tmp_path):
    from tests.helpers.runs import killed_run

    killed_run(tmp_path / "out")
    listed = CliRunner().invoke(main, ["gc", str(tmp_path / "out")])
    assert listed.exit_code == 0 and "run1" in listed.output and "stopped at 50%" in listed.output
    assert len(list(tmp_path.glob(".out.*.staging"))) == 1
    deleted = CliRunner().invoke(main, ["gc", str(tmp_path / "out"), "--delete"])
    assert deleted.exit_code == 0 and not list(tmp_path.glob(".out.*.staging"))
    both = CliRunner().invoke(main, ["run", "jobs/nightly_summarize.yaml", "--profile", "conf/local.yaml",
                                     "--resume", "--restart"])
    assert both.exit_code == EXIT_BAD_CONFIG and "exclude each other" in both.output
    reuse = CliRunner().invoke(main, ["run", "jobs/nightly_summarize.yaml", "--profile", "conf/local.yaml",
                                      "--reuse", str(tmp_path), "--no-reuse"])
    assert reuse.exit_code == EXIT_BAD_CONFIG and "--reuse and --no-reuse exclude each other" in reuse.output


def summary_report() -> dict:
    """A report with the buckets of the issue's `make run`: figures that wrap at 80 columns."""
    def bucket(rows: int, pt: tuple[int, int, int], cut: int, copies: int) -> dict:
        return {"rows": rows, "prompt_tokens": dict(zip(("min", "median", "max"), pt)),
                "generated": {"rows": rows, "median_output_tokens": 64, "cut_at_limit": cut,
                              "copies_opening": copies}}

    return {"job": "nightly_summarize", "run_id": "20261201T163220Z-10e453", "rows_in": 24, "rows_out": 24,
            "status": {"ok": 24}, "tokens": {"prompt": 12814, "output": 1300}, "wall_s": 245.9,
            "output_tokens_per_s": 5.3, "output": "out", "report_path": "out/_report.json",
            "buckets": {"le128": bucket(1, (96, 96, 96), 1, 0), "le256": bucket(7, (131, 188, 228), 4, 1),
                        "le512": bucket(6, (259, 396, 491), 5, 0), "le1024": bucket(10, (528, 959, 959), 7, 0)}}


def test_off_a_terminal_each_row_of_the_summary_table_is_one_line(capsys, monkeypatch):
    """Off a terminal rich assumes 80 columns and wrapped "131 / 188 / 228" over two lines;
    there the table is as wide as its content. On a terminal it keeps the terminal's width."""
    from pipeline.cli import print_summary

    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    print_summary(summary_report())
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[1]: line for line in lines if line.startswith("│ ")}
    assert rows["le256"].split("│")[1:-1] == [" le256  ", "        7 ", "             131 / 188 / 228 ",
                                            "                  64 ", "      4 (57%) ", " 1 (14%) "]
    assert list(rows) == ["le128", "le256", "le512", "le1024", "total"]
    assert "┃ bucket ┃     rows ┃ prompt tokens (min/med/max) ┃" in lines[2]

    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # a terminal of 80 columns: today's table
    monkeypatch.setenv("COLUMNS", "80")
    print_summary(summary_report())
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in capsys.readouterr().out.splitlines()]
    assert {len(line) for line in lines if line[:1] in "┏┃┡│├└"} == {80}


def test_the_summary_says_what_reuse_gave_or_why_nothing():
    from pipeline.cli import reuse_line

    given = {"sources": [{"run_id": "r1", "date": "2026-12-01", "rows_reused": 187}], "notes": [],
             "rows_reused": 187, "rows_generated": 15, "output_tokens_not_generated": 2992, "engine_s_saved": 11.66}
    assert reuse_line(given) == ("reused: 187 rows (187 from r1 (2026-12-01)) · generated 15 · 2,992 output tokens "
                                 "not generated, about 11.7 s of engine time saved")
    none = {"sources": [], "notes": [], "rows_reused": 0, "rows_generated": 5, "output_tokens_not_generated": 0,
            "engine_s_saved": 0.0}
    assert reuse_line(none) == "reused: none (no earlier output to take from)"
    off = none | {"notes": ["reuse is off: sampling with a temperature and no seed: every result is its own"]}
    assert reuse_line(off).startswith("reused: none (reuse is off: sampling")


def test_the_summary_says_how_the_job_used_a_live_server():
    from pipeline.cli import server_line

    s = {"url": "http://10.0.0.5:8000", "prompt_as": "text", "prompt_as_why": "the server has no /tokenize",
         "notes": ["the server does not schedule by priority"], "ttft_ms": {"p50": 120.0, "p99": 2400.0, "slo": 2000.0},
         "in_flight": {"peak_in_flight": 48, "max_in_flight": 64,
                       "backoffs": [{"reasons": ["online_ttft"]}, {"reasons": ["online_ttft", "queue"]}]}}
    line = server_line(s)
    assert "prompts as text (the server has no /tokenize)" in line and "in flight up to 48 (cap 64)" in line
    assert "back-offs: online_ttft 2, queue 1" in line and "p99 2,400 ms (target 2,000)" in line
    assert line.endswith("the server does not schedule by priority")
