"""The trainer's argument and build checks, and the bounds of a fit (``train/loop/arguments.py``)."""

from __future__ import annotations

import warnings

import pytest
import torch

from torchfold.engine.static import StaticShapes
from torchfold.examples.datasets import Vocab, generate_sst
from torchfold.examples.models import TreeLSTMBuild
from torchfold.train.loop.arguments import warn_if_unpadded


def test_only_an_unpadded_plan_on_xla_is_warned_about() -> None:
    trees = generate_sst(4, seed=0)
    vocab = Vocab.build(trees)
    plan, _ = TreeLSTMBuild(vocab)(trees)
    padded, _ = TreeLSTMBuild(vocab, shapes=StaticShapes())(trees)
    xla = torch.device("xla")
    with pytest.warns(UserWarning, match="TraceTrainer on XLA got an unpadded plan from the loader's build"):
        assert warn_if_unpadded(plan, xla) is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_if_unpadded(plan, torch.device("cpu")) is False
        assert warn_if_unpadded(padded, xla) is False
