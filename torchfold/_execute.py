"""Executing a fold: one batched call per group, arguments gathered from batched results.

Every group's result stays one batched tensor (or tuple of them). A consumer's argument
column is assembled with at most two tensor operations, whatever the number of nodes:

* all its rows come, in order, from one whole earlier result: that tensor is passed through
  with no copy;
* otherwise the sources it reads (earlier results, and tensors given to ``add``) are
  concatenated once, and one ``index_select`` picks the rows in call order (skipped when the
  concatenation already is in call order).

So ``apply`` costs O(groups) tensor operations, not O(nodes).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from torchfold._errors import FoldError
from torchfold._node import Group, Node
from torchfold._plan import check_requests, module_device, resolve_ops

if TYPE_CHECKING:
    from torchfold._fold import Fold

__all__ = ["execute"]

_Tensor = torch.Tensor
_is_batched = operator.attrgetter("batch")


class _Results:
    """Batched results of the groups run so far, by source number (see ``Owner``), and how many
    rows each call owns in them."""

    __slots__ = ("outputs", "rows", "tensors")

    def __init__(self) -> None:
        self.tensors: dict[int, _Tensor] = {}
        self.rows: dict[int, int] = {}
        self.outputs: dict[Group, int] = {}  # how many outputs each group returned (0: one tensor)

    def store(self, group: Group, out: Any) -> None:
        calls = len(group.calls)
        if isinstance(out, _Tensor):
            outputs: Sequence[Any] = (out,)
            sources: Sequence[int] = (group.source,)
            self.outputs[group] = 0
        elif isinstance(out, tuple | list):
            outputs = out
            sources = group.output_sources
            self.outputs[group] = len(out)
        else:
            raise FoldError(
                f"op {group.name!r} at depth {group.depth} returned a {type(out).__name__}; "
                "ops must return a tensor or a tuple of tensors"
            )
        if group.num_outputs > len(outputs) or (group.num_outputs and isinstance(out, _Tensor)):
            returned = "a single tensor" if isinstance(out, _Tensor) else len(outputs)
            fix = (
                "use the node without .split()"
                if isinstance(out, _Tensor)
                else f"call .split({len(outputs)})"
            )
            raise FoldError(
                f"split index out of range: nodes of op {group.name!r} at depth {group.depth} were split into "
                f"{group.num_outputs} outputs, but it returned {returned}; {fix}"
            )
        for key, value in enumerate(outputs):
            if not isinstance(value, _Tensor):
                raise FoldError(
                    f"op {group.name!r} at depth {group.depth} returned a {type(value).__name__} as output "
                    f"{key}; ops must return a tensor or a tuple of tensors"
                )
            if value.dim() == 0 or value.shape[0] % calls:
                where = "" if isinstance(out, _Tensor) else f" as output {key}"
                raise FoldError(
                    f"op {group.name!r} at depth {group.depth} ran {calls} calls batched and returned shape "
                    f"{tuple(value.shape)}{where}: its leading dim must be a multiple of {calls} (each call owns "
                    "the same number of rows, in call order)"
                )
        for source, value in zip(sources, outputs, strict=False):  # outputs never split are not read
            self.tensors[source] = value
            self.rows[source] = value.shape[0] // calls

    def source(self, node: Node) -> tuple[_Tensor, int]:
        """The batched tensor that holds ``node``'s rows, and how many rows each call owns in it."""
        tensor = self.tensors.get(node.source)
        if tensor is not None:
            return tensor, self.rows[node.source]
        group = node.group
        count = self.outputs[group]
        if node.output is None:
            raise FoldError(
                f"{node!r} is used whole, but op {group.name!r} at depth {group.depth} returned {count} outputs; "
                f"take them apart with .split({count})"
            )
        raise FoldError(  # unreachable in practice: store() checks splits against what the op returned
            f"split index out of range: {node!r} asks for output {node.output} of op {group.name!r} at depth "
            f"{group.depth}, which returned {count or 'a single tensor'}"
        )


def _where(group: Group | None, position: int | None) -> str:
    if group is None:
        return f"apply request {position}"
    return f"op {group.name!r} at depth {group.depth}, argument {position}"


# A source read only in part is gathered on its own first when copying it whole into the
# concatenation would move more than this many unused bytes. Backward zero-fills the whole
# source either way, so compacting only saves the forward copy, at the price of one more
# operation and its Python bookkeeping: measured on the SST Tree-LSTM benchmark (sources of
# 0.1-0.5 MB), compacting at 256 KB made apply+backward 13% slower than never compacting. So
# only very large, sparsely read sources (big graphs, long sequences) are compacted.
COMPACT_BYTES = 1 << 23


class _Spec:
    """Where the rows of one batched argument come from.

    ``pieces`` are the tensors read (earlier results and tensors given to ``add``); call ``i``
    takes ``rows`` rows of ``pieces[item_piece[i]]`` from row ``item_start[i]`` on. The per-call
    arrays are numpy, so planning a gather costs two attribute sweeps over the nodes and a few
    vectorised operations, whatever the number of sources.
    """

    __slots__ = ("_owner_of", "is_result", "item_piece", "item_start", "owners", "pieces", "rows")

    def __init__(
        self,
        pieces: list[_Tensor],
        is_result: list[bool],
        item_piece: np.ndarray,
        item_start: np.ndarray,
        rows: int,
        owners: Callable[[int], Any],
    ) -> None:
        self.pieces = pieces
        self.is_result = is_result  # per piece: an earlier result (may be compacted) or a given tensor
        self.item_piece = item_piece
        self.item_start = item_start
        self.rows = rows
        self.owners = owners  # piece number -> a node of it or a description, for messages

    def passes_through(self) -> bool:
        """Exactly one whole piece, in order: the argument is that tensor, no copy needed."""
        return len(self.pieces) == 1 and _in_order(self.item_start, self.rows, self.pieces[0].shape[0])

    def compatible(self, other: _Spec) -> bool:
        a, b = self.pieces[0], other.pieces[0]
        return (
            self.rows == other.rows
            and a.shape[1:] == b.shape[1:]
            and a.dtype == b.dtype
            and a.device == b.device
        )

    def shares_a_piece(self, other: _Spec) -> bool:
        return not {id(p) for p in self.pieces}.isdisjoint(id(p) for p in other.pieces)


def _in_order(starts: np.ndarray, rows: int, total: int) -> bool:
    """Do ``starts`` take all ``total`` rows, in order?"""
    return len(starts) * rows == total and bool((starts == np.arange(0, total, rows)).all())


def _no_rows(where: str, tensor: _Tensor) -> FoldError:
    return FoldError(
        f"{where}: a 0-dim tensor ({tensor!r}) has no rows; "
        "pass x.reshape(1) or x.unsqueeze(0) so its leading dim counts rows"
    )


def _rows_mismatch(where: str, first: Any, rows: int, other: Any, k: int) -> FoldError:
    return FoldError(
        f"{where}: rows disagree within the group: {first} gives {rows} rows per call but {other} gives {k}; "
        "every call of a group must pass the same number of rows at each position"
    )


def _node_spec(column: Sequence[Node], results: _Results, where: str) -> _Spec:
    """Spec of a column of nodes only: the hot path."""
    sources = [node.source for node in column]
    distinct = dict.fromkeys(sources)  # in first-use order

    def owner(piece: int) -> Node:
        return column[sources.index(list(distinct)[piece])]

    pieces: list[_Tensor] = []
    rows = -1
    tensors = results.tensors
    for number, source in enumerate(distinct):
        tensor = tensors.get(source)
        if tensor is None:
            results.source(owner(number))  # raises, naming the node
        k = results.rows[source]
        if k != rows and rows != -1:
            raise _rows_mismatch(where, owner(0), rows, owner(number), k)
        rows = k
        distinct[source] = number
        pieces.append(tensor)  # type: ignore[arg-type]
    index = np.fromiter([node.index for node in column], dtype=np.int64, count=len(column))
    if len(pieces) == 1:
        item_piece = np.zeros(len(column), dtype=np.int64)
    else:
        table = np.zeros(max(distinct) + 1, dtype=np.int64)
        table[list(distinct)] = np.arange(len(distinct))
        item_piece = table[np.fromiter(sources, dtype=np.int64, count=len(sources))]
    return _Spec(pieces, [True] * len(pieces), item_piece, index * rows if rows != 1 else index, rows, owner)


def _mixed_spec(column: Sequence[Any], results: _Results, where: str) -> _Spec:
    """Spec of a column mixing nodes and tensors given to ``add`` (rows: a tensor's leading dim)."""
    pieces: list[_Tensor] = []
    owners: list[Any] = []
    piece_of: dict[Any, int] = {}
    item_piece: list[int] = []
    item_start: list[int] = []
    rows = -1
    for item in column:
        if item.__class__ is Node:
            key: Any = ("node", item.source)
            piece = piece_of.get(key)
            if piece is None:
                tensor, k = results.source(item)
                piece = piece_of[key] = len(pieces)
                pieces.append(tensor)
                owners.append(item)
            else:
                k = results.rows[item.source]
            start = item.index * k
        else:
            if item.dim() == 0:
                raise _no_rows(where, item)
            key = id(item)
            piece = piece_of.get(key)
            k = item.shape[0]
            if piece is None:
                piece = piece_of[key] = len(pieces)
                pieces.append(item)
                owners.append(f"a tensor of shape {tuple(item.shape)}")
            start = 0
        if k != rows:
            if rows != -1:
                raise _rows_mismatch(
                    where, owners[0], rows, item if item.__class__ is Node else owners[piece], k
                )
            rows = k
        item_piece.append(piece)
        item_start.append(start)
    is_result = [owner.__class__ is Node for owner in owners]
    return _Spec(
        pieces, is_result, np.array(item_piece, dtype=np.int64), np.array(item_start, dtype=np.int64), rows,
        owners.__getitem__,
    )  # fmt: skip


def _spec(column: Sequence[Any], results: _Results, where: str, nodes_only: bool) -> _Spec:
    spec = _node_spec(column, results, where) if nodes_only else _mixed_spec(column, results, where)
    first = spec.pieces[0]
    for number, other in enumerate(spec.pieces[1:], 1):
        if other.shape[1:] != first.shape[1:] or other.dtype != first.dtype or other.device != first.device:
            raise FoldError(
                f"{where}: rows disagree in shape within the group: {spec.owners(0)} gives rows of "
                f"{tuple(first.shape[1:])} {first.dtype} on {first.device}, but {spec.owners(number)} gives "
                f"{tuple(other.shape[1:])} {other.dtype} on {other.device}; calls of one group must pass "
                "same-shaped rows at each position (use different ops for different shapes)"
            )
    return spec


def _merge(specs: list[_Spec]) -> _Spec:
    """One spec reading the union of the pieces of ``specs``, their calls one after another."""
    pieces: list[_Tensor] = []
    is_result: list[bool] = []
    origins: list[tuple[_Spec, int]] = []
    piece_of: dict[int, int] = {}
    item_pieces = []
    for spec in specs:
        remap = []
        for number, piece in enumerate(spec.pieces):
            merged = piece_of.get(id(piece))
            if merged is None:
                merged = piece_of[id(piece)] = len(pieces)
                pieces.append(piece)
                is_result.append(spec.is_result[number])
                origins.append((spec, number))
            remap.append(merged)
        item_pieces.append(np.array(remap, dtype=np.int64)[spec.item_piece])

    def owner(piece: int) -> Any:
        spec, number = origins[piece]
        return spec.owners(number)

    item_start = np.concatenate([spec.item_start for spec in specs])
    return _Spec(pieces, is_result, np.concatenate(item_pieces), item_start, specs[0].rows, owner)


def _rows_index(starts: np.ndarray, rows: int, device: torch.device) -> _Tensor:
    """Indices of ``rows`` consecutive rows from each start, on ``device``."""
    if rows != 1:
        starts = (starts[:, None] + np.arange(rows, dtype=np.int64)).reshape(-1)
    index = torch.from_numpy(np.ascontiguousarray(starts, dtype=np.int64))
    return index if device.type == "cpu" else index.to(device)


def _materialize(specs: list[_Spec]) -> list[_Tensor]:
    """The batched arguments of ``specs`` (compatible, sharing pieces) with one cat and one gather."""
    spec = specs[0] if len(specs) == 1 else _merge(specs)
    pieces, rows = spec.pieces, spec.rows
    device = pieces[0].device
    if len(pieces) > 1:
        _compact_sparse_sources(spec)
        offsets = np.cumsum([0] + [piece.shape[0] for piece in pieces], dtype=np.int64)
        starts = offsets[spec.item_piece] + spec.item_start
        total = int(offsets[-1])
        source = torch.cat(pieces, 0)
    else:
        starts, total, source = spec.item_start, pieces[0].shape[0], pieces[0]
    if not _in_order(starts, rows, total):
        source = source.index_select(0, _rows_index(starts, rows, device))
    if len(specs) == 1:
        return [source]
    return list(source.split_with_sizes([len(s.item_piece) * rows for s in specs]))


def _compact_sparse_sources(spec: _Spec) -> None:
    """Replace earlier results that are mostly unused here by just the rows used, in use order."""
    pieces, rows = spec.pieces, spec.rows
    if sum(piece.numel() * piece.element_size() for piece in pieces) <= COMPACT_BYTES:
        return  # no source is big enough to leave that much unused
    uses = np.bincount(spec.item_piece, minlength=len(pieces))
    device = pieces[0].device
    for p, piece in enumerate(pieces):
        unused = piece.shape[0] - int(uses[p]) * rows
        row_bytes = math.prod(piece.shape[1:]) * piece.element_size()
        if spec.is_result[p] and unused > 0 and unused * row_bytes > COMPACT_BYTES:
            mask = spec.item_piece == p
            kept = spec.item_start[mask]
            spec.item_start[mask] = np.arange(len(kept), dtype=np.int64) * rows
            pieces[p] = piece.index_select(0, _rows_index(kept, rows, device))


def _shared(column: Sequence[Any], results: _Results, where: str) -> _Tensor:
    """A ``nobatch`` position: one node's value, passed whole to the batched call."""
    node = column[0]
    for other in column:
        if other is not node:
            raise FoldError(
                f"{where}: {node!r} is nobatch, so every call of the group must pass that same "
                f"node there, but another call passes {other!r}; use .nobatch() only for a value shared by all "
                "calls of an op at a depth"
            )
    tensor, k = results.source(node)
    if tensor.shape[0] == k:
        return tensor
    return tensor[node.index * k : (node.index + 1) * k]


def _concat_given(column: Sequence[_Tensor]) -> _Tensor | None:
    """Tensors given to ``add``, each once and with the same rows: just concatenate them.

    Returns None when the general path is needed (a repeated tensor, different row counts, a
    0-dim tensor or a shape mismatch), which also words the error precisely.
    """
    first = column[0]
    if first.dim() == 0 or len({id(t) for t in column}) != len(column):
        return None
    rows, dtype = first.shape[0], first.dtype
    if any(t.dim() == 0 or t.shape[0] != rows or t.dtype != dtype for t in column):
        return None
    try:
        return torch.cat(tuple(column), 0)
    except RuntimeError:
        return None


def _single_call_arguments(group: Group, results: _Results, device: torch.device) -> list[_Tensor]:
    """Arguments of a group of one call (chains, roots): each node's own rows, as a view."""
    args: list[Any] = []
    for position, arg in enumerate(group.calls[0]):
        cls = arg.__class__
        if cls is Node:
            tensor, k = results.source(arg)
            args.append(tensor if tensor.shape[0] == k else tensor[arg.index * k : (arg.index + 1) * k])
        elif cls is int:
            args.append(torch.tensor([arg], dtype=torch.long, device=device))
        elif cls is float:
            args.append(torch.tensor([arg], dtype=torch.get_default_dtype(), device=device))
        elif arg.dim() == 0:
            raise _no_rows(_where(group, position), arg)
        else:
            args.append(arg)
    return args


def _batch_arguments(group: Group, results: _Results, device: torch.device) -> list[_Tensor]:
    """One batched tensor per argument position of ``group``.

    Positions that read the same earlier results (a binary node's left and right children,
    say) are gathered together: one concatenation and one index_select for all of them.
    """
    if len(group.calls) == 1:
        return _single_call_arguments(group, results, device)
    args: list[Any] = []
    specs: list[tuple[int, _Spec]] = []
    for position, column in enumerate(zip(*group.calls, strict=True)):
        where = _where(group, position)
        kinds = set(map(type, column))
        if kinds == {Node}:
            if all(map(_is_batched, column)):
                specs.append((position, _spec(column, results, where, nodes_only=True)))
                args.append(None)
            else:
                args.append(_shared(column, results, where))
        elif kinds == {int}:
            args.append(torch.tensor(column, dtype=torch.long, device=device))
        elif kinds <= {int, float}:
            args.append(torch.tensor(column, dtype=torch.get_default_dtype(), device=device))
        elif int in kinds or float in kinds:
            raise FoldError(
                f"{where}: ints and nodes/tensors are mixed at one position ({len(group.calls)} calls); pass "
                "either ints everywhere or tensors/nodes everywhere (e.g. wrap the ints as tensors of the right shape)"
            )
        elif Node in kinds and not all(node.batch for node in column if node.__class__ is Node):
            args.append(_shared(column, results, where))
        elif Node not in kinds and (stacked := _concat_given(column)) is not None:
            args.append(stacked)
        else:
            specs.append((position, _spec(column, results, where, nodes_only=False)))
            args.append(None)
    # A position that takes a whole earlier result in order needs no copy: it stays alone.
    # The others join the first compatible cluster they share a source with.
    clusters: list[list[tuple[int, _Spec]]] = []
    for position, spec in specs:
        if spec.passes_through():
            args[position] = spec.pieces[0]
            continue
        home = next(
            (c for c in clusters if c[0][1].compatible(spec) and any(s.shares_a_piece(spec) for _, s in c)),
            None,
        )
        if home is None:
            clusters.append([(position, spec)])
        else:
            home.append((position, spec))
    for cluster in clusters:
        for (position, _), tensor in zip(cluster, _materialize([s for _, s in cluster]), strict=True):
            args[position] = tensor
    return args


def _run_groups(fold: Fold, nn: object, device: torch.device) -> _Results:
    groups = fold.groups()
    fns: list[Callable[..., Any]] = resolve_ops(nn, groups)
    results = _Results()
    for group, fn in zip(groups, fns, strict=True):
        args = _batch_arguments(group, results, device)
        group.arg_shapes = [(a.dtype, a.shape) for a in args]
        try:
            out = fn(*args)
        except FoldError:
            raise
        except Exception as error:
            shapes = group.describe_arg_shapes()
            raise FoldError(
                f"while applying {group.name!r} at depth {group.depth} to {len(group.calls)} nodes "
                f"(batched argument shapes: {shapes}): {type(error).__name__}: {error}"
            ) from error
        results.store(group, out)
    return results


def execute(fold: Fold, nn: object, requests: Sequence[Sequence[Node]]) -> list[_Tensor]:
    """Run ``fold``'s groups on ``nn`` and return one batched tensor per request."""
    check_requests(fold, requests)
    device = fold.device if fold.device is not None else module_device(nn)
    results = _run_groups(fold, nn, device)
    outputs = []
    for i, request in enumerate(requests):  # a nobatch handle asked for as an output is just its rows
        (output,) = _materialize([_spec(request, results, _where(None, i), nodes_only=True)])
        outputs.append(output)
    return outputs
