"""A user's task: the truth value of random boolean-formula DAGs, with embedding leaves.

Each sample is a DAG over four variables: leaves are (variable, value) pairs looked up in an
``nn.Embedding``, and five ops (and, or, xor, implies, not), each a ``Linear``, combine earlier
nodes, subexpressions shared within a formula. One group of the fold then reads, at one argument
position, a leaf's rows in some calls and an op's rows in others: under bfloat16 autocast the
embedding gives float32 and the ``Linear`` bfloat16, which the fold joins as ``torch.cat`` would.
The command line trains it with ``--task _formula_task:make_task`` (``tests/helpers`` on the path).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import torchfold
from torchfold.train import Task

VARIABLES = 4
BINARY = {"and_": lambda a, b: a and b, "or_": lambda a, b: a or b, "xor_": lambda a, b: a != b}
BINARY["implies"] = lambda a, b: (not a) or b

#: a formula: its nodes in order, each ("leaf", variable, value) or (op, argument, argument) by
#: node number ("not_" reads its first argument only); the last node is the root
Formula = list[tuple[str, int, int]]


class FormulaNet(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(2 * VARIABLES, dim)
        self.cells = nn.ModuleDict({name: nn.Linear(2 * dim, dim) for name in BINARY})
        self.negate = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, 2)

    def leaf(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)

    def _binary(self, name: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.cells[name](torch.cat((a, b), dim=1)))

    def and_(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self._binary("and_", a, b)

    def or_(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self._binary("or_", a, b)

    def xor_(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self._binary("xor_", a, b)

    def implies(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self._binary("implies", a, b)

    def not_(self, a: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.negate(a))


def random_formula(rng: random.Random, size: int) -> tuple[Formula, int]:
    """A formula of ``size`` ops over fresh leaves and earlier nodes (shared), and its truth value."""
    nodes: Formula = [("leaf", v, rng.randrange(2)) for v in rng.sample(range(VARIABLES), 2)]
    for _ in range(size):
        op = rng.choice([*BINARY, "not_", "leaf"])
        if op == "leaf":
            nodes.append(("leaf", rng.randrange(VARIABLES), rng.randrange(2)))
        else:
            nodes.append((op, rng.randrange(len(nodes)), rng.randrange(len(nodes))))
    if nodes[-1][0] == "leaf":
        nodes.append(("not_", len(nodes) - 1, 0))
    values: list[bool] = []
    for op, a, b in nodes:
        if op == "leaf":
            values.append(bool(b))
        elif op == "not_":
            values.append(not values[a])
        else:
            values.append(BINARY[op](values[a], values[b]))
    return nodes, int(values[-1])


def record(fold: Any, formula: Formula) -> Any:
    """Record ``formula`` on ``fold``; its root node."""
    nodes: list[Any] = []
    for op, a, b in formula:
        if op == "leaf":
            nodes.append(fold.add("leaf", 2 * a + b))
        elif op == "not_":
            nodes.append(fold.add("not_", nodes[a]))
        else:
            nodes.append(fold.add(op, nodes[a], nodes[b]))
    return nodes[-1]


def build(samples: Sequence[tuple[Formula, int]], shapes: Any = None) -> tuple[Any, Any]:
    fold = torchfold.Fold(shapes=shapes)
    plan = fold.plan([[record(fold, formula) for formula, _ in samples]])
    labels = np.array([label for _, label in samples], dtype=np.int64)
    weights = np.full(len(samples), 1 / len(samples))
    return plan, (plan.pad(request=0, values=labels).numpy(), plan.pad(request=0, values=weights).numpy())


def loss(model: nn.Module, outputs: Sequence[torch.Tensor], targets: Any) -> torch.Tensor:
    [h] = outputs
    labels, weights = (torch.as_tensor(t, device=h.device) for t in targets)
    losses = F.cross_entropy(cast(FormulaNet, model).out(h), labels, reduction="none")
    return (losses * weights.to(losses.dtype)).sum()


def evaluate(model: nn.Module, samples: Sequence[tuple[Formula, int]]) -> dict[str, float]:
    plan, (labels, _) = build(samples)
    [h] = plan.apply(model)
    predicted = cast(FormulaNet, model).out(h).argmax(dim=1).cpu()
    return {"accuracy": float((predicted == torch.as_tensor(labels)).float().mean())}


def make_task(size: int = 48, dim: int = 8, ops: int = 6, seed: int = 0) -> Task:
    rng = random.Random(seed)
    samples = [random_formula(rng, rng.randint(1, ops)) for _ in range(size + 16)]
    return Task(
        "formulas",
        train=samples[:size],
        build=build,
        model=functools.partial(FormulaNet, dim),
        loss=loss,
        eval=samples[size:],
        evaluate=evaluate,
        description=f"{size} random boolean formulas",
        settings={"dim": dim, "ops": ops},
    )
