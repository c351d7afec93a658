"""The figure of an elastic run (``elastic.png``), drawn with matplotlib's Agg backend."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torchfold.cli.elastic_schedule import ElasticSchedule
from torchfold.train.schedule.availability import AvailabilityInterval

__all__ = ["plot_elastic", "plot_unavailable"]


def plot_unavailable() -> str | None:
    """Why ``elastic.png`` cannot be drawn here (matplotlib, the ``plot`` extra, does not import), else ``None``.

    The elastic run asks before it trains, and then trains and compares without the picture.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        return f"matplotlib could not be imported ({e}); pip install 'pytorch-fold[plot]' to draw it"
    return None


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds >= 2 * 3600:
        return 3600.0, "h"
    if seconds >= 120:
        return 60.0, "min"
    return 1.0, "s"


def plot_elastic(
    path: Path,
    intervals: Sequence[AvailabilityInterval],
    schedule: ElasticSchedule,
    rows: list[dict[str, Any]],
    group_starts: Sequence[int],
    title: str,
) -> None:
    """Write the elastic run's figure to ``path``: availability and processes, batch, accumulation, LR, loss.

    ``group_starts``: the first step of each group after the first (a dashed line marks each).
    """
    # A bare Figure renders with Agg and leaves pyplot's global backend and figures alone.
    from matplotlib.figure import Figure

    origin = intervals[0].start_time
    horizon = schedule.steps[-1].trace_time + schedule.step_time
    scale, unit = _time_unit(horizon)
    fig = Figure(figsize=(9, 12))
    axes = fig.subplots(5, 1)
    # Panel 1, over trace time: what the trace offered and what the elastic run ran.
    shown = [i for i in intervals if i.start_time - origin < horizon]
    times = [(i.start_time - origin) / scale for i in shown] + [
        min(shown[-1].end_time - origin, horizon) / scale
    ]
    devices = [i.devices for i in shown]
    ax = axes[0]
    ax.step(times, [*devices, devices[-1]], where="post", color="tab:gray", label="devices available")
    ax.set_ylabel("devices available")
    ax.set_xlabel(f"trace time ({unit})")
    twin = ax.twinx()
    # Processes over time: each step's group, none during a pause, held to the end of the last step.
    used = sorted(
        [(r["trace_time_s"], r["processes"]) for r in rows] + [(p.start_time, 0) for p in schedule.pauses]
    )
    used.append((horizon, used[-1][1]))
    twin.step(
        [t / scale for t, _ in used],
        [n for _, n in used],
        where="post",
        color="tab:blue",
        label="processes used",
    )
    twin.set_ylabel("processes used", color="tab:blue")
    twin.set_ylim(0, max(r["processes"] for r in rows) + 0.5)
    for pause in schedule.pauses:
        ax.axvspan(pause.start_time / scale, pause.end_time / scale, color="tab:red", alpha=0.15, lw=0)
    ax.set_title(title)
    handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(handles, [str(h.get_label()) for h in handles], loc="lower left", fontsize=8)
    # Panels 2-5, over steps.
    # A step plot draws a value from its step to the next: repeat the last value at the end step.
    steps = [r["step"] for r in rows] + [rows[-1]["step"] + 1]
    rows = [*rows, rows[-1]]
    panels = [
        (axes[1], [r["global_batch"] for r in rows], "global batch", "tab:green"),
        (
            axes[2],
            [r["accumulation_minibatches"] for r in rows],
            "accumulation\nminibatches / process",
            "tab:purple",
        ),
        (axes[3], [r["lr"] for r in rows], "learning rate", "tab:orange"),
    ]
    for ax, values, label, color in panels:
        ax.step(steps, values, where="post", color=color)
        ax.set_ylabel(label)
    axes[2].step(
        steps, [r["processes"] for r in rows], where="post", color="tab:blue", alpha=0.6, label="processes"
    )
    axes[2].legend(loc="upper right", fontsize=8)
    # Losses are points, one per step: without the repeated end.
    axes[4].plot(steps[:-1], [r["loss"] for r in rows[:-1]], color="tab:red", label="elastic run")
    if any(r["reference_loss"] != "" for r in rows):
        axes[4].plot(
            steps[:-1],
            [math.nan if r["reference_loss"] == "" else r["reference_loss"] for r in rows[:-1]],
            color="black",
            ls=":",
            label="one uninterrupted process",
        )
    axes[4].set_ylabel("loss")
    axes[4].legend(loc="upper right", fontsize=8)
    axes[4].set_xlabel("step")
    for ax in axes[1:]:
        for start in group_starts:
            ax.axvline(start, color="gray", lw=0.6, ls="--")
        for pause in schedule.pauses:
            ax.axvline(pause.first_step, color="tab:red", lw=1.2, alpha=0.5)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=90)
