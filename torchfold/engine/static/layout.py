"""The layout of one envelope version: slots, gathers, and where each argument lies in a plan's inputs.

A :class:`StaticLayout` is all that stays constant between plans fitted to one version of a
:class:`~torchfold.engine.static.shapes.StaticShapes` envelope (for one list of request
kinds and one depth bucket): so one compiled graph (XLA, ``torch.compile``, a CUDA graph) per layout runs them all.
It also pads a plan's arrays into its :class:`~torchfold.engine.static.padded.StaticPlan`.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import pickle
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from torchfold._errors import FoldError
from torchfold.engine.ir import PlanData, check_portable_op
from torchfold.engine.node import Op
from torchfold.engine.static.columns import Batch, Column, OpKey, Stream, count_items
from torchfold.engine.static.padded import StaticInputs, StaticPlan, run

if TYPE_CHECKING:
    from torchfold.engine.static.shapes import StaticShapes

__all__ = ["Piece", "Slot", "StaticGather", "StaticLayout"]

_Tensor = torch.Tensor


class Piece:
    """One earlier slot output that a gather concatenates: its slot, its output and its calls."""

    __slots__ = ("calls", "output", "slot")

    def __init__(self, slot: int, output: int | None, calls: int) -> None:
        self.slot = slot
        self.output = output
        self.calls = calls


class StaticGather:
    """Positions of a slot (or a request) filled by one concatenation and one ``index_select``.

    ``offsets`` maps a (slot, output) to where its calls start in the concatenation; ``items``
    is the number of calls each position takes (the slot's capacity, or 1 for a shared node).
    ``streams``: for a gather reading every earlier slot of its streams (trees), those streams;
    gathers reading one set of streams read prefixes of one list of pieces (slots are in depth
    order), so the executor keeps one running concatenation per set: O(levels) operations, not
    O(levels²). None for a gather reading only the level before it (a chain: one piece or few).
    """

    __slots__ = ("items", "offsets", "pieces", "positions", "streams")

    def __init__(
        self, pieces: list[Piece], positions: list[int], items: int, streams: frozenset[Stream] | None = None
    ) -> None:
        self.streams = streams
        self.pieces = pieces
        self.positions = positions
        self.items = items
        self.offsets: dict[tuple[int, int | None], int] = {}
        start = 0
        for piece in pieces:
            self.offsets[(piece.slot, piece.output)] = start
            start += piece.calls


class Slot:
    """One batched call of a static plan: an op at a depth, run on ``num_calls`` (its capacity) calls.

    Where each argument comes from in a :class:`StaticInputs`: ``gather_spans``, per gather, its
    index's span of ``ints``; ``fixed``, per other position, ``(position, kind, where)``, ``where``
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
        self.gathers: list[StaticGather] = []
        self.gather_spans: list[tuple[int, int]] = []  # each gather's index, in ``ints``
        self.fixed: list[tuple[int, str, Any]] = []

    def outputs(self) -> list[int | None]:
        return list(range(self.num_outputs)) if self.num_outputs else [None]

    def where(self, position: int) -> str:
        return f"op {self.name!r} at depth {self.depth}, argument {position}"


@dataclass(frozen=True)
class _Request:
    """One request of a layout: its kind, capacity (None: tensors, as many rows as given) and where it reads."""

    kind: str
    capacity: int | None
    gather: StaticGather | None
    where: Any  # a span of ints/floats, or the number of a given tensor


class StaticLayout:
    """What every plan fitted to one version of a :class:`StaticShapes` envelope (for one list of
    request kinds, and one depth bucket: the levels it runs, ``levels``) runs: its slots (op, depth, capacity) in order, their gathers, the requests'
    gathers and capacities, and where each argument lies in a plan's :class:`StaticInputs`.

    Plans of one layout differ only in their inputs' values, so :meth:`run`, a pure function
    of ``nn`` and the inputs, runs the same tensor operations on the same shapes for all: one
    graph per layout (XLA, ``torch.compile``, CUDA graphs). :attr:`key` names that graph:
    equal for two plans fitted to the same envelope version, request kinds and depth bucket,
    different otherwise; it is hashable and pickles (plans built in ``DataLoader`` workers carry it).
    """

    def __init__(self, shapes: StaticShapes, signature: tuple[str, ...], levels: int | None = None) -> None:
        self.slots = [Slot(depth, key, name, capacity) for depth, key, name, capacity in shapes.slots(levels)]
        self.index = {(slot.depth, slot.key): number for number, slot in enumerate(self.slots)}
        self.total_calls = sum(slot.num_calls for slot in self.slots)
        self.fills = shapes.fills
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
            by_reach: dict[frozenset[tuple[Stream, float]], list[int]] = {}
            for position, kind in enumerate(kinds):
                if kind == "nodes":
                    reach = frozenset(shapes.reach(slot.key, position).items())
                    by_reach.setdefault(reach, []).append(position)
                elif kind == "shared":
                    reach = frozenset(shapes.reach(slot.key, position).items())
                    slot.gathers.append(
                        StaticGather(
                            self._pieces(made, slot.depth, reach), [position], 1, _every_level(reach)
                        )
                    )
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
                    StaticGather(
                        self._pieces(made, slot.depth, reach), positions, slot.num_calls, _every_level(reach)
                    )
                )
            for gather in slot.gathers:
                size = gather.items * len(gather.positions)
                slot.gather_spans.append((ints, ints + size))
                ints += size
        # per request: its kind and capacity, and for node rows the gather that reads them (every depth)
        self.requests: list[_Request] = []
        for number, (kind, room, streams) in enumerate(shapes.requests(signature)):
            reads: StaticGather | None = None
            if kind == "nodes":
                reads = StaticGather(
                    self._pieces(made, math.inf, [(s, math.inf) for s in streams]),
                    [0],
                    room,
                    frozenset(streams),
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
        self.levels = shapes.levels if levels is None else min(levels, shapes.levels)
        self._key = (shapes.token, shapes.version, signature, self.levels, digest)

    @property
    def key(self) -> tuple[Any, ...]:
        """Hashable and picklable: equal for plans fitted to one envelope version with the same request
        kinds and depth bucket."""
        return self._key

    @property
    def capacities(self) -> list[int | None]:
        """Rows per node each request gets padded to (None: a request of tensors, never padded)."""
        return [request.capacity for request in self.requests]

    def _content(self) -> tuple[Any, ...]:
        """The layout as plain values: what a graph captured from :meth:`run` depends on."""
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
    ) -> list[Piece]:
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
            Piece(number, output, self.slots[number].num_calls)
            for number, output in sorted(numbers, key=_slot_order)
        ]

    def pad(self, plan: PlanData, batch: Batch) -> StaticPlan:
        """``plan``'s index arrays and columns, padded to this layout."""
        slot_of_group = [self.index[slot] for slot in batch.slots]
        # per source number: (slot, output) of the group that produces it
        owner = [(slot_of_group[number], output) for number, output in batch.owner]
        columns_of: dict[int, list[Column]] = {slot_of_group[i]: cols for i, cols in enumerate(batch.columns)}
        calls_of = {slot_of_group[i]: calls for i, calls in enumerate(batch.calls)}
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
                ints[where[0] : where[1]] = _padded_index(request.gather, owner, column, count_items(column))
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

        The executor of every plan (:func:`~torchfold.engine.executor.run_calls`), each slot's
        arguments read as slices of ``inputs``. A pure function of ``nn`` and the tensors of
        ``inputs``: tensor operations only, no transfer, nothing read back to Python, no branch
        on a tensor's value; so it can be traced once per layout (``torch.compile``, a CUDA
        graph capture) and replayed for every plan of the layout. Outputs are padded to the
        capacities: a plan's sizes vary from batch to batch, so cutting them
        (:meth:`StaticPlan.unpad`) is the plan's job.

        >>> import torch, torchfold
        >>> f = torchfold.Fold(shapes=torchfold.StaticShapes(min_rows=4))
        >>> plan = f.plan([[f.add(torch.neg, 1), f.add(torch.neg, 2)]])
        >>> padded = plan.layout.run(None, plan.inputs())
        >>> padded, plan.unpad(padded)
        ([tensor([-1, -2, -1, -1])], [tensor([-1, -2])])

        Raises:
            ValueError: ``padded=False`` (unpadding needs the plan's sizes), or ``inputs``
                made for another layout.
            FoldError: unknown op, or an op returning something other than rows per call.
        """
        return run(self, nn, inputs, padded=padded)

    def __getstate__(self) -> dict[str, Any]:
        """What pickles: refused, like a plan's, for an op bound to an object (its copy would get the gradients)."""
        for slot in self.slots:
            check_portable_op(slot.op, slot.name, slot.depth)
        return self.__dict__

    def __reduce__(self) -> tuple[Any, ...]:
        # Every plan built in a DataLoader worker carries its layout, tens of KB for SST batches
        # that are the same for every plan of an envelope version. The state travels whole, as
        # one bytes object pickled once per layout here; the receiving process unpickles it only
        # for a key it has not seen, and otherwise hands back the layout it already has (the key
        # includes a digest of the content, so equal keys mean equal layouts).
        blob = _SENT.get(self)
        if blob is None:
            blob = _SENT[self] = pickle.dumps(self.__getstate__(), protocol=pickle.HIGHEST_PROTOCOL)
        return (_received_layout, (self._key, blob))

    def __repr__(self) -> str:
        return (
            f"StaticLayout({len(self.slots)} slots of {self.total_calls} calls in {self.levels} levels, {len(self.requests)} requests, "
            f"key version {self._key[1]})"
        )


# A layout's pickled state, per layout (sending side); the layouts unpickled, per key (receiving side).
_SENT: weakref.WeakKeyDictionary[StaticLayout, bytes] = weakref.WeakKeyDictionary()
_RECEIVED: weakref.WeakValueDictionary[tuple[Any, ...], StaticLayout] = weakref.WeakValueDictionary()


def _received_layout(key: tuple[Any, ...], blob: bytes) -> StaticLayout:
    """The layout of ``key``: the one this process already has, else the one ``blob`` holds."""
    layout = _RECEIVED.get(key)
    if layout is None:
        layout = StaticLayout.__new__(StaticLayout)
        layout.__dict__.update(pickle.loads(blob))
        _RECEIVED[key] = layout
    return layout


def _every_level(reach: frozenset[tuple[Stream, float]]) -> frozenset[Stream] | None:
    """The streams of a gather that reads every earlier level of them, or None."""
    if all(back == math.inf for _, back in reach):
        return frozenset(stream for stream, _ in reach)
    return None


def _op_label(op: Op) -> str:
    """An op as a graph's key names it: its name, or a callable's module and qualified name."""
    if isinstance(op, str):
        return op
    return f"{getattr(op, '__module__', '?')}.{getattr(op, '__qualname__', type(op).__qualname__)}"


def _slot_order(piece: tuple[int, int | None]) -> tuple[int, int]:
    return piece[0], -1 if piece[1] is None else piece[1]


def _padded_index(
    gather: StaticGather, owner: list[tuple[int, int | None]], column: Column | None, real: int
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


def _padded_values(column: Column | None, fill: Any, capacity: int, dtype: Any) -> np.ndarray:
    values = np.full(capacity, fill if column is None else column.values[0], dtype=dtype)
    if column is not None:
        values[: len(column.values)] = column.values
    return values


def _padded_tensors(column: Column | None, fill: _Tensor, capacity: int) -> _Tensor:
    """Tensors given to ``add``, concatenated, then the first call's rows repeated up to ``capacity`` calls."""
    given: list[_Tensor] = [] if column is None else list(column.values)
    first = fill if column is None else given[0]  # never 0-dim: the planner refuses tensors without rows
    return torch.cat(given + [first] * (capacity - len(given)), 0)
