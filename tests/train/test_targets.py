"""Targets left unpadded: refused by the trainer naming the rows, on the CPU too, not first on XLA.

A build that forgets ``plan.pad`` trains on the CPU (plans are not padded there) and used to fail
on XLA inside the loss, in torch's words. The trainer checks the targets of every padded plan, and
on a run that does not pad, the first minibatch built once more into static shapes.
"""

from __future__ import annotations

import functools
import random
from typing import Any

import numpy as np
import pytest
import torch
from _formula_task import Formula, build, make_task, record

import torchfold
from torchfold import StaticShapes
from torchfold.train.data.loader import StepLoader
from torchfold.train.loop.targets import check_target_rows, probe_target_rows
from torchfold.train.loop.trainer import TraceTrainer
from torchfold.train.optim.optimizer import AccumulatingOptimizer

MINIBATCH = 8


def unpadded_build(samples: list[tuple[Formula, int]], shapes: Any = None) -> tuple[Any, Any]:
    """The formula task's build, its targets not padded (the mistake)."""
    fold = torchfold.Fold(shapes=shapes)
    plan = fold.plan([[record(fold, formula) for formula, _ in samples]])
    labels = np.array([label for _, label in samples], dtype=np.int64)
    return plan, (labels, np.full(len(samples), 1 / len(samples)))


def trainer(build: Any, **options: Any) -> TraceTrainer:
    task = make_task(size=32)
    torch.manual_seed(0)
    model = task.make_model()
    optimizer = AccumulatingOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    loader = StepLoader(task.train, MINIBATCH, build=build, trace=[16, 8])
    return TraceTrainer(model, optimizer, loader, task.loss, progress=False, **options)


UNPADDED = (
    r"the targets of the loader's build have 8 rows \(targets\[0\]\) but the plan's padded batch has (\d+) "
    r"\(request 0: 8 nodes padded to \1 by static shapes\)"
)
FIX = r"pad every per-node target in build with plan\.pad\(request=0, values=\.\.\.\), padded rows weighing 0"


def test_unpadded_targets_are_refused_on_the_cpu_before_the_first_step() -> None:
    """The run does not pad (the CPU, eager): its first minibatch is built once into static shapes."""
    run = trainer(unpadded_build)
    with pytest.raises(
        ValueError,
        match=UNPADDED.replace(r"static shapes\)", r"static shapes, as on XLA .* to check\)") + "; " + FIX,
    ):
        run.fit(max_steps=2)
    assert run.next_step == 0 and all(p.grad is None for p in run.model.parameters())


def test_unpadded_targets_of_a_padded_plan_are_refused_naming_the_rows() -> None:
    """A padded plan (as on XLA): refused before the loss, not by cross_entropy's batch sizes."""
    run = trainer(functools.partial(unpadded_build, shapes=StaticShapes()))
    with pytest.raises(ValueError, match=UNPADDED + "; " + FIX):
        run.fit(max_steps=1)


def test_padded_targets_train_and_the_check_draws_nothing_from_the_run() -> None:
    """The task's own build pads: the run trains. The probe's build draws from the global generators
    as the run's builds do, and puts them back: the run sees what it would have seen without it."""
    seen: dict[str, list[float]] = {"probed": [], "not probed": []}

    def drawing(samples: list[Any], shapes: Any = None, *, into: str) -> tuple[Any, Any]:
        draw = (random.random(), float(np.random.rand()), float(torch.rand(())))
        if shapes is None:  # (the probe's draws are not the run's)
            seen[into].append(sum(draw))
        return build(samples, shapes)

    def unprobed(samples: list[Any]) -> tuple[Any, Any]:  # no shapes argument: nothing to probe with
        return drawing(samples, into="not probed")

    for _name, make in (("probed", functools.partial(drawing, into="probed")), ("not probed", unprobed)):
        random.seed(3)
        np.random.seed(3)
        history = trainer(make).fit(max_steps=2)
        assert [s.step for s in history] == [0, 1]
    assert seen["probed"] == seen["not probed"] and len(seen["probed"]) == 3


def test_the_check_walks_the_targets_and_leaves_other_rows_alone() -> None:
    fold = torchfold.Fold(shapes=StaticShapes(min_rows=4))
    nodes = [fold.add(torch.neg, value) for value in (1, 2, 3)]
    plan = fold.plan([nodes, nodes[:1]])  # requests of 3 and 1 nodes, padded to 4 and 2
    assert plan.sizes == [3, 1] and plan.capacities[0] == 4 and plan.capacities[1] > 1
    padded = plan.pad(request=0, values=[1.0, 2.0, 3.0])
    check_target_rows(plan, {"labels": padded, "scale": torch.tensor(2.0), "vocab": torch.zeros(10, 2)})
    check_target_rows(plan, [padded, np.zeros(plan.capacities[1])])
    with pytest.raises(
        ValueError, match=r"have 3 rows \(targets\[1\]\['w'\]\) .* padded batch has 4 \(request 0"
    ):
        check_target_rows(plan, (padded, {"w": np.ones(3)}))
    with pytest.raises(ValueError, match=r"have 1 rows \(targets\) .* \(request 1: 1 nodes padded to"):
        check_target_rows(plan, torch.ones(1, 5))
    unpadded = torchfold.Fold()
    plain = unpadded.plan([[unpadded.add(torch.neg, 1)]])
    check_target_rows(plain, torch.ones(1))  # nothing is padded: nothing to check


def test_the_probe_asks_only_a_build_that_takes_shapes_and_leaves_a_failing_one_alone() -> None:
    items = make_task(size=8).train[:4]
    with pytest.raises(ValueError, match="this run's first minibatch, built once more that way to check"):
        probe_target_rows(unpadded_build, items)
    probe_target_rows(lambda samples: unpadded_build(samples), items)  # no shapes: not asked
    probe_target_rows(build, items)  # pads: fine

    def refuses_shapes(samples: list[Any], shapes: Any = None) -> tuple[Any, Any]:
        if shapes is not None:
            raise RuntimeError("this build cannot pad")
        return unpadded_build(samples)

    probe_target_rows(refuses_shapes, items)  # its run does not pad: not this check's business
