"""A plan read as padding reads it: per group (batched call) its slot and argument columns.

What :class:`~torchfold.engine.static.shapes.StaticShapes` checks a plan against (does it
fit the envelope?) and what :class:`~torchfold.engine.static.layout.StaticLayout` pads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from torchfold._errors import FoldError
from torchfold.engine.ir import Arg, GroupCall, PlanData

__all__ = ["Batch", "Column", "OpKey", "Stream", "count_items", "decode", "request_kinds"]

# An op as the envelope knows it: (op, arity, outputs split, the kind of every argument position)
OpKey = tuple[Any, ...]
# One output of an op (None: its single result) that argument positions read
Stream = tuple[OpKey, int | None]
_Tensor = torch.Tensor


@dataclass
class Column:
    """One argument position of one batched call, as padding sees it.

    ``kind`` is ``"nodes"`` (rows of earlier results: ``sources`` and ``calls`` per call),
    ``"shared"`` (one ``nobatch`` node passed whole), ``"ints"``/``"floats"`` (a numpy column)
    or ``"given"`` (tensors given to ``add``, one per call).
    """

    kind: str
    sources: np.ndarray | None = None
    calls: np.ndarray | None = None
    values: Any = None
    _unique: tuple[np.ndarray, np.ndarray] | None = field(default=None, init=False, repr=False)

    def unique_sources(self) -> tuple[np.ndarray, np.ndarray]:
        """The distinct sources read, and each call's place among them (fitting and padding both ask)."""
        if self._unique is None:
            assert self.sources is not None
            self._unique = np.unique(self.sources, return_inverse=True)
        return self._unique


@dataclass
class Batch:
    """A plan decoded for fitting: per group its slot and columns, per request its column."""

    slots: list[tuple[int, OpKey]]
    names: list[str]
    calls: list[int]
    columns: list[list[Column]]
    requests: list[Column]
    streams: list[Stream]  # per source number
    depths: list[int]  # per source number: the depth of the group that makes it
    owner: list[tuple[int, int | None]]  # per source number: (group, output) that makes it


def decode(plan: PlanData) -> Batch:
    columns = [_group_columns(plan, group) for group in plan.groups]
    keys: list[OpKey] = [
        (
            group.op,
            group.arity,
            group.num_outputs,
            tuple(column.kind for column in cols),
            _given_layouts(cols),
        )
        for group, cols in zip(plan.groups, columns, strict=True)
    ]
    streams: list[Stream] = [(keys[number], output) for number, output in plan.source_owner]
    depths = [plan.groups[number].depth for number, _ in plan.source_owner]
    return Batch(
        slots=[(group.depth, key) for group, key in zip(plan.groups, keys, strict=True)],
        names=[group.name for group in plan.groups],
        calls=[group.num_calls for group in plan.groups],
        columns=columns,
        requests=[_request_column(plan, request, number) for number, request in enumerate(plan.requests)],
        streams=streams,
        depths=depths,
        owner=list(plan.source_owner),
    )


def _given_layouts(columns: list[Column]) -> tuple[Any, ...]:
    """Per position, the rows, row shape and dtype of its given tensors (None for others): part of
    an op's key, so that tensors of another layout get a slot of their own instead of a wrong one."""
    layouts: list[Any] = []
    for column in columns:
        if column.kind != "given":
            layouts.append(None)
            continue
        first = column.values[0]
        layouts.append((tuple(first.shape), first.dtype))
    return tuple(layouts)


def _group_columns(plan: PlanData, group: GroupCall) -> list[Column]:
    columns: list[Column | None] = [None] * group.arity
    for position, arg in group.fixed:
        kind, value = arg.kind, arg.value
        if kind in ("ints", "floats"):
            columns[position] = Column(kind, values=value)
        elif kind == "tensor":
            columns[position] = Column("given", values=[value])
        elif kind == "concat":
            columns[position] = Column("given", values=list(value))
        elif kind == "shared":
            source, call = value
            columns[position] = Column("shared", np.array([source]), np.array([call]))
        else:  # rows, whole
            columns[position] = _nodes_column(plan, arg, group.where(position))
    for gather in group.gathers:
        item_piece, item_call = gather.items()
        given = [number for number, piece in enumerate(gather.pieces) if not isinstance(piece, int)]
        if len(given) == len(gather.pieces):  # tensors only (some calls pass the same one): each call's
            start = 0
            for position, size in zip(gather.positions, gather.sizes, strict=True):
                pieces = item_piece[start : start + size].tolist()
                columns[position] = Column("given", values=[gather.pieces[p] for p in pieces])
                start += size
            continue
        if given:
            first_item = int(np.flatnonzero(np.isin(item_piece, given))[0])
            position = gather.positions[
                int(np.searchsorted(np.cumsum(gather.sizes), first_item, side="right"))
            ]
            raise FoldError(
                f"{group.where(position)}: static shapes cannot pad a position that mixes nodes and "
                "tensors given to add; record the tensors through an op (fold.add('input', tensor) with "
                "def input(self, x): return x) so that the position reads nodes only"
            )
        item_source = np.asarray(gather.pieces, dtype=np.int64)[item_piece]
        start = 0
        for position, size in zip(gather.positions, gather.sizes, strict=True):
            end = start + size
            columns[position] = Column("nodes", item_source[start:end], item_call[start:end])
            start = end
    return [column for column in columns if column is not None]


def _request_column(plan: PlanData, request: Any, number: int) -> Column:
    """A request: node rows (padded like a position), ints or floats (padded), or given tensors (passed as is)."""
    if isinstance(request, Arg) and request.kind in ("ints", "floats"):
        return Column(request.kind, values=request.value)
    if isinstance(request, Arg) and request.kind == "concat":
        return Column("given", values=list(request.value))
    if not isinstance(request, Arg) and not all(isinstance(piece, int) for piece in request.pieces):
        raise FoldError(
            f"apply request {number}: static shapes cannot pad a request that mixes nodes and tensors; ask for "
            "the nodes in one request and pass the tensors (targets) to the loss yourself, padded with plan.pad"
        )
    return _nodes_column(plan, request, f"apply request {number}")


def _nodes_column(plan: PlanData, arg: Any, where: str) -> Column:
    """A position or request reading rows of earlier results, whatever shortcut the planner chose."""
    if isinstance(arg, Arg):
        if arg.kind == "whole":
            source = arg.value
            calls = plan.groups[plan.source_owner[source][0]].num_calls
            return Column("nodes", np.full(calls, source, dtype=np.int64), np.arange(calls, dtype=np.int64))
        if arg.kind == "rows":
            source, call = arg.value
            return Column("nodes", np.array([source], dtype=np.int64), np.array([call], dtype=np.int64))
        raise AssertionError(f"{where}: unexpected argument kind {arg.kind!r}")  # pragma: no cover
    item_piece, item_call = arg.items()
    return Column("nodes", np.asarray(arg.pieces, dtype=np.int64)[item_piece], item_call)


def request_kinds(batch: Batch) -> tuple[str, ...]:
    """What a plan asks for, as the envelope keeps it apart: the kind of each request."""
    return tuple(column.kind for column in batch.requests)


def count_items(column: Column) -> int:
    """Calls (items) in a column."""
    if column.sources is not None:
        return len(column.sources)
    return len(column.values)
