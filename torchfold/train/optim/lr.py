"""Learning-rate scaling rules: the learning rate of a step from its global batch size.

The rules here depend on the batch size alone; :class:`~torchfold.train.AccumulatingOptimizer`
adds AdaScale, which also needs the gradients.
"""

from __future__ import annotations

import math

from torchfold._validate import check_int

__all__ = ["LR_RULES", "scaled_lr"]

# The rules that depend on the batch size alone (the optimizer wrapper adds AdaScale).
LR_RULES: tuple[str, ...] = ("constant", "linear", "sqrt")


def scaled_lr(base_lr: float, batch_size: int, ref_batch_size: int, rule: str = "linear") -> float:
    """Learning rate for ``batch_size`` under a scaling rule relative to ``ref_batch_size``.

    Args:
        base_lr: learning rate at the reference batch size.
        batch_size: global batch size of the step.
        ref_batch_size: batch size at which ``base_lr`` applies.
        rule: ``"constant"`` (``base_lr``), ``"linear"`` (``base_lr * batch / ref``) or
            ``"sqrt"`` (``base_lr * sqrt(batch / ref)``).

    >>> scaled_lr(0.1, 512, 256, "linear"), scaled_lr(0.1, 1024, 256, "sqrt")
    (0.2, 0.2)
    """
    check_int("batch_size", batch_size)
    check_int("ref_batch_size", ref_batch_size)
    if rule == "constant":
        return base_lr
    if rule == "linear":
        return base_lr * batch_size / ref_batch_size
    if rule == "sqrt":
        return base_lr * math.sqrt(batch_size / ref_batch_size)
    raise ValueError(f"rule should be one of {LR_RULES}, got {rule!r}")
