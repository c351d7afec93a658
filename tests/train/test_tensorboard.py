"""The TensorBoard writer: a trainer's metrics as scalars in real event files, read back by TensorBoard."""

from __future__ import annotations

import builtins
from pathlib import Path
from typing import Any

import pytest
import torch
from _loop_worker import make_trainer, sst_trees

from torchfold.train.loop.tensorboard import TensorBoardWriter


def test_a_runs_log_lines_and_evaluations_reach_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")  # the dev extra installs it
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trees = sst_trees()
    with TensorBoardWriter(tmp_path / "run") as writer:
        trainer = make_trainer(
            trees,
            log_every=4,
            log=lambda line: None,
            on_metrics=writer,
            evaluate=lambda model, samples: {"answer": torch.tensor(42.0)},
            eval_every=6,
        )
        history = trainer.fit(max_steps=12)
    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"train/loss", "train/lr", "train/batch_size", "train/samples_per_s", "eval/answer"} <= set(
        scalars
    )
    assert [(e.step, e.value) for e in events.Scalars("eval/answer")] == [(6, 42.0), (12, 42.0)]
    losses = [e.value for e in events.Scalars("train/loss")]
    assert [e.step for e in events.Scalars("train/loss")] == [4, 8, 12]
    expected = sum(s.loss * s.batch_size for s in history[:4]) / sum(s.batch_size for s in history[:4])
    assert losses[0] == pytest.approx(expected, rel=1e-6)


def test_without_tensorboard_the_error_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    real_import = builtins.__import__

    def no_tensorboard(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("torch.utils.tensorboard"):
            raise ModuleNotFoundError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(ImportError, match=r"pip install 'pytorch-fold\[tensorboard\]'"):
        TensorBoardWriter(tmp_path)
