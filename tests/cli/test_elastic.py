"""``python -m torchfold elastic run``: the schedule as pure functions, bad input, and real elastic runs."""

from __future__ import annotations

import csv
import itertools
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchfold.cli.elastic import CSV_COLUMNS, elastic_schedule, main, processes_for
from torchfold.train.loop.checkpoint import checkpoint_path, load_checkpoint
from torchfold.train.schedule.availability import AvailabilityInterval, read_availability
from torchfold.train.schedule.trace import BatchSizeTrace

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str, name: str = "gpus.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def intervals(*rows: tuple[float, int]) -> list[AvailabilityInterval]:
    """Intervals from ``(start_time, devices)`` rows; each ends where the next starts, the last after 10 s."""
    ends = [start for start, _ in rows[1:]] + [rows[-1][0] + 10]
    return [
        AvailabilityInterval(start, end, devices, line)
        for line, ((start, devices), end) in enumerate(zip(rows, ends, strict=True), 2)
    ]


# -- processes_for ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("devices", "peak", "max_processes", "expected"),
    [
        (0, 56, 3, 0),
        (1, 56, 3, 1),  # any device keeps one process
        (18, 56, 3, 1),
        (19, 56, 3, 2),
        (37, 56, 3, 2),
        (38, 56, 3, 3),
        (56, 56, 3, 3),
        (120, 120, 1, 1),
        (3, 3, 3, 3),
        (1, 3, 3, 1),
    ],
)
def test_processes_for(devices: int, peak: int, max_processes: int, expected: int) -> None:
    assert processes_for(devices, peak, max_processes) == expected


def test_processes_for_errors() -> None:
    with pytest.raises(ValueError, match="devices=57 is more than peak_devices=56"):
        processes_for(57, 56, 3)
    with pytest.raises(ValueError, match="max_processes must be a positive int, got 0"):
        processes_for(1, 56, 0)
    with pytest.raises(TypeError, match="devices must be an int"):
        processes_for(True, 56, 3)


# -- elastic_schedule -----------------------------------------------------------------------------------


def test_schedule_follows_processes_and_pauses() -> None:
    # 4 of 6 devices -> 2 processes, 6 -> 3, none -> pause, 2 -> 1 (steps every 10 s).
    schedule = elastic_schedule(intervals((0, 4), (30, 6), (50, 0), (70, 2)), step_time=10, max_processes=3)
    assert [(s.processes, s.first_step, s.end_step) for s in schedule.segments] == [
        (2, 0, 3),
        (3, 3, 5),
        (0, 5, 5),
        (1, 5, 6),
    ]
    assert [s.processes for s in schedule.steps] == [2, 2, 2, 3, 3, 1]
    assert [s.devices for s in schedule.steps] == [4, 4, 4, 6, 6, 2]
    assert [s.trace_time for s in schedule.steps] == [0, 10, 20, 30, 40, 70]
    assert [s.line for s in schedule.steps] == [2, 2, 2, 3, 3, 5]
    pause = schedule.pauses[0]
    assert (pause.is_pause, pause.num_steps, pause.start_time, pause.end_time) == (True, 0, 50, 70)
    assert schedule.peak_devices == 6 and schedule.num_steps == 6 and len(schedule.groups) == 3


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        # Device counts that map to the same process count make one group (no restart).
        ([(0, 5), (20, 6), (40, 5)], [(3, 0, 5)]),
        # A pause between two groups of the same size still restarts: no process survives it.
        ([(0, 6), (20, 0), (40, 6)], [(3, 0, 2), (0, 2, 2), (3, 2, 3)]),
        # A trace that starts without devices starts with a pause; one that ends so drops it.
        ([(0, 0), (20, 6), (40, 0)], [(0, 0, 0), (3, 0, 2)]),
        # An interval holding no step's start (21..26 s, steps start every 10 s) is not seen.
        ([(0, 6), (21, 0), (26, 6)], [(3, 0, 4)]),
        # Consecutive pauses merge.
        ([(0, 6), (20, 0), (30, 0), (40, 2)], [(3, 0, 2), (0, 2, 2), (1, 2, 3)]),
    ],
)
def test_schedule_segments(rows: list[tuple[float, int]], expected: list[tuple[int, int, int]]) -> None:
    schedule = elastic_schedule(intervals(*rows), step_time=10, max_processes=3)
    assert [(s.processes, s.first_step, s.end_step) for s in schedule.segments] == expected
    assert [s.index for s in schedule.segments] == list(range(len(expected)))


def test_schedule_max_steps_cuts_and_drops_what_follows() -> None:
    schedule = elastic_schedule(
        intervals((0, 6), (30, 0), (50, 2)), step_time=10, max_processes=3, max_steps=2
    )
    assert [(s.processes, s.first_step, s.end_step) for s in schedule.segments] == [(3, 0, 2)]
    schedule = elastic_schedule(
        intervals((0, 6), (30, 0), (50, 2)), step_time=10, max_processes=3, max_steps=4
    )
    assert [(s.processes, s.first_step, s.end_step) for s in schedule.segments] == [
        (3, 0, 3),
        (0, 3, 3),
        (1, 3, 4),
    ]


def test_schedule_steps_match_the_batch_size_trace(tmp_path: Path) -> None:
    # The elastic run's steps are from_availability's: with 1 sample per device, batch size == devices.
    path = write(tmp_path, ",Time,GPUs\n0,100.0,2\n1,110.0,0\n2,120.0,4\n3,125.5,1\n4,126.0,3\n5,140,0\n")
    schedule = elastic_schedule(read_availability(path), step_time=4, max_processes=2)
    trace = BatchSizeTrace.from_availability(path, per_device_batch=1, step_time=4)
    assert [s.devices for s in schedule.steps] == list(trace)
    assert [s.processes for s in schedule.steps] == [1, 1, 1, 2, 2, 2, 2, 2]


@pytest.mark.parametrize(
    ("rows", "kwargs", "message"),
    [
        ([(0, 0), (10, 0)], {}, "no device is available at any time (all 2 intervals have 0 devices)"),
        ([(0, 0), (11, 3), (12, 0)], {}, "no step fits: no interval with devices > 0 holds the start"),
        ([(0, 3)], {"step_time": 0}, "step_time should be a positive number of seconds, got 0"),
        ([(0, 3)], {"max_processes": 0}, "max_processes must be a positive int, got 0"),
        ([(0, 3)], {"max_steps": 0}, "max_steps must be a positive int, got 0"),
    ],
)
def test_schedule_errors(rows: list[tuple[float, int]], kwargs: dict[str, float], message: str) -> None:
    settings = {"step_time": 10.0, "max_processes": 3, **kwargs}
    with pytest.raises(ValueError, match=re.escape(message)):
        elastic_schedule(intervals(*rows), source="t.csv", **settings)  # type: ignore[arg-type]


def test_schedule_of_the_a100_trace(traces_dir: Path) -> None:
    path = traces_dir / "gcp_a100_gpus.csv"
    schedule = elastic_schedule(read_availability(path), step_time=63, max_processes=3, source=str(path))
    devices = [int(line.split(",")[2]) for line in path.read_text().splitlines()[1:-1]]
    assert schedule.num_steps == sum(1 for d in devices if d > 0)  # one step per row with devices
    assert schedule.peak_devices == max(devices) == 56
    assert {s.processes for s in schedule.steps} <= {1, 2, 3}
    for step in schedule.steps:
        assert step.processes == math.ceil(step.devices * 3 / 56)
    groups = schedule.groups
    assert all(a.end_step == b.first_step for a, b in itertools.pairwise(groups))
    assert groups[-1].end_step == schedule.num_steps


# -- bad input on the command line -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "args", "message"),
    [
        (",Time,GPUs\n0,0,0\n1,60,0\n2,120,0\n", [], "no device is available at any time"),
        (
            ",Time,GPUs\n0,0,2\n1,60,x\n",
            [],
            "gpus.csv, line 3: device count should be an integer >= 0, got 'x'",
        ),
        (
            ",Time,GPUs\n0,0,2\n1,60,2\n",
            ["--max-device-batch-size", "0"],
            "--max-device-batch-size: must be a positive integer, got 0",
        ),
        (
            ",Time,GPUs\n0,0,2\n1,60,2\n",
            ["--max-processes", "-1"],
            "--max-processes: must be a positive integer, got -1",
        ),
        (
            ",Time,GPUs\n0,0,2\n1,60,2\n",
            ["--step-time", "0"],
            "--step-time: must be a positive number, got 0.0",
        ),
        (",Time,GPUs\n0,0,2\n1,60,2\n", ["--global-batch", "8", "--trace", "8"], "not allowed with argument"),
        (
            ",Time,GPUs\n0,0,2\n1,60,2\n",
            ["--step-time", "10", "--trace", "constant:48:3"],
            "--trace constant:48:3 has 3 steps, the elastic run needs 6; use a longer trace, or --max-steps 3",
        ),
    ],
)
def test_bad_input_is_one_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, args: list[str], message: str
) -> None:
    path = write(tmp_path, text)
    status = main(["run", "--availability", str(path), "--run-dir", str(tmp_path / "run"), *args])
    err = capsys.readouterr().err
    assert status == 2
    assert message in err
    assert not (tmp_path / "run").exists()  # nothing started


def test_missing_file_and_used_run_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--availability", str(tmp_path / "no.csv"), "--run-dir", str(tmp_path)]) == 2
    assert "no.csv" in capsys.readouterr().err
    path = write(tmp_path, ",Time,GPUs\n0,0,2\n1,60,2\n")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step-00000004.pt").write_bytes(b"")
    assert main(["run", "--availability", str(path), "--run-dir", str(tmp_path / "run")]) == 2
    assert "already holds checkpoints of a run; use a new --run-dir" in capsys.readouterr().err


def test_elastic_command_is_listed(capsys: pytest.CaptureFixture[str]) -> None:
    from torchfold.cli import main as cli

    assert cli(["--help"]) == 0
    assert "elastic" in capsys.readouterr().out
    assert cli(["elastic", "run", "--help"]) == 0
    captured = capsys.readouterr()
    assert "--max-device-batch-size" in captured.out and captured.err == ""
    assert cli(["elastic", "--help"]) == 0
    out = capsys.readouterr().out
    assert "{run}" in out and "replay" not in out  # the earlier name is a hidden alias


def test_the_earlier_name_still_runs_and_says_it_was_renamed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from torchfold.cli import main as cli

    # The same missing trace through both names (past the parser, into the command itself): the
    # same error, under the new name, after the line that names it.
    args = ["--availability", str(tmp_path / "no.csv"), "--run-dir", str(tmp_path / "run"), "--data", "sst"]
    assert cli(["elastic", "run", *args]) == 2
    new = capsys.readouterr().err
    assert cli(["elastic", "replay", *args]) == 2
    old = capsys.readouterr().err
    renamed = "torchfold elastic replay was renamed: use torchfold elastic run\n"
    assert new.startswith("torchfold elastic run: error: ") and "no.csv" in new, new
    assert old == renamed + new, old
    assert cli(["elastic", "replay", "--help"]) == 0
    captured = capsys.readouterr()
    assert captured.err == renamed and "usage: python -m torchfold elastic run" in captured.out


# -- real elastic runs -----------------------------------------------------------------------------

SMALL = ["--max-train", "120", "--max-words", "10", "--hidden-dim", "16", "--global-batch", "24"]


def elastic_run(
    tmp_path: Path, text: str, *args: str, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    path = write(tmp_path, text)
    command = [
        sys.executable,
        "-m",
        "torchfold",
        "elastic",
        "run",
        "--availability",
        str(path),
        "--run-dir",
        str(tmp_path / "run"),
        *SMALL,
        "--pause-seconds",
        "0.5",
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO)


@pytest.mark.slow
def test_a_failing_group_is_named(tmp_path: Path) -> None:
    result = elastic_run(
        tmp_path,
        ",Time,GPUs\n0,0,1\n1,30,1\n",
        "--step-time",
        "10",
        "--max-processes",
        "1",
        "--",
        "--no-such-option",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "segment 0 (1 process, planned steps 0..2): the group exited with status" in result.stderr
    assert "segment-00.log" in result.stderr and "--no-such-option" in result.stderr


@pytest.mark.slow
def test_a_hanging_group_is_killed_and_named(tmp_path: Path) -> None:
    result = elastic_run(
        tmp_path,
        ",Time,GPUs\n0,0,1\n1,30,1\n",
        "--step-time",
        "10",
        "--max-processes",
        "1",
        "--segment-timeout",
        "2",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert (
        "segment 0 (1 process, planned steps 0..2): the group did not finish its steps within "
        "--segment-timeout 2 s" in result.stderr
    )


@pytest.mark.slow
def test_without_matplotlib_the_elastic_run_says_so_first_and_still_compares(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # matplotlib unimportable in this process (the groups, other processes, never import it)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    path = write(tmp_path, ",Time,GPUs\n0,0,1\n1,10,1\n")
    run = tmp_path / "run"
    argv = [
        "run",
        "--availability",
        str(path),
        "--run-dir",
        str(run),
        *SMALL,
        "--step-time",
        "10",
        "--max-processes",
        "1",
    ]
    assert main(argv) == 0, capsys.readouterr()
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("elastic.png will not be drawn: matplotlib could not be imported"), lines
    assert "pip install 'pytorch-fold[plot]'" in lines[1]
    [result] = [line for line in lines if line.startswith("parameters after step 1: ")]
    assert "within float64 summation-order tolerance" in result
    assert lines[-1].startswith("elastic.png not drawn: matplotlib could not be imported"), lines
    assert (run / "steps.csv").is_file() and not (run / "elastic.png").exists()


@pytest.mark.slow
def test_two_three_pause_one_matches_one_process(tmp_path: Path) -> None:
    # 10 s per step: 4 of 6 devices (2 processes) for 4 steps, 6 (3) for 4, none for 2 step
    # times, then 1 device (1 process) for 4 steps.
    text = ",Time,GPUs\n0,1000,4\n1,1040,6\n2,1080,0\n3,1100,1\n4,1140,1\n"
    result = elastic_run(tmp_path, text, "--step-time", "10", "--max-device-batch-size", "4", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    run = tmp_path / "run"
    [result_line] = [
        line for line in result.stdout.splitlines() if line.startswith("parameters after step 12: ")
    ]
    assert "within float64 summation-order tolerance" in result_line

    with (run / "steps.csv").open() as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames or ()) == CSV_COLUMNS
        rows = list(reader)
    assert [int(r["step"]) for r in rows] == list(range(12))
    planned = [2] * 4 + [3] * 4 + [1] * 4
    assert [int(r["planned_processes"]) for r in rows] == planned
    assert [float(r["trace_time_s"]) for r in rows] == [10.0 * k for k in range(8)] + [
        100.0 + 10 * k for k in range(4)
    ]
    used = [int(r["processes"]) for r in rows]
    # A group stops after the step it runs when SIGTERM reaches it. On a loaded machine it may
    # have run past its segment by then: those steps are the previous group's, from a segment's
    # first step on, with no gap.
    for k, (p, q) in enumerate(zip(used, planned, strict=True)):
        if p != q:
            start = max(b for b in (0, 4, 8) if b <= k)
            assert start > 0 and all(used[j] == used[start - 1] for j in range(start, k + 1)), used
    for r in rows:  # accumulation minibatches follow the processes: ceil(global / (processes * 4))
        assert int(r["accumulation_minibatches"]) == math.ceil(
            int(r["global_batch"]) / (int(r["processes"]) * 4)
        )
        assert float(r["loss"]) == pytest.approx(float(r["reference_loss"]), rel=1e-9)

    with (run / "segments.csv").open() as f:
        segments = list(csv.DictReader(f))
    expected = [
        ("group", "2", "preempted"),
        ("group", "3", "preempted"),
        ("pause", "0", "pause"),
        ("group", "1", "finished"),
    ]
    assert [(s["kind"], s["processes"]) for s in segments] == [e[:2] for e in expected]
    for s, (_, _, stop) in zip(segments, expected, strict=True):
        # the 3-process group finds nothing to run when the 2-process group overran all its steps
        assert s["stop"] == stop or (s["processes"] == "3" and s["stop"] == "skipped" and 3 not in used), (
            segments
        )
    for history in sorted((run / "history").glob("segment-*.jsonl")):  # num_replicas, once the rows have it
        group = segments[int(history.stem.split("-")[1])]
        for line in history.read_text().splitlines():
            assert json.loads(line).get("num_replicas", int(group["processes"])) == int(group["processes"])

    assert (run / "elastic.png").read_bytes().startswith(b"\x89PNG")
    ours = load_checkpoint(checkpoint_path(run / "checkpoints", 12))["model"]
    theirs = load_checkpoint(checkpoint_path(run / "reference", 12))["model"]
    torch.testing.assert_close(ours, theirs)
