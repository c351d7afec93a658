"""The plan users hold: :class:`FoldPlan`, a planned fold, picklable, applied to a module.

Its parts are :class:`~torchfold.engine.ir.PlanData`'s; running them is the executor's
(:mod:`~torchfold.engine.executor`), or the static envelope's on an XLA device
(:mod:`~torchfold.engine.static`).
"""

from __future__ import annotations

from typing import Any

import torch

from torchfold._errors import FoldError
from torchfold.engine.executor import run
from torchfold.engine.ir import PlanData, check_pad_rows, check_request_number
from torchfold.engine.readiness import refused_by_readiness
from torchfold.engine.resolve import device_for
from torchfold.engine.static import envelope_for

__all__ = ["FoldPlan", "apply_plan"]

_Tensor = torch.Tensor


class FoldPlan(PlanData):
    """A planned fold: every group's batched call and gather, ready to run on a module.

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

    @property
    def capacities(self) -> list[int]:
        """Rows per node of each output of ``apply(padded=True)``: the sizes, as nothing is padded."""
        return self.sizes

    def pad(self, request: int, values: Any, fill: float = 0) -> _Tensor:
        """``values`` (one per node of request ``request``) as a tensor: nothing to pad in an unpadded plan.

        The same call as :meth:`StaticPlan.pad <torchfold.StaticPlan.pad>`, so one loss works
        with padded and unpadded plans.
        """
        check_request_number(request, len(self.requests))
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
        return apply_plan(self, nn)

    def __repr__(self) -> str:
        groups, requests = len(self.groups), len(self.requests)
        return (
            f"FoldPlan({groups} group{'s' * (groups != 1)}, {self.num_nodes} node{'s' * (self.num_nodes != 1)}, "
            f"{requests} request{'s' * (requests != 1)})"
        )


def apply_plan(
    plan: FoldPlan, nn: object, arg_shapes: list[list[tuple[Any, Any]]] | None = None
) -> list[_Tensor]:
    """``plan.apply(nn)``, also giving each group's batched argument shapes to ``arg_shapes`` when
    given (what ``print(fold)`` shows after :meth:`Fold.apply <torchfold.Fold.apply>`); the plan
    is never written."""
    device = device_for(nn, plan.device)
    envelope = envelope_for("auto" if plan.pad_on_xla else None, nn, device)
    if envelope is not None:
        try:
            padded = envelope.cover(plan)
        except FoldError as error:
            if not plan.merges_depths:
                raise
            why = f"whose batched calls mix an op's depths and change from batch to batch, on {device.type} (static shapes)"
            raise refused_by_readiness(error, why) from None
        return padded.apply(nn)
    if plan.volatile and torch.is_grad_enabled():
        with torch.no_grad():
            return run(plan, nn, arg_shapes, device)
    return run(plan, nn, arg_shapes, device)
