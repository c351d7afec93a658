"""Pictures of a fold: nodes laid out by depth, each batched group drawn as one box.

Uses matplotlib only (no graphviz), from the ``plot`` extra: ``pip install 'pytorch-fold[plot]'``.
Small folds show every node and edge; folds with more than ``max_nodes`` nodes are drawn one
box per group, with edges between groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchfold.engine.node import Group, Recording, Tape

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


__all__ = ["draw_fold"]

_X_STEP = 1.7  # horizontal distance between depths, in node spacings

_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C")


def _literal(arg: Any) -> str:
    if isinstance(arg, torch.Tensor):
        if arg.numel() == 1:
            return f"{arg.item():g}"
        return "tensor\n" + "x".join(map(str, arg.shape))
    return repr(arg)


def draw_fold(
    fold: Recording,
    path: str | Path | None = None,
    *,
    max_nodes: int = 60,
    max_groups: int = 200,
    depths: range | None = None,
    title: str | None = None,
    ax: Axes | None = None,
) -> Figure:
    """Draw ``fold`` left to right by depth; every rounded box is one batched call.

    Args:
        fold: the fold to draw (before or after ``apply``).
        path: if given, the figure is saved there (format from the suffix, e.g. ``.png``).
        max_nodes: above this many nodes, draw one box per group instead of every node.
        max_groups: refuse to draw more groups than this (matplotlib takes seconds per hundred
            boxes and the picture is unreadable): draw a part with ``depths`` instead.
        depths: draw only the groups at these depths (e.g. ``range(0, 20)``); arguments
            coming from groups left out are shown as ``op@depth`` labels.
        title: figure title; default: a summary of nodes, groups and depths.
        ax: draw into these axes instead of a new figure.

    Raises:
        ValueError: more than ``max_groups`` groups to draw, or no group at ``depths``.
        ImportError: matplotlib is missing (install the ``plot`` extra).

    Example:
        >>> import torchfold
        >>> f = torchfold.Fold()
        >>> a = f.add("leaf", 1)
        >>> fig = f.draw(title="one leaf")
    """
    _require_matplotlib()
    groups = fold.groups()
    all_depths = len({g.depth for g in groups})
    if depths is not None:
        groups = [g for g in groups if g.depth in depths]
        if not groups:
            raise ValueError(
                f"depths={depths!r}: this fold has no group there (its depths are 0 to {all_depths - 1})"
            )
    if len(groups) > max_groups:
        first, stop = groups[0].depth, groups[max_groups].depth  # groups come sorted by depth
        raise ValueError(
            f"this fold has {len(groups)} batched groups over {all_depths} depths, more than max_groups={max_groups}: "
            f"so large a drawing is slow and unreadable; draw a part, e.g. fold.draw(depths=range({first}, "
            f"{max(stop, first + 1)})), or raise max_groups"
        )
    if ax is None:
        import matplotlib.pyplot as plt

    colors: dict[Any, str] = {}
    for group in groups:
        colors.setdefault(group.op, _COLORS[len(colors) % len(_COLORS)])
    if ax is None:
        width = 2.2 * _X_STEP * (max((g.depth for g in groups), default=0) + 1.5)
        height = max(
            3.0, 0.55 * max((_column_height(groups, d) for d in {g.depth for g in groups}), default=1)
        )
        fig, ax = plt.subplots(figsize=(min(width, 24), min(height, 24)))
    else:
        fig = ax.get_figure(root=True)  # type: ignore[assignment]
    nodes = sum(len(g.nodes) for g in groups)
    if nodes > max_nodes:
        _draw_groups(ax, groups, colors, fold.tape)
    else:
        _draw_nodes(ax, groups, colors, fold.tape)
    drawn = sorted({g.depth for g in groups})
    ax.set_xticks([_X_STEP * d for d in drawn], [f"depth {d}" for d in drawn])
    ax.tick_params(axis="x", length=0)
    ax.set_yticks([])
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)
    part = "" if len(drawn) == all_depths else f" (depths {drawn[0]}-{drawn[-1]} of {all_depths})"
    ax.set_title(title or f"{nodes} nodes, {len(groups)} batched calls, {len(drawn)} depths{part}", pad=22)
    ax.set_aspect("equal")  # round nodes and boxes whatever the fold's width and height
    ax.autoscale_view()
    ax.margins(0.08)
    if path is not None:
        fig.savefig(path, dpi=120, bbox_inches="tight")
    return fig


def _require_matplotlib() -> None:
    # matplotlib is the optional `plot` extra: name the extra to install, keeping the import error's type.
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise type(error)(
            f"Fold.draw needs matplotlib, which could not be imported ({error}): "
            "pip install 'pytorch-fold[plot]'",
            name=error.name,
            path=error.path,
        ) from error


def _column_height(groups: Sequence[Group], depth: int) -> float:
    return sum(len(g.nodes) + 1.2 for g in groups if g.depth == depth)


def _box(ax: Axes, x: float, y0: float, y1: float, color: str, label: str) -> None:
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(
        FancyBboxPatch(
            (x - 0.42, y0 - 0.42),
            0.84,
            y1 - y0 + 0.84,
            boxstyle="round,pad=0.02,rounding_size=0.15",
            facecolor=color,
            alpha=0.15,
            edgecolor=color,
            linewidth=1.5,
        )
    )
    ax.text(x, y1 + 0.55, label, ha="center", va="bottom", fontsize=9, color=color, fontweight="bold")


def _arrow(
    ax: Axes,
    start: tuple[float, float],
    end: tuple[float, float],
    output: int | None = None,
    dashed: bool = False,
) -> None:
    ax.annotate(
        "",
        xy=end,
        xytext=start,
        arrowprops={
            "arrowstyle": "-|>",
            "color": "#555555",
            "linewidth": 1.0,
            "linestyle": "--" if dashed else "-",
            "shrinkA": 11,
            "shrinkB": 11,
            # edges that skip depths bend more, so they do not run through the nodes in between
            "connectionstyle": f"arc3,rad={0.08 + 0.3 * max(0.0, (end[0] - start[0]) / _X_STEP - 1):.2f}",
        },
    )
    if output is not None:  # near the source, where the outputs of a multi-output call part ways
        above = output % 2 == 0
        ax.text(start[0] + 0.3, start[1] + (0.2 if above else -0.2), f"[{output}]", fontsize=7, color="#555555",
                va="bottom" if above else "top")  # fmt: skip


def _handle(arg: Any, group: Group, tape: Tape) -> tuple[Group, int, int | None, bool] | None:
    """A stored argument's producer as (group, index, output, batched), if it is a node (see ``Group``)."""
    if arg.__class__ is not int or group.depth == 0:
        return None
    source = tape.source[arg]
    batch = source >= 0
    source = source if batch else ~source
    return tape.source_group[source], tape.index[arg], tape.source_output[source], batch


def _draw_nodes(ax: Axes, groups: Sequence[Group], colors: dict[Any, str], tape: Tape) -> None:
    position: dict[tuple[Group, int], tuple[float, float]] = {}
    literals: list[tuple[str, tuple[float, float]]] = []  # (text, consumer position)
    heights = {d: _column_height(groups, d) for d in {g.depth for g in groups}}
    cursor: dict[int, float] = {}
    for group in groups:
        y = cursor.get(group.depth, heights[group.depth] / 2)
        top = y
        for index in range(len(group.nodes)):
            position[(group, index)] = (_X_STEP * group.depth, y - index)
        bottom = y - (len(group.nodes) - 1)
        _box(ax, _X_STEP * group.depth, bottom, top, colors[group.op], f"{group.name} ×{len(group.nodes)}")
        cursor[group.depth] = bottom - 2.2
    for group in groups:
        for index, args in enumerate(group.calls):
            x, y = position[(group, index)]
            ax.scatter([x], [y], s=380, color=colors[group.op], zorder=3, edgecolors="white")
            ax.text(x, y, str(index), ha="center", va="center", color="white", fontsize=8, zorder=4)
            for slot, arg in enumerate(args):
                node = _handle(arg, group, tape)
                source = position.get(node[:2]) if node is not None else None
                if node is not None and source is not None:
                    _arrow(ax, source, (x, y), node[2], dashed=not node[3])
                elif node is not None:  # from a depth not drawn
                    spot = (x - 0.55, y + 0.25 * (slot - (len(args) - 1) / 2))
                    literals.append((f"{node[0].name}@{node[0].depth}", spot))
                elif arg.__class__ is tuple:  # a tagged literal (see Group)
                    literals.append((repr(arg[1]), (x - 0.55, y + 0.25 * (slot - (len(args) - 1) / 2))))
                else:
                    literals.append((_literal(arg), (x - 0.55, y + 0.25 * (slot - (len(args) - 1) / 2))))
    for text, (lx, ly) in literals:
        ax.text(lx, ly, text, ha="right", va="center", fontsize=7, color="#333333",
                bbox={"boxstyle": "round,pad=0.15", "facecolor": "#f2f2f2", "edgecolor": "#bbbbbb"})  # fmt: skip


def _draw_groups(ax: Axes, groups: Sequence[Group], colors: dict[Any, str], tape: Tape) -> None:
    position: dict[Group, tuple[float, float]] = {}
    cursor: dict[int, float] = {}
    for group in groups:
        y = cursor.get(group.depth, 0.0)
        x = _X_STEP * group.depth
        position[group] = (x, y)
        cursor[group.depth] = y - 2.0
        _box(ax, x, y, y, colors[group.op], "")
        ax.text(x, y, f"{group.name}\n×{len(group.nodes)}", ha="center", va="center", fontsize=8)
    for group in groups:
        feeders = {
            node[0] for args in group.nodes for arg in args if (node := _handle(arg, group, tape)) is not None
        }
        for source in sorted(feeders & position.keys(), key=lambda g: (g.depth, g.order)):
            _arrow(ax, position[source], position[group])
