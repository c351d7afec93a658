"""A run's metrics in TensorBoard: :class:`TensorBoardWriter`, a metrics callback for :class:`~torchfold.train.TraceTrainer`.

Needs the ``tensorboard`` extra (``pip install 'pytorch-fold[tensorboard]'``): PyTorch's
``SummaryWriter`` writes TensorBoard's event files with the ``tensorboard`` package.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

__all__ = ["TensorBoardWriter"]


class TensorBoardWriter:
    """Write each metric a run reports as a TensorBoard scalar, at the step it is of.

    Give it to the trainer as ``TraceTrainer(..., on_metrics=[TensorBoardWriter("runs/a")])``: the
    main rank's log lines (``train/loss``, ``train/lr``, ...) and evaluations (``eval/<name>``)
    are then written to ``log_dir`` (view them with ``tensorboard --logdir runs``).

    Args:
        log_dir: the directory of the event files (created if missing).
        **kwargs: passed to ``torch.utils.tensorboard.SummaryWriter`` (e.g. ``flush_secs``).

    Raises:
        ImportError: the ``tensorboard`` package is missing, naming the extra that installs it.
    """

    def __init__(self, log_dir: str | os.PathLike[str], **kwargs: Any) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when asked for
        except ImportError as e:
            raise ImportError(
                f"TensorBoardWriter needs the tensorboard package, which is not installed ({e}); "
                "pip install 'pytorch-fold[tensorboard]'"
            ) from e
        self.log_dir = os.fspath(log_dir)
        self.writer = SummaryWriter(log_dir=self.log_dir, **kwargs)

    def __call__(self, step: int, metrics: Mapping[str, float]) -> None:
        """Write ``metrics`` at ``step`` (a metrics callback: see ``TraceTrainer(on_metrics=)``)."""
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()

    def __enter__(self) -> TensorBoardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
