"""A :class:`~torchfold.train.TraceTrainer`'s checkpoints: the state they hold, when they are
written, and how a run resumes from one.

A checkpoint holds the model, the optimizer, the loader's position, every rank's generator states
(:mod:`torchfold.train.loop.rng`) and the run's ``settings`` (what the checkpoint is only valid with).
It resumes on any number of processes: a step holds the same samples however many share it, and
its update is their mean, so the parameters follow one uninterrupted run up to summation order.
Random draws: with ``seed=``, the generators are seeded before every minibatch from ``(seed, step,
minibatch position in the step)``, so dropout depends on the minibatch, not on the process that
runs it; with a fixed minibatch size that makes the draws, too, world-size invariant. Without
``seed``, each rank's generators continue where its checkpoint left them, which needs the same
number of processes; on another number they are re-seeded from ``(step, rank)`` with a warning.
The file format (atomic writes, checks of what is read) is :mod:`torchfold.train.loop.checkpoint`'s.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from torchfold.train.data.loader import StepLoader
from torchfold.train.data.sampler import TraceMismatch
from torchfold.train.distributed.world import gather_objects, world
from torchfold.train.loop.checkpoint import (
    check_trainer_state,
    latest_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from torchfold.train.loop.rng import derived_seed, rng_state, seed_generators, set_rng_state
from torchfold.train.optim.optimizer import AccumulatingOptimizer

__all__ = [
    "DEVICE_OPTIONS",
    "checkpoint_due",
    "load_trainer_state",
    "non_finite_loss_message",
    "on_this_device",
    "trainer_state",
    "write_checkpoint",
]

# Param group options (torch's word; ``settings`` is what a checkpoint is only valid with) that say
# how an update runs on the device, not what it computes: a checkpoint's are those of the device it
# was written on, this run's stand.
DEVICE_OPTIONS = ("capturable", "fused", "foreach")


def checkpoint_due(checkpoint_dir: Path | None, checkpoint_every: int, next_step: int) -> bool:
    """Whether the step before ``next_step`` ends with a checkpoint (every ``checkpoint_every``)."""
    return checkpoint_dir is not None and checkpoint_every > 0 and next_step % checkpoint_every == 0


def write_checkpoint(state: dict[str, Any], path: Path, checkpoint_dir: Path | None, keep: int) -> None:
    """Save ``state`` at ``path`` (rank 0's job); in ``checkpoint_dir``, keep only the ``keep`` newest."""
    save_checkpoint(state, path)
    if checkpoint_dir is not None and path.parent == checkpoint_dir:
        prune_checkpoints(checkpoint_dir, keep)


def non_finite_loss_message(step: int, loss: float, checkpoint_dir: Path | None) -> str:
    """Why the run stopped at ``step``, and the checkpoint to resume from."""
    last = latest_checkpoint(checkpoint_dir) if checkpoint_dir is not None else None
    where = (
        f"the last checkpoint written is {last}: resume from it (or an earlier one) with a lower learning rate"
        if last is not None
        else "no checkpoint was written before it"
    )
    return f"step {step}: the loss became {loss}, so training stopped before saving this step; {where}"


def trainer_state(
    step: int,
    model: torch.nn.Module,
    optimizer: AccumulatingOptimizer,
    loader: StepLoader[Any, Any],
    settings: dict[str, Any],
    device: torch.device,
) -> dict[str, Any]:
    """What resumes a run at ``step``; a collective (every rank contributes its generators' states)."""
    states = gather_objects(rng_state(device), what=f"generator states for the checkpoint at step {step}")
    return {
        "step": step,
        "world_size": world().size,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "loader": loader.state_dict(),
        "rng": states,
        "settings": settings,
    }


def load_trainer_state(
    state: dict[str, Any],
    source: str,
    *,
    model: torch.nn.Module,
    optimizer: AccumulatingOptimizer,
    loader: StepLoader[Any, Any],
    settings: Mapping[str, Any],
    seed: int | None,
    device: torch.device,
) -> int:
    """Restore a :func:`trainer_state` (checked first; ``source`` is named in errors); its step."""
    check_trainer_state(state, source, optimizer=optimizer.optimizer, settings=settings)
    parts: list[tuple[str, Callable[[Any], Any]]] = [
        ("model", model.load_state_dict),
        # with this run's device options: a checkpoint moves between devices (e.g. XLA and the CPU)
        ("optimizer", lambda saved: optimizer.load_state_dict(on_this_device(saved, optimizer))),
        ("loader", loader.load_state_dict),
    ]
    for name, load in parts:
        try:
            load(state[name])
        except TraceMismatch as e:  # (says what differs and the fix itself)
            raise e.from_source(source) from e
        except (RuntimeError, ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
            detail = " ".join(str(e).split()).rstrip(". ")  # load_state_dict's report spans lines
            raise ValueError(
                f"{source}: its {name} state does not fit this run: {detail}. Resume with the settings the "
                "checkpoint was written with, or use another checkpoint directory to start afresh"
            ) from e
    _restore_generators(state, source, seed, device)
    return int(state["step"])


def _restore_generators(state: dict[str, Any], source: str, seed: int | None, device: torch.device) -> None:
    """This rank's generator states from ``state``, or, written by another number of processes,
    generators seeded from ``(seed, step, rank)`` (with a warning where there is no ``seed``)."""
    found = world()
    world_size, rank = found.size, found.rank
    saved_world = state["world_size"]
    if saved_world == world_size:
        set_rng_state(state["rng"][rank], device)
        return
    # Rank r of K' has no generator state of its own in a checkpoint of K processes.
    seed_generators(derived_seed(0 if seed is None else seed, int(state["step"]), rank), device)
    if seed is None:
        warnings.warn(
            f"{source} was written by {saved_world} processes and this run has {world_size}: the "
            f"generators are re-seeded from (step, rank), so random draws (dropout) differ from an "
            "uninterrupted run; give TraceTrainer seed= to seed each minibatch's draws world-size invariantly",
            stacklevel=4,  # the caller of TraceTrainer.load_state_dict
        )


def on_this_device(saved: Any, optimizer: torch.optim.Optimizer) -> Any:
    """``saved`` (an optimizer state dict) with the device options of ``optimizer``'s param groups.

    ``Optimizer.load_state_dict`` takes every group option from the file, ``capturable`` and
    ``fused`` too, and places the step counts by them: a state written on XLA (``capturable``)
    would make the CPU's Adam refuse its parameters, a CPU's (``fused``) XLA's.
    """
    if not isinstance(saved, dict):
        return saved
    if "param_groups" not in saved and isinstance(saved.get("optimizer"), dict):  # torchfold 0.1.0: nested
        return {**saved, "optimizer": on_this_device(saved["optimizer"], optimizer)}
    groups = saved.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(optimizer.param_groups):
        return saved  # load_state_dict says what does not fit
    return {
        **saved,
        "param_groups": [
            {**group, **{key: current[key] for key in DEVICE_OPTIONS if key in current}}
            if isinstance(group, dict)
            else group
            for group, current in zip(groups, optimizer.param_groups, strict=True)
        ],
    }
