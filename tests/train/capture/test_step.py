"""``captured_step`` (torchfold/train/capture/step.py) on the CPU: the model keeps the mode its user set."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import torchfold


class _Dropped(torch.nn.Module):
    """A leaf through a dropout: in train() half its values are zeroed, in eval() none."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))
        self.drop = torch.nn.Dropout(0.5)

    def leaf(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x.float().unsqueeze(1) * self.w)


def _loss(model: Any, outputs: list[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    return ((outputs[0].sum(1) - targets) ** 2).mean()


def _plan(values: list[int]) -> Any:
    fold = torchfold.Fold()
    return fold.plan([[fold.add("leaf", v) for v in values]])


STEPS = [[1, 2], [3, 1, 2], [2, 2]]


def test_a_model_in_eval_stays_in_eval_and_runs_without_dropout() -> None:
    torch.manual_seed(0)
    model = _Dropped().eval()
    step = torchfold.train.captured_step(model, _loss, torch.optim.SGD(model.parameters(), lr=0.01))
    losses = []
    for values in STEPS:
        losses.append(float(step([(_plan(values), torch.tensor(values, dtype=torch.float), len(values))])))
        assert not model.training and not model.drop.training
    reference = _Dropped().eval()
    expected, weights = _eager_plain(reference, STEPS)
    assert losses == pytest.approx(expected, rel=1e-6)
    torch.testing.assert_close(model.w.detach(), weights)


def test_a_model_in_train_stays_in_train_and_the_mode_may_change_between_steps() -> None:
    torch.manual_seed(0)
    model = _Dropped()
    step = torchfold.train.captured_step(model, _loss, torch.optim.SGD(model.parameters(), lr=0.01))
    step([(_plan([1, 2]), torch.tensor([1.0, 2.0]), 2)])
    assert model.training
    model.eval()
    step([(_plan([1, 2]), torch.tensor([1.0, 2.0]), 2)])
    assert not model.training
    model.train()
    step([(_plan([1, 2]), torch.tensor([1.0, 2.0]), 2)])
    assert model.training


def _eager_plain(model: _Dropped, steps: list[list[int]]) -> tuple[list[float], torch.Tensor]:
    """The same steps with no fold at all: each sample's leaf, summed, against its value."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for values in steps:
        optimizer.zero_grad()
        predictions = torch.stack([model.leaf(torch.tensor([v]))[0].sum() for v in values])
        loss = ((predictions - torch.tensor(values, dtype=torch.float)) ** 2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.w.detach().clone()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_step_returns_its_mean_loss_over_its_samples_with_either_reduction(reduction: str) -> None:
    """``reduction="sum"`` (a loss summed over the minibatch's samples) gives the same mean as "mean"."""

    def summed(model: Any, outputs: list[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        return ((outputs[0].sum(1) - targets) ** 2).sum()

    model = _Dropped().eval()
    optimizer = torchfold.train.AccumulatingOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0), reduction=reduction
    )
    step = torchfold.train.captured_step(model, _loss if reduction == "mean" else summed, optimizer)
    minibatches = [(_plan(values), torch.tensor(values, dtype=torch.float), len(values)) for values in STEPS]
    squared = [(4 * v - v) ** 2 for values in STEPS for v in values]  # outputs: 4 ones times v
    assert float(step(minibatches)) == pytest.approx(sum(squared) / len(squared), rel=1e-6)
