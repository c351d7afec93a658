"""Static shapes: pad compiled plans so that the graphs XLA compiles repeat from batch to batch.

XLA (TPUs, and ``torch_xla`` on the CPU) compiles one program per distinct sequence of tensor
operations and shapes. An unpadded plan has a different sequence of (depth, op, calls) for every
batch of trees, so every batch compiles anew (seconds each). :class:`StaticShapes` is a
grow-only *envelope* learned over the batches it sees:

* one **slot** per (depth, op signature), holding a capacity taken from a bucket ladder
  (powers of two from ``min_rows`` by default) that only grows;
* the number of depth levels is the deepest level seen times ``headroom``, rounded up to a
  multiple of ``level_step``; the levels past the deepest one seen repeat its ops at the
  smallest bucket, so a somewhat deeper batch still fits;
* each argument position of an op reads the concatenation of the earlier slots' outputs of the
  op outputs ("streams") it has ever read, as far back in depth as it has ever read them times
  ``headroom`` (its *reach*), so which tensors a gather concatenates depends on the envelope
  only, never on the batch. The reach keeps a chain linear: an RNN step reads the level just
  before it, not every earlier level (which made a chain of n calls cost O(n²)).

:meth:`StaticShapes.fit` pads a :class:`~torchfold.FoldPlan` into the envelope, growing it when
the plan does not fit, and returns a :class:`StaticPlan`. Every plan fitted to one version of
the envelope runs the same tensor operations on the same shapes; only the index data differs.
So after a warm-up the number of compiled graphs stays fixed.

Padding never shows: a padded call repeats the arguments of a real call of its column (a real
row, an int or float the column holds, a given tensor's rows), so padded rows are finite and
computed like real ones, and no real row and no request reads them. ``apply`` returns exactly the
requested rows; ``apply(model, padded=True)`` returns them padded to the envelope's capacity, for
a loss whose shape must not vary either (weight the padded rows with 0, see :meth:`StaticPlan.pad`).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from torchfold._errors import FoldError, add_note
from torchfold._validate import check_int
from torchfold.engine.ir import (
    Arg,
    GroupCall,
    PlanData,
    check_pad_rows,
    check_portable_op,
    check_request_number,
    portable_tensors,
)
from torchfold.engine.node import Op
from torchfold.engine.resolve import check_unchanged, module_device, resolve_ops, versions

__all__ = ["StaticInputs", "StaticLayout", "StaticPlan", "StaticShapes", "StaticShapesWarning"]

_Tensor = torch.Tensor
# An op as the envelope knows it: (op, arity, outputs split, the kind of every argument position)
OpKey = tuple[Any, ...]
# One output of an op (None: its single result) that argument positions read
Stream = tuple[OpKey, int | None]


_NUMPY_DEFAULT = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}
_BY_MODULE: weakref.WeakKeyDictionary[Any, StaticShapes] = weakref.WeakKeyDictionary()


class StaticShapesWarning(UserWarning):
    """A plan did not fit a warmed-up envelope: it grows, and the next run compiles a new graph."""


@dataclass
class _Column:
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
class _Batch:
    """A plan decoded for fitting: per step its slot and columns, per request its column."""

    slots: list[tuple[int, OpKey]]
    names: list[str]
    calls: list[int]
    columns: list[list[_Column]]
    requests: list[_Column]
    streams: list[Stream]  # per source number
    depths: list[int]  # per source number: the depth of the step that makes it


def _decode(plan: PlanData) -> _Batch:
    columns = [_step_columns(plan, step) for step in plan.steps]
    keys: list[OpKey] = [
        (step.op, step.arity, step.num_outputs, tuple(column.kind for column in cols), _given_layouts(cols))
        for step, cols in zip(plan.steps, columns, strict=True)
    ]
    streams: list[Stream] = [(keys[number], output) for number, output in plan.source_owner]
    depths = [plan.steps[number].depth for number, _ in plan.source_owner]
    return _Batch(
        slots=[(step.depth, key) for step, key in zip(plan.steps, keys, strict=True)],
        names=[step.name for step in plan.steps],
        calls=[step.num_calls for step in plan.steps],
        columns=columns,
        requests=[_request_column(plan, request, number) for number, request in enumerate(plan.requests)],
        streams=streams,
        depths=depths,
    )


def _given_layouts(columns: list[_Column]) -> tuple[Any, ...]:
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


def _step_columns(plan: PlanData, step: GroupCall) -> list[_Column]:
    columns: list[_Column | None] = [None] * step.arity
    for position, arg in step.fixed:
        kind, value = arg.kind, arg.value
        if kind in ("ints", "floats"):
            columns[position] = _Column(kind, values=value)
        elif kind == "tensor":
            columns[position] = _Column("given", values=[value])
        elif kind == "concat":
            columns[position] = _Column("given", values=list(value))
        elif kind == "shared":
            source, call = value
            columns[position] = _Column("shared", np.array([source]), np.array([call]))
        else:  # rows, whole
            columns[position] = _nodes_column(plan, arg, step.where(position))
    for gather in step.gathers:
        item_piece, item_call = gather.items()
        given = [number for number, piece in enumerate(gather.pieces) if not isinstance(piece, int)]
        if len(given) == len(gather.pieces):  # tensors only (some calls pass the same one): each call's
            start = 0
            for position, size in zip(gather.positions, gather.sizes, strict=True):
                pieces = item_piece[start : start + size].tolist()
                columns[position] = _Column("given", values=[gather.pieces[p] for p in pieces])
                start += size
            continue
        if given:
            first_item = int(np.flatnonzero(np.isin(item_piece, given))[0])
            position = gather.positions[
                int(np.searchsorted(np.cumsum(gather.sizes), first_item, side="right"))
            ]
            raise FoldError(
                f"{step.where(position)}: static shapes cannot pad a position that mixes nodes and "
                "tensors given to add; record the tensors through an op (fold.add('input', tensor) with "
                "def input(self, x): return x) so that the position reads nodes only"
            )
        item_source = np.asarray(gather.pieces, dtype=np.int64)[item_piece]
        start = 0
        for position, size in zip(gather.positions, gather.sizes, strict=True):
            end = start + size
            columns[position] = _Column("nodes", item_source[start:end], item_call[start:end])
            start = end
    return [column for column in columns if column is not None]


def _request_column(plan: PlanData, request: Any, number: int) -> _Column:
    """A request: node rows (padded like a position), ints or floats (padded), or given tensors (passed as is)."""
    if isinstance(request, Arg) and request.kind in ("ints", "floats"):
        return _Column(request.kind, values=request.value)
    if isinstance(request, Arg) and request.kind == "concat":
        return _Column("given", values=list(request.value))
    if not isinstance(request, Arg) and not all(isinstance(piece, int) for piece in request.pieces):
        raise FoldError(
            f"apply request {number}: static shapes cannot pad a request that mixes nodes and tensors; ask for "
            "the nodes in one request and pass the tensors (targets) to the loss yourself, padded with plan.pad"
        )
    return _nodes_column(plan, request, f"apply request {number}")


def _nodes_column(plan: PlanData, arg: Any, where: str) -> _Column:
    """A position or request reading rows of earlier results, whatever shortcut the compiler chose."""
    if isinstance(arg, Arg):
        if arg.kind == "whole":
            source = arg.value
            calls = plan.steps[plan.source_owner[source][0]].num_calls
            return _Column("nodes", np.full(calls, source, dtype=np.int64), np.arange(calls, dtype=np.int64))
        if arg.kind == "rows":
            source, call = arg.value
            return _Column("nodes", np.array([source], dtype=np.int64), np.array([call], dtype=np.int64))
        raise AssertionError(f"{where}: unexpected argument kind {arg.kind!r}")  # pragma: no cover
    item_piece, item_call = arg.items()
    return _Column("nodes", np.asarray(arg.pieces, dtype=np.int64)[item_piece], item_call)


def _signature(batch: _Batch) -> tuple[str, ...]:
    """What a plan asks for, as the envelope keeps it apart: the kind of each request."""
    return tuple(column.kind for column in batch.requests)


def _count(column: _Column) -> int:
    """Calls (items) in a column."""
    if column.sources is not None:
        return len(column.sources)
    return len(column.values)


class StaticShapes:
    """A grow-only envelope of padded shapes: plans fitted to it repeat the same XLA graphs.

    The default for folds applied on an XLA device (one envelope per module); pass one to
    :class:`~torchfold.Fold` (``Fold(shapes=StaticShapes())``) to choose the ladder, to share it,
    or to pad on a CPU or GPU too (static shapes are what CUDA graphs need as well).

    Args:
        min_rows: the smallest bucket, in calls (default 16).
        growth: each bucket of the ladder is this factor times the previous one (default 1.5).
        sizes: an explicit ladder instead (increasing ints); a group larger than its last size
            gets a bucket grown from it by ``growth``, with a warning, never an error.
        level_step: the number of depth levels is rounded up to a multiple of this (default 8).
        headroom: a group that outgrows its slot gets the bucket of this many times its calls
            (default 1.3): more room against later growth, for more padding.
        warmup: plans fitted before growing the envelope warns (default 20); growth during the
            warm-up is expected and silent.

    Example:
        >>> import torch, torchfold
        >>> class Sum(torch.nn.Module):
        ...     def leaf(self, x):
        ...         return x.float().unsqueeze(1)
        ...     def add(self, a, b):
        ...         return a + b
        >>> shapes = torchfold.StaticShapes(min_rows=4)
        >>> f = torchfold.Fold(shapes=shapes)
        >>> a, b, c = f.add("leaf", 1), f.add("leaf", 2), f.add("leaf", 3)
        >>> plan = f.plan([[f.add("add", f.add("add", a, b), c)]])
        >>> plan.apply(Sum())
        [tensor([[6.]])]
        >>> plan.apply(Sum(), padded=True)[0].shape, plan.sizes, plan.capacities
        (torch.Size([4, 1]), [1], [4])
    """

    def __init__(
        self,
        *,
        min_rows: int = 16,
        growth: float = 1.5,
        sizes: Sequence[int] | None = None,
        level_step: int = 8,
        headroom: float = 1.3,
        warmup: int = 20,
    ) -> None:
        self.min_rows = check_int("StaticShapes(min_rows)", min_rows, 1)
        if (
            isinstance(growth, bool)
            or not isinstance(growth, int | float)
            or not growth > 1
            or math.isinf(growth)
        ):
            raise ValueError(f"StaticShapes(growth={growth!r}): growth must be a finite number > 1, like 2.0")
        self.growth = float(growth)
        self.sizes: tuple[int, ...] | None = None
        if sizes is not None:
            if not isinstance(sizes, Iterable):
                raise TypeError(
                    f"StaticShapes(sizes={sizes!r}): sizes must be a sequence of positive ints, like (8, 32, 128)"
                )
            ladder = tuple(sizes)
            if not ladder or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in ladder):
                raise ValueError(
                    f"StaticShapes(sizes={sizes!r}): sizes must be positive ints, like (8, 32, 128)"
                )
            if any(b <= a for a, b in itertools.pairwise(ladder)):
                raise ValueError(
                    f"StaticShapes(sizes={sizes!r}): sizes must increase strictly, like (8, 32, 128)"
                )
            self.sizes = ladder
        self.level_step = check_int("StaticShapes(level_step)", level_step, 1)
        if (
            isinstance(headroom, bool)
            or not isinstance(headroom, int | float)
            or not 1 <= headroom < math.inf
        ):
            raise ValueError(
                f"StaticShapes(headroom={headroom!r}): headroom must be a finite number >= 1, like 1.25"
            )
        self.headroom = float(headroom)
        self.warmup = check_int("StaticShapes(warmup)", warmup, 0)
        self._capacity: dict[tuple[int, OpKey], int] = {}
        self._order: dict[OpKey, int] = {}  # ops in first-seen order: the order of slots at a depth
        self._names: dict[OpKey, str] = {}
        # what each position of an op reads: per stream, its reach (levels back)
        self._streams: dict[tuple[OpKey, int], dict[Stream, int]] = {}
        self._fills: dict[tuple[OpKey, int], Any] = {}  # a value that pads an ints/floats/given position
        # per request signature (the kinds of the requests, in order): each request's kind, capacity
        # and streams; training ([nodes]) and evaluation ([roots]) then keep an envelope each
        self._requests: dict[tuple[str, ...], list[tuple[str, int, set[Stream]]]] = {}
        self._deepest = -1
        self._levels = 0
        self._layouts: dict[tuple[str, ...], StaticLayout] = {}
        #: how many times the envelope grew: the number of distinct graphs it has asked for
        self.version = 0
        # who this envelope is, in layout keys: travels with its pickles (to loader workers)
        self._token = uuid.uuid4().hex
        #: plans fitted so far
        self.plans = 0
        #: calls that plans held, and calls run after padding (``padded_calls / real_calls - 1`` is the waste)
        self.real_calls = 0
        self.padded_calls = 0

    def __repr__(self) -> str:
        return (
            f"StaticShapes(version={self.version}, plans={self.plans}, slots={len(self._capacity)}, "
            f"levels={self._levels}, waste={self.waste:.2f})"
        )

    @classmethod
    def of(cls, module: object) -> StaticShapes:
        """The envelope that folds applied on an XLA device use for ``module`` (made on first use).

        >>> import torch
        >>> model = torch.nn.Linear(2, 2)
        >>> StaticShapes.of(model) is StaticShapes.of(model)
        True
        """
        shapes = _BY_MODULE.get(module)
        if shapes is None:
            shapes = _BY_MODULE[module] = cls()
        return shapes

    @property
    def waste(self) -> float:
        """Padded calls per real call over all plans fitted (0.0: no padding)."""
        return self.padded_calls / self.real_calls - 1 if self.real_calls else 0.0

    def bucket(self, calls: int) -> int:
        """The capacity the ladder gives a group of ``calls`` calls.

        >>> StaticShapes().bucket(9), StaticShapes().bucket(17), StaticShapes(sizes=(10, 100)).bucket(101)
        (16, 24, 150)
        """
        if self.sizes is not None:
            for size in self.sizes:
                if size >= calls:
                    return size
            size = self.sizes[-1]
        else:
            size = self.min_rows
        while size < calls:
            size = max(size + 1, math.ceil(size * self.growth))
        return size

    # -- fitting ----------------------------------------------------------------------------

    def fit(self, plan: PlanData) -> StaticPlan:
        """Pad ``plan`` into the envelope (growing it first if the plan does not fit)."""
        if isinstance(plan, StaticPlan):
            raise TypeError("fit expects an unpadded FoldPlan; this plan is already padded")
        if not isinstance(plan, PlanData):
            raise TypeError(f"fit expects a FoldPlan (from Fold.plan), got {type(plan).__name__}")
        batch = _decode(plan)
        if not self._fits(batch):
            self._grow(batch)
        self.plans += 1
        signature = _signature(batch)
        layout = self._layouts.get(signature)
        if layout is None:
            layout = self._layouts[signature] = StaticLayout(self, signature)
        padded = layout.pad(plan, batch)
        self.real_calls += sum(batch.calls)
        self.padded_calls += layout.total_calls
        return padded

    def _streams_of(self, batch: _Batch, column: _Column) -> set[Stream]:
        assert column.sources is not None
        return {batch.streams[s] for s in column.unique_sources()[0].tolist()}

    def _reach_of(self, batch: _Batch, column: _Column, depth: int) -> dict[Stream, int]:
        """Per stream a position at ``depth`` reads, how many levels back it reads it at most."""
        assert column.sources is not None
        reach: dict[Stream, int] = {}
        for source in column.unique_sources()[0].tolist():
            stream, back = batch.streams[source], depth - batch.depths[source]
            if reach.get(stream, 0) < back:
                reach[stream] = back
        return reach

    def _fits(self, batch: _Batch) -> bool:
        requests = self._requests.get(_signature(batch))
        if requests is None:
            return False
        capacity = self._capacity
        for slot, calls, columns in zip(batch.slots, batch.calls, batch.columns, strict=True):
            if capacity.get(slot, 0) < calls:
                return False
            depth, key = slot
            for position, column in enumerate(columns):
                if column.kind in ("nodes", "shared"):
                    known = self._streams[(key, position)]
                    for stream, back in self._reach_of(batch, column, depth).items():
                        if known.get(stream, 0) < back:
                            return False
        for (kind, room, streams), column in zip(requests, batch.requests, strict=True):
            if kind != "given" and _count(column) > room:
                return False
            if kind == "nodes" and not self._streams_of(batch, column) <= streams:
                return False
        return True

    def _grow(self, batch: _Batch) -> None:
        for slot, name, calls, columns in zip(
            batch.slots, batch.names, batch.calls, batch.columns, strict=True
        ):
            depth, key = slot
            have = self._capacity.get(slot, 0)
            if calls > have:
                self._capacity[slot] = self.bucket(math.ceil(calls * self.headroom))
            self._order.setdefault(key, len(self._order))
            self._names.setdefault(key, name)
            for position, column in enumerate(columns):
                where = (key, position)
                if column.kind in ("nodes", "shared"):
                    known = self._streams.setdefault(where, {})
                    for stream, back in self._reach_of(batch, column, depth).items():
                        if known.get(stream, 0) < back:  # room to read a little further back later
                            known[stream] = max(back, math.ceil(back * self.headroom))
                elif where not in self._fills:
                    first = column.values[0]
                    self._fills[where] = first.detach().clone() if isinstance(first, _Tensor) else first
            self._deepest = max(self._deepest, depth)
        # Levels past the deepest seen repeat its ops at the smallest bucket: a batch a little
        # deeper than all before it then fits without a new graph.
        wanted = math.ceil((self._deepest + 1) * self.headroom)
        self._levels = max(self._levels, -(-wanted // self.level_step) * self.level_step)
        # (only ops that read nodes: one without node arguments always runs at depth 0)
        deepest_ops = [
            key
            for depth, key in self._capacity
            if depth == self._deepest and any(kind in ("nodes", "shared") for kind in key[3])
        ]
        for depth in range(self._deepest + 1, self._levels):
            for key in deepest_ops:
                self._capacity.setdefault((depth, key), self.bucket(1))
        signature = _signature(batch)
        requests = self._requests.get(signature) or [(column.kind, 0, set()) for column in batch.requests]
        self._requests[signature] = [
            (
                kind,
                room if _count(column) <= room else self.bucket(math.ceil(_count(column) * self.headroom)),
                streams | self._streams_of(batch, column) if kind == "nodes" else streams,
            )
            for (kind, room, streams), column in zip(requests, batch.requests, strict=True)
        ]
        grown = bool(self._layouts)
        self._layouts.clear()
        self.version += 1
        if grown and self.plans >= self.warmup:
            warnings.warn(
                f"a fold did not fit the static shapes learned over {self.plans} plans, so they grow "
                f"(version {self.version}): expect one new compilation; a larger min_rows, growth or level_step "
                "leaves more room",
                StaticShapesWarning,
                stacklevel=4,
            )


class _Piece:
    """One earlier slot output that a gather concatenates: its slot, its output and its calls."""

    __slots__ = ("calls", "output", "slot")

    def __init__(self, slot: int, output: int | None, calls: int) -> None:
        self.slot = slot
        self.output = output
        self.calls = calls


class _StaticGather:
    """Positions of a slot (or a request) filled by one concatenation and one ``index_select``.

    ``offsets`` maps a (slot, output) to where its calls start in the concatenation; ``items``
    is the number of calls each position takes (the slot's capacity, or 1 for a shared node).
    """

    __slots__ = ("items", "offsets", "pieces", "positions")

    def __init__(self, pieces: list[_Piece], positions: list[int], items: int) -> None:
        self.pieces = pieces
        self.positions = positions
        self.items = items
        self.offsets: dict[tuple[int, int | None], int] = {}
        start = 0
        for piece in pieces:
            self.offsets[(piece.slot, piece.output)] = start
            start += piece.calls


class _Slot:
    """One batched call of a static plan: an op at a depth, run on ``num_calls`` (its capacity) calls.

    ``args`` says where each argument comes from in a :class:`StaticInputs`: per gather its
    span of ``ints`` (the index), per other position ``(position, kind, where)``, ``where``
    being a span of ``ints`` or ``floats``, or the number of a ``given`` tensor.
    """

    __slots__ = (
        "arity",
        "depth",
        "fixed",
        "gather_spans",
        "gathers",
        "key",
        "name",
        "num_calls",
        "num_outputs",
        "op",
    )

    def __init__(self, depth: int, key: OpKey, name: str, capacity: int) -> None:
        self.key = key
        self.op: Op = key[0]
        self.arity: int = key[1]
        self.num_outputs: int = key[2]
        self.depth = depth
        self.name = name
        self.num_calls = capacity
        self.gathers: list[_StaticGather] = []
        self.gather_spans: list[tuple[int, int]] = []  # each gather's index, in ``ints``
        self.fixed: list[
            tuple[int, str, Any]
        ] = []  # ints / floats / given positions: (position, kind, where)

    def outputs(self) -> list[int | None]:
        return list(range(self.num_outputs)) if self.num_outputs else [None]

    def where(self, position: int) -> str:
        return f"op {self.name!r} at depth {self.depth}, argument {position}"


class StaticInputs(NamedTuple):
    """What one batch gives a :class:`StaticLayout`'s runner: fixed-shape tensors, one set per plan.

    ``ints`` (int64) holds every gather's index and every int column, ``floats`` (the default
    float dtype) every float column, end to end; their lengths are the layout's
    (``num_ints``, ``num_floats``). ``given`` holds the tensors given to ``add``: per position
    that reads them, padded to its capacity (a shape the layout fixes), then per request of
    tensors, as given: a request whose tensors vary in rows varies this shape, and so the graph.
    """

    ints: _Tensor
    floats: _Tensor
    given: tuple[_Tensor, ...]


@dataclass(frozen=True)
class _Request:
    """One request of a layout: its kind, capacity (None: tensors, as many rows as given) and where it reads."""

    kind: str
    capacity: int | None
    gather: _StaticGather | None
    where: Any  # a span of ints/floats, or the number of a given tensor


class StaticLayout:
    """What every plan fitted to one version of a :class:`StaticShapes` envelope (for one list of
    request kinds) runs: its slots (op, depth, capacity) in order, their gathers, the requests'
    gathers and capacities, and where each argument lies in a plan's :class:`StaticInputs`.

    Plans of one layout differ only in their inputs' values, so :meth:`run`, a pure function
    of ``nn`` and the inputs, runs the same tensor operations on the same shapes for all: one
    graph per layout (XLA, ``torch.compile``, CUDA graphs). :attr:`key` names that graph:
    equal for two plans fitted to the same envelope version and request kinds, different
    otherwise; it is hashable and pickles (plans built in ``DataLoader`` workers carry it).
    """

    def __init__(self, shapes: StaticShapes, signature: tuple[str, ...]) -> None:
        order = shapes._order
        keys = sorted(shapes._capacity, key=lambda slot: (slot[0], order[slot[1]]))
        self.slots = [
            _Slot(depth, key, shapes._names[key], shapes._capacity[(depth, key)]) for depth, key in keys
        ]
        self.index = {slot: number for number, slot in enumerate(keys)}
        self.total_calls = sum(slot.num_calls for slot in self.slots)
        self.fills = shapes._fills
        self.signature = signature
        # per stream, the slots making it: their depths (ascending) and numbers, for bisecting a reach
        made: dict[Stream, tuple[list[int], list[int]]] = {}
        for number, slot in enumerate(self.slots):
            for output in slot.outputs():
                depths, numbers = made.setdefault((slot.key, output), ([], []))
                depths.append(slot.depth)
                numbers.append(number)
        ints = floats = 0  # lengths of the packed arrays so far
        given: list[str] = []  # per given tensor, where it is read (for messages)
        for slot in self.slots:
            kinds = slot.key[3]
            by_reach: dict[frozenset[tuple[Stream, int]], list[int]] = {}
            for position, kind in enumerate(kinds):
                if kind == "nodes":
                    reach = frozenset(shapes._streams[(slot.key, position)].items())
                    by_reach.setdefault(reach, []).append(position)
                elif kind == "shared":
                    reach = frozenset(shapes._streams[(slot.key, position)].items())
                    slot.gathers.append(_StaticGather(self._pieces(made, slot.depth, reach), [position], 1))
                elif kind == "ints":
                    slot.fixed.append((position, kind, (ints, ints + slot.num_calls)))
                    ints += slot.num_calls
                elif kind == "floats":
                    slot.fixed.append((position, kind, (floats, floats + slot.num_calls)))
                    floats += slot.num_calls
                else:
                    slot.fixed.append((position, kind, len(given)))
                    given.append(slot.where(position))
            for reach, positions in by_reach.items():
                slot.gathers.append(
                    _StaticGather(self._pieces(made, slot.depth, reach), positions, slot.num_calls)
                )
            for gather in slot.gathers:
                size = gather.items * len(gather.positions)
                slot.gather_spans.append((ints, ints + size))
                ints += size
        # per request: its kind and capacity, and for node rows the gather that reads them (every depth)
        self.requests: list[_Request] = []
        for number, (kind, room, streams) in enumerate(shapes._requests[signature]):
            reads: _StaticGather | None = None
            if kind == "nodes":
                reads = _StaticGather(
                    self._pieces(made, math.inf, [(s, math.inf) for s in streams]), [0], room
                )
            if kind in ("nodes", "ints"):
                where: Any = (ints, ints + room)
                ints += room
            elif kind == "floats":
                where = (floats, floats + room)
                floats += room
            else:
                where = len(given)
                given.append(f"apply request {number}")
            self.requests.append(_Request(kind, None if kind == "given" else room, reads, where))
        self.num_ints = ints
        self.num_floats = floats
        self.given = given
        # The envelope's identity (a token that travels with its pickles) and version name the
        # layout; the digest of the layout's content keeps apart copies of one envelope grown
        # apart in different processes (DataLoader workers) to the same version number.
        digest = hashlib.blake2b(repr(self._content()).encode(), digest_size=12).hexdigest()
        self._key = (shapes._token, shapes.version, signature, digest)

    @property
    def key(self) -> tuple[Any, ...]:
        """Hashable and picklable: equal for plans fitted to one envelope version with the same request kinds."""
        return self._key

    @property
    def capacities(self) -> list[int | None]:
        """Rows per node each request gets padded to (None: a request of tensors, never padded)."""
        return [request.capacity for request in self.requests]

    def _content(self) -> tuple[Any, ...]:
        """The layout as plain values: what a graph traced from :meth:`run` depends on."""
        slots = tuple(
            (
                slot.depth,
                _op_label(slot.op),
                slot.key[1:4],
                repr(slot.key[4]),
                slot.num_calls,
                tuple(
                    (tuple((p.slot, p.output) for p in g.pieces), tuple(g.positions), g.items)
                    for g in slot.gathers
                ),
            )
            for slot in self.slots
        )
        requests = tuple(
            (
                r.kind,
                r.capacity,
                None if r.gather is None else tuple((p.slot, p.output) for p in r.gather.pieces),
            )
            for r in self.requests
        )
        return slots, requests, self.num_ints, self.num_floats, len(self.given)

    def _pieces(
        self,
        made: dict[Stream, tuple[list[int], list[int]]],
        depth: float,
        reach: Iterable[tuple[Stream, float]],
    ) -> list[_Piece]:
        """The outputs of slots less deep than ``depth`` that belong to a stream of ``reach``, at most
        its reach levels back; O(pieces) whatever the number of slots, so a chain stays linear."""
        numbers: list[tuple[int, int | None]] = []
        latest: tuple[int, int | None] | None = None  # the last slot of a stream before ``depth``
        for stream, back in reach:
            found = made.get(stream)
            if found is None:
                continue
            depths, slots = found
            end = bisect.bisect_left(depths, depth)
            start = bisect.bisect_left(depths, depth - back, 0, end)
            numbers.extend((number, stream[1]) for number in slots[start:end])
            if end and (latest is None or slots[end - 1] > latest[0]):
                latest = (slots[end - 1], stream[1])
        if not numbers:
            # Only a slot that runs padding only (a level past the deepest seen, whose streams
            # are all further back than a real call ever read): any earlier output of its streams
            # gives it rows of the right shape.
            if latest is None:  # pragma: no cover - a real call reads an earlier slot, so an envelope has one
                raise FoldError(f"static shapes: no earlier output to read at depth {depth}")
            numbers.append(latest)
        return [
            _Piece(number, output, self.slots[number].num_calls)
            for number, output in sorted(numbers, key=_slot_order)
        ]

    def pad(self, plan: PlanData, batch: _Batch) -> StaticPlan:
        """``plan``'s index arrays and columns, padded to this layout."""
        slot_of_step = [self.index[slot] for slot in batch.slots]
        # per source number: (slot, output) of the step that produces it
        owner = [(slot_of_step[number], output) for number, output in plan.source_owner]
        columns_of: dict[int, list[_Column]] = {slot_of_step[i]: cols for i, cols in enumerate(batch.columns)}
        calls_of = {slot_of_step[i]: calls for i, calls in enumerate(batch.calls)}
        ints = np.empty(self.num_ints, dtype=np.int64)
        floats = np.empty(self.num_floats, dtype=np.float64)
        given: list[_Tensor] = []
        for number, slot in enumerate(self.slots):
            columns = columns_of.get(number)
            real = calls_of.get(number, 0)
            for gather, (start, _end) in zip(slot.gathers, slot.gather_spans, strict=True):
                items = gather.items
                for offset, p in enumerate(gather.positions):
                    ints[start + offset * items : start + (offset + 1) * items] = _padded_index(
                        gather, owner, None if columns is None else columns[p], real
                    )
            for position, kind, where in slot.fixed:
                column = None if columns is None else columns[position]
                fill = self.fills[(slot.key, position)]
                if kind == "ints":
                    ints[where[0] : where[1]] = _padded_values(column, fill, slot.num_calls, np.int64)
                elif kind == "floats":
                    floats[where[0] : where[1]] = _padded_values(column, fill, slot.num_calls, np.float64)
                else:
                    given.append(_padded_tensors(column, fill, slot.num_calls))
        for request, column in zip(self.requests, batch.requests, strict=True):
            kind, where = request.kind, request.where
            if request.gather is not None:
                ints[where[0] : where[1]] = _padded_index(request.gather, owner, column, _count(column))
            elif kind == "ints":
                ints[where[0] : where[1]] = _padded_values(column, 0, where[1] - where[0], np.int64)
            elif kind == "floats":
                floats[where[0] : where[1]] = _padded_values(column, 0, where[1] - where[0], np.float64)
            else:  # tensors only: any number of rows each, passed as they are
                given.append(torch.cat(column.values, 0))
        return StaticPlan(
            self,
            ints,
            floats,
            tuple(given),
            sizes=plan.sizes,
            real_calls=sum(batch.calls),
            num_nodes=plan.num_nodes,
            device=plan.device,
            volatile=plan.volatile,
        )

    def run(self, nn: object, inputs: StaticInputs, *, padded: bool = True) -> list[_Tensor]:
        """Run the layout's ops on ``nn`` with one plan's ``inputs``; one padded tensor per request.

        A pure function of ``nn`` and the tensors of ``inputs``: tensor operations only, no
        transfer, nothing read back to Python, no branch on a tensor's value; so it can be
        traced once per layout (``torch.compile``, a CUDA graph capture) and replayed for
        every plan of the layout. Outputs are padded to the capacities: a plan's sizes vary
        from batch to batch, so cutting them (:meth:`StaticPlan.unpad`) is the plan's job.

        Raises:
            ValueError: ``padded=False`` (unpadding needs the plan's sizes), or ``inputs``
                made for another layout.
            FoldError: unknown op, or an op returning something other than rows per call.
        """
        if not padded:
            raise ValueError(
                "StaticLayout.run(padded=False): a layout does not know a batch's sizes; run it padded and cut the "
                "outputs with plan.unpad(outputs), or call plan.apply(nn)"
            )
        ints, floats, given = inputs
        if (
            ints.shape != (self.num_ints,)
            or floats.shape != (self.num_floats,)
            or len(given) != len(self.given)
        ):
            raise ValueError(
                f"StaticLayout.run: inputs of {tuple(ints.shape)} ints, {tuple(floats.shape)} floats and {len(given)} "
                f"given tensors, but this layout takes ({self.num_ints},), ({self.num_floats},) and {len(self.given)}; "
                "pass the inputs of a plan of this layout (plan.inputs(), where plan.layout.key is this layout's key)"
            )
        fns: list[Callable[..., Any]] = resolve_ops(nn, self.slots)
        results: dict[tuple[int, int | None], _Tensor] = {}
        for number, (slot, fn) in enumerate(zip(self.slots, fns, strict=True)):
            args: list[Any] = [None] * slot.arity
            for gather, (start, end) in zip(slot.gathers, slot.gather_spans, strict=True):
                taken, rows = _take(gather, results, ints[start:end], self.slots)
                if len(gather.positions) == 1:
                    args[gather.positions[0]] = taken
                else:
                    for where, part in zip(gather.positions, taken.split(gather.items * rows), strict=True):
                        args[where] = part
            for position, kind, where in slot.fixed:
                if kind == "ints":
                    args[position] = ints[where[0] : where[1]]
                elif kind == "floats":
                    args[position] = floats[where[0] : where[1]]
                else:
                    args[position] = given[where]
            before = versions(args)
            try:
                out = fn(*args)
            except FoldError:
                raise
            except Exception as error:
                add_note(
                    error,
                    f"torchfold: while applying {slot.name!r} at depth {slot.depth} to {slot.num_calls} calls "
                    f"(padded; static shapes)",
                )
                raise
            check_unchanged(args, before, slot.name, slot.depth)
            for output, value in _store(slot, out):
                results[(number, output)] = value
        outputs = []
        for request in self.requests:
            where = request.where
            if request.gather is not None:
                outputs.append(_take(request.gather, results, ints[where[0] : where[1]], self.slots)[0])
            elif request.kind == "ints":
                outputs.append(ints[where[0] : where[1]])
            elif request.kind == "floats":
                outputs.append(floats[where[0] : where[1]])
            else:
                outputs.append(given[where])
        return outputs

    def __getstate__(self) -> dict[str, Any]:
        """What pickles: refused, like a plan's, for an op bound to an object (its copy would get the gradients)."""
        for slot in self.slots:
            check_portable_op(slot.op, slot.name, slot.depth)
        return self.__dict__

    def __repr__(self) -> str:
        return (
            f"StaticLayout({len(self.slots)} slots of {self.total_calls} calls, {len(self.requests)} requests, "
            f"key version {self._key[1]})"
        )


def _op_label(op: Op) -> str:
    """An op as a graph's key names it: its name, or a callable's module and qualified name."""
    if isinstance(op, str):
        return op
    return f"{getattr(op, '__module__', '?')}.{getattr(op, '__qualname__', type(op).__qualname__)}"


def _slot_order(piece: tuple[int, int | None]) -> tuple[int, int]:
    return piece[0], -1 if piece[1] is None else piece[1]


def _padded_index(
    gather: _StaticGather, owner: list[tuple[int, int | None]], column: _Column | None, real: int
) -> np.ndarray:
    """A position's calls in the gather's concatenation; padded calls repeat the first real call."""
    index = np.zeros(gather.items, dtype=np.int64)
    if column is not None and real:
        assert column.sources is not None and column.calls is not None
        unique, inverse = column.unique_sources()
        starts = np.array([gather.offsets[owner[source]] for source in unique.tolist()], dtype=np.int64)
        taken = starts[inverse] + column.calls
        index[: len(taken)] = taken
        index[len(taken) :] = taken[0]
    return index


def _padded_values(column: _Column | None, fill: Any, capacity: int, dtype: Any) -> np.ndarray:
    values = np.full(capacity, fill if column is None else column.values[0], dtype=dtype)
    if column is not None:
        values[: len(column.values)] = column.values
    return values


def _padded_tensors(column: _Column | None, fill: _Tensor, capacity: int) -> _Tensor:
    """Tensors given to ``add``, concatenated, then the first call's rows repeated up to ``capacity`` calls."""
    given: list[_Tensor] = [] if column is None else list(column.values)
    first = fill if column is None else given[0]  # never 0-dim: the compiler refuses tensors without rows
    return torch.cat(given + [first] * (capacity - len(given)), 0)


class StaticPlan:
    """A plan padded into a :class:`StaticShapes` envelope: every plan of one envelope version
    runs the same tensor operations on the same shapes, so XLA compiles it once.

    Made by :meth:`StaticShapes.fit` (or ``Fold(shapes=...).plan(...)``); it pickles like a
    :class:`~torchfold.FoldPlan`. It is a :class:`StaticLayout` (:attr:`layout`, shared by
    every plan of the envelope version) and this batch's data: all index arrays and int
    columns packed into one int64 array (:attr:`ints`), float columns into one float64 array
    (:attr:`floats`), and the tensors given to ``add``; :meth:`inputs` makes them tensors.
    """

    def __init__(
        self,
        layout: StaticLayout,
        ints: np.ndarray,
        floats: np.ndarray,
        given: tuple[_Tensor, ...],
        *,
        sizes: list[int],
        real_calls: int,
        num_nodes: int,
        device: torch.device | None,
        volatile: bool,
    ) -> None:
        self.layout = layout
        self.ints = ints
        self.floats = floats
        self.given = given
        #: calls (nodes) each request asks for, and how many rows ``apply(padded=True)`` returns for it
        self.sizes = sizes
        self.capacities = [
            size if capacity is None else capacity
            for capacity, size in zip(layout.capacities, sizes, strict=True)
        ]
        self.real_calls = real_calls
        self.num_nodes = num_nodes
        self.device = device
        self.volatile = volatile

    @property
    def slots(self) -> list[_Slot]:
        """The layout's batched calls, in the order they run."""
        return self.layout.slots

    @property
    def padded_calls(self) -> int:
        """Calls run, padding included (``real_calls`` are the plan's own)."""
        return self.layout.total_calls

    def inputs(self, device: torch.device | str | None = None) -> StaticInputs:
        """This batch's :class:`StaticInputs` on ``device`` (default: the plan's, else the CPU).

        Fresh tensors at every call: what :meth:`StaticLayout.run` reads. One transfer for the
        ints, one for the floats, one per given tensor.
        """
        if device is None:
            device = self.device if self.device is not None else torch.device("cpu")
        ints = torch.from_numpy(self.ints).to(device, copy=True)
        floats = torch.from_numpy(self.floats).to(device=device, dtype=torch.get_default_dtype(), copy=True)
        return StaticInputs(ints, floats, tuple(tensor.to(device) for tensor in self.given))

    def pad(self, request: int, values: Any, fill: float = 0) -> _Tensor:
        """``values`` (one per node of request ``request``) as a tensor padded to its capacity with ``fill``.

        With ``apply(model, padded=True)``, pad per-node targets and weights so that the padded
        rows weigh nothing: ``(losses * plan.pad(0, weights)).sum()``, or cross-entropy with
        ``ignore_index`` and ``plan.pad(0, labels, fill=-100)``. Give host values (a list, a
        numpy array or a CPU tensor) and move the result to the device: its shape is the
        capacity's, so on XLA it never makes a new graph.

        >>> import torch, torchfold
        >>> f = torchfold.Fold(shapes=torchfold.StaticShapes(min_rows=4))
        >>> plan = f.plan([[f.add(torch.neg, 1), f.add(torch.neg, 2)]])
        >>> plan.pad(0, [0.5, 0.5])
        tensor([0.5000, 0.5000, 0.0000, 0.0000])
        """
        check_request_number(request, len(self.sizes))
        size, capacity = self.sizes[request], self.capacities[request]
        if isinstance(values, _Tensor) and values.device.type != "cpu":
            tensor = values  # already on a device: padded there (on XLA, sizes that vary then compile anew)
            check_pad_rows(request, tuple(tensor.shape), size)
            out = tensor.new_full((capacity, *tensor.shape[1:]), fill)
            out[:size] = tensor
            return out
        # On the host, in numpy: only the padded tensor is made, so its shape never varies.
        array = values.numpy() if isinstance(values, _Tensor) else np.asarray(values)
        if array.dtype == np.float64 and not isinstance(values, np.ndarray | _Tensor):
            array = array.astype(
                _NUMPY_DEFAULT.get(torch.get_default_dtype(), np.float32)
            )  # Python floats: torch's default dtype
        check_pad_rows(request, array.shape, size)
        padded = np.full((capacity, *array.shape[1:]), fill, dtype=array.dtype)
        padded[:size] = array
        return torch.from_numpy(padded)

    def unpad(self, outputs: Sequence[_Tensor]) -> list[_Tensor]:
        """Padded outputs (of :meth:`StaticLayout.run`) cut to this plan's requested rows."""
        cut = []
        for output, size, capacity in zip(outputs, self.sizes, self.capacities, strict=True):
            rows = output.shape[0] // capacity if capacity else 1
            cut.append(output[: size * rows])
        return cut

    def apply(self, nn: torch.nn.Module | object, *, padded: bool = False) -> list[_Tensor]:
        """Run the padded plan on ``nn``; one tensor per request (padded to its capacity if ``padded``).

        The same as ``plan.layout.run(nn, plan.inputs(device))`` (then :meth:`unpad`, unless
        ``padded``), ``device`` being the plan's, else the module's.

        Raises:
            FoldError: unknown op, or an op returning something other than rows per call.
        """
        device = self.device if self.device is not None else module_device(nn)
        if self.volatile:
            with torch.no_grad():
                outputs = self.layout.run(nn, self.inputs(device))
        else:
            outputs = self.layout.run(nn, self.inputs(device))
        return outputs if padded else self.unpad(outputs)

    def __getstate__(self) -> dict[str, Any]:
        """What pickles: refused, like a :class:`~torchfold.FoldPlan`'s, where a copy would cut gradients off.

        Raises:
            FoldError: an op is a bound method, or a tensor given to ``add`` requires grad.
        """
        for slot in self.layout.slots:
            check_portable_op(slot.op, slot.name, slot.depth)
        given = tuple(
            portable_tensors(tensor, where)
            for tensor, where in zip(self.given, self.layout.given, strict=True)
        )
        return {**self.__dict__, "given": given}

    def __len__(self) -> int:
        return self.num_nodes

    def __repr__(self) -> str:
        return (
            f"StaticPlan({len(self.slots)} slots, {self.num_nodes} nodes in {self.real_calls} calls padded to "
            f"{self.padded_calls}, requests {self.sizes} of {self.capacities})"
        )


def _store(slot: _Slot, out: Any) -> list[tuple[int | None, _Tensor]]:
    """The outputs of a slot's call, checked: a tensor, or a tuple of ``num_outputs`` tensors."""
    where = f"op {slot.name!r} at depth {slot.depth}"
    if isinstance(out, _Tensor):
        outputs: list[tuple[int | None, Any]] = [(None, out)]
        if slot.num_outputs:
            raise FoldError(
                f"{where} returned a single tensor but its nodes were split into {slot.num_outputs}"
            )
    # A tuple of types, not ``tuple | list``: torch.compile (dynamo, torch 2.9) breaks the graph on a
    # PEP 604 union in isinstance, and this runs inside compiled steps.
    elif isinstance(out, (tuple, list)):
        if len(out) != slot.num_outputs:
            raise FoldError(
                f"{where} returned {len(out)} outputs but its nodes were "
                f"{'split into ' + str(slot.num_outputs) if slot.num_outputs else 'used whole'}; "
                f"call .split({len(out)}) on them"
            )
        outputs = list(enumerate(out))
    else:
        raise FoldError(
            f"{where} returned a {type(out).__name__}; ops must return a tensor or a tuple of tensors"
        )
    for output, value in outputs:
        if (
            not isinstance(value, _Tensor)
            or value.dim() == 0
            or value.shape[0] == 0
            or value.shape[0] % slot.num_calls
        ):
            shape = tuple(value.shape) if isinstance(value, _Tensor) else type(value).__name__
            raise FoldError(
                f"{where} ran {slot.num_calls} calls (padded) and returned {shape} as output {output}: "
                f"ops must return rows per call, a leading dim that is a positive multiple of {slot.num_calls}"
            )
    return outputs


def _take(
    gather: _StaticGather, results: dict[tuple[int, int | None], _Tensor], index: _Tensor, slots: list[_Slot]
) -> tuple[_Tensor, int]:
    """The rows of a gather: its pieces concatenated, then one ``index_select``."""
    tensors = [results[(piece.slot, piece.output)] for piece in gather.pieces]
    # What the envelope joins over all batches must agree, though each batch alone may read only
    # some of it: rows per call, row shape and dtype of every piece.
    first = gather.pieces[0]
    reference = tensors[0]
    rows = reference.shape[0] // first.calls
    for piece, tensor in zip(gather.pieces, tensors, strict=True):
        if (
            tensor.shape[0] != piece.calls * rows
            or tensor.shape[1:] != reference.shape[1:]
            or tensor.dtype != reference.dtype
        ):
            raise FoldError(
                f"static shapes: an argument position reads the outputs of op {slots[first.slot].name!r} "
                f"({rows} rows of {tuple(reference.shape[1:])} {reference.dtype} per call) and, in this or an earlier "
                f"batch, of op {slots[piece.slot].name!r} ({tensor.shape[0] / piece.calls:g} rows of "
                f"{tuple(tensor.shape[1:])} {tensor.dtype} per call); one envelope pads them together, so they must "
                "agree: give ops of different outputs different names, or use a StaticShapes per kind of graph"
            )
    source = tensors[0] if len(tensors) == 1 else torch.cat(tensors, 0)
    if rows != 1:
        index = (index.unsqueeze(1) * rows + torch.arange(rows, device=index.device)).reshape(-1)
    return source.index_select(0, index), rows
