"""What a user reads on the terminal: our own lines only, and a summary table that fits a log."""

from __future__ import annotations

import subprocess
import sys

from pipeline.cli import share
from tests.helpers import REPO

FOREIGN = ("nanobind", "leaked", "Traceback")


def test_the_terminal_holds_our_lines_only_and_each_bucket_row_is_one_line(job_run, tmp_path):
    """`pipeline dev tiny-model` into a fresh folder builds a Llama with transformers, which
    loads triton (through torch's compiler); its bindings' leak report, 29 lines, followed our
    output at exit. The shared run's stdout is a pipe, where rich assumed 80 columns and wrapped
    the prompt-token cell of a bucket over two lines."""
    built = subprocess.run([sys.executable, "-m", "pipeline", "dev", "tiny-model", str(tmp_path / "tiny")],
                           capture_output=True, text=True, cwd=REPO, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    problems = [f"{command} {stream} holds {word!r}"
                for command, result in (("dev tiny-model", built), ("run", job_run.result))
                for stream in ("stdout", "stderr") for word in FOREIGN if word in getattr(result, stream)]

    table = [line for line in job_run.result.stdout.splitlines() if line.startswith("│")]
    rows = {line.split("│")[1].strip(): line for line in table}
    for name, b in job_run.report["buckets"].items():
        pt, g = b["prompt_tokens"], b["generated"]
        figures = [f"{b['rows']:,}", f"{pt['min']:,} / {pt['median']:,.0f} / {pt['max']:,}",
                   f"{g['median_output_tokens']:,.0f}", share(g["cut_at_limit"], g["rows"]),
                   share(g["copies_opening"], g["rows"])]
        missing = [f for f in figures if f not in rows.get(name, "")]
        if missing:
            problems.append(f"the row of {name} lacks {missing}: {rows.get(name)!r}")
    if "" in rows:
        problems.append(f"a cell wrapped onto a line of its own: {rows['']!r}")
    assert problems == [], "\n".join(problems) + "\n\n" + built.stderr[-2000:] + job_run.result.stdout[-3000:]
