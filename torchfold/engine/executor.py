"""The executor of a plan, padded or not: one loop over its batched calls (:func:`run_calls`).

:func:`run_calls` resolves the ops, then for each batched call in order assembles its
arguments, calls the op (:func:`~torchfold.engine.ops.call_op`), checks and keeps what it
returns (:func:`~torchfold.engine.ops.check_outputs`), and finally assembles one tensor per
request. It runs a plan (:class:`~torchfold.engine.ir.PlanData`, through :func:`run`)
and a padded one (:meth:`StaticLayout.run <torchfold.engine.static.layout.StaticLayout.run>`)
alike; what differs between them is how arguments are read from earlier results, which a
:class:`Results` object of each plan kind says. Here, the plain plan's: every group's
result stays one batched tensor (or tuple of them), and a consumer's argument is assembled
with at most two tensor operations, whatever the number of nodes:

* all its rows come, in order, from one whole earlier result: that tensor is passed through
  with no copy;
* otherwise the sources it reads (earlier results, and tensors given to ``add``) are
  concatenated once, and one ``index_select`` picks the rows in call order (skipped when the
  concatenation already is in call order). Positions reading common sources share both. Sources
  of different float precision (under autocast) are promoted first, as ``torch.cat`` would
  (:func:`~torchfold.engine.ops.gathered_dtype`).

The plan counts in calls; here, once each result's rows per call is known, the indices are
scaled to rows. So ``apply`` costs O(groups) tensor operations, not O(nodes), and its Python
work is a loop over groups: all per-node bookkeeping happened when the fold was planned.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, cast

import numpy as np
import torch

from torchfold._errors import FoldError
from torchfold.engine.devices import on_host
from torchfold.engine.ir import Arg, Gather, GroupCall, PlanData, call_offsets, stored_index
from torchfold.engine.node import Op
from torchfold.engine.ops import call_op, check_outputs, dtypes_disagree, gathered_dtype, tuple_used_whole
from torchfold.engine.readiness import refused_by_readiness
from torchfold.engine.resolve import device_for, resolve_ops

__all__ = ["BatchedCall", "Results", "run", "run_calls"]

_Tensor = torch.Tensor


class BatchedCall(Protocol):
    """What the executor reads of a batched call: a plan's ``GroupCall`` or a static ``Slot``."""

    op: Op
    name: str
    depth: int
    num_calls: int
    num_outputs: int


_Call = TypeVar("_Call", bound=BatchedCall, contravariant=True)


class Results(Protocol[_Call]):
    """The results of a plan's batched calls so far, kept and read the way its kind of plan does.

    :func:`run_calls` asks it for each call's arguments, gives it each call's checked outputs,
    and at the end asks it for each request's tensor.
    """

    def arguments(self, call: _Call) -> list[Any]:
        """The batched arguments of ``call``, one per position, from earlier results and the plan's data."""
        ...

    def store(self, number: int, call: _Call, out: Any, outputs: Sequence[_Tensor]) -> None:
        """Keep what call ``number`` returned: ``out`` as the op returned it, ``outputs`` its checked tensors."""
        ...

    def request(self, number: int) -> _Tensor:
        """The tensor of request ``number``, once every call has run."""
        ...


# NOTE: one executor for plain and padded plans. The loop, the op call, the output checks and the
# request assembly are here once; a plan kind only says how it reads arguments (a plain plan:
# numpy indices, with pass-through, combined gathers and compaction, and precise mismatch
# errors; a static layout: slices of its packed input tensors and running concatenations). The
# static kind's reads are pure tensor operations, so that this loop stays one graph under
# ``torch.compile(fullgraph=True)``: nothing here branches on a tensor's value.
def run_calls(
    nn: object,
    calls: Sequence[_Call],
    results: Results[_Call],
    requests: int,
    *,
    padded: bool = False,
    arg_shapes: list[list[tuple[Any, Any]]] | None = None,
) -> list[_Tensor]:
    """Run ``calls`` in order on ``nn``, their arguments read from ``results``; one tensor per request.

    ``padded``: the calls are a static layout's (error messages say so). ``arg_shapes``, if
    given, receives the (dtype, shape) of each call's batched arguments, one list per call.

    Its two users: :func:`run` (a plain plan) and :meth:`StaticLayout.run
    <torchfold.engine.static.layout.StaticLayout.run>` (a padded one).
    """
    fns: list[Callable[..., Any]] = resolve_ops(nn, calls)
    for number, (call, fn) in enumerate(zip(calls, fns, strict=True)):
        args = results.arguments(call)
        if arg_shapes is not None:
            arg_shapes.append([(a.dtype, a.shape) for a in args])
        name, depth, count = call.name, call.depth, call.num_calls
        out = call_op(fn, args, name, depth, count, padded=padded)
        outputs = check_outputs(out, name, depth, count, call.num_outputs, padded=padded)
        results.store(number, call, out, outputs)
    return [results.request(number) for number in range(requests)]


def run(
    plan: PlanData,
    nn: object,
    arg_shapes: list[list[tuple[Any, Any]]] | None = None,
    device: torch.device | None = None,
) -> list[_Tensor]:
    """Run ``plan``'s groups on ``nn`` and return one batched tensor per request.

    The plan is only read (several threads may run it). ``arg_shapes``, if given, receives the
    (dtype, shape) of each group's batched arguments, one list per group run. ``device``: where
    ints and floats are made, if the caller already knows (default: the plan's, else the module's).

    >>> import torch, torchfold
    >>> f = torchfold.Fold()
    >>> run(f.plan([[f.add(torch.neg, 1), f.add(torch.neg, 2)]]), None)
    [tensor([-1, -2])]
    """
    if device is None:
        device = device_for(nn, plan.device)
    return run_calls(nn, plan.groups, _Results(plan, device), len(plan.requests), arg_shapes=arg_shapes)


# A source read only in part is gathered on its own first when copying it whole into the
# concatenation would move more than this many unused bytes. Backward zero-fills the whole
# source either way, so compacting only saves the forward copy, at the price of one more
# operation: measured on the SST Tree-LSTM benchmark (sources of 0.1-0.5 MB), compacting at
# 256 KB made apply+backward 13% slower than never compacting. So only very large, sparsely
# read sources (big graphs, long sequences) are compacted.
COMPACT_BYTES = 1 << 23


class _Results:
    """A plain plan's results (:class:`Results`): the batched results of the groups run so far,
    by source number, and how many rows each call owns. ``device``: where ints and floats are made."""

    __slots__ = ("device", "kinds", "outputs", "plan", "tensors")

    def __init__(self, plan: PlanData, device: torch.device) -> None:
        count = len(plan.source_owner)
        self.plan = plan
        self.device = device
        self.tensors: list[_Tensor | None] = [None] * count
        # per source: (rows per call, row shape, dtype, device): what must agree to gather together
        self.kinds: list[tuple[Any, ...] | None] = [None] * count
        self.outputs = [0] * len(plan.groups)  # outputs each group returned (0: one tensor)

    def arguments(self, group: GroupCall) -> list[Any]:
        device = self.device
        args: list[Any] = [None] * group.arity
        for position, arg in group.fixed:
            args[position] = _value(arg, self, device)
        if group.combined:
            gathered = _combined_gathered(group, self, device)
            if gathered is not None:
                positions = [position for gather in group.gathers for position in gather.positions]
                for position, tensor in zip(positions, gathered, strict=True):
                    args[position] = tensor
                return args
        for gather in group.gathers:
            for position, tensor in zip(
                gather.positions, _gathered(gather, self, device, group.where), strict=True
            ):
                args[position] = tensor
        return args

    def store(self, number: int, group: GroupCall, out: Any, outputs: Sequence[_Tensor]) -> None:
        calls = group.num_calls
        if isinstance(out, _Tensor):
            sources: Sequence[int] = (group.source,)
        else:
            sources = group.output_sources
            self.outputs[number] = len(outputs)
        for source, value in zip(sources, outputs, strict=False):  # outputs never split are not read
            self.tensors[source] = value
            self.kinds[source] = _rows_kind(value, value.shape[0] // calls)

    def get(self, source: int, call: int) -> tuple[_Tensor, int]:
        """The batched tensor of ``source`` and its rows per call (``call``: a call reading it, for messages)."""
        tensor = self.tensors[source]
        if tensor is not None:
            return tensor, cast(tuple[Any, ...], self.kinds[source])[0]
        number, _ = self.plan.source_owner[source]
        group, count = self.plan.groups[number], self.outputs[number]
        # A source that was split is checked by store(); so this is a result used whole that was a tuple.
        raise tuple_used_whole(self.plan.describe_item(source, call), group.name, group.depth, count)

    def request(self, number: int) -> _Tensor:
        request = self.plan.requests[number]
        if isinstance(request, Arg):
            return _value(request, self, self.device)
        (output,) = _gathered(request, self, self.device, lambda _: f"apply request {number}")
        return output


def _rows_index(calls: np.ndarray, rows: int, device: torch.device) -> _Tensor:
    """Indices of the ``rows`` consecutive rows of each of ``calls``, on ``device``."""
    if rows != 1:
        calls = (calls.astype(np.int64)[:, None] * rows + np.arange(rows, dtype=np.int64)).reshape(-1)
    index = torch.from_numpy(calls)  # int32 or int64, contiguous: made so by the planner
    return index if on_host(device) else index.to(device)


def _value(arg: Arg, results: _Results, device: torch.device) -> _Tensor:
    kind, value = arg.kind, arg.value
    if kind == "whole":
        return results.get(value, 0)[0]
    if kind == "rows" or kind == "shared":
        source, call = value
        tensor, k = results.get(source, call)
        return tensor if tensor.shape[0] == k else tensor[call * k : (call + 1) * k]
    # Ints and floats become a fresh tensor at every apply (never a view of the plan's array),
    # so a caller changing an output that is an op's int input (returned as is) cannot change the plan.
    if kind == "ints":
        return torch.from_numpy(value).to(device, copy=True)
    if kind == "floats":
        return torch.from_numpy(value).to(device=device, dtype=torch.get_default_dtype(), copy=True)
    if kind == "concat":
        return torch.cat(value, 0)
    return value  # "tensor": given to add


class _Mismatch(Exception):
    """Pieces of a gather that disagree; :func:`_explain` turns it into a precise FoldError."""


def _pieces(gather: Gather, results: _Results) -> tuple[list[_Tensor], int]:
    """The tensors a gather reads and the rows each call owns in them (the same for all)."""
    tensors: list[_Tensor] = []
    kind: tuple[Any, ...] | None = None
    mixed = False  # rows of different dtypes: joined in their promoted dtype (gathered_dtype)
    for number, piece in enumerate(gather.pieces):
        if isinstance(piece, int):
            tensor = results.tensors[piece]
            if tensor is None:  # a tuple result used whole: name the first item reading it
                item_piece, item_call = gather.items()
                results.get(piece, int(item_call[np.argmax(item_piece == number)]))
            this = cast(tuple[Any, ...], results.kinds[piece])  # (set with its tensor)
        else:
            tensor = piece
            this = _rows_kind(piece, piece.shape[0])
        if kind is None:
            kind = this
        elif this != kind:
            if this[:2] != kind[:2] or this[3] != kind[3]:  # rows per call, row shape, device
                raise _Mismatch
            mixed = True
        tensors.append(cast(_Tensor, tensor))
    if mixed:
        dtype = gathered_dtype([tensor.dtype for tensor in tensors])
        if dtype is None or results.plan.merges_depths:  # (calls of several depths: never promoted)
            raise _Mismatch
        tensors = [tensor.to(dtype) for tensor in tensors]
    return tensors, cast(tuple[Any, ...], kind)[0]


def _rows_kind(tensor: _Tensor, rows: int) -> tuple[Any, ...]:
    """What must agree between tensors gathered together: rows per call, row shape, dtype, device
    (dtypes of one kind may differ: :func:`_pieces` promotes them)."""
    return (rows, tensor.shape[1:], tensor.dtype, tensor.device)


def _explain(gather: Gather, results: _Results, where: Callable[[int], str]) -> FoldError:
    """The precise error for a gather whose pieces disagree: the position, and the two items."""
    plan = results.plan
    item_piece, item_call = gather.items()

    def describe(piece: int, item: int) -> str:
        value = gather.pieces[piece]
        if isinstance(value, int):
            return plan.describe_item(value, int(item_call[item]))
        return f"a tensor of shape {tuple(value.shape)}"

    def fetch(piece: int) -> tuple[_Tensor, int]:
        value = gather.pieces[piece]
        return results.get(value, 0) if isinstance(value, int) else (value, value.shape[0])

    start = 0
    for position, size in zip(gather.positions, gather.sizes, strict=True):
        seen: dict[int, int] = {}  # piece -> the first item reading it, in first-use order
        for item in range(start, start + size):
            seen.setdefault(int(item_piece[item]), item)
        start += size
        (reference, first_item), *others = seen.items()
        first, rows = fetch(reference)
        for piece, item in others:
            other, k = fetch(piece)
            if k != rows:
                return FoldError(
                    f"{where(position)}: rows disagree within the group: {describe(reference, first_item)} gives "
                    f"{rows} rows per call but {describe(piece, item)} gives {k}; every call of a group must pass "
                    "the same number of rows at each position"
                )
            if other.shape[1:] != first.shape[1:] or other.device != first.device:
                return FoldError(
                    f"{where(position)}: rows disagree in shape within the group: {describe(reference, first_item)} "
                    f"gives rows of {tuple(first.shape[1:])} {first.dtype} on {first.device}, but "
                    f"{describe(piece, item)} gives {tuple(other.shape[1:])} {other.dtype} on {other.device}; calls "
                    "of one group must pass same-shaped rows at each position (use different ops for different shapes)"
                )
            if plan.merges_depths and first.dtype != other.dtype:  # (never promoted: see PlanData)
                return FoldError(
                    f"{where(position)}: rows disagree in dtype within the group: {describe(reference, first_item)} "
                    f"gives {first.dtype} rows but {describe(piece, item)} gives {other.dtype}"
                )
            if gathered_dtype([first.dtype, other.dtype]) is None:
                return FoldError(
                    dtypes_disagree(
                        where(position),
                        describe(reference, first_item),
                        first.dtype,
                        describe(piece, item),
                        other.dtype,
                    )
                )
    # Unreachable: positions of one gather are linked by shared sources, so a disagreement
    # between them is one within some position, reported above.
    return FoldError(f"{where(gather.positions[0])}: the sources gathered together disagree in row shape")


def _gathered(
    gather: Gather, results: _Results, device: torch.device, where: Callable[[int], str]
) -> list[_Tensor]:
    """The tensors of a gather's positions: one concatenation and (unless in order) one ``index_select``."""
    try:
        tensors, rows = _pieces(gather, results)
    except _Mismatch:
        error = _explain(gather, results, where)
        if results.plan.merges_depths:
            why = "which batches an op's calls of every depth together, and this op's rows change with depth"
            error = refused_by_readiness(error, why)
        raise error from None
    index = gather.index
    if len(tensors) > 1:
        first = tensors[0]
        row_bytes = math.prod(first.shape[1:]) * first.element_size()
        if index is not None and rows and gather.total_calls * rows * row_bytes > COMPACT_BYTES:
            index = _compact_sparse_sources(gather, tensors, rows, device)
        source = torch.cat(tensors, 0)
    else:
        source = tensors[0]
    if index is not None:
        source = source.index_select(0, _rows_index(index, rows, device))
    if len(gather.sizes) == 1:
        return [source]
    return list(source.split_with_sizes([size * rows for size in gather.sizes]))


def _combined_gathered(group: GroupCall, results: _Results, device: torch.device) -> list[_Tensor] | None:
    """A group's gathers as one (``GroupCall.combined``), in the order of their positions; None if their
    sources disagree (or one is a tuple used whole, or they are big enough to compact): each
    gather then runs on its own, and explains any error precisely."""
    tensors, kinds = results.tensors, results.kinds
    kind = kinds[cast(int, group.gathers[0].pieces[0])]  # combined gathers read earlier results only
    pieces: list[_Tensor] = []
    for gather in group.gathers:
        for source in cast(list[int], gather.pieces):
            tensor = tensors[source]
            if tensor is None or kinds[source] != kind:
                return None
            pieces.append(tensor)
    total = sum(gather.total_calls for gather in group.gathers)
    rows, shape = cast(tuple[Any, ...], kind)[:2]
    if total * rows * math.prod(shape) * pieces[0].element_size() > COMPACT_BYTES:
        return None
    indices = []
    base = 0
    for gather in group.gathers:  # each gather's calls, shifted past the pieces of the gathers before it
        own = np.arange(gather.total_calls) if gather.index is None else gather.index.astype(np.int64)
        indices.append(own + base)
        base += gather.total_calls
    index = stored_index(np.concatenate(indices), base)
    taken = torch.cat(pieces, 0).index_select(0, _rows_index(index, rows, device))
    return list(taken.split_with_sizes([size * rows for gather in group.gathers for size in gather.sizes]))


def _compact_sparse_sources(
    gather: Gather, tensors: list[_Tensor], rows: int, device: torch.device
) -> np.ndarray:
    """Replace earlier results mostly unused here by just the rows used (in ``tensors``); the new index."""
    item_piece, item_call = gather.items()
    uses = np.bincount(item_piece, minlength=len(tensors))
    for p, tensor in enumerate(tensors):
        unused = tensor.shape[0] - int(uses[p]) * rows
        row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()
        if isinstance(gather.pieces[p], int) and unused > 0 and unused * row_bytes > COMPACT_BYTES:
            mask = item_piece == p
            kept = item_call[mask]
            item_call[mask] = np.arange(len(kept), dtype=np.int64)
            tensors[p] = tensor.index_select(0, _rows_index(kept, rows, device))
    offsets = call_offsets([t.shape[0] // rows for t in tensors])
    return offsets[item_piece] + item_call
