"""The loss a trainer calls for each minibatch: one type, :class:`PlanLoss`, for the loop and every runner."""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["PlanLoss"]


class PlanLoss(Protocol):
    """``loss(model, outputs, targets)``: a minibatch's scalar loss from its applied plan and its targets.

    ``outputs`` is ``plan.apply(model)`` (one tensor per request of the plan); the loss is averaged
    over the minibatch's samples (summed when the optimizer has ``reduction="sum"``).
    """

    def __call__(
        self, model: torch.nn.Module, outputs: list[torch.Tensor], targets: Any, /
    ) -> torch.Tensor: ...
