"""keep_hyperparameters: resuming refuses a checkpoint's other optimizer or hyperparameters, or keeps the run's."""

from __future__ import annotations

import pickle

import pytest
import torch

from torchfold.train.checkpoint import HyperparameterMismatch, keep_hyperparameters


def _saved(optimizer: torch.optim.Optimizer) -> dict[str, object]:
    return {"optimizer": optimizer.state_dict()}


def test_a_different_learning_rate_or_optimizer_is_refused_before_loading() -> None:
    model = torch.nn.Linear(2, 1)
    saved = _saved(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    run = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    with (
        pytest.raises(HyperparameterMismatch) as caught,
        keep_hyperparameters(saved, run, "checkpoint a.pt", override=["lr"]),
    ):
        pytest.fail("the block ran")
    assert (caught.value.name, caught.value.saved, caught.value.value) == ("momentum", 0.9, 0.5)
    assert str(caught.value) == (
        "checkpoint a.pt was written with momentum 0.9, this run has momentum 0.5; resume with momentum=0.9, or "
        "keep momentum=0.5 with keep_hyperparameters(override=['momentum'])"
    )
    assert str(pickle.loads(pickle.dumps(caught.value))) == str(caught.value)
    with (
        pytest.raises(
            HyperparameterMismatch, match="written with optimizer 'sgd', this run has optimizer 'adam'"
        ),
        keep_hyperparameters(saved, torch.optim.Adam(model.parameters(), lr=0.1), "checkpoint a.pt"),
    ):
        pass


def test_an_overridden_value_stays_after_loading_and_an_equal_one_is_not_reported() -> None:
    model = torch.nn.Linear(2, 1)
    saved = _saved(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    run = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    with keep_hyperparameters(saved, run, "checkpoint a.pt", override=["lr", "momentum"]) as kept:
        run.load_state_dict(saved["optimizer"])  # type: ignore[arg-type]
        assert run.param_groups[0]["lr"] == 0.1  # what loading alone does
    assert kept == {"lr": (0.1, 0.02)}
    assert (run.param_groups[0]["lr"], run.param_groups[0]["momentum"]) == (0.02, 0.9)
    with (
        pytest.raises(ValueError, match=r"override='lr'\): give a list of \['lr', 'momentum'\]"),
        keep_hyperparameters(saved, run, "checkpoint a.pt", override="lr"),
    ):
        pass
