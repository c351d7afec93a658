"""Planning a fold: from recorded nodes to a :class:`FoldPlan` of integer index arrays (:func:`plan_fold`).

A plan says, for every batched group in execution order, where each argument position comes
from: a column of ints, tensors given to ``add``, one node's rows, a whole earlier result, or a
gather (one concatenation of the sources read, then one ``index_select`` in call order).
Positions that read the same sources (a binary node's left and right children) share one
gather. All of it is worked out here, in call units, from the recorded graph alone: the module
is not needed and no tensor op runs, so a plan can be built in a ``DataLoader`` worker process
and shipped (pickled) to the training process, which then only runs tensor ops
(:mod:`torchfold.engine.executor`).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import numpy as np
import torch

from torchfold._errors import FoldError
from torchfold.engine import native
from torchfold.engine.ir import Arg, Gather, GroupCall
from torchfold.engine.node import (
    Group,
    Node,
    Recording,
    handle_of,
    ints_and_floats_mixed,
    literals_and_rows_mixed,
)
from torchfold.engine.plan import FoldPlan
from torchfold.engine.resolve import check_requests

__all__ = ["plan_fold"]

_Tensor = torch.Tensor
_Item = TypeVar("_Item")
# Groups of at most this many calls have their columns read in Python: numpy's ~1-3 us per call
# outweighs its speed on a few dozen items (SST batches: most groups above the first depths).
_SMALL = 64
_shape = operator.attrgetter("shape")
_dtype = operator.attrgetter("dtype")
_device = operator.attrgetter("device")


def _no_rows(where: str, tensor: _Tensor) -> FoldError:
    return FoldError(
        f"{where}: a 0-dim tensor ({tensor!r}) has no rows; "
        "pass x.reshape(1) or x.unsqueeze(0) so its leading dim counts rows"
    )


class _Pieces:
    """The pieces a column or gather reads, numbered in first-use order by key."""

    __slots__ = ("calls", "keys", "numbers", "values")

    def __init__(self) -> None:
        self.keys: list[Any] = []  # source numbers, or ("tensor", id) for tensors given to add
        self.values: list[int | _Tensor] = []
        self.calls: list[int] = []  # calls in each piece (a given tensor counts as one)
        self.numbers: dict[Any, int] = {}

    @classmethod
    def of_sources(cls, sources: list[int], calls: list[int]) -> _Pieces:
        """Earlier results only, already in first-use order (the node-column fast path)."""
        pieces = cls()
        pieces.keys, pieces.values, pieces.calls = sources, list(sources), calls
        pieces.numbers = {source: number for number, source in enumerate(sources)}
        return pieces

    def number(self, key: Any, value: int | _Tensor, calls: int) -> int:
        number = self.numbers.get(key)
        if number is None:
            number = self.numbers[key] = len(self.values)
            self.keys.append(key)
            self.values.append(value)
            self.calls.append(calls)
        return number


class _Column:
    """One gathered argument position before merging: the pieces it reads, and per call its piece and call."""

    __slots__ = ("item_call", "item_piece", "pieces", "position")

    def __init__(self, position: int, pieces: _Pieces, item_piece: np.ndarray, item_call: np.ndarray) -> None:
        self.position = position
        self.pieces = pieces
        self.item_piece = item_piece
        self.item_call = item_call

    def whole_source(self) -> int | None:
        """The source this column takes whole and in call order, if it does."""
        values = self.pieces.values
        piece = values[0]
        if len(values) != 1 or not isinstance(piece, int):
            return None
        calls = self.pieces.calls[0]
        if len(self.item_call) != calls or not (self.item_call == np.arange(calls)).all():
            return None
        return piece


class _Planner:
    """Builds a :class:`FoldPlan` from a fold's groups, a column (argument position) at a time.

    A fold stores node arguments as handles, rows of its tape (see ``Tape``); here the tape
    becomes numpy arrays once, and a column of handles is looked up in them as a whole.
    """

    def __init__(self, fold: Recording) -> None:
        self.groups = fold.groups()
        tape = self.tape = fold.tape
        self.source_calls = [0] * tape.sources  # calls of the group behind each source
        self.source_owner: list[tuple[int, int | None]] = [(0, None)] * tape.sources
        for number, group in enumerate(self.groups):
            calls = len(group.nodes)
            self.source_calls[group.source] = calls
            self.source_owner[group.source] = (number, None)
            for output, source in enumerate(group.output_sources):
                self.source_calls[source] = calls
                self.source_owner[source] = (number, output)
        # groups whose every argument is a batched node are planned in C while it is on (native.use)
        self.native = native.enabled()
        self.scratch: bytearray | None = None  # marks per source for the C planner (see native_group)
        self.handle_source = np.array(tape.source, dtype=np.int64)  # ~source for a nobatch handle
        self.handle_index = np.array(tape.index, dtype=np.int64)

    def node_column(self, position: int, sources: np.ndarray, item_call: np.ndarray) -> _Column:
        """A column of batched nodes, given as their sources and calls: the hot path."""
        first = int(sources[0])
        if (sources == first).all():
            keys: list[int] = [first]
            item_piece = np.zeros(len(sources), dtype=np.int64)
        else:  # sources numbered in first-use order (a few per column: a dict, not np.unique's sort)
            keys = list(dict.fromkeys(sources.tolist()))
            number = np.zeros(max(keys) + 1, dtype=np.int64)
            number[keys] = np.arange(len(keys))
            item_piece = number[sources]
        source_calls = self.source_calls
        return _Column(
            position, _Pieces.of_sources(keys, [source_calls[s] for s in keys]), item_piece, item_call
        )

    def mixed_column(self, position: int, column: Sequence[Any], where: str) -> _Column:
        """A column mixing nodes (handles, ``int``) and tensors given to ``add``."""
        pieces = _Pieces()
        item_piece: list[int] = []
        item_call: list[int] = []
        tape = self.tape
        for item in column:
            if item.__class__ is int:
                source = tape.source[item]
                source = source if source >= 0 else ~source
                item_piece.append(pieces.number(source, source, self.source_calls[source]))
                item_call.append(tape.index[item])
            else:
                if item.dim() == 0:
                    raise _no_rows(where, item)
                item_piece.append(pieces.number(("tensor", id(item)), item, 1))
                item_call.append(0)
        return _Column(
            position, pieces, np.array(item_piece, dtype=np.int64), np.array(item_call, dtype=np.int64)
        )

    def group_call(self, group: Group) -> GroupCall:
        """The batched call of ``group``: its argument positions as fixed arguments and gathers."""
        calls = group.calls
        batched = GroupCall(group, len(calls[0]))
        nodes = group.depth > 0  # above depth 0 a bare int is a node's handle, literals are tagged
        if len(calls) == 1:
            self.single_call(batched, calls[0], nodes)
            return batched
        if group.plain and nodes and self.native and self.native_group(batched, group):
            self.set_combined(batched)
            return batched
        if len(calls) <= _SMALL and group.plain and nodes:  # a few calls: Python beats numpy's cost per call
            self.few_node_calls(batched, calls)
            self.set_combined(batched)
            return batched
        columns: list[_Column] = []
        # NOTE: columns are taken one at a time, not with zip(*calls): that holds an iterator (an
        # object the garbage collector tracks) per call at once, and a large group's set them off.
        table = (  # (fromiter: a third of the time np.array takes on a list of tuples)
            np.fromiter(
                itertools.chain.from_iterable(calls), dtype=np.int64, count=len(calls) * batched.arity
            ).reshape(len(calls), batched.arity)
            if group.plain
            else None
        )
        for position in range(batched.arity):
            if table is not None:
                self.int_column(batched, position, table[:, position], nodes, columns)
                continue
            column = list(map(operator.itemgetter(position), calls))
            kinds = set(map(type, column))
            if kinds == {int}:
                self.int_column(batched, position, np.array(column, dtype=np.int64), nodes, columns)
                continue
            if tuple in kinds:  # tagged literals: ("int", value) or ("float", value)
                literal = {item[0] for item in column if item.__class__ is tuple}
                if kinds == {tuple} and len(literal) == 1:
                    (tag,) = literal
                    values = np.array(
                        [value for _, value in column], dtype=np.int64 if tag == "int" else np.float64
                    )
                    batched.fixed.append((position, Arg("ints" if tag == "int" else "floats", values)))
                    continue
                if not nodes and int in kinds:  # depth 0: bare ints are ints
                    literal.add("int")
                if literal == {
                    "int",
                    "float",
                }:  # one tensor, one dtype (the eager EagerFold refuses the same mix)
                    stored = [self.literal(item, nodes) for item in column]
                    int_value = next(value for kind, value in stored if kind == "int")
                    float_value = next(value for kind, value in stored if kind == "float")
                    raise FoldError(ints_and_floats_mixed(batched.where(position), int_value, float_value))
                raise FoldError(literals_and_rows_mixed(batched.where(position), f"{next(iter(literal))}s"))
            if not nodes:
                if int in kinds:
                    raise FoldError(literals_and_rows_mixed(batched.where(position), "ints"))
                if _concatenable(column):
                    batched.fixed.append((position, Arg("concat", list(column))))
                else:
                    columns.append(self.mixed_column(position, column, batched.where(position)))
            elif int in kinds and any(self.tape.source[item] < 0 for item in column if item.__class__ is int):
                batched.fixed.append((position, self.shared(column, batched.where(position))))
            elif int not in kinds and _concatenable(column):
                batched.fixed.append((position, Arg("concat", list(column))))
            else:
                columns.append(self.mixed_column(position, column, batched.where(position)))
        batched.gathers = self.merge(batched, columns)
        self.set_combined(batched)
        return batched

    @staticmethod
    def set_combined(batched: GroupCall) -> None:
        """Combined only where some gather concatenates anyway: gathers that each read one earlier
        result are cheaper as one ``index_select`` each than as a concatenation of all of them."""
        batched.combined = (
            len(batched.gathers) > 1
            and any(len(gather.pieces) > 1 for gather in batched.gathers)
            and all(isinstance(piece, int) for gather in batched.gathers for piece in gather.pieces)
        )

    def native_group(self, batched: GroupCall, group: Group) -> bool:
        """What ``few_node_calls`` makes, for a group of any size, in C; False (nothing made) where
        some argument is a ``nobatch`` node, which the Python paths plan (and word any error)."""
        tape = self.tape
        if self.scratch is None:  # every byte 0xff: each mark -1 (plain_group leaves them so)
            self.scratch = bytearray(b"\xff") * (native.SCRATCH_BYTES_PER_SOURCE * tape.sources)
        found = native.plain_group(
            group.nodes, batched.arity, tape.source, tape.index, self.source_calls, self.scratch
        )
        if found is None:
            return False
        wholes, gathers = found
        batched.fixed.extend((position, Arg("whole", source)) for position, source in wholes)
        count = batched.num_calls
        for pieces, piece_calls, index, positions in gathers:
            array = None if index is None else np.frombuffer(index, dtype=np.int64)
            batched.gathers.append(
                Gather.of_index(
                    cast("list[int | _Tensor]", pieces),
                    piece_calls,
                    array,
                    positions,
                    [count] * len(positions),
                )
            )
        return True

    def few_node_calls(self, batched: GroupCall, calls: list[tuple[int, ...]]) -> None:
        """A group of a few calls (see ``_SMALL``) whose arguments are all node handles, in Python
        lists, with one array per gather: what ``int_column`` per position and ``merge`` make."""
        source_of, call_of, source_calls = (
            self.tape.source.__getitem__,
            self.tape.index.__getitem__,
            self.source_calls,
        )
        count = len(calls)
        in_order = list(range(count))
        wholes: list[tuple[int, Arg]] = []
        columns: list[tuple[int, list[int], list[int], list[int]]] = []  # position, sources, calls, keys
        for position, handles in enumerate(zip(*calls, strict=True)):
            sources = list(map(source_of, handles))
            if min(sources) < 0:
                batched.fixed.append((position, self.shared(handles, batched.where(position))))
                continue
            item_call = list(map(call_of, handles))
            keys = list(dict.fromkeys(sources))  # its sources in first-use order
            if len(keys) == 1 and source_calls[keys[0]] == count and item_call == in_order:
                wholes.append((position, Arg("whole", keys[0])))  # an earlier result whole and in order
            else:
                columns.append((position, sources, item_call, keys))
        batched.fixed.extend(wholes)
        for cluster in _clustered(columns, operator.itemgetter(3)):
            # the cluster's sources in first-use order, column after column (as gather)
            pieces: list[int | _Tensor] = list(
                dict.fromkeys(itertools.chain.from_iterable(c[3] for c in cluster))
            )
            piece_calls = [source_calls[piece] for piece in pieces]
            item_calls = itertools.chain.from_iterable(column[2] for column in cluster)
            if len(pieces) == 1:
                index = list(item_calls)
            else:
                start = dict(zip(pieces, itertools.accumulate(piece_calls, initial=0), strict=False))
                item_sources = itertools.chain.from_iterable(column[1] for column in cluster)
                index = list(map(operator.add, map(start.__getitem__, item_sources), item_calls))
            positions = [column[0] for column in cluster]
            batched.gathers.append(
                Gather.of_index(pieces, piece_calls, index, positions, [count] * len(cluster))
            )

    def int_column(
        self, batched: GroupCall, position: int, values: np.ndarray, nodes: bool, columns: list[_Column]
    ) -> None:
        """A column of bare ints: handles of nodes above depth 0 (see ``Group``), ints at depth 0."""
        if not nodes:
            batched.fixed.append((position, Arg("ints", np.ascontiguousarray(values))))
            return
        sources = self.handle_source[values]
        if (sources >= 0).all():
            columns.append(self.node_column(position, sources, self.handle_index[values]))
        else:
            batched.fixed.append((position, self.shared(values.tolist(), batched.where(position))))

    @staticmethod
    def literal(item: Any, nodes: bool) -> tuple[str, Any]:
        """A stored literal as ``(kind, value)``; ``("", None)`` for a node or a tensor."""
        if item.__class__ is tuple:
            return item[0], item[1]
        if item.__class__ is int and not nodes:
            return "int", item
        return "", None

    def shared(self, column: Sequence[Any], where: str) -> Arg:
        """A ``nobatch`` position: one node's value, passed whole to the batched call."""
        tape = self.tape
        node = next(item for item in column if item.__class__ is int and tape.source[item] < 0)
        for other in column:
            if other.__class__ is not int or other != node:
                shown = tape.label(other) if other.__class__ is int else repr(other)
                raise FoldError(
                    f"{where}: {tape.label(node)} is nobatch, so every call of the group must pass that same "
                    f"node there, but another call passes {shown}; use .nobatch() only for a value shared by all "
                    "calls of an op at a depth"
                )
        return Arg("shared", (~tape.source[node], tape.index[node]))

    def single_call(self, batched: GroupCall, args: tuple[Any, ...], nodes: bool) -> None:
        """A group of one call (chains, roots): each node's own rows, as a view."""
        tape = self.tape
        for position, arg in enumerate(args):
            cls = arg.__class__
            if cls is int and nodes:
                source = tape.source[arg]
                kind = "rows" if source >= 0 else "shared"
                batched.fixed.append(
                    (position, Arg(kind, (source if source >= 0 else ~source, tape.index[arg])))
                )
            elif cls is int:
                batched.fixed.append((position, Arg("ints", np.array([arg], dtype=np.int64))))
            elif cls is tuple:
                tag, value = arg
                if tag == "int":
                    batched.fixed.append((position, Arg("ints", np.array([value], dtype=np.int64))))
                else:
                    batched.fixed.append((position, Arg("floats", np.array([value], dtype=np.float64))))
            elif arg.dim() == 0:
                raise _no_rows(batched.where(position), arg)
            else:
                batched.fixed.append((position, Arg("tensor", arg)))

    def merge(self, batched: GroupCall, columns: list[_Column]) -> list[Gather]:
        """Columns taking a whole result in order pass it through; the others that read a
        common source share one gather (connected through shared sources)."""
        gathered: list[_Column] = []
        for column in columns:
            whole = column.whole_source()
            if whole is not None:
                batched.fixed.append((column.position, Arg("whole", whole)))
            else:
                gathered.append(column)
        return [self.gather(cluster) for cluster in _clustered(gathered, lambda column: column.pieces.keys)]

    @staticmethod
    def gather(columns: list[_Column]) -> Gather:
        if len(columns) == 1:
            (column,) = columns
            return Gather(
                column.pieces.values, column.pieces.calls, column.item_piece, column.item_call,
                [column.position], [len(column.item_call)],
            )  # fmt: skip
        pieces = _Pieces()
        item_pieces = []
        for column in columns:
            remap = [
                pieces.number(key, piece, calls)
                for key, piece, calls in zip(
                    column.pieces.keys, column.pieces.values, column.pieces.calls, strict=True
                )
            ]
            item_pieces.append(np.array(remap, dtype=np.int64)[column.item_piece])
        return Gather(
            pieces.values,
            pieces.calls,
            np.concatenate(item_pieces),
            np.concatenate([column.item_call for column in columns]),
            [column.position for column in columns],
            [len(column.item_call) for column in columns],
        )

    def request(self, request: Sequence[Any], number: int = 0) -> Arg | Gather:
        """A request: its items' rows in order (a nobatch handle is just its rows; ints make one
        LongTensor). ``check_requests`` made sure that ints and floats come alone."""
        cls = request[0].__class__
        if cls is int or cls is float:
            return Arg(
                "ints" if cls is int else "floats",
                np.array(request, dtype=np.int64 if cls is int else np.float64),
            )
        kinds = set(map(type, request))
        if Node not in kinds:
            return Arg("concat", list(request))  # tensors only: any number of rows each, like the original
        if kinds == {Node}:
            handles = np.fromiter(map(handle_of, request), dtype=np.int64, count=len(request))
            sources = self.handle_source[handles]
            sources = np.where(sources < 0, ~sources, sources)  # a nobatch handle: its rows, as any other's
            calls = self.handle_index[handles]
            first, count = int(sources[0]), len(request)
            if (
                self.source_calls[first] == count
                and (sources == first).all()
                and (calls == np.arange(count)).all()
            ):
                return Arg("whole", first)  # every node of one group, in order: the common request
            column = self.node_column(0, sources, calls)
        else:  # nodes and tensors: one gather (never a whole source), each tensor one call's rows
            items = [handle_of(item) if item.__class__ is Node else item for item in request]
            column = self.mixed_column(0, items, f"apply request {number}")
        return self.gather([column])


def _clustered(columns: list[_Item], keys: Callable[[_Item], Sequence[Any]]) -> list[list[_Item]]:
    """Columns that read a common source (``keys``) in one cluster, in order: each column joins the
    first cluster holding a column that shares a source with it (``native.plain_group``'s rule too)."""
    clusters: list[list[_Item]] = []
    for column in columns:
        found = set(keys(column))
        home = next((c for c in clusters if any(not found.isdisjoint(keys(other)) for other in c)), None)
        if home is None:
            clusters.append([column])
        else:
            home.append(column)
    return clusters


def _concatenable(column: Sequence[_Tensor]) -> bool:
    """Tensors given to ``add``, each once, all alike (rows, row shape, dtype, device): one ``cat``.

    Anything else takes the general gather, which also words any error precisely.
    """
    first, count = column[0], len(column)
    if first.dim() == 0 or len(set(map(id, column))) != count:
        return False
    # attribute getters mapped in C, then counted: a third faster than a generator over the tensors
    return (
        list(map(_shape, column)).count(first.shape) == count
        and list(map(_dtype, column)).count(first.dtype) == count
        and list(map(_device, column)).count(first.device) == count
    )


def plan_fold(fold: Recording, requests: Sequence[Sequence[Any]], merges_depths: bool = False) -> FoldPlan:
    """The :class:`FoldPlan` that computes ``requests`` (lists of ``fold``'s nodes): what
    :meth:`Fold.plan <torchfold.Fold.plan>` returns. ``merges_depths``: ``fold`` is regrouped by
    readiness (see ``PlanData.merges_depths``)."""
    check_requests(fold, requests)
    planner = _Planner(fold)
    groups = [planner.group_call(group) for group in planner.groups]
    planned = [planner.request(request, number) for number, request in enumerate(requests)]
    plan = FoldPlan(
        groups, planned, planner.source_owner, len(fold), fold.device, fold.volatile, fold.shapes == "auto"
    )
    if merges_depths:
        plan.merges_depths = True
    return plan
