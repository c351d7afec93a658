"""envelope_for: the one rule of when a plan is padded (Fold.plan and FoldPlan.apply both ask it)."""

from __future__ import annotations

import torch

import torchfold
from torchfold import StaticShapes
from torchfold.engine.static import envelope_for


def test_the_rule_for_each_fold_setting_and_device() -> None:
    model = torch.nn.Linear(2, 2)
    mine = StaticShapes()
    cpu, xla = torch.device("cpu"), torch.device("xla")
    assert envelope_for(mine) is mine and envelope_for(mine, model, cpu) is mine  # given: always
    assert envelope_for("auto") is None  # planning: the device is not known yet
    assert envelope_for("auto", model, cpu) is None
    assert envelope_for("auto", model, xla) is StaticShapes.of(model)  # one envelope per module
    assert envelope_for(None, model, xla) is None  # never


def test_plan_pads_into_a_given_envelope_and_leaves_auto_to_apply() -> None:
    def record(shapes: StaticShapes | str | None) -> object:
        fold = torchfold.Fold(shapes=shapes)
        return fold.plan([[fold.add(torch.neg, 1), fold.add(torch.neg, 2)]])

    mine = StaticShapes(min_rows=4)
    assert isinstance(record(mine), torchfold.StaticPlan) and mine.plans == 1
    auto, never = record("auto"), record(None)
    assert isinstance(auto, torchfold.FoldPlan) and auto.pad_on_xla
    assert isinstance(never, torchfold.FoldPlan) and not never.pad_on_xla
    model = torch.nn.Module()
    assert [t.tolist() for t in auto.apply(model)] == [[-1, -2]]  # on the CPU: not padded
    assert StaticShapes.of(model).plans == 0
