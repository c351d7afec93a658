"""`python -m torchfold train --task`: a task written outside the package trains, resumes after a kill, runs under torchrun."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
from _external_task import MODULE, UNPADDED_SOURCE, write_task
from _train_cli import run_train

from torchfold.train.loop.checkpoint import list_checkpoints

REPO = Path(__file__).resolve().parents[2]
SPEC = f"{MODULE}:make_task"
QUICK = ["--trace", "12", "--minibatch-size", "6", "--no-progress", "--log-every", "0", "--workers", "0"]


@pytest.fixture
def task_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "user"
    folder.mkdir()
    write_task(folder)
    monkeypatch.syspath_prepend(str(folder))
    return folder


def _env(task_dir: Path) -> dict[str, str]:
    path = os.pathsep.join([str(task_dir), str(REPO), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def test_a_task_outside_the_package_trains_and_evaluates(
    task_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_train(["--task", SPEC, "--task-arg", "dim=6", "--max-steps", "4", *QUICK], capsys)
    assert code == 0, err
    assert "task parity: 48 digit sequences" in out
    assert "done: 4 steps (48 samples" in out
    assert "eval: accuracy " in out and "(16 held-out samples of task parity)" in out


def test_the_run_s_messages_count_samples_not_trees(
    task_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A task of digit sequences once heard of "epoch(s) of 48 trees"."""
    args = ["--task", SPEC, *QUICK]
    args[args.index("--trace") + 1] = "12,12,12,12,12"
    code, out, err = run_train(args, capsys)
    assert code == 0, err
    assert "they hold 1 complete epoch(s) of 48 samples, and the last 1 step(s)" in out, out
    assert "trees" not in out, out


def test_the_task_settings_guard_a_resume(
    task_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ck = ["--checkpoint-dir", str(tmp_path / "ck")]
    assert run_train(["--task", SPEC, "--max-steps", "2", *QUICK, *ck], capsys)[0] == 0
    code, _out, err = run_train(
        ["--task", SPEC, "--task-arg", "dim=5", "--max-steps", "3", *QUICK, *ck], capsys
    )
    assert code == 2, err
    assert "written with task parity's dim 8, this run has task parity's dim 5" in err


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--task", "no_such_module:make"], ["--task no_such_module:make: no module named", "PYTHONPATH"]),
        (["--task", "parity"], ["--task parity: not a built-in task (pyast, sst) nor MODULE:FUNCTION"]),
        (["--task", f"{MODULE}:make_tsak"], [f"did you mean {MODULE}:make_task?"]),
        (
            ["--task", f"{MODULE}:Chain", "--task-arg", "dim=4"],
            ["returned a Chain, not a torchfold.train.Task"],
        ),
        (["--task", SPEC, "--task-arg", "dims=4"], ["--task-arg dims=4: make_task", "did you mean dim?"]),
        (["--task", SPEC, "--task-arg", "dim=four"], ["--task-arg dim=four: make_task's dim is an int"]),
        (["--task", SPEC, "--task-arg", "dim"], ["--task-arg dim: expected KEY=VALUE"]),
        (["--task", SPEC, "--hidden-dim", "4"], ["--hidden-dim is an option of the built-in sst task"]),
    ],
)
def test_bad_task_specs_are_one_line_naming_the_value_and_the_fix(
    task_dir: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needles: list[str]
) -> None:
    code, _out, err = run_train([*argv, "--max-steps", "1", *QUICK], capsys)
    assert code == 2, err
    [line] = err.splitlines()
    assert line.startswith("torchfold train: error: "), line
    for needle in needles:
        assert needle in line, line


@pytest.mark.parametrize("compile_", ["off", "on"])
def test_targets_left_unpadded_are_refused_on_the_cpu_as_the_guide_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], compile_: str
) -> None:
    """The guide's task with ``return plan, (labels, weights)``: refused before the first step, on the
    CPU whether its plans are padded (--compile on) or not, in the words the guide shows."""
    write_task(tmp_path, "unpadded_parity", UNPADDED_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["--task", "unpadded_parity:make_task", "--max-steps", "2", "--compile", compile_, *QUICK]
    code, _out, err = run_train(argv, capsys)
    assert code == 2, err
    [line] = err.splitlines()
    assert line.startswith(
        "torchfold train: error: the targets of the loader's build have 6 rows (targets[0]) but the plan's "
        "padded batch has 16 (request 0: 6 nodes padded to 16 by static shapes"
    ), line
    assert "pad every per-node target in build with plan.pad(request=0, values=...)" in line
    if compile_ == "off":  # the guide's example: the CPU, eager
        assert line in (REPO / "docs" / "guide" / "your-model.md").read_text().splitlines()


def test_help_lists_the_built_in_tasks(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _err = run_train(["--help"], capsys)
    assert code == 0
    assert "sst (torchfold.examples.tasks:sst_task)" in " ".join(out.split())
    assert "pyast (torchfold.examples.tasks:pyast_task)" in " ".join(out.split())


def test_the_pyast_task_trains_on_a_folder_of_the_standard_library(
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = Path(sysconfig.get_paths()["stdlib"]) / "email"
    args = ["--task", "pyast", "--task-arg", f"root={root}", "--task-arg", "hidden_dim=8"]
    args += ["--task-arg", "embedding_dim=4", "--task-arg", "train_size=48", "--max-steps", "2", *QUICK]
    code, out, err = run_train(args, capsys)
    assert code == 0, err
    assert "task pyast: " in out and "label 'returns a value' (majority" in out
    assert "eval: accuracy " in out


@pytest.mark.slow
def test_a_task_outside_the_package_resumes_after_a_kill(task_dir: Path, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    command = [sys.executable, "-m", "torchfold", "train", "--task", SPEC, *QUICK]
    command += ["--checkpoint-dir", str(ck), "--checkpoint-every", "1"]
    first = subprocess.Popen([*command, "--max-steps", "100000"], env=_env(task_dir), cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while len(list_checkpoints(ck)) < 2 or list_checkpoints(ck)[-1][0] < 3:
            assert first.poll() is None, "the first run ended before it was killed"
            assert time.monotonic() < deadline, "the first run wrote no checkpoint"
            time.sleep(0.05)
    finally:
        first.send_signal(signal.SIGKILL)  # no chance to checkpoint or to release its lock
        first.wait(timeout=60)
    assert first.returncode == -signal.SIGKILL
    newest = list_checkpoints(ck)[-1][0]
    done = subprocess.run(
        [*command, "--max-steps", str(newest + 2)],
        env=_env(task_dir),
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert f"at step {newest}" in done.stdout and f"up to step {newest + 2}" in done.stdout, done.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_a_task_outside_the_package_runs_under_torchrun(task_dir: Path, tmp_path: Path) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--nnodes=1"]
    command += ["--max-restarts=0", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{_free_port()}"]
    command += ["-m", "torchfold", "train", "--task", SPEC, "--max-steps", "3", "--backend", "gloo", *QUICK]
    done = subprocess.run(
        command, env=_env(task_dir), cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 process(es), minibatch 6" in done.stdout, done.stdout
    assert "done: 3 steps (36 samples" in done.stdout, done.stdout


def test_the_demo_trains_a_task_outside_the_package(
    task_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from torchfold.cli.demo import main as demo

    args = ["--task", SPEC, "--task-arg", "dim=6", "--epochs", "2", "--batch-size", "8", "--no-progress"]
    assert demo(args) == 0
    out = capsys.readouterr().out
    assert "task parity: 48 digit sequences" in out
    assert "epoch 2: loss " in out and ", eval accuracy " in out
    assert demo(["--task", f"{MODULE}:nothing"]) == 2
    assert f"--task {MODULE}:nothing: module {MODULE} has no function" in capsys.readouterr().err


def test_bf16_trains_a_task_whose_leaves_are_an_embedding(capsys: pytest.CaptureFixture[str]) -> None:
    """``--precision bf16`` on a task whose leaves are an ``nn.Embedding`` (float32 rows) and whose
    ops are ``Linear`` (bfloat16 rows under autocast): a group holding both is joined promoted."""
    argv = ["--task", "_formula_task:make_task", "--max-steps", "3", "--precision", "bf16", *QUICK]
    code, out, err = run_train(argv, capsys)
    assert code == 0, err
    assert "done: 3 steps (36 samples" in out and "eval: accuracy " in out
