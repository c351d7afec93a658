"""A task written outside torchfold, as a user would: its source, for tests to write to a temporary folder.

Parity of digit sequences, each sequence folded left to right (a deep chain for long ones): small
enough to train in a second, with a real fold, a loss, an evaluation and padded targets.
"""

from __future__ import annotations

from pathlib import Path

MODULE = "my_parity_task"

SOURCE = '''
"""Parity of a digit sequence, folded left to right: a task written outside torchfold."""

import functools
import random

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import torchfold
from torchfold.train import Task


class Chain(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, dim)
        self.merge = nn.Linear(2 * dim, dim)
        self.out = nn.Linear(dim, 2)

    def digit(self, x):
        return self.embed(x)

    def pair(self, left, right):
        return torch.tanh(self.merge(torch.cat((left, right), dim=1)))


def build(samples, shapes=None):
    fold = torchfold.Fold(shapes=shapes)
    roots = []
    for digits in samples:
        node = fold.add("digit", digits[0])
        for d in digits[1:]:
            node = fold.add("pair", node, fold.add("digit", d))
        roots.append(node)
    plan = fold.plan([roots])
    labels = np.array([sum(s) % 2 for s in samples], dtype=np.int64)
    weights = np.full(len(samples), 1 / len(samples))
    # padded rows weigh 0 (request=0: the first list of nodes given to fold.plan)
    labels = plan.pad(request=0, values=labels).numpy()
    weights = plan.pad(request=0, values=weights).numpy()
    return plan, (labels, weights)


def loss(model, outputs, targets):
    [h] = outputs
    labels, weights = (torch.as_tensor(t, device=h.device) for t in targets)
    losses = F.cross_entropy(model.out(h), labels, reduction="none")
    return (losses * weights.to(losses.dtype)).sum()


def evaluate(model, samples):
    plan, (labels, _) = build(samples)
    [h] = plan.apply(model)
    predicted = model.out(h).argmax(dim=1).cpu()
    return {"accuracy": float((predicted == torch.as_tensor(labels)).float().mean())}


def make_task(size: int = 48, dim: int = 8, longest: int = 6) -> Task:
    rng = random.Random(0)
    samples = [[rng.randrange(10) for _ in range(rng.randint(1, longest))] for _ in range(size + 16)]
    return Task(
        "parity",
        train=samples[:size],
        build=build,
        model=functools.partial(Chain, dim),
        loss=loss,
        eval=samples[size:],
        evaluate=evaluate,
        description=f"{size} digit sequences",
        settings={"dim": dim},
    )
'''


#: the same task, its build forgetting to pad the targets (the guide's example of that mistake)
UNPADDED_SOURCE = SOURCE.replace(
    """    # padded rows weigh 0 (request=0: the first list of nodes given to fold.plan)
    labels = plan.pad(request=0, values=labels).numpy()
    weights = plan.pad(request=0, values=weights).numpy()
""",
    "",
)
assert UNPADDED_SOURCE != SOURCE


def write_task(folder: Path, module: str = MODULE, source: str = SOURCE) -> Path:
    """Write the task's module (or ``source``) to ``folder`` (put it on ``PYTHONPATH``); returns the file."""
    path = folder / f"{module}.py"
    path.write_text(source)
    return path
