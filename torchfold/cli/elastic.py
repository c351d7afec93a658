"""``python -m torchfold elastic run``: drive a real training run through a resource-availability trace.

This module holds the command line and the process orchestration; the schedule (steps and
segments) is :mod:`torchfold.cli.elastic_schedule`, the figure :mod:`torchfold.cli.elastic_plot`.

A resource trace (``,Time,GPUs`` rows, see :func:`~torchfold.train.schedule.availability.read_availability`) says how
many devices a job had over time. The command scales that count to the processes one machine can
run (:func:`processes_for`), maps trace time to optimizer steps (one step per ``step_time``
seconds, as :meth:`~torchfold.train.BatchSizeTrace.from_availability` counts them) and cuts the
steps into segments of one process count (:func:`elastic_schedule`). Each segment runs as one
``torchrun`` group of ``python -m torchfold train``, which resumes from the newest checkpoint;
when the process count changes, the command sends SIGTERM to the group's torchrun agent (it
forwards the signal to its workers, which finish the step in progress, checkpoint and exit), waits
for it to exit, and starts the next group. Like a real preemption, the signal races the training:
a group whose steps are faster than the signal's way to its workers runs a few steps of the next
segment; ``steps.csv`` records the processes that ran each step, and the next group resumes
from the newest checkpoint (or is skipped if it has nothing left to run). A span without devices pauses the elastic run: no process
runs for a short real pause. At the end one uninterrupted process trains on the same steps, and
the command compares the two runs' parameters: training is world-size invariant, so they agree up
to float summation order.

The run folder holds ``steps.csv`` (one row per step), ``segments.csv`` (one row per group or
pause), ``elastic.png`` (with the ``plot`` extra; without matplotlib the command says so before it
starts, and runs and compares all the same), ``logs/`` (each group's output), ``history/`` (each group's step stats),
``checkpoints/`` and ``reference/`` (the uninterrupted run).

Example::

    python -m torchfold elastic run --availability DATA/traces/gcp_a100_gpus.csv \\
        --run-dir runs/a100 --step-time 630 --max-train 400 --max-words 12

Exit status: 0 when every group ran and the parameters match the uninterrupted run, 1 when a
group failed, hung or the parameters differ beyond summation order, 2 for bad arguments or input
files (the message names the value, the file and line, and the fix).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchfold._validate import non_negative_float, positive_float, positive_int, seed_int
from torchfold.cli.elastic_plot import plot_elastic, plot_unavailable
from torchfold.cli.elastic_schedule import (
    ElasticSchedule,
    ScheduledStep,
    Segment,
    elastic_schedule,
    processes_for,
)
from torchfold.examples.datasets import ENV_VAR
from torchfold.train.schedule.availability import read_availability
from torchfold.train.schedule.trace import BatchSizeTrace

__all__ = [
    "ElasticRunError",
    "ElasticSchedule",
    "ScheduledStep",
    "Segment",
    "build_parser",
    "compare_parameters",
    "elastic_schedule",
    "main",
    "processes_for",
]

_PROG = "python -m torchfold elastic run"

# The command's earlier name: a hidden alias of `run` for one release, which says so on stderr.
_OLD_NAME = "replay"
_RENAMED = "torchfold elastic replay was renamed: use torchfold elastic run"

# The columns of steps.csv, in order.
CSV_COLUMNS = (
    "step",
    "trace_time_s",
    "devices",
    "planned_processes",
    "processes",
    "global_batch",
    "accumulation_minibatches",
    "lr",
    "loss",
    "reference_loss",
    "segment",
)


# -- the command --------------------------------------------------------------------------------


class ElasticRunError(RuntimeError):
    """A group of the elastic run failed, hung, or left no checkpoint (the message names the segment)."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m torchfold elastic``."""
    parser = argparse.ArgumentParser(
        prog="python -m torchfold elastic", description="Elastic training tools."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{run}")
    p = commands.add_parser(
        "run",
        prog=_PROG,
        help="drive a real training run through a resource-availability trace",
        description="Drive a real Tree-LSTM training through a resource-availability trace: scale the devices to "
        "1..--max-processes gloo processes, restart the run (SIGTERM, torchrun with the new count, resume from "
        "the newest checkpoint) at every change of the process count, pause while no device is available, and "
        "compare the final parameters with one uninterrupted process. Arguments after '--' go to every "
        "`python -m torchfold train` run. Writes steps.csv, segments.csv and (with matplotlib, the plot extra) elastic.png to --run-dir.",
    )
    p.add_argument(
        "--availability", required=True, metavar="FILE", help="availability CSV (',Time,GPUs' rows)"
    )
    p.add_argument(
        "--run-dir", required=True, metavar="DIR", help="run folder to write (must hold no checkpoints)"
    )
    p.add_argument(
        "--max-processes",
        type=positive_int,
        default=3,
        help="processes for the trace's peak devices (default 3)",
    )
    p.add_argument(
        "--step-time",
        type=positive_float,
        help="trace seconds per optimizer step (default: the trace's median row interval, one step per row)",
    )
    p.add_argument("--max-steps", type=positive_int, help="run at most this many steps")
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--global-batch", type=positive_int, default=48, help="samples per step (default 48)")
    batch.add_argument(
        "--trace",
        help="global batch per step instead: a step,batchsize CSV, an int, a list or a schedule (as train's)",
    )
    p.add_argument(
        "--max-device-batch-size",
        type=positive_int,
        default=8,
        help="most samples per process per minibatch; accumulation minibatches per process = "
        "ceil(global / (processes * this)) (default 8)",
    )
    p.add_argument(
        "--task",
        metavar="SPEC",
        help="what to train, as train's --task: a built-in task or package.module:function (default: the sst "
        "task with the four options below)",
    )
    p.add_argument(
        "--task-arg", action="append", default=[], metavar="KEY=VALUE", help="as train's --task-arg (repeat)"
    )
    p.add_argument(
        "--data", metavar="DIR", help=f"sst task: SST directory (as train's --data; default ${ENV_VAR})"
    )
    p.add_argument(
        "--max-train", type=positive_int, default=400, help="sst task: training trees (default 400)"
    )
    p.add_argument(
        "--max-words", type=positive_int, default=12, help="sst task: longest tree in words (default 12)"
    )
    p.add_argument(
        "--hidden-dim", type=positive_int, default=32, help="sst task: Tree-LSTM size (default 32)"
    )
    p.add_argument("--lr", type=positive_float, default=0.005, help="learning rate (default 0.005)")
    p.add_argument("--seed", type=seed_int, default=0, help="default 0")
    p.add_argument(
        "--pause-seconds",
        type=non_negative_float,
        default=1.0,
        help="real seconds a span without devices pauses the run (default 1)",
    )
    p.add_argument(
        "--segment-timeout",
        type=positive_float,
        default=600.0,
        help="seconds one group may run before it is killed and the elastic run fails (default 600)",
    )
    p.add_argument(
        "--stop-timeout",
        type=positive_float,
        default=90.0,
        help="seconds a group may take to stop after SIGTERM (default 90; torchrun kills workers after 30)",
    )
    p.add_argument("--no-reference", action="store_true", help="skip the uninterrupted single-process run")
    return parser


def _free_port() -> int:
    # Bound and released: a race with another program is possible but rare, and torchrun then fails fast.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    """The children's environment: they import this torchfold (a work tree may not be the installed one)."""
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    return env


def _newest_step(directory: Path) -> int:
    from torchfold.train.loop.checkpoint import list_checkpoints

    found = list_checkpoints(directory)
    return found[-1][0] if found else 0


def _read_history(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:  # a row cut by a killed process
                raise ElasticRunError(f"{path}, line {number}: not a JSON history row ({e})") from e
    return rows


def _log_tail(path: Path, lines: int = 8) -> str:
    """What a group's log says went wrong: the train command's error lines, else its last lines."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    # Every rank prints the same error; torchrun's failure table after it would hide it.
    errors = list(dict.fromkeys(line for line in text if "torchfold train: error:" in line))
    shown = errors[-3:] if errors else text[-lines:]
    return "\n  | ".join(["", *shown]) if shown else ""


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL a group started with ``start_new_session=True`` (the agent and its workers) and reap it."""
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


@dataclass
class _GroupResult:
    segment: Segment
    first_step: int  # where the group resumed
    rows: list[dict[str, Any]]  # its history rows
    stop: str  # "finished", "preempted" or "skipped"
    wall_seconds: float
    returncode: int | None


def _run_group(
    segment: Segment,
    train_args: list[str],
    run_dir: Path,
    *,
    final_step: int,
    segment_timeout: float,
    stop_timeout: float,
    label: str,
) -> _GroupResult:
    """Run one segment's torchrun group until it has run the segment's steps; stop it with SIGTERM."""
    checkpoints = run_dir / "checkpoints"
    start_step = _newest_step(checkpoints)
    if start_step >= segment.end_step:  # the previous group's last step in progress ran past this segment
        return _GroupResult(segment, start_step, [], "skipped", 0.0, None)
    name = f"segment-{segment.index:02d}"
    history = run_dir / "history" / f"{name}.jsonl"
    log = run_dir / "logs" / f"{name}.log"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={segment.processes}",
        "--nnodes=1",
        "--max-restarts=0",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=localhost:{_free_port()}",
        "-m",
        "torchfold",
        "train",
        *train_args,
        "--checkpoint-dir",
        str(checkpoints),
        "--checkpoint-every",
        "1",
        "--history",
        str(history),
    ]
    last = segment.end_step >= final_step  # runs to --max-steps by itself
    began = time.monotonic()
    signalled = False
    with log.open("wb") as out:
        out.write(("$ " + " ".join(command) + "\n").encode())
        out.flush()
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=_env(), start_new_session=True
        )
        try:
            while process.poll() is None:
                elapsed = time.monotonic() - began
                if elapsed > segment_timeout:
                    _kill_group(process)
                    raise ElasticRunError(
                        f"{label}: the group did not finish its steps within --segment-timeout "
                        f"{segment_timeout:g} s (newest checkpoint: step {_newest_step(checkpoints)}); killed it. "
                        f"Log {log}:{_log_tail(log)}"
                    )
                done = _newest_step(checkpoints)
                # The signal goes out while the group runs its last planned step (it has run one step
                # at least, so it is past start-up): it finishes that step, checkpoints and exits.
                if not last and not signalled and done > start_step and done >= segment.end_step - 1:
                    process.send_signal(signal.SIGTERM)  # to the agent, which forwards it to its workers
                    signalled = True
                    try:
                        process.wait(timeout=stop_timeout)
                    except subprocess.TimeoutExpired:
                        _kill_group(process)
                        raise ElasticRunError(
                            f"{label}: the group did not exit within --stop-timeout {stop_timeout:g} s after "
                            f"SIGTERM; killed it. Log {log}:{_log_tail(log)}"
                        ) from None
                    break
                time.sleep(0.01)  # a short poll keeps the overrun past a segment small
        finally:
            if process.poll() is None:  # an error or Ctrl-C in this command itself: leave no process behind
                _kill_group(process)
    seconds = time.monotonic() - began
    rows = _read_history(history)
    end = _newest_step(checkpoints)
    expected_end = rows[-1]["step"] + 1 if rows else start_step
    if process.returncode != 0 and not signalled:
        raise ElasticRunError(
            f"{label}: the group exited with status {process.returncode} before its last step. Log {log}:"
            f"{_log_tail(log)}"
        )
    if end != expected_end or (rows and rows[0]["step"] != start_step):
        ran = f"steps {rows[0]['step']}..{rows[-1]['step']}" if rows else "no step"
        # On SIGTERM, `train` finishes the step in progress, checkpoints it and exits (status 75):
        # its history and checkpoints then end at the same step. Killed workers leave them apart.
        raise ElasticRunError(
            f"{label}: the group resumed at step {start_step} and its history shows {ran}, but the newest "
            f"checkpoint is step {end}; a group must checkpoint every step it runs and record it before it "
            f"exits (status {process.returncode}{' after SIGTERM' if signalled else ''}: were its workers "
            f"killed instead of stopping after the step?). Log {log}:{_log_tail(log)}"
        )
    return _GroupResult(
        segment, start_step, rows, "preempted" if signalled else "finished", seconds, process.returncode
    )


def _run_reference(train_args: list[str], run_dir: Path, final_step: int, timeout: float) -> Path:
    """One uninterrupted process on the same steps; returns its final checkpoint."""
    directory = run_dir / "reference"
    log = run_dir / "logs" / "reference.log"
    command = [
        sys.executable,
        "-m",
        "torchfold",
        "train",
        *train_args,
        "--checkpoint-dir",
        str(directory),
        "--history",
        str(run_dir / "history" / "reference.jsonl"),
    ]
    env = _env()
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # one process, even when this command itself runs under a launcher
    with log.open("wb") as out:
        out.write(("$ " + " ".join(command) + "\n").encode())
        out.flush()
        try:
            subprocess.run(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout, check=True
            )
        except subprocess.TimeoutExpired:
            raise ElasticRunError(
                f"reference run: no result within {timeout:g} s (--segment-timeout). Log {log}:{_log_tail(log)}"
            ) from None
        except subprocess.CalledProcessError as e:
            raise ElasticRunError(
                f"reference run: exited with status {e.returncode}. Log {log}:{_log_tail(log)}"
            ) from None
    step = _newest_step(directory)
    if step != final_step:
        raise ElasticRunError(
            f"reference run: ended at step {step}, expected {final_step}. Log {log}:{_log_tail(log)}"
        )
    from torchfold.train.loop.checkpoint import checkpoint_path

    return checkpoint_path(directory, step)


def compare_parameters(elastic: Path, reference: Path) -> tuple[float, int, bool]:
    """``(max abs difference, number of values, within float summation-order tolerance)`` of two checkpoints' models.

    The tolerance is :func:`torch.testing.assert_close`'s default for the parameters' dtype
    (float64: ``rtol=1e-7, atol=1e-7``).
    """
    import torch

    from torchfold.train.loop.checkpoint import load_checkpoint

    ours, theirs = load_checkpoint(elastic)["model"], load_checkpoint(reference)["model"]
    if ours.keys() != theirs.keys():
        raise ElasticRunError(
            f"{elastic} and {reference} hold different parameters: {sorted(ours)} vs {sorted(theirs)}"
        )
    diff, count = 0.0, 0
    for name, value in ours.items():
        diff = max(diff, (value - theirs[name]).abs().max().item() if value.numel() else 0.0)
        count += value.numel()
    try:
        torch.testing.assert_close(ours, theirs)
        close = True
    except AssertionError:
        close = False
    return diff, count, close


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def main(argv: Sequence[str]) -> int:
    """Run ``elastic run`` with ``argv`` (the arguments after ``elastic``); return the exit status.

    ``elastic replay``, the command's earlier name, still runs it (a hidden alias, for this release
    only) after one line on stderr that names the new one.
    """
    argv = list(argv)
    if argv[:1] == [_OLD_NAME]:
        print(_RENAMED, file=sys.stderr)
        argv[0] = "run"
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse exits on --help and on usage errors; report it as a status
        return e.code if isinstance(e.code, int) else 2
    try:
        return _run_elastic(args, extra)
    except (ValueError, FileNotFoundError) as e:  # bad arguments or input files
        print(f"torchfold elastic run: error: {e}", file=sys.stderr)
        return 2
    except (ElasticRunError, OSError) as e:
        print(f"torchfold elastic run: error: {e}", file=sys.stderr)
        return 1


def _run_elastic(args: argparse.Namespace, extra: list[str]) -> int:
    sst = args.task is None  # the sst task, with this command's --data, --max-train, ... options
    if sst and args.data is None and not os.environ.get(ENV_VAR) and "--generate" not in extra:
        raise ValueError(
            f"no training data: pass --data DIR (SST's train.txt, or an sst/ subdirectory) or set ${ENV_VAR}=DIR; "
            "or pass train's --generate N after --"
        )
    source = args.availability
    intervals = read_availability(source)
    step_time = args.step_time
    if step_time is None:
        step_time = statistics.median(i.end_time - i.start_time for i in intervals)
    schedule = elastic_schedule(
        intervals,
        step_time=step_time,
        max_processes=args.max_processes,
        max_steps=args.max_steps,
        source=source,
    )
    run_dir = Path(args.run_dir)
    if _newest_step(run_dir / "checkpoints") or _newest_step(run_dir / "reference"):
        raise ValueError(
            f"--run-dir {run_dir} already holds checkpoints of a run; use a new --run-dir or delete {run_dir}"
        )
    final_step = schedule.num_steps
    if args.trace is not None:
        trace = BatchSizeTrace.parse(args.trace)
        if trace.num_steps is not None and trace.num_steps < final_step:
            raise ValueError(
                f"--trace {args.trace} has {trace.num_steps} steps, the elastic run needs {final_step}; "
                f"use a longer trace, or --max-steps {trace.num_steps}"
            )
    train_args = [
        "--trace",
        str(args.global_batch) if args.trace is None else args.trace,
        *("--max-device-batch-size", str(args.max_device_batch_size)),
        *(
            (
                "--max-train",
                str(args.max_train),
                "--max-words",
                str(args.max_words),
                "--embedding-dim",
                str(args.hidden_dim),
                "--hidden-dim",
                str(args.hidden_dim),
            )
            if sst
            else ("--task", args.task)
        ),
        *(arg for item in args.task_arg for arg in ("--task-arg", item)),
        "--lr",
        str(args.lr),
        "--seed",
        str(args.seed),
        "--max-steps",
        str(final_step),
        "--dtype",
        "float64",
        "--workers",
        "0",
        "--threads",
        "1",
        "--log-every",
        "0",
        "--no-progress",
        *(["--data", args.data] if args.data is not None and sst else []),
        *extra,
    ]
    for folder in ("checkpoints", "history", "logs"):
        (run_dir / folder).mkdir(parents=True, exist_ok=True)
    groups, pauses = schedule.groups, schedule.pauses
    print(
        f"elastic run of {source}: {final_step} steps of {step_time:g} trace s, peak {schedule.peak_devices} devices "
        f"-> {args.max_processes} processes; {_count(len(groups), 'group')}, {_count(len(pauses), 'pause')}; run folder {run_dir}",
        flush=True,
    )
    no_picture = plot_unavailable()
    if no_picture is not None:  # said before the training, not found after it
        print(f"elastic.png will not be drawn: {no_picture}", flush=True)
    results: list[_GroupResult] = []
    segment_rows: list[dict[str, Any]] = []
    for segment in schedule.segments:
        label = (
            f"segment {segment.index} (pause)"
            if segment.is_pause
            else f"segment {segment.index} ({segment.processes} process{'' if segment.processes == 1 else 'es'}, planned steps "
            f"{segment.first_step}..{segment.end_step - 1})"
        )
        if segment.is_pause:
            time.sleep(args.pause_seconds)
            print(
                f"{label}: no device from trace time {segment.start_time:g} s to {segment.end_time:g} s; "
                f"paused {args.pause_seconds:g} s with no process running",
                flush=True,
            )
            segment_rows.append(
                {
                    "segment": segment.index,
                    "kind": "pause",
                    "processes": 0,
                    "planned_first_step": segment.first_step,
                    "planned_end_step": segment.end_step,
                    "first_step": "",
                    "end_step": "",
                    "trace_start_s": segment.start_time,
                    "trace_end_s": segment.end_time,
                    "wall_s": f"{args.pause_seconds:.2f}",
                    "stop": "pause",
                }
            )
            continue
        result = _run_group(
            segment,
            train_args,
            run_dir,
            final_step=final_step,
            segment_timeout=args.segment_timeout,
            stop_timeout=args.stop_timeout,
            label=label,
        )
        results.append(result)
        ran = (
            f"ran steps {result.rows[0]['step']}..{result.rows[-1]['step']}" if result.rows else "ran no step"
        )
        print(
            f"{label}: resumed at step {result.first_step}, {ran}, {result.stop} ({result.wall_seconds:.1f} s)",
            flush=True,
        )
        segment_rows.append(
            {
                "segment": segment.index,
                "kind": "group",
                "processes": segment.processes,
                "planned_first_step": segment.first_step,
                "planned_end_step": segment.end_step,
                "first_step": result.first_step,
                "end_step": result.first_step + len(result.rows),
                "trace_start_s": segment.start_time,
                "trace_end_s": segment.end_time,
                "wall_s": f"{result.wall_seconds:.2f}",
                "stop": result.stop,
            }
        )
    with (run_dir / "segments.csv").open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(segment_rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(segment_rows)
    ran_by: dict[int, tuple[_GroupResult, dict[str, Any]]] = {}
    for result in results:
        for row in result.rows:
            ran_by[row["step"]] = (result, row)
    missing = [s.step for s in schedule.steps if s.step not in ran_by]
    if missing:
        raise ElasticRunError(f"steps {missing[:5]}{'...' if len(missing) > 5 else ''} were run by no group")
    reference_loss: dict[int, float] = {}
    reference: Path | None = None
    if not args.no_reference:
        reference = _run_reference(train_args, run_dir, final_step, args.segment_timeout)
        reference_loss = {
            r["step"]: r["loss"] for r in _read_history(run_dir / "history" / "reference.jsonl")
        }
    rows = []
    for planned in schedule.steps:
        result, row = ran_by[planned.step]
        rows.append(
            {
                "step": planned.step,
                "trace_time_s": planned.trace_time,
                "devices": planned.devices,
                "planned_processes": planned.processes,
                "processes": result.segment.processes,
                "global_batch": row["batch_size"],
                "accumulation_minibatches": row["local_minibatches"],
                "lr": row["lr"],
                "loss": row["loss"],
                "reference_loss": reference_loss.get(planned.step, ""),
                "segment": result.segment.index,
            }
        )
    _write_csv(run_dir / "steps.csv", rows)
    print(f"written: {run_dir / 'steps.csv'}, {run_dir / 'segments.csv'}", flush=True)
    restarts = sum(1 for r in results if r.rows) - 1
    close = True
    if reference is not None:  # the result first: nothing after it can hide it
        from torchfold.train.loop.checkpoint import checkpoint_path

        diff, count, close = compare_parameters(
            checkpoint_path(run_dir / "checkpoints", final_step), reference
        )
        verdict = (
            "within float64 summation-order tolerance (assert_close: rtol 1e-07, atol 1e-07)"
            if close
            else "NOT within float64 summation-order tolerance (assert_close: rtol 1e-07, atol 1e-07)"
        )
        print(
            f"parameters after step {final_step}: elastic run ({_count(restarts, 'restart')}, {_count(len(pauses), 'pause')}) vs one "
            f"uninterrupted process: max abs difference {diff:.3g} over {count} values; {verdict}",
            flush=True,
        )
    if no_picture is None:
        plot_elastic(
            run_dir / "elastic.png",
            intervals,
            schedule,
            rows,
            [r.first_step for r in results[1:] if r.rows],  # where a restarted group resumed
            f"{Path(source).name}: {final_step} steps, {_count(restarts, 'restart')}, {_count(len(pauses), 'pause')}",
        )
        print(f"written: {run_dir / 'elastic.png'}")
    else:
        print(f"elastic.png not drawn: {no_picture}")
    return 0 if close else 1
