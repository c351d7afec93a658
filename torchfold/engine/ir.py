"""The parts of a plan: one batched call per group, its arguments and gathers, as plain picklable data.

What :mod:`~torchfold.engine.planner` produces and what :mod:`~torchfold.engine.executor` and
:mod:`~torchfold.engine.static` read. Nothing here runs an op: :class:`PlanData` holds the
parts, and :class:`~torchfold.FoldPlan` (:mod:`~torchfold.engine.plan`) adds running them.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from torchfold._errors import FoldError
from torchfold.engine.devices import on_host
from torchfold.engine.node import Group, Op, node_label

__all__ = [
    "INT32_LIMIT",
    "Arg",
    "Gather",
    "GroupCall",
    "PlanData",
    "call_offsets",
    "check_pad_rows",
    "check_portable_op",
    "check_request_number",
    "portable_tensors",
    "stored_index",
]

_Tensor = torch.Tensor
INT32_LIMIT = 2**31 - 1


def call_offsets(counts: Sequence[int]) -> np.ndarray:
    """Where each piece starts in a concatenation of pieces of ``counts`` calls (and the total, last)."""
    # A few pieces per gather: summed in Python, 3x faster than np.cumsum on a list (its conversion dominates)
    return np.fromiter(itertools.accumulate(counts, initial=0), dtype=np.int64, count=len(counts) + 1)


def stored_index(index: np.ndarray, total: int) -> np.ndarray:
    """A gather's index (int64) as a plan keeps it: int32 when ``total`` calls fit, half the
    bytes to ship from a DataLoader worker (``index_select`` takes both)."""
    return index.astype(np.int32) if total < INT32_LIMIT else index


class GroupCall:
    """One batched call of a plan: a recorded group, without its nodes.

    ``fixed`` holds the argument positions that need no gather, ``gathers`` the others.
    ``combined`` says that the group has several gathers, all of earlier results, one of them
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
        self.num_calls = len(group.nodes)
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
        self.index: np.ndarray | None = None if in_order else stored_index(index, total)

    @classmethod
    def of_index(
        cls,
        pieces: list[int | _Tensor],
        piece_calls: list[int],
        index: list[int] | np.ndarray | None,
        positions: list[int],
        sizes: list[int],
    ) -> Gather:
        """The gather whose items are at ``index`` in the concatenation of the pieces (int64, or
        a list), or in its order (None): made by the planner's paths that work the index out
        whole (see ``torchfold.engine.planner``)."""
        gather = cls.__new__(cls)
        gather.pieces, gather.piece_calls, gather.positions, gather.sizes = (
            pieces,
            piece_calls,
            positions,
            sizes,
        )
        total = gather.total_calls = sum(piece_calls)
        if isinstance(index, list):
            in_order = len(index) == total and index == list(range(total))
            index = None if in_order else np.array(index, dtype=np.int64)
        gather.index = None if index is None else stored_index(index, total)
        return gather

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """Each item's piece and call in it (for messages and compaction: not kept, recomputed)."""
        calls = np.arange(self.total_calls) if self.index is None else self.index
        offsets = call_offsets(self.piece_calls)
        item_piece = np.searchsorted(offsets[1:], calls, side="right")
        return item_piece, calls - offsets[item_piece]


class PlanData:
    """The parts of a plan: its groups (one batched call each) in execution order and its requests.

    ``groups`` holds one :class:`GroupCall` per group of the fold (one op at one depth), in the
    order they run. ``source_owner`` maps each source number to (group number, output or None
    for the whole result). The base of :class:`~torchfold.FoldPlan`, which adds running it;
    what the static envelope reads to pad a plan.
    """

    def __init__(
        self,
        groups: list[GroupCall],
        requests: list[Arg | Gather],
        source_owner: list[tuple[int, int | None]],
        num_nodes: int,
        device: torch.device | None,
        volatile: bool,
        pad_on_xla: bool = True,
    ) -> None:
        self.groups = groups
        self.requests = requests
        self.source_owner = source_owner  # per source number: (group, output or None for the whole result)
        self.num_nodes = num_nodes
        self.device = device
        self.volatile = volatile
        # On an XLA device, pad into the module's StaticShapes envelope (Fold(shapes="auto"))
        self.pad_on_xla = pad_on_xla

    #: planned by readiness (``Fold(schedule="ready")``): a group may hold an op's calls of several
    #: depths, so rows that disagree in dtype are refused, not promoted (the executor); a class
    #: attribute, so that plans pickled before it load as depth plans
    merges_depths = False

    @property
    def steps(self) -> list[GroupCall]:
        """Deprecated name of :attr:`groups` (a plan's batched calls, one per group)."""
        warnings.warn(
            "PlanData.steps (FoldPlan.steps) is deprecated; use .groups (in torchfold a step is an optimizer step)",
            FutureWarning,
            stacklevel=2,
        )
        return self.groups

    @property
    def sizes(self) -> list[int]:
        """Nodes each request asks for: the rows of each output, per row a node owns."""
        sizes = []
        for request in self.requests:
            if isinstance(request, Gather):
                sizes.append(sum(request.sizes))
            elif request.kind == "whole":
                sizes.append(self.groups[self.source_owner[request.value][0]].num_calls)
            elif request.kind in ("ints", "floats"):
                sizes.append(len(request.value))
            elif request.kind == "concat":  # tensors: their rows
                sizes.append(sum(int(t.shape[0]) for t in request.value))
            else:  # one node's rows
                sizes.append(1)
        return sizes

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
        return {**self.__dict__, "groups": [_portable(group) for group in self.groups], "requests": requests}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickle; plans pickled before their groups were named ``groups`` (``steps``) load too."""
        if "steps" in state:
            state = {("groups" if key == "steps" else key): value for key, value in state.items()}
        self.__dict__.update(state)

    def describe_item(self, source: int, call: int) -> str:
        """How a node is shown in messages, from its source number and call: ``Node('op', depth=1, index=3)``."""
        number, output = self.source_owner[source]
        return node_label(self.groups[number].name, self.groups[number].depth, call, output)

    def __len__(self) -> int:
        return self.num_nodes


def check_request_number(request: object, count: int) -> int:
    """``pad``'s request number must name one of the plan's ``count`` requests (for both plan kinds)."""
    if isinstance(request, bool) or not isinstance(request, int):
        raise TypeError(
            f"pad(request={request!r}): request must be an int, the number of a list given to plan"
        )
    if not 0 <= request < count:
        raise IndexError(
            f"pad(request={request}): the plan has {count} request{'s' * (count != 1)} (numbered 0 to {count - 1}); "
            "give the number of the list given to plan whose nodes the values belong to"
        )
    return request


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


def _portable(group: GroupCall) -> GroupCall:
    """``group`` as it may travel to another process (see ``FoldPlan.__getstate__``)."""
    check_portable_op(group.op, group.name, group.depth)
    given = [arg for _, arg in group.fixed if arg.kind in ("tensor", "concat")]
    if not given and all(isinstance(piece, int) for gather in group.gathers for piece in gather.pieces):
        return group  # nothing but index arrays: pickles as it is
    portable = copy.copy(group)
    portable.fixed = [
        (position, Arg(arg.kind, portable_tensors(arg.value, group.where(position))))
        if arg.kind in ("tensor", "concat")
        else (position, arg)
        for position, arg in group.fixed
    ]
    portable.gathers = [
        _portable_gather(gather, group.where(gather.positions[0])) for gather in group.gathers
    ]
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
            "plan and apply this fold in the same process"
        )
    if on_host(tensor.device) and tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
        return tensor.clone()  # a view of a bigger tensor (images[i : i + 1]) would pickle all of it
    return tensor
