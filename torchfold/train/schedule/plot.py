"""Plotting batch-size traces (and the learning rate they give) to PNG files.

matplotlib is imported when a plot is drawn, not with this module: the rest of training does not
need it. Without it, plotting raises an ImportError that names the extra to install.

A trace is read through :class:`PlottedTrace`, what :func:`plot_trace` needs of one, so that
this module knows nothing of :mod:`torchfold.train.schedule.trace`, whose ``BatchSizeTrace.plot`` it is.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

from torchfold._validate import check_int
from torchfold.train.optim.lr import scaled_lr

__all__ = ["plot_trace"]


def _figure_class() -> Any:
    """matplotlib's bare ``Figure`` (it renders with Agg and leaves pyplot's global state alone)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            f"plotting a trace needs matplotlib, which is not installed ({e}); pip install 'pytorch-fold[plot]'"
        ) from e
    return Figure


class PlottedTrace(Protocol):
    """What :func:`plot_trace` reads of a trace: a :class:`~torchfold.train.schedule.trace.BatchSizeTrace` is one."""

    @property
    def source(self) -> str: ...

    @property
    def num_steps(self) -> int | None: ...

    @property
    def batch_sizes(self) -> tuple[int, ...]: ...

    def __getitem__(self, step: int) -> int: ...

    def require_bounded(self, what: str) -> None: ...


def plot_trace(
    trace: PlottedTrace,
    path: str | os.PathLike[str],
    *,
    lr: float | None = None,
    ref_batch_size: int | None = None,
    rule: str = "linear",
    num_steps: int | None = None,
) -> None:
    """Plot ``trace``'s batch size over steps (and, with ``lr``, the learning rate under ``rule``) to a PNG.

    Args:
        trace: the batch-size trace.
        path: output image file.
        lr: base learning rate at ``ref_batch_size``; adds a learning-rate panel.
        ref_batch_size: reference batch size for ``lr`` (default: the first step's batch size).
        rule: ``"constant"``, ``"linear"`` or ``"sqrt"`` (see :func:`~torchfold.train.optim.lr.scaled_lr`).
        num_steps: how many steps to plot (required for an unbounded trace).

    Raises:
        ImportError: matplotlib is not installed (``pip install 'pytorch-fold[plot]'``).
    """
    Figure = _figure_class()
    if num_steps is None:
        trace.require_bounded("plot without num_steps")
        num_steps = len(trace.batch_sizes)
    check_int("num_steps", num_steps)
    sizes = [trace[s] for s in range(min(num_steps, trace.num_steps or num_steps))]
    ref = sizes[0] if ref_batch_size is None else ref_batch_size
    lrs = None if lr is None else [scaled_lr(lr, b, ref, rule) for b in sizes]
    panels = 1 if lrs is None else 2
    fig = Figure(figsize=(8, 2.6 * panels))
    axes = fig.subplots(panels, 1, sharex=True, squeeze=False)
    steps = range(len(sizes))
    axes[0][0].step(steps, sizes, where="post")
    axes[0][0].set_ylabel("global batch size")
    axes[0][0].set_title(f"{Path(trace.source).name}: {len(sizes)} steps, {sum(sizes)} samples")
    if lrs is not None:
        axes[1][0].step(steps, lrs, where="post", color="tab:orange")
        axes[1][0].set_ylabel(f"lr ({rule}, {lr} @ {ref})")
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
