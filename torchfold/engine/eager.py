"""The eager twin of :class:`~torchfold.Fold`: same API, every ``add`` runs at once.

Use it to debug a model (stack traces point at the failing call, values can be printed as
they are made) and as the reference that fold results are tested against.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from torchfold._errors import FoldError
from torchfold.engine.node import (
    INT64_MAX,
    INT64_MIN,
    Op,
    check_split,
    ints_and_floats_mixed,
    literals_and_rows_mixed,
    op_name,
    outside_int64,
)
from torchfold.engine.ops import check_unchanged, versions
from torchfold.engine.resolve import check_request_items, cuda_device, device_for

__all__ = ["EagerFold", "EagerNode"]


class EagerNode:
    """The value of one eager call, with the ``split``/``nobatch`` API of a fold node."""

    __slots__ = ("depth", "op", "value")

    def __init__(self, op: Op, value: Any, depth: int = 0) -> None:
        self.op = op
        self.value = value
        self.depth = depth  # as a Fold counts it: what would be batched with what

    def split(self, num: int) -> tuple[EagerNode, ...]:
        """One node per output of a call that returned a tuple of ``num`` tensors."""
        check_split(num)
        if not isinstance(self.value, tuple | list):
            raise FoldError(
                f"split index out of range: op {op_name(self.op)!r} returned a single tensor, not {num} outputs; "
                "use the node without .split()"
            )
        if len(self.value) != num:
            problem = "split leaves outputs unused" if num < len(self.value) else "split index out of range"
            raise FoldError(
                f"{problem}: op {op_name(self.op)!r} at depth {self.depth} was split into {num} outputs, "
                f"but it returned {len(self.value)}; call .split({len(self.value)})"
            )
        return tuple(EagerNode(self.op, self.value[i], self.depth) for i in range(num))

    def nobatch(self) -> EagerNode:
        """A no-op here: eager values are never batched."""
        return self

    def tensor(self) -> torch.Tensor:
        if not isinstance(self.value, torch.Tensor):
            count = len(self.value) if isinstance(self.value, tuple | list) else 0
            raise FoldError(
                f"a node of op {op_name(self.op)!r} is used whole, but the op returned {count} outputs; "
                f"take them apart with .split({count})"
            )
        return self.value

    def __repr__(self) -> str:
        return f"EagerNode({op_name(self.op)!r}, {self.value!r})"


class EagerFold:
    """Runs each ``add`` immediately on ``nn``; ``apply`` concatenates the requested values.

    Ints become a ``LongTensor`` of shape ``(1,)`` (floats, a float tensor) and tensors pass
    as is, exactly what one call sees inside a batched :class:`~torchfold.Fold` group of size 1.

    Args:
        nn: the module whose methods are the ops.
        device: where int/float arguments are created; default: ``nn``'s device.
        cuda, volatile: TorchFold 0.x flags, as for :class:`~torchfold.Fold`.

    Example:
        >>> import torch, torchfold
        >>> class Doubler(torch.nn.Module):
        ...     def exp(self, x):
        ...         return 2 * x
        >>> model = Doubler()
        >>> u = torchfold.EagerFold(model)
        >>> a = u.add("exp", 1)
        >>> u.apply(model, [[a, u.add("exp", a)]])
        [tensor([2, 4])]
    """

    def __init__(
        self,
        nn: torch.nn.Module | object,
        device: torch.device | str | None = None,
        *,
        cuda: bool = False,
        volatile: bool = False,
    ) -> None:
        self.nn = nn
        self.device = torch.device("cuda") if cuda else device_for(nn, device or None)
        self.volatile = volatile
        # per (depth, op, arity, position), the first int or float passed there and the first
        # node/tensor (None): a Fold batches those calls into one tensor, so it refuses mixes
        self._seen: dict[tuple[int, Op, int, int], dict[type | None, Any]] = {}

    def cuda(self) -> EagerFold:
        """Make int and float arguments on the GPU from now on (the original TorchFold's method); returns self.

        Example:
            >>> import torch, torchfold
            >>> unfold = torchfold.EagerFold(torch.nn.Linear(2, 2))
            >>> if torch.cuda.is_available():
            ...     unfold = unfold.cuda()

        Raises:
            RuntimeError: CUDA is not available.
        """
        self.device = cuda_device("EagerFold")
        return self

    def _argument(self, op: Op, position: int, arg: Any) -> Any:
        if isinstance(arg, EagerNode):
            return arg.tensor()
        if isinstance(arg, bool) or not isinstance(arg, int | float | torch.Tensor):
            raise FoldError(
                f"argument {position + 1} of {op_name(op)!r} is a {type(arg).__name__} ({arg!r}); "
                "arguments must be nodes, ints, floats or tensors"
            )
        if isinstance(arg, int):
            if not INT64_MIN <= arg <= INT64_MAX:
                raise FoldError(
                    f"argument {position + 1} of {op_name(op)!r} is {outside_int64(arg)}; ints become a LongTensor: "
                    "pass a float or a tensor instead"
                )
            return torch.tensor([arg], dtype=torch.long, device=self.device)
        if isinstance(arg, float):
            return torch.tensor([arg], dtype=torch.get_default_dtype(), device=self.device)
        return arg

    def _check_batchable(self, op: Op, depth: int, args: tuple[Any, ...]) -> None:
        """Refuse what a Fold could not batch with earlier calls of the same group (same message)."""
        for position, arg in enumerate(args):
            cls = arg.__class__
            seen = self._seen.setdefault((depth, op, len(args), position), {})
            kind = cls if cls is int or cls is float else None  # None: rows (a node or a tensor)
            seen.setdefault(kind, arg)
            if len(seen) == 1:
                continue
            where = f"op {op_name(op)!r} at depth {depth}, argument {position}"
            if None not in seen:
                raise FoldError(ints_and_floats_mixed(where, seen[int], seen[float]))
            raise FoldError(literals_and_rows_mixed(where, "ints" if int in seen else "floats"))

    def add(self, op: Op, *args: Any) -> EagerNode:
        """Run ``op(*args)`` now and return its value wrapped as a node."""
        if isinstance(op, str):
            fn = getattr(self.nn, op, None)
            if not callable(fn):
                raise FoldError(
                    f"unknown op {op!r}: {type(self.nn).__name__}.{op} is not a method; define it on the module"
                )
        elif callable(op):
            fn = op
        else:
            raise TypeError(f"op must be a method name (str) or a callable, got {op!r}")
        values = [self._argument(op, i, a) for i, a in enumerate(args)]
        depth = 1 + max((a.depth for a in args if isinstance(a, EagerNode)), default=-1)
        self._check_batchable(op, depth, args)
        before = versions(values)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.volatile):
            value = fn(*values)
        check_unchanged(values, before, op_name(op), depth)
        for output in value if isinstance(value, tuple | list) else (value,):
            if (
                isinstance(output, torch.Tensor) and output.dim() and output.shape[0] == 0
            ):  # as a Fold refuses
                raise FoldError(
                    f"op {op_name(op)!r} at depth {depth} returned shape {tuple(output.shape)}: no rows for its call; "
                    "every call must own at least one row (an op that filters rows loses track of which call owns "
                    "which: mask values instead)"
                )
        return EagerNode(op, value, depth)

    def apply(
        self, nn: torch.nn.Module | object, nodes: Sequence[Sequence[EagerNode | torch.Tensor | int | float]]
    ) -> list[torch.Tensor]:
        """Concatenate the values of each list of nodes along dim 0 (lists take what ``Fold.apply`` takes).

        Raises:
            ValueError: ``nn`` is not the module this EagerFold was created with (its ops ran on that one).
            FoldError: an empty or malformed request.
        """
        if nn is not self.nn:
            raise ValueError(
                f"EagerFold.apply was given another {type(nn).__name__} than the one this EagerFold ran its ops on "
                f"(a {type(self.nn).__name__} given to EagerFold(...)); pass that same module to apply"
            )
        if not nodes or any(len(request) == 0 for request in nodes):
            raise FoldError("empty request: apply needs a non-empty list of non-empty lists of nodes")
        return [self._request(number, request) for number, request in enumerate(nodes)]

    def _request(self, number: int, request: Sequence[Any]) -> torch.Tensor:
        check_request_items(number, request, EagerNode)
        cls = request[0].__class__
        if cls is int or cls is float:
            dtype = torch.long if cls is int else torch.get_default_dtype()
            return torch.tensor(request, dtype=dtype, device=self.device)
        values = [item.tensor() if isinstance(item, EagerNode) else item for item in request]
        if any(isinstance(item, EagerNode) for item in request) and any(
            not isinstance(item, EagerNode) for item in request
        ):  # a Fold gathers them as calls: each item's rows count as one call's
            rows = [len(value) for value in values]
            if len(set(rows)) > 1:
                other = next(j for j, count in enumerate(rows) if count != rows[0])
                raise FoldError(
                    f"apply request {number}: rows disagree: item 0 gives {rows[0]} rows but item {other} gives "
                    f"{rows[other]}; a request mixing nodes and tensors needs the same number of rows per item"
                )
        return torch.cat(values, 0)
