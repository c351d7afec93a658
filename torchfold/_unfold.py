"""The eager twin of :class:`~torchfold.Fold`: same API, every ``add`` runs at once.

Use it to debug a model (stack traces point at the failing call, values can be printed as
they are made) and as the reference that fold results are tested against.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from torchfold._errors import FoldError
from torchfold._node import Op, op_name
from torchfold._plan import module_device

__all__ = ["Unfold", "UnfoldNode"]


class UnfoldNode:
    """The value of one eager call, with the ``split``/``nobatch`` API of a fold node."""

    __slots__ = ("op", "value")

    def __init__(self, op: Op, value: Any) -> None:
        self.op = op
        self.value = value

    def split(self, num: int) -> tuple[UnfoldNode, ...]:
        """One node per output of a call that returned a tuple of ``num`` tensors."""
        if isinstance(num, bool) or not isinstance(num, int) or num < 1:
            raise ValueError(f"split(num) needs a positive int, got {num!r}")
        if not isinstance(self.value, tuple | list):
            raise FoldError(
                f"split index out of range: op {op_name(self.op)!r} returned a single tensor, not {num} outputs; "
                "use the node without .split()"
            )
        if len(self.value) < num:
            raise FoldError(
                f"split index out of range: op {op_name(self.op)!r} returned {len(self.value)} outputs, "
                f"split({num}) asks for more"
            )
        return tuple(UnfoldNode(self.op, self.value[i]) for i in range(num))

    def nobatch(self) -> UnfoldNode:
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
        return f"UnfoldNode({op_name(self.op)!r}, {self.value!r})"


class Unfold:
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
        >>> u = torchfold.Unfold(Doubler())
        >>> a = u.add("exp", 1)
        >>> u.apply(Doubler(), [[a, u.add("exp", a)]])
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
        self.device = torch.device("cuda") if cuda else torch.device(device) if device else module_device(nn)
        self.volatile = volatile

    def _argument(self, op: Op, position: int, arg: Any) -> Any:
        if isinstance(arg, UnfoldNode):
            return arg.tensor()
        if isinstance(arg, bool) or not isinstance(arg, int | float | torch.Tensor):
            raise FoldError(
                f"argument {position} of {op_name(op)!r} is a {type(arg).__name__} ({arg!r}); "
                "arguments must be nodes, ints, floats or tensors"
            )
        if isinstance(arg, int):
            return torch.tensor([arg], dtype=torch.long, device=self.device)
        if isinstance(arg, float):
            return torch.tensor([arg], dtype=torch.get_default_dtype(), device=self.device)
        return arg

    def add(self, op: Op, *args: Any) -> UnfoldNode:
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
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.volatile):
            return UnfoldNode(op, fn(*values))

    def apply(
        self, nn: torch.nn.Module | object, nodes: Sequence[Sequence[UnfoldNode]]
    ) -> list[torch.Tensor]:
        """Concatenate the values of each list of nodes along dim 0."""
        if not nodes or any(len(request) == 0 for request in nodes):
            raise FoldError("empty request: apply needs a non-empty list of non-empty lists of nodes")
        return [torch.cat([node.tensor() for node in request], 0) for request in nodes]
