"""`python -m torchfold train`'s flags for what the Python trainer has: --precision, --max-grad-norm,
--tensorboard and --eval-every, run for real on the SST sample in tests/data, a few steps each."""

from __future__ import annotations

import builtins
import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from _train_cli import run_train, write_sst

from torchfold.train.loop.checkpoint import load_checkpoint

# 24 training trees of at most ten words, 20 dev trees to evaluate on, steps of 12 in minibatches of 6
QUICK = [
    *("--max-train", "24", "--max-words", "10", "--task-arg", "max_eval=20", "--minibatch-size", "6"),
    *("--hidden-dim", "4", "--embedding-dim", "4", "--no-progress", "--log-every", "0", "--workers", "0"),
]


def _run(data_dir: Path, *extra: str) -> list[str]:
    return ["--trace", "12", "--data", str(data_dir), *QUICK, *extra]


def _losses(history: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in history.read_text().splitlines()]


def test_precision_bf16_runs_the_steps_under_autocast(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = {}
    for precision in ("fp32", "bf16"):
        history = tmp_path / f"{precision}.jsonl"
        args = _run(data_dir, "--max-steps", "3", "--precision", precision, "--history", str(history))
        code, out, err = run_train(args, capsys)
        assert code == 0 and "eval: root_accuracy " in out, err
        runs[precision] = _losses(history)
    fp32, bf16 = runs["fp32"], runs["bf16"]
    assert all(math.isfinite(loss) for loss in bf16) and len(bf16) == 3
    assert bf16 != fp32  # bfloat16's rounding shows in the losses: the flag reached the steps
    assert bf16 == pytest.approx(fp32, rel=0.02)  # and the same model trains


def test_precision_fp16_on_the_cpu_is_a_usage_error_naming_the_flag(
    data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _out, err = run_train(
        _run(data_dir, "--max-steps", "1", "--precision", "fp16", "--device", "cpu"), capsys
    )
    assert code == 2, err
    [line] = err.splitlines()
    assert line.startswith("torchfold train: error: --precision fp16 needs a CUDA device"), line
    assert "use --precision bf16" in line and "precision=" not in line, line


def test_max_grad_norm_clips_every_update_to_that_norm(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Plain SGD with lr 1: an update is minus the step's (clipped) gradient, so the parameters move
    # by exactly --max-grad-norm between two checkpoints; unclipped they move by the gradient's norm.
    ck = tmp_path / "ck"
    sgd = ("--optimizer", "sgd", "--momentum", "0", "--lr", "1")
    keep = ("--checkpoint-dir", str(ck), "--checkpoint-every", "1", "--keep-checkpoints", "3")
    code, _out, err = run_train(
        _run(data_dir, "--max-steps", "3", *sgd, *keep, "--max-grad-norm", "0.001"), capsys
    )
    assert code == 0, err
    models = [load_checkpoint(ck / f"step-0000000{n}.pt")["model"] for n in (1, 2, 3)]
    for before, after in itertools.pairwise(models):
        moved = torch.cat([(after[name] - before[name]).flatten().double() for name in before]).norm()
        assert float(moved) == pytest.approx(1e-3, rel=1e-3)


def test_tensorboard_gets_the_log_lines_and_eval_every_s_evaluations(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("tensorboard")  # the dev extra installs it
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board, history = tmp_path / "runs" / "a", tmp_path / "h.jsonl"
    args = _run(data_dir, "--max-steps", "4", "--eval-every", "2", "--tensorboard", str(board))
    args += ["--history", str(history)]
    args[args.index("--log-every") + 1] = "1"
    code, out, err = run_train(args, capsys)
    assert code == 0, err
    assert "eval at step 2 | root_accuracy " in out and "eval at step 4 | root_accuracy " in out, out
    events = EventAccumulator(str(board))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "eval/root_accuracy", "eval/node_accuracy"} <= scalars, scalars
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
    assert [e.step for e in events.Scalars("eval/node_accuracy")] == [2, 4]
    steps = [json.loads(line) for line in history.read_text().splitlines()]
    assert [bool(s["metrics"]) for s in steps] == [
        False,
        True,
        False,
        True,
    ]  # after steps 1 and 3: 2 and 4 done
    # the run's last line is the last evaluation's (step 4), not a second one
    node_accuracy = steps[-1]["metrics"]["node_accuracy"]
    [final] = [line for line in out.splitlines() if line.startswith("eval: ")]
    assert f"node_accuracy {node_accuracy:.4f}" in final, final
    assert events.Scalars("eval/node_accuracy")[-1].value == pytest.approx(node_accuracy)


def test_eval_every_for_a_task_without_an_evaluation_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train_only = write_sst(tmp_path, 24)  # a folder with train.txt only: no dev trees to evaluate on
    args = [
        "--trace",
        "12",
        "--data",
        str(train_only),
        "--max-steps",
        "1",
        "--workers",
        "0",
        "--eval-every",
        "2",
    ]
    code, _out, err = run_train(args, capsys)
    assert code == 2, err
    [line] = err.splitlines()
    assert line == (
        "torchfold train: error: --eval-every 2: task sst has no evaluation (its Task has no evaluate= and eval=); "
        "give it one, or drop --eval-every"
    )


def test_tensorboard_without_the_package_names_the_flag_and_the_extra(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_import = builtins.__import__

    def no_tensorboard(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("torch.utils.tensorboard"):
            raise ModuleNotFoundError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    board = tmp_path / "tb"
    code, _out, err = run_train(_run(data_dir, "--max-steps", "1", "--tensorboard", str(board)), capsys)
    assert code == 2, err
    [line] = err.splitlines()
    assert line.startswith(f"torchfold train: error: --tensorboard {board}: "), line
    assert "pip install 'pytorch-fold[tensorboard]'" in line, line
