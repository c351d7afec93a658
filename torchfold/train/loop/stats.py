"""What one optimizer step did (:class:`StepStats`), and its loss read back from the device.

A step's loss stays on the device as a weighted sum until it is read: at once, summed over the
ranks with the stop requests in one all-reduce (:func:`summed_over_ranks`), or, in one process
on an accelerator, after the next step has been launched (:func:`read_loss`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from torchfold._deprecation import RenamedAttribute
from torchfold.train.data.sampler import StepSplit
from torchfold.train.distributed.world import all_reduce_sum_, world
from torchfold.train.optim.optimizer import AccumulatingOptimizer

__all__ = ["StepLoss", "StepStats", "read_loss", "step_stats", "summed_over_ranks"]

#: a step's loss left on the device: the weighted sum of its minibatches' losses, as (tensor, factor)
StepLoss = tuple[torch.Tensor, float]

#: the message of a loss that became NaN or infinite, from the step and the loss
NonFiniteMessage = Callable[[int, float], str]


@dataclass(frozen=True)
class StepStats:
    """What happened in one optimizer step (the same on every rank, except the ``local_`` fields).

    Args:
        step: global step index into the trace.
        epoch: the epoch of the step.
        batch_size: global number of samples in the step.
        num_minibatches: minibatches in the step over all ranks.
        local_minibatches: minibatches this rank ran (may be 0).
        local_nodes: nodes in this rank's plans in the step.
        lr: learning rate of the first parameter group in the update (after the LR rule).
        loss: mean loss over the step's global batch (over all ranks).
        seconds: wall time of the step on this rank.
        num_replicas: processes (replicas) that shared the step (:attr:`World.size`).
        stop_requested: some rank received SIGTERM by the end of the step: the run stops after it.
        metrics: the metrics of the evaluation run after this step (``TraceTrainer(evaluate=...)``),
            by name; empty where none ran.
    """

    step: int
    epoch: int
    batch_size: int
    num_minibatches: int
    local_minibatches: int
    local_nodes: int
    lr: float
    loss: float
    seconds: float
    num_replicas: int = 1
    stop_requested: bool = False
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)

    world_size = RenamedAttribute("num_replicas", "processes that shared the step")


def step_stats(
    split: StepSplit, optimizer: AccumulatingOptimizer, nodes: int, start: float, stop_requested: bool
) -> StepStats:
    """The stats of the step ``split`` that ``optimizer`` has just ended, its loss still unread (NaN);
    a RuntimeError where the ranks together ran another number of samples than the loader planned."""
    if optimizer.last_batch_size != split.batch_size:
        raise RuntimeError(
            f"step {split.step}: the ranks together ran {optimizer.last_batch_size} samples but the "
            f"loader planned {split.batch_size}; every rank needs a loader with num_replicas = world size "
            "and the same trace, dataset, batch size and seed"
        )
    return StepStats(
        step=split.step,
        epoch=split.epoch,
        batch_size=split.batch_size,
        num_minibatches=optimizer.last_num_minibatches,  # a split minibatch counts as its parts
        local_minibatches=split.local_minibatches,
        local_nodes=nodes,
        lr=float(optimizer.param_groups[0]["lr"]) * optimizer.last_lr_factor,
        loss=math.nan,
        seconds=time.perf_counter() - start,
        num_replicas=world().size,
        stop_requested=stop_requested,
    )


def summed_over_ranks(
    stats: StepStats,
    loss: torch.Tensor,
    samples: int,
    stop_requested: bool,
    dtype: torch.dtype,
    start: float,
    non_finite: NonFiniteMessage,
) -> StepStats:
    """``stats`` with the step's mean loss and stop request over every rank (one all-reduce of
    ``loss``, this rank's ``samples`` and its ``stop_requested``, in ``dtype``); a FloatingPointError with
    ``non_finite``'s message where the loss is not finite (the same sum on every rank: all stop)."""
    local = [float(samples), float(stop_requested)]
    totals = torch.cat([loss.reshape(1), torch.tensor(local, dtype=dtype, device=loss.device)])
    all_reduce_sum_([totals])
    total_loss, total_samples, stopping_ranks = totals.tolist()
    if total_samples and not math.isfinite(total_loss):
        raise FloatingPointError(non_finite(stats.step, total_loss / total_samples))
    return dataclasses.replace(
        stats,
        loss=total_loss / total_samples if total_samples else math.nan,
        seconds=time.perf_counter() - start,
        stop_requested=stopping_ranks > 0,
    )


def read_loss(stats: StepStats, loss: StepLoss | None, non_finite: NonFiniteMessage) -> StepStats:
    """``stats`` with the loss of a deferred step read back (a wait for that step only)."""
    if loss is None:
        return stats
    total = float(loss[0]) * loss[1]
    if stats.batch_size and not math.isfinite(total):
        raise FloatingPointError(non_finite(stats.step, total / stats.batch_size))
    return dataclasses.replace(stats, loss=total / stats.batch_size if stats.batch_size else math.nan)
