"""``torchfold.train.captured_step``: the trainer's captured steps, as one call in a loop of your own."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from torchfold.train.capture.mechanism import StepMechanism
from torchfold.train.capture.runner import StepRunner
from torchfold.train.data.loader import to_device
from torchfold.train.distributed.world import run_context
from torchfold.train.loss import PlanLoss
from torchfold.train.optim.optimizer import AccumulatingOptimizer

__all__ = ["CapturedStep", "captured_step"]


class CapturedStep:
    """One optimizer step per call, over any number of minibatches, run the way :func:`captured_step` chose.

    Call it with the step's minibatches, each ``(plan, targets, num_samples)`` (targets on the host
    or the device: they are moved to the model's); it runs their forward, loss and backward, then
    the update, and returns the step's mean loss over its samples as a 0-dim tensor on the device
    (not read back: ``float()`` it when you want the number). The model runs in the mode you set
    (``model.train()`` or ``model.eval()``); the step never changes it.
    """

    def __init__(self, runner: StepRunner, device: torch.device) -> None:
        self.runner = runner
        self.device = device

    @property
    def optimizer(self) -> AccumulatingOptimizer:
        """The wrapper that weighs the minibatches and scales the learning rate."""
        return self.runner.optimizer

    @property
    def captures(self) -> int:
        """How many programs were captured so far (0 for eager steps)."""
        return self.runner.captures

    def __call__(self, minibatches: Iterable[tuple[Any, Any, int]]) -> torch.Tensor:
        batch = list(minibatches)
        if not batch:
            raise ValueError("a step needs at least one minibatch (plan, targets, num_samples); got none")
        for number, item in enumerate(batch):
            if not (isinstance(item, tuple) and len(item) == 3):
                raise TypeError(
                    f"minibatch {number} must be a tuple (plan, targets, num_samples), got {type(item).__name__}"
                )
        # NOTE: the model keeps the mode its user set (a step in eval() runs without dropout); every
        # capture keys its programs on ``model.training``, so a change of mode is a new capture
        total, sole = 0, len(batch) == 1  # (a step of one minibatch may run whole)
        for plan, targets, num_samples in batch:
            # targets from the host (plan.pad's, numpy) go to the device, as the trainer's loader moves
            # them, whichever runner runs the step (the eager one would hand XLA a CPU tensor)
            self.runner.run_minibatch(plan, to_device(targets, self.device), num_samples, sole_minibatch=sole)
            total += num_samples
        summed, scale = self.runner.update()
        assert summed is not None
        # the loss sum weighs each minibatch's loss by sample_weight(n, reduction): its samples' sum
        # either way, so over the step's samples it is their mean (what the trainer reports too)
        return summed * (scale / total)


def captured_step(
    model: torch.nn.Module,
    loss: PlanLoss,
    optimizer: torch.optim.Optimizer,
    *,
    compile: str = "auto",
    device: torch.device | str | None = None,
    lr_rule: str = "constant",
    ref_batch_size: int | None = None,
) -> CapturedStep:
    """A training step to call once per optimizer step, run as ``compile=`` says.

    ``loss(model, outputs, targets) -> scalar`` gets ``plan.apply(model, padded=True)``'s outputs,
    as in :class:`~torchfold.train.TraceTrainer`. With ``compile="auto"`` every step's Python runs
    (on XLA lazily, XLA compiling a program per graph and reusing it); ``compile="on"``:
    :func:`torch.compile` (on XLA, TorchDynamo's guards in front of programs captured from its
    graphs; the step's Python run lazily where it cannot capture the step whole); ``compile="replay"`` (XLA and CUDA, opt-in): every
    step replayed from programs captured once per static-shape layout (plans from
    ``Fold(shapes=StaticShapes(...))``) without running its Python, however many minibatches it
    has on XLA, a step of one minibatch from one CUDA graph on a GPU
    (:data:`~torchfold.train.capture.mechanism.REPLAY_CONTRACT`).

    Args:
        model: the module whose methods are the fold ops.
        loss: the minibatch's scalar loss, averaged over its samples.
        optimizer: a ``torch.optim`` optimizer (on XLA created with ``capturable=True`` where it
            has the option: :meth:`StepMechanism.optimizer
            <torchfold.train.capture.mechanism.StepMechanism.optimizer>` adds the options the device
            needs), or an :class:`~torchfold.train.AccumulatingOptimizer`.
        compile: ``"auto"`` (default), ``"on"``, ``"replay"`` or ``"off"``.
        device: where the model runs (default: the model's, by :func:`~torchfold.train.run_context`).
        lr_rule, ref_batch_size: the learning-rate rule when ``optimizer`` is a plain optimizer.

    Example:
        >>> import torch, torchfold
        >>> class Model(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = torch.nn.Parameter(torch.ones(1))
        ...     def leaf(self, x):
        ...         return (x.float() * self.w).unsqueeze(1)
        >>> model = Model()
        >>> step = torchfold.train.captured_step(model, lambda m, outputs, t: ((outputs[0] - t) ** 2).mean(),
        ...                                torch.optim.SGD(model.parameters(), lr=0.1))
        >>> f = torchfold.Fold()  # on XLA: Fold(shapes=torchfold.StaticShapes()), targets padded by plan.pad
        >>> plan = f.plan([[f.add("leaf", 1), f.add("leaf", 2)]])
        >>> loss = step([(plan, torch.tensor([[2.0], [4.0]]), 2)])   # one minibatch of 2 samples
        >>> round(float(loss), 4), round(model.w.item(), 4)
        (2.5, 1.5)
    """
    if not isinstance(optimizer, AccumulatingOptimizer):
        optimizer = AccumulatingOptimizer(optimizer, lr_rule=lr_rule, ref_batch_size=ref_batch_size)  # type: ignore[arg-type]
    device = run_context(device, model=model).device
    return CapturedStep(StepMechanism(device, compile=compile).runner(model, loss, optimizer), device)
