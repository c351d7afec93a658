"""Mixed precision for a training run: ``precision="bf16"`` or ``"fp16"``, one rule per device.

``"bf16"`` runs each minibatch's forward and loss under :func:`torch.autocast` with
``torch.bfloat16`` on any device (the CPU, CUDA, XLA); the parameters, their gradients and the
update stay in their own dtype, and bfloat16 needs no loss scaling. ``"fp16"`` autocasts to
``torch.float16`` and, since float16 gradients underflow, scales the loss by a
``torch.amp.GradScaler`` (:class:`ScaledLoss`): the optimizer unscales the step's all-reduced
gradient, skips the update of a step that overflowed and adjusts the scale
(:class:`~torchfold.train.AccumulatingOptimizer`'s ``grad_scaler``). That is CUDA's recipe, and
``"fp16"`` is refused on other devices. ``"fp32"`` (the default) changes nothing.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from torchfold.train.distributed.devices import is_cuda
from torchfold.train.loss import PlanLoss

__all__ = ["PRECISIONS", "ScaledLoss", "autocast", "check_precision", "grad_scaler"]

#: the values of ``precision=``
PRECISIONS = ("fp32", "bf16", "fp16")

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(precision: object, device: torch.device) -> str:
    """``precision`` if it is one of :data:`PRECISIONS` and runs on ``device``, else a ValueError saying why.

    >>> check_precision("bf16", torch.device("cpu"))
    'bf16'
    >>> check_precision("fp16", torch.device("cpu"))
    Traceback (most recent call last):
    ...
    ValueError: precision='fp16' needs a CUDA device (its loss scaling is CUDA's recipe), and this run is on cpu; use precision='bf16' there
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    if precision == "fp16" and not is_cuda(device):
        raise ValueError(
            f"precision='fp16' needs a CUDA device (its loss scaling is CUDA's recipe), and this run is on "
            f"{device.type}; use precision='bf16' there"
        )
    return str(precision)


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The context a minibatch's forward and loss run in for ``precision`` on ``device``."""
    dtype = _DTYPES.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """The loss scaler ``precision`` needs on ``device`` (``"fp16"`` only), or ``None``."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None


class ScaledLoss:
    """``loss`` whose gradient is multiplied by ``scaler``'s scale, its value unchanged.

    The backward of every minibatch then starts from ``scale * dloss`` (what keeps float16
    gradients from underflowing), while the value the run reports stays the loss itself.
    """

    def __init__(self, loss: PlanLoss, scaler: torch.amp.GradScaler) -> None:
        self.loss, self.scaler = loss, scaler

    def __call__(self, model: torch.nn.Module, outputs: Any, targets: Any) -> torch.Tensor:
        value = self.loss(model, outputs, targets)
        if not isinstance(value, torch.Tensor):
            return value  # the runner says what a loss must be
        scaled = self.scaler.scale(value)
        return value.detach() + (scaled - scaled.detach())  # the value of `value`, the gradient of `scaled`
