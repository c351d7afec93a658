"""Linear layers captured for XLA's CPU backend: the forward product reads a transposed copy of the weight.

``nn.Linear`` computes ``x·Wᵀ`` with ``W`` stored ``(out, in)``. On the few rows a fold's level
has, XLA's CPU backend runs that product, with the weight as stored, several times slower than
a product of the same work whose right operand is not transposed (``g·W``, the input's
gradient; ``benchmarks/xla_dots.py`` measures both). XLA folds an explicit transpose back into
the product, so writing ``x @ W.t()`` changes nothing. Inside :func:`transposed_weights`,
``F.linear`` on an XLA tensor instead multiplies by a copy of ``Wᵀ`` made once per weight and per capture, kept from being folded
back by an optimization barrier; the backward pass multiplies by ``W`` itself. Values and
gradients are those of ``F.linear``, up to the order of floating-point sums.

:class:`~torchfold.train.capture.xla_programs.XlaPrograms` (``compile="replay"``) and
:class:`~torchfold.train.capture.dynamo_programs.XlaGraphPrograms` (``compile="on"``) capture their
programs inside it on XLA's CPU backend (on a TPU, XLA lays out the weight itself).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx
from torch.overrides import TorchFunctionMode

from torchfold.train.distributed.devices import is_xla, of_kind

__all__ = ["transposed_weights", "transposes_here"]


class _Linear(torch.autograd.Function):
    """``x·Wᵀ + b`` computed as ``x·T + b`` with ``T`` a copy of ``Wᵀ``; gradients through ``W``.

    The backward pass is made of differentiable operations on ``x`` and ``W``, so gradients of
    gradients (a gradient penalty) are those of ``F.linear`` too."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        transposed: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.with_bias = bias is not None  # type: ignore[attr-defined]
        return x @ transposed if bias is None else torch.addmm(bias, x, transposed)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        return (
            grad @ weight if needs[0] else None,
            grad.t() @ x if needs[1] else None,
            None,
            grad.sum(0) if ctx.with_bias and needs[3] else None,
        )


class _TransposedWeights(TorchFunctionMode):
    """``F.linear`` on a 2-D weight of ``device_type`` through :class:`_Linear`; one copy per weight."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        # id(weight) -> (weight, its version when copied, the copy)
        self.copies: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
        self.calls = 0

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is not F.linear:
            return func(*args, **kwargs)
        x, weight, bias = _linear_arguments(args, kwargs)
        if (
            not isinstance(x, torch.Tensor)
            or not isinstance(weight, torch.Tensor)
            or weight.dim() != 2
            or x.dim() < 1
            or weight.shape[1] == 0
            or (bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != weight.shape[:1]))
            or not of_kind(weight.device, self.device_type)
            or torch.is_autocast_enabled(weight.device.type)
        ):  # anything else (a bias that broadcasts, autocast's dtypes) as F.linear does it
            return func(*args, **kwargs)
        self.calls += 1
        rows = x.reshape(-1, x.shape[-1])
        out = _Linear.apply(rows, weight, self._copy(weight), bias)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    def _copy(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight``'s transpose as a tensor of its own, made once per weight (again if it changed in place)."""
        known = self.copies.get(id(weight))
        if known is not None and known[0] is weight and known[1] == weight._version:
            return known[2]
        copy = weight.detach().t().clone()
        if is_xla(copy.device):
            import torch_xla.core.xla_model as xm

            xm.optimization_barrier_([copy])  # else XLA folds the transpose back into the product
        self.copies[id(weight)] = (weight, weight._version, copy)
        return copy


def _linear_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
    """``F.linear``'s ``(input, weight, bias)``, given by position or by name."""
    named = dict(zip(("input", "weight", "bias"), args, strict=False))
    named.update(kwargs)
    return named.get("input"), named.get("weight"), named.get("bias")


def transposes_here() -> bool:
    """Whether XLA's products want :func:`transposed_weights`: on its CPU backend (on a TPU, XLA
    lays out the weight itself). Starts torch_xla's runtime."""
    import torch_xla.runtime

    return str(torch_xla.runtime.device_type()).upper() == "CPU"


@contextlib.contextmanager
def transposed_weights(device_type: str = "xla") -> Iterator[_TransposedWeights]:
    """Inside, ``F.linear`` (and so ``nn.Linear``) on weights of ``device_type`` multiplies by a
    copy of the transposed weight, made once per weight; yields the mode (``calls`` counts them).

    Values and gradients (gradients of gradients too) equal ``F.linear``'s, up to the order of
    floating-point sums. A weight changed in place (an optimizer step inside) is copied again.
    Under autocast, ``F.linear`` runs as it is; ``torch.func`` transforms (``vmap``, ``grad``)
    are not supported inside.

    >>> import torch
    >>> layer = torch.nn.Linear(3, 2).double()
    >>> x = torch.randn(4, 3, dtype=torch.float64)
    >>> with transposed_weights("cpu") as mode:
    ...     y = layer(x)
    >>> mode.calls, torch.allclose(y, x @ layer.weight.t() + layer.bias)
    (1, True)
    """
    mode = _TransposedWeights(device_type)
    with mode:
        yield mode
