"""A per-sample forward trained like a fold: ``Task(forward=...)``.

A task may give ``forward(model, sample) -> loss`` (plain PyTorch for one sample, the shape of a
``torch.utils.data`` ``Dataset`` item's training step) instead of ``build`` and ``loss``. The run
then carries each minibatch's samples as a :class:`SampleMinibatch` where a fold's plan would go,
and :class:`SampleLoss` runs ``forward`` for every sample under :func:`torchfold.autobatch`,
batched as it runs, and returns the mean over samples: the same loss a ``build`` task's minibatch
gives, so minibatch weighting, accumulation and distributed splitting are unchanged and a step
equals one big batch.

NOTE (XLA): autobatch's batch size per op follows the minibatch's samples, so on XLA every new
size compiles a new program. A per-sample task warns there once, naming the fix (a ``build``
task recording on ``Fold(shapes=StaticShapes(...))``, whose sizes are bucketed).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from torchfold.engine.autobatching import autobatch
from torchfold.engine.devices import needs_static_shapes

__all__ = ["SampleLoss", "SampleMinibatch", "build_samples"]


class SampleMinibatch:
    """A minibatch's samples, standing where a fold's plan stands; ``apply`` gives them back.

    >>> SampleMinibatch([3, 1]).apply(None), len(SampleMinibatch([3, 1]))
    ([3, 1], 2)
    """

    def __init__(self, samples: Sequence[Any]) -> None:
        self.samples = list(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def apply(self, model: Any, padded: bool = False) -> list[Any]:
        return self.samples


def build_samples(samples: Sequence[Any], shapes: Any = None) -> tuple[SampleMinibatch, None]:
    """The ``build`` of a per-sample task: the samples as they are, no targets (``forward`` reads them)."""
    return SampleMinibatch(samples), None


class SampleLoss:
    """The ``loss`` of a per-sample task: ``forward`` on every sample under autobatch, the mean of the losses.

    Args:
        forward: ``forward(model, sample) -> scalar loss`` for one sample, plain PyTorch. It runs
            with the model's device as the default device, so the tensors it makes are there.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(1, 1)
        >>> def forward(model, x):
        ...     return (model(torch.tensor([[float(x)]])) ** 2).sum()
        >>> loss = SampleLoss(forward)(model, [1, 2, 3], None)
        >>> eager = torch.stack([forward(model, x) for x in [1, 2, 3]]).mean()
        >>> torch.allclose(loss, eager)
        True
    """

    def __init__(self, forward: Callable[[nn.Module, Any], torch.Tensor]) -> None:
        if not callable(forward):
            raise TypeError(f"SampleLoss(forward=...) must be callable, got {type(forward).__name__}")
        self.forward = forward
        self._warned = False

    def __call__(self, model: nn.Module, outputs: Sequence[Any], targets: Any = None) -> torch.Tensor:
        samples = list(outputs)
        if not samples:
            raise ValueError("a per-sample task got an empty minibatch; minibatches hold at least one sample")
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        if not self._warned and needs_static_shapes(device):
            self._warned = True
            warnings.warn(
                "a per-sample forward on XLA: autobatch's batch size per op follows each minibatch's samples, so "
                "every new size compiles a new program; for a bounded number of programs write the task with "
                "build (record on torchfold.Fold(shapes=StaticShapes(...))) instead of forward",
                stacklevel=2,
            )
        with device:  # the forward's own tensors (torch.tensor(...), torch.zeros(...)) on the model's device
            losses = autobatch(self.forward, samples, model)
        for index, value in enumerate(losses):
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                got = (
                    f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
                )
                raise ValueError(
                    f"Task forward returned {got} for sample {index} of the minibatch ({samples[index]!r:.60}); "
                    "it must return that sample's loss as a scalar tensor, e.g. F.cross_entropy(logits, y) or "
                    "loss.sum()"
                )
        return torch.stack([value.reshape(()) for value in losses]).mean()
