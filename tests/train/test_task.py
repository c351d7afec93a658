"""``Task`` (torchfold/train/task.py): its model made and checked, its evaluation run in eval mode."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from torchfold.train import Task


def _build(samples: Sequence[Any], shapes: Any = None) -> tuple[Any, Any]:
    raise AssertionError("not built here")


def _loss(model: Any, outputs: Any, targets: Any) -> torch.Tensor:
    return torch.zeros(())


def _task(model: Any, **kwargs: Any) -> Task:
    return Task("t", train=[1, 2], build=_build, model=model, loss=_loss, **kwargs)


def test_make_model_returns_the_module() -> None:
    assert isinstance(_task(lambda: torch.nn.Linear(1, 1)).make_model(), torch.nn.Linear)


def test_make_model_refuses_a_factory_that_needs_arguments_naming_the_fix() -> None:
    with pytest.raises(
        TypeError, match=r"task t: model\(\) failed: .*functools.partial\(MyModel, hidden_dim\)"
    ):
        _task(torch.nn.Linear).make_model()


def test_make_model_refuses_what_is_not_a_module() -> None:
    with pytest.raises(TypeError, match=r"task t: model\(\) returned a dict, not a torch.nn.Module"):
        _task(dict).make_model()


def test_evaluate_model_runs_in_eval_mode_without_grad_and_restores_the_mode() -> None:
    seen: list[tuple[bool, bool, int]] = []

    def evaluate(model: torch.nn.Module, samples: Sequence[Any]) -> dict[str, float]:
        seen.append((model.training, torch.is_grad_enabled(), len(samples)))
        return {"accuracy": 0.5}

    task = _task(lambda: torch.nn.Linear(1, 1), eval=[3, 4, 5], evaluate=evaluate)
    model = task.make_model().train()
    assert task.evaluate_model(model) == {"accuracy": 0.5}
    assert seen == [(False, False, 3)] and model.training
    assert task.evaluate_model(model.eval()) == {"accuracy": 0.5} and not model.training


def test_evaluate_model_without_evaluate_says_what_to_give() -> None:
    with pytest.raises(
        ValueError, match=r"task t has no evaluate; give Task\(\.\.\., evaluate=\.\.\., eval=\.\.\.\)"
    ):
        _task(lambda: torch.nn.Linear(1, 1)).evaluate_model(torch.nn.Linear(1, 1))
