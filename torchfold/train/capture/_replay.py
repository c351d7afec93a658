"""What the replays (:mod:`~torchfold.train.capture.xla_programs`, :mod:`~torchfold.train.capture.cuda_replay`) share.

A replayed step reads the optimizer's options (its param groups' keys but the learning rates, which
are inputs) as they are at each step (:func:`options_now`; a CUDA graph keeps them as constants:
:func:`optimizer_options`), reads the batch's targets as tensors in a fixed order, and steps with
learning rates it sets itself: the rules for each live here, once.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import torch

from torchfold.engine.static import StaticPlan
from torchfold.train.capture.compiled import check_loss
from torchfold.train.loss import PlanLoss

Options = tuple[tuple[tuple[str, str], ...], ...]  # per param group: (name, repr of value), sorted

__all__ = [
    "MAX_OPTIONS",
    "Options",
    "StepReplay",
    "at_rates_without_grads",
    "gradients_into",
    "optimizer_options",
    "options_now",
    "target_tensors",
]


class StepReplay:
    """What both whole-step replays are: a module, a loss and an optimizer, the reason steps are
    no longer replayed (:attr:`refused`), and the ordinary step they run instead."""

    def __init__(self, model: torch.nn.Module, loss: PlanLoss, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.loss, self.optimizer = model, loss, optimizer
        #: why steps cannot be replayed (found at the first capture that failed), or None
        self.refused: str | None = None
        # per layout: the optimizer options captured for it
        self._seen_options: dict[Hashable, list[Options]] = {}

    def _check_call(self, plan: Any, lrs: list[float]) -> None:
        """A step's arguments: a static-shape plan, and one learning rate per param group."""
        if not isinstance(plan, StaticPlan):
            raise TypeError(
                f"a replayed step needs a static-shape plan (a StaticPlan), got {type(plan).__name__}"
            )
        groups = self.optimizer.param_groups
        if len(lrs) != len(groups):
            raise ValueError(f"lrs has {len(lrs)} learning rates for {len(groups)} param groups")

    def _options(self, plan: StaticPlan) -> tuple[Options, str | None]:
        """The optimizer's options but the learning rates, and why they cannot be replayed
        (:func:`optimizer_options`, over the options seen on ``plan``'s layout)."""
        return optimizer_options(self.optimizer, self._seen_options, plan.layout.key)

    def _refuse(self, why: str) -> None:
        """Steps are not replayed from now on (the caller runs them another way); one warning."""
        if self.refused is None:
            self.refused = why
            warnings.warn(f"steps are not replayed whole: {why}", stacklevel=4)

    def _eager_step(self, plan: StaticPlan, targets: Any, lrs: list[float]) -> torch.Tensor:
        """One ordinary step (the optimizer's own update); the loss."""
        with at_rates_without_grads(self.optimizer, lrs):
            loss = check_loss(self.loss(self.model, plan.apply(self.model, padded=True), targets))
            loss.backward()
            self.optimizer.step()
        return loss.detach()


def gradients_into(loss: torch.Tensor, params: list[torch.Tensor]) -> None:
    """The gradients of ``loss`` into ``p.grad`` (None before) of the ``params`` that require grad,
    by ``torch.autograd.grad``: no gradient accumulator runs, nor its hooks (a whole step of one
    minibatch needs no minibatch weighting)."""
    trainable = [p for p in params if p.requires_grad]
    for p, grad in zip(trainable, torch.autograd.grad(loss, trainable, allow_unused=True), strict=True):
        p.grad = grad


# An optimizer's options are its param groups' keys (torch's word: ``Optimizer(params, **options)``);
# ``settings`` is what a checkpoint is only valid with (``TraceTrainer(settings=)``). Distinct
# options (other than learning rates) captured for one layout before an option that keeps changing
# is refused: a few changes are a new graph each, a schedule is not.
MAX_OPTIONS = 4


def options_now(optimizer: torch.optim.Optimizer) -> tuple[Options, str | None]:
    """The optimizer's options but the learning rates, as they are now, and why they cannot be a
    replayed step's: a tensor among them (its value would be frozen into the graph).

    >>> model = torch.nn.Linear(2, 1)
    >>> options, why = options_now(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    >>> dict(options[0])["momentum"], why
    ('0.9', None)
    """
    options: list[tuple[tuple[str, str], ...]] = []
    for number, group in enumerate(optimizer.param_groups):
        for name, value in group.items():
            values = value if isinstance(value, tuple | list) else (value,)
            if name not in ("params", "lr") and any(isinstance(v, torch.Tensor) for v in values):
                return (), (
                    f"param group {number}'s {name!r} is a tensor, which a replayed step would keep at its "
                    "captured value; give it as a number"
                )
        options.append(tuple(sorted((k, repr(v)) for k, v in group.items() if k not in ("params", "lr"))))
    return tuple(options), None


def optimizer_options(
    optimizer: torch.optim.Optimizer, seen: dict[Hashable, list[Options]], layout: Hashable
) -> tuple[Options, str | None]:
    """:func:`options_now`, for a replay whose graph holds the options as constants (a CUDA graph):
    also refused, values that keep changing on ``layout`` (e.g. a schedule of Adam's betas: a new
    graph at every step). ``seen`` keeps, per layout, the options already captured (this call adds
    to it)."""
    frozen, why = options_now(optimizer)
    if why is not None:
        return frozen, why
    known = seen.setdefault(layout, [])
    if frozen not in known:
        if len(known) >= MAX_OPTIONS:
            last = known[-1]
            changed = sorted(
                {name for now, then in zip(frozen, last, strict=False) for name, _ in set(now) ^ set(then)}
            )
            return frozen, (
                f"the optimizer's options ({', '.join(changed) or 'param groups'}) took "
                f"{len(known) + 1} values on one layout, and each is a new graph to compile; a schedule of them "
                "runs the usual way instead, not replayed whole (the learning rate alone may change freely)"
            )
        known.append(frozen)
    return frozen, None


@contextlib.contextmanager
def at_rates_without_grads(optimizer: torch.optim.Optimizer, rates: Sequence[Any]) -> Iterator[None]:
    """Inside, param group ``i`` steps with learning rate ``rates[i]`` (a number or a tensor)
    from no gradients; afterwards its own learning rates are back and the gradients ``None``."""
    groups = optimizer.param_groups
    own = [group["lr"] for group in groups]
    params = [p for group in groups for p in group["params"]]
    try:
        for group, rate in zip(groups, rates, strict=True):
            group["lr"] = rate
        for p in params:
            p.grad = None
        yield
    finally:
        for group, rate in zip(groups, own, strict=True):
            group["lr"] = rate
        for p in params:
            p.grad = None


def target_tensors(targets: Any) -> tuple[list[torch.Tensor], str | None]:
    """The tensors of ``targets`` (a tensor, or tuples, lists and dicts of them) in a fixed order,
    and why they cannot be a replay's inputs (anything else in them would be a constant of the
    graph), or None.

    >>> target_tensors((torch.zeros(2), {"w": torch.ones(2)}))
    ([tensor([0., 0.]), tensor([1., 1.])], None)
    >>> target_tensors([torch.zeros(1), 3])[1]
    'its targets hold a value of type int, not only tensors'
    """
    if isinstance(targets, torch.Tensor):
        return [targets], None
    items: list[Any]
    if isinstance(targets, tuple | list):
        items = list(targets)
    elif isinstance(targets, dict):
        items = [targets[name] for name in sorted(targets)]
    else:
        return [], f"its targets hold a value of type {type(targets).__name__}, not only tensors"
    found: list[torch.Tensor] = []
    for item in items:
        tensors, why = target_tensors(item)
        if why is not None:
            return [], why
        found += tensors
    return found, None
