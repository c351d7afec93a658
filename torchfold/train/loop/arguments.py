"""What :class:`~torchfold.train.TraceTrainer` is given, checked, and where its :meth:`fit` stops.

A bad argument gets a ``TypeError`` (the wrong kind of thing) or a ``ValueError`` (out of range)
naming the argument, the rule and the value, before anything is built; an unpadded plan from the
loader's build on XLA gets one warning.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from torchfold._validate import check_int
from torchfold.engine.static.shapes import StaticPlan
from torchfold.train.data.loader import StepLoader
from torchfold.train.distributed.devices import needs_static_shapes
from torchfold.train.distributed.world import world
from torchfold.train.optim.optimizer import AccumulatingOptimizer
from torchfold.train.persample import SampleMinibatch

__all__ = [
    "Evaluate",
    "check_arguments",
    "check_evaluation",
    "check_loader_rank",
    "check_parts",
    "ends_epoch",
    "fit_end",
    "warn_if_unpadded",
]

#: ``evaluate(model, eval_data) -> {"name": value}``: a run's evaluation (a task's ``evaluate`` too)
Evaluate = Callable[[torch.nn.Module, Any], Mapping[str, Any]]


def check_parts(model: object, optimizer: object, loader: object, loss: object) -> None:
    """TraceTrainer's model, optimizer, loader and loss are of the kinds it runs, or a TypeError says which not."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, AccumulatingOptimizer):
        raise TypeError(
            f"optimizer must be a torchfold AccumulatingOptimizer (it accumulates minibatches and "
            f"all-reduces once per step), got {type(optimizer).__name__}; wrap it: "
            f"AccumulatingOptimizer({type(optimizer).__name__}(...), lr_rule=...)"
        )
    if not isinstance(loader, StepLoader):
        raise TypeError(f"loader must be a torchfold StepLoader, got {type(loader).__name__}")
    if loader.build is None:
        raise ValueError(
            "the loader has no build function: give it build=... returning (FoldPlan, targets) for a minibatch "
            "of items (e.g. torchfold.examples.models.TreeLSTMBuild(vocab))"
        )
    if not callable(loss):
        raise TypeError(f"loss must be callable as loss(model, outputs, targets), got {loss!r}")


def check_loader_rank(loader: StepLoader[Any, Any]) -> int:
    """This process's rank, if ``loader`` is for it, or a ValueError saying how to make one that is."""
    found = world()
    world_size, rank = found.size, found.rank
    if (loader.num_replicas, loader.rank) != (world_size, rank):
        raise ValueError(
            f"the loader is for rank {loader.rank} of {loader.num_replicas} but this process is rank "
            f"{rank} of {world_size}; create the loader after the process group (its defaults then fit)"
        )
    return rank


def check_arguments(
    checkpoint_every: object,
    log_every: object,
    keep_checkpoints: object,
    seed: object,
    preemption_timeout: object,
) -> None:
    """TraceTrainer's numeric arguments are in range, or a TypeError/ValueError names the first that is not."""
    check_int("checkpoint_every", checkpoint_every, 0)
    check_int("log_every", log_every, 0, optional=True)
    check_int("keep_checkpoints", keep_checkpoints, 1)
    check_int("seed", seed, 0, optional=True)
    if isinstance(preemption_timeout, bool) or not (
        isinstance(preemption_timeout, (int, float)) and preemption_timeout > 0
    ):
        raise ValueError(
            f"preemption_timeout must be a positive number of seconds, got {preemption_timeout!r}"
        )


def check_evaluation(evaluate: object, eval_every: object, eval_every_epochs: object) -> tuple[int, int]:
    """TraceTrainer's evaluation schedule: every how many steps and epochs (0: not by that count).

    An ``evaluate`` with neither count runs after every epoch; a count without ``evaluate`` is a
    ValueError (it would silently evaluate nothing).

    >>> check_evaluation(print, None, None), check_evaluation(print, 100, None), check_evaluation(None, None, None)
    ((0, 1), (100, 0), (0, 0))
    """
    check_int("eval_every", eval_every, 1, optional=True)
    check_int("eval_every_epochs", eval_every_epochs, 1, optional=True)
    if evaluate is None:
        if eval_every is not None or eval_every_epochs is not None:
            raise ValueError(
                "eval_every/eval_every_epochs say when to evaluate, but there is no evaluate=: pass "
                "evaluate=fn(model, eval_data) -> {'metric': value}"
            )
        return 0, 0
    if not callable(evaluate):
        raise TypeError(f"evaluate must be callable as evaluate(model, eval_data), got {evaluate!r}")
    if eval_every is None and eval_every_epochs is None:
        return 0, 1
    return (eval_every if isinstance(eval_every, int) else 0), (
        eval_every_epochs if isinstance(eval_every_epochs, int) else 0
    )


def ends_epoch(loader: StepLoader[Any, Any], epoch: int, next_step: int) -> bool:
    """Whether the step before ``next_step``, of epoch ``epoch``, is that epoch's last."""
    sampler = loader.sampler
    return sampler.trace.epoch(epoch, sampler.dataset_size, drop_last=sampler.drop_last).end_step == next_step


def fit_end(
    loader: StepLoader[Any, Any], next_step: int, max_steps: int | None, epochs: int | None
) -> tuple[int, int | None]:
    """:meth:`TraceTrainer.fit`'s bounds from ``next_step``: the global step to stop before, and
    the number of epochs (``None``: bounded by steps)."""
    sampler = loader.sampler
    if epochs is None:
        epochs = sampler.num_epochs
    if epochs is None and max_steps is None:
        raise ValueError(
            f"the loader's steps have no end (trace {sampler.trace.source!r}): pass max_steps= or epochs= to fit()"
        )
    end = math.inf
    if epochs is not None:
        if epochs <= loader.epoch:
            end = next_step
        else:
            end = sampler.trace.epoch(epochs - 1, sampler.dataset_size, drop_last=sampler.drop_last).end_step
    if max_steps is not None:
        end = min(end, max_steps)
    return int(end), epochs


def warn_if_unpadded(plan: Any, device: torch.device) -> bool:
    """Whether a plan from the loader's build runs unpadded on XLA (then a warning says how to pad)."""
    # a per-sample task's minibatch: SampleLoss warns, naming its own fix
    if not needs_static_shapes(device) or isinstance(plan, StaticPlan | SampleMinibatch):
        return False
    warnings.warn(
        "TraceTrainer on XLA got an unpadded plan from the loader's build: every new size compiles a new "
        "graph; build static-shape plans with padded targets instead (Fold(shapes=StaticShapes(...)) and "
        "plan.pad, e.g. TreeLSTMBuild(vocab, shapes=...))",
        stacklevel=4,  # TraceTrainer's step (the frame the trainer's own warning named)
    )
    return True
