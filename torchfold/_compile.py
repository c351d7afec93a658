"""Compiling a fold: from recorded nodes to a :class:`FoldPlan` of integer index arrays.

A plan says, for every batched group in execution order, where each argument position comes
from: a column of ints, tensors given to ``add``, one node's rows, a whole earlier result, or a
gather (one concatenation of the sources read, then one ``index_select`` in call order).
Positions that read the same sources (a binary node's left and right children) share one
gather. All of it is worked out here, in call units, from the recorded graph alone: the module
is not needed and no tensor op runs, so a plan can be built in a ``DataLoader`` worker process
and shipped (pickled) to the training process, which then only runs tensor ops
(:mod:`torchfold._execute`).
"""

from __future__ import annotations

import copy
import inspect
import itertools
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from torchfold._errors import FoldError
from torchfold._node import Group, Node, Op, ints_and_floats_mixed, literals_and_rows_mixed, node_label
from torchfold._plan import check_requests, module_device

if TYPE_CHECKING:
    from torchfold._fold import Fold

__all__ = [
    "INT32_LIMIT",
    "FoldPlan",
    "call_offsets",
    "check_pad_rows",
    "check_portable_op",
    "compile_fold",
    "portable_tensors",
]

_Tensor = torch.Tensor
INT32_LIMIT = 2**31 - 1
_is_batched = operator.attrgetter("batch")
_source = operator.attrgetter("source")
_index = operator.attrgetter("index")
_shape = operator.attrgetter("shape")
_dtype = operator.attrgetter("dtype")
_device = operator.attrgetter("device")


def call_offsets(counts: Sequence[int]) -> np.ndarray:
    """Where each piece starts in a concatenation of pieces of ``counts`` calls (and the total, last)."""
    # A few pieces per gather: summed in Python, 3x faster than np.cumsum on a list (its conversion dominates)
    return np.fromiter(itertools.accumulate(counts, initial=0), dtype=np.int64, count=len(counts) + 1)


class Step:
    """One batched call of a plan: a recorded group, without its nodes.

    ``fixed`` holds the argument positions that need no gather, ``gathers`` the others.
    ``combined`` says that the step has several gathers, all of earlier results, one of them
    reading several: ``apply`` then
    runs them as one (one concatenation and one ``index_select`` for all: a Tree-LSTM node's
    ``h`` and ``c`` children, kept apart by ``gathers`` because they read different sources)
    when the sources turn out to agree in rows per call, row shape, dtype and device. The joint
    index is made at apply time from the gathers' own: storing it too would make the plans
    shipped from ``DataLoader`` workers half as big again.
    """

    __slots__ = (
        "arity",
        "combined",
        "depth",
        "fixed",
        "gathers",
        "name",
        "num_calls",
        "num_outputs",
        "op",
        "output_sources",
        "source",
    )

    def __init__(self, group: Group, arity: int) -> None:
        self.op: Op = group.op
        self.name = group.name
        self.depth = group.depth
        self.num_calls = len(group.calls)
        self.arity = arity
        self.source = group.source
        self.output_sources = tuple(group.output_sources)
        self.num_outputs = group.num_outputs
        self.fixed: list[tuple[int, Arg]] = []
        self.gathers: list[Gather] = []
        self.combined = False

    def __setstate__(self, state: tuple[None, dict[str, Any]] | dict[str, Any]) -> None:
        """Unpickle; plans pickled before ``combined`` existed load too, their gathers run one by one."""
        slots = state[1] if isinstance(state, tuple) else state
        self.combined = False
        for name, value in slots.items():
            setattr(self, name, value)

    def where(self, position: int) -> str:
        return f"op {self.name!r} at depth {self.depth}, argument {position}"


class Arg:
    """An argument position that needs no gather. ``kind`` says what ``value`` holds:

    * ``"ints"``/``"floats"``: a numpy column, made a long / default-dtype tensor on the device;
    * ``"tensor"``: a tensor given to ``add`` (the only call of its group);
    * ``"concat"``: tensors given to ``add``, one per call, to concatenate;
    * ``"rows"``: ``(source, call)``: one call's rows of an earlier result (one-call groups), as a view;
    * ``"shared"``: ``(source, call)``: the same, for a ``nobatch`` node: passed whole to the
      batched call, however many calls it has (static shapes pad ``"rows"`` but never this);
    * ``"whole"``: ``source``: an earlier result taken whole and in order, passed through.
    """

    __slots__ = ("kind", "value")

    def __init__(self, kind: str, value: Any) -> None:
        self.kind = kind
        self.value = value


class Gather:
    """Argument positions filled by one concatenation and (unless already in order) one ``index_select``.

    ``pieces`` are what is read: source numbers of earlier results (ints) and tensors given to
    ``add``; ``piece_calls`` how many calls each holds (a given tensor counts as one call).
    ``index`` gives, for each item (the calls of every position, one position after another),
    its call in the concatenation of all pieces, or is None when that is already the items'
    order. Counting in calls, not rows, keeps the plan valid whatever number of rows each call
    turns out to own.
    """

    __slots__ = ("index", "piece_calls", "pieces", "positions", "sizes", "total_calls")

    def __init__(
        self,
        pieces: list[int | _Tensor],
        piece_calls: list[int],
        item_piece: np.ndarray,
        item_call: np.ndarray,
        positions: list[int],
        sizes: list[int],
    ) -> None:
        self.pieces = pieces
        self.piece_calls = piece_calls
        self.positions = positions  # argument positions filled, in item order
        self.sizes = sizes  # items of each position
        offsets = call_offsets(piece_calls)
        index = offsets[item_piece] + item_call if len(pieces) > 1 else item_call
        total = self.total_calls = int(offsets[-1])  # calls in the concatenation of all pieces
        in_order = len(index) == total and bool((index == np.arange(total)).all())
        # int32 when it fits: half the bytes to ship from a DataLoader worker (index_select takes both)
        self.index: np.ndarray | None = (
            None if in_order else index.astype(np.int32) if total < INT32_LIMIT else index
        )

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """Each item's piece and call in it (for messages and compaction: not kept, recomputed)."""
        calls = np.arange(self.total_calls) if self.index is None else self.index
        offsets = call_offsets(self.piece_calls)
        item_piece = np.searchsorted(offsets[1:], calls, side="right")
        return item_piece, calls - offsets[item_piece]


class FoldPlan:
    """A compiled fold: every batched call and gather, ready to run on a module.

    Made by :meth:`Fold.plan <torchfold.Fold.plan>`; :meth:`apply` runs it. A plan holds no
    nodes, only ops, integer index arrays and the tensors given to ``add``, so it pickles:
    build folds in ``DataLoader`` worker processes and apply the plans in the training process,
    which then does tensor work only. Applying one plan again recomputes from the current weights.

    To ship a plan, record ops by name (or as plain functions) and give ``add`` only tensors
    that need no gradient: pickling refuses ops bound to an object and tensors that require
    grad, whose copies would cut the gradient off. A tensor given as a view of a bigger one
    (``images[i : i + 1]``) pickles as just its rows.

    Example:
        >>> import pickle, torch, torchfold
        >>> class Doubler(torch.nn.Module):
        ...     def exp(self, x):
        ...         return 2 * x
        >>> f = torchfold.Fold()
        >>> a = f.add("exp", 1)
        >>> plan = f.plan([[a, f.add("exp", a)]])
        >>> plan
        FoldPlan(2 groups, 2 nodes, 1 request)
        >>> pickle.loads(pickle.dumps(plan)).apply(Doubler())
        [tensor([2, 4])]
    """

    def __init__(
        self,
        steps: list[Step],
        requests: list[Arg | Gather],
        source_owner: list[tuple[int, int | None]],
        num_nodes: int,
        device: torch.device | None,
        volatile: bool,
        pad_on_xla: bool = True,
    ) -> None:
        self.steps = steps
        self.requests = requests
        self.source_owner = source_owner  # per source number: (step, output or None for the whole result)
        self.num_nodes = num_nodes
        self.device = device
        self.volatile = volatile
        # On an XLA device, pad into the module's StaticShapes envelope (Fold(shapes="auto"))
        self.pad_on_xla = pad_on_xla

    @property
    def sizes(self) -> list[int]:
        """Nodes each request asks for: the rows of each output, per row a node owns."""
        sizes = []
        for request in self.requests:
            if isinstance(request, Gather):
                sizes.append(sum(request.sizes))
            elif request.kind == "whole":
                sizes.append(self.steps[self.source_owner[request.value][0]].num_calls)
            elif request.kind in ("ints", "floats"):
                sizes.append(len(request.value))
            elif request.kind == "concat":  # tensors: their rows
                sizes.append(sum(int(t.shape[0]) for t in request.value))
            else:  # one node's rows
                sizes.append(1)
        return sizes

    @property
    def capacities(self) -> list[int]:
        """Rows per node of each output of ``apply(padded=True)``: the sizes, as nothing is padded."""
        return self.sizes

    def pad(self, request: int, values: Any, fill: float = 0) -> _Tensor:
        """``values`` (one per node of request ``request``) as a tensor: nothing to pad in an unpadded plan.

        The same call as :meth:`StaticPlan.pad <torchfold.StaticPlan.pad>`, so one loss works
        with padded and unpadded plans.
        """
        tensor = torch.as_tensor(values)
        check_pad_rows(request, tuple(tensor.shape), self.sizes[request])
        return tensor

    def apply(self, nn: torch.nn.Module | object, *, padded: bool = False) -> list[_Tensor]:
        """Run the plan's batched calls on ``nn``; one tensor per request given to ``Fold.plan``.

        On an XLA device the plan is padded into the module's :class:`~torchfold.StaticShapes`
        envelope first (unless its Fold was made with ``shapes=None``), so that the graphs XLA
        compiles repeat; the outputs are the same. ``padded`` is for the same call on a
        :class:`~torchfold.StaticPlan`: nothing here is padded, so the outputs are exact.
        The plan is not changed, so several threads may apply one plan at once.

        Raises:
            FoldError: unknown op, rows that disagree within a group, or a bad split.
            Exception: an exception raised inside an op, of its own type, with a note naming
                the op, the depth, the nodes and the batched argument shapes.
        """
        return self._run(nn)

    def _run(self, nn: object, arg_shapes: list[list[tuple[Any, Any]]] | None = None) -> list[_Tensor]:
        """``apply``, also giving each step's batched argument shapes to ``arg_shapes`` (the plan is never written)."""
        from torchfold._execute import run  # (a cycle: _execute imports this module)

        device = self.device if self.device is not None else module_device(nn)
        if self.pad_on_xla and device.type == "xla":
            from torchfold._static import StaticShapes

            return StaticShapes.of(nn).fit(self).apply(nn)
        if self.volatile and torch.is_grad_enabled():
            with torch.no_grad():
                return run(self, nn, arg_shapes, device)
        return run(self, nn, arg_shapes, device)

    def __getstate__(self) -> dict[str, Any]:
        """What pickles: the plan, with tensors given to ``add`` cut down to their own rows.

        Raises:
            FoldError: an op is a bound method (the pickle would hold a copy of its object, and
                the module applying the plan would get no gradients through it), or a tensor
                given to ``add`` requires grad (its copy would cut the gradient off).
        """
        requests = [
            Arg(request.kind, portable_tensors(request.value, f"apply request {number}"))
            if isinstance(request, Arg) and request.kind == "concat"
            else _portable_gather(request, f"apply request {number}")
            if isinstance(request, Gather)
            else request
            for number, request in enumerate(self.requests)
        ]
        return {**self.__dict__, "steps": [_portable(step) for step in self.steps], "requests": requests}

    def describe_item(self, source: int, call: int) -> str:
        """How a node is shown in messages, from its source number and call: ``Node('op', depth=1, index=3)``."""
        number, output = self.source_owner[source]
        return node_label(self.steps[number].name, self.steps[number].depth, call, output)

    def __len__(self) -> int:
        return self.num_nodes

    def __repr__(self) -> str:
        groups, requests = len(self.steps), len(self.requests)
        return (
            f"FoldPlan({groups} group{'s' * (groups != 1)}, {self.num_nodes} node{'s' * (self.num_nodes != 1)}, "
            f"{requests} request{'s' * (requests != 1)})"
        )


# --------------------------------------------------------------------------------------------


def check_pad_rows(request: int, shape: tuple[int, ...], size: int) -> None:
    """``pad``'s values must give one row per node of the request (for padded and unpadded plans alike)."""
    if len(shape) == 0 or shape[0] != size:
        raise ValueError(
            f"pad(request={request}): values have shape {shape} but the request has {size} nodes; "
            "give one value (row) per node of the request"
        )


def check_portable_op(op: Op, name: str, depth: int) -> None:
    """Refuse to pickle an op bound to an object: the copy would get the gradients, not the module."""
    if inspect.ismethod(op):
        owner = type(op.__self__).__name__
        raise FoldError(
            f"op {name!r} at depth {depth} is a method bound to a {owner}: a pickled plan would carry its "
            f"own copy of that {owner}, and the module applying the plan would get no gradients through it; "
            f"record the op by name, fold.add({op.__name__!r}, ...), to ship plans between processes"
        )


def _portable(step: Step) -> Step:
    """``step`` as it may travel to another process (see ``FoldPlan.__getstate__``)."""
    check_portable_op(step.op, step.name, step.depth)
    given = [arg for _, arg in step.fixed if arg.kind in ("tensor", "concat")]
    if not given and all(isinstance(piece, int) for gather in step.gathers for piece in gather.pieces):
        return step  # nothing but index arrays: pickles as it is
    portable = copy.copy(step)
    portable.fixed = [
        (position, Arg(arg.kind, portable_tensors(arg.value, step.where(position))))
        if arg.kind in ("tensor", "concat")
        else (position, arg)
        for position, arg in step.fixed
    ]
    portable.gathers = [_portable_gather(gather, step.where(gather.positions[0])) for gather in step.gathers]
    return portable


def _portable_gather(gather: Gather, where: str) -> Gather:
    if all(isinstance(piece, int) for piece in gather.pieces):
        return gather
    moved = copy.copy(gather)
    moved.pieces = [
        piece if isinstance(piece, int) else portable_tensors(piece, where) for piece in gather.pieces
    ]
    return moved


def portable_tensors(value: Any, where: str) -> Any:
    """A tensor given to ``add`` (or a list of them) reduced to its own rows for pickling."""
    if isinstance(value, list):
        return [portable_tensors(tensor, where) for tensor in value]
    tensor: _Tensor = value
    if tensor.requires_grad:
        raise FoldError(
            f"{where}: a tensor given to add requires grad (shape {tuple(tensor.shape)}); a pickled plan holds a copy "
            "of it, so no gradient would reach the original: use parameters inside the module's ops instead, or "
            "compile and apply this plan in the same process"
        )
    if (
        tensor.device.type == "cpu"
        and tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size()
    ):
        return tensor.clone()  # a view of a bigger tensor (images[i : i + 1]) would pickle all of it
    return tensor


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


class _Compiler:
    """Builds a :class:`FoldPlan` from a fold's groups (one pass over the nodes)."""

    def __init__(self, fold: Fold) -> None:
        self.groups = fold.groups()
        self.source_calls = [0] * fold._token.sources  # calls of the group behind each source
        self.source_owner: list[tuple[int, int | None]] = [(0, None)] * fold._token.sources
        for number, group in enumerate(self.groups):
            calls = len(group.calls)
            self.source_calls[group.source] = calls
            self.source_owner[group.source] = (number, None)
            for output, source in enumerate(group.output_sources):
                self.source_calls[source] = calls
                self.source_owner[source] = (number, output)

    def node_column(self, position: int, column: Sequence[Node]) -> _Column:
        """A column of batched nodes: the hot path."""
        sources = list(map(_source, column))
        item_call = np.fromiter(map(_index, column), dtype=np.int64, count=len(column))
        first = sources[0]
        if sources.count(first) == len(sources):
            keys: list[Any] = [first]
            item_piece = np.zeros(len(column), dtype=np.int64)
        else:
            # sources numbered in first-use order
            numbers = {source: number for number, source in enumerate(dict.fromkeys(sources))}
            keys = list(numbers)
            item_piece = np.fromiter(map(numbers.__getitem__, sources), dtype=np.int64, count=len(sources))
        source_calls = self.source_calls
        return _Column(
            position, _Pieces.of_sources(keys, [source_calls[s] for s in keys]), item_piece, item_call
        )

    def mixed_column(self, position: int, column: Sequence[Any], where: str) -> _Column:
        """A column mixing nodes and tensors given to ``add``."""
        pieces = _Pieces()
        item_piece: list[int] = []
        item_call: list[int] = []
        for item in column:
            if item.__class__ is Node:
                item_piece.append(pieces.number(item.source, item.source, self.source_calls[item.source]))
                item_call.append(item.index)
            else:
                if item.dim() == 0:
                    raise _no_rows(where, item)
                item_piece.append(pieces.number(("tensor", id(item)), item, 1))
                item_call.append(0)
        return _Column(
            position, pieces, np.array(item_piece, dtype=np.int64), np.array(item_call, dtype=np.int64)
        )

    def step(self, group: Group) -> Step:
        calls = group.calls
        step = Step(group, len(calls[0]))
        if len(calls) == 1:
            self.single_call(step, calls[0])
            return step
        columns: list[_Column] = []
        for position, column in enumerate(zip(*calls, strict=True)):
            kinds = set(map(type, column))
            if kinds == {Node}:
                if all(map(_is_batched, column)):
                    columns.append(self.node_column(position, column))
                else:
                    step.fixed.append((position, _shared(column, step.where(position))))
            elif kinds == {int}:
                step.fixed.append((position, Arg("ints", np.array(column, dtype=np.int64))))
            elif kinds == {float}:
                step.fixed.append((position, Arg("floats", np.array(column, dtype=np.float64))))
            elif kinds == {int, float}:  # one tensor, one dtype (the eager Unfold refuses the same mix)
                int_value = next(item for item in column if item.__class__ is int)
                float_value = next(item for item in column if item.__class__ is float)
                raise FoldError(ints_and_floats_mixed(step.where(position), int_value, float_value))
            elif int in kinds or float in kinds:
                raise FoldError(
                    literals_and_rows_mixed(step.where(position), "ints" if int in kinds else "floats")
                )
            elif Node in kinds and not all(item.batch for item in column if item.__class__ is Node):
                step.fixed.append((position, _shared(column, step.where(position))))
            elif Node not in kinds and _concatenable(column):
                step.fixed.append((position, Arg("concat", list(column))))
            else:
                columns.append(self.mixed_column(position, column, step.where(position)))
        step.gathers = self.merge(step, columns)
        # Combined only where some gather concatenates anyway: gathers that each read one earlier
        # result are cheaper as one index_select each than as a concatenation of all of them.
        step.combined = (
            len(step.gathers) > 1
            and any(len(gather.pieces) > 1 for gather in step.gathers)
            and all(isinstance(piece, int) for gather in step.gathers for piece in gather.pieces)
        )
        return step

    def single_call(self, step: Step, args: tuple[Any, ...]) -> None:
        """A group of one call (chains, roots): each node's own rows, as a view."""
        for position, arg in enumerate(args):
            cls = arg.__class__
            if cls is Node:
                kind = "rows" if arg.batch else "shared"
                step.fixed.append((position, Arg(kind, (arg.source, arg.index))))
            elif cls is int:
                step.fixed.append((position, Arg("ints", np.array([arg], dtype=np.int64))))
            elif cls is float:
                step.fixed.append((position, Arg("floats", np.array([arg], dtype=np.float64))))
            elif arg.dim() == 0:
                raise _no_rows(step.where(position), arg)
            else:
                step.fixed.append((position, Arg("tensor", arg)))

    def merge(self, step: Step, columns: list[_Column]) -> list[Gather]:
        """Columns taking a whole result in order pass it through; the others that read a
        common source share one gather (connected through shared sources)."""
        clusters: list[list[_Column]] = []
        for column in columns:
            whole = column.whole_source()
            if whole is not None:
                step.fixed.append((column.position, Arg("whole", whole)))
                continue
            keys = set(column.pieces.keys)
            home = next(
                (c for c in clusters if any(not keys.isdisjoint(other.pieces.keys) for other in c)), None
            )
            if home is None:
                clusters.append([column])
            else:
                home.append(column)
        return [self.gather(cluster) for cluster in clusters]

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

    def whole_request(self, request: Sequence[Node]) -> int | None:
        """The source a request of nodes asks for whole and in call order, if it does (``apply``
        on every node of one group: the common request, found without building index arrays)."""
        first, count = request[0].source, len(request)
        if self.source_calls[first] != count or list(map(_source, request)).count(first) != count:
            return None
        return first if list(map(_index, request)) == list(range(count)) else None

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
            whole = self.whole_request(request)
            if whole is not None:
                return Arg("whole", whole)
            column = self.node_column(0, request)
        else:  # nodes and tensors: one gather (never a whole source), each tensor one call's rows
            column = self.mixed_column(0, request, f"apply request {number}")
        return self.gather([column])


def _shared(column: Sequence[Any], where: str) -> Arg:
    """A ``nobatch`` position: one node's value, passed whole to the batched call."""
    node = next(item for item in column if item.__class__ is Node and not item.batch)
    for other in column:
        if other is not node:
            raise FoldError(
                f"{where}: {node!r} is nobatch, so every call of the group must pass that same "
                f"node there, but another call passes {other!r}; use .nobatch() only for a value shared by all "
                "calls of an op at a depth"
            )
    return Arg("shared", (node.source, node.index))


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


def compile_fold(fold: Fold, requests: Sequence[Sequence[Any]]) -> FoldPlan:
    """The :class:`FoldPlan` that computes ``requests`` (lists of ``fold``'s nodes)."""
    check_requests(fold, requests)
    compiler = _Compiler(fold)
    steps = [compiler.step(group) for group in compiler.groups]
    planned = [compiler.request(request, number) for number, request in enumerate(requests)]
    return FoldPlan(
        steps, planned, compiler.source_owner, len(fold), fold.device, fold.volatile, fold.shapes == "auto"
    )
