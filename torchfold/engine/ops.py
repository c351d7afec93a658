"""Calling an op on one batched call and checking what it returns: one place for the executor.

The executor (:func:`torchfold.engine.executor.run_calls`), for plain and padded plans alike,
calls each op through :func:`call_op` and checks its result with :func:`check_outputs`, so a
failing op reads the same whichever kind of plan ran it (a padded call says ``padded; static
shapes``). It resolves ops on the module with :func:`torchfold.engine.resolve.resolve_ops`. The
eager twin (:class:`~torchfold.EagerFold`) keeps the same rule on arguments changed in place
(:func:`versions`, :func:`check_unchanged`). Rows of one argument position that differ in float
precision (an autocast region) are gathered in one dtype by :func:`gathered_dtype`.

Everything here runs inside compiled steps too (``torch.compile`` captures the executor on padded plans):
no branch on a tensor's value, and ``isinstance`` with tuples of types, not PEP 604 unions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from torchfold._errors import FoldError, add_note
from torchfold.engine.node import describe_arg_shapes, node_label

__all__ = [
    "call_op",
    "check_outputs",
    "check_unchanged",
    "dtypes_disagree",
    "gathered_dtype",
    "tuple_used_whole",
    "versions",
]

_Tensor = torch.Tensor
_PADDED = " (padded; static shapes)"


def call_op(
    fn: Callable[..., Any], args: list[Any], name: str, depth: int, calls: int, *, padded: bool = False
) -> Any:
    """``fn(*args)`` for ``calls`` batched calls of op ``name`` at ``depth``.

    An exception raised inside the op keeps its type (``except torch.OutOfMemoryError`` must
    still catch it) and gets a note saying where; an op changing an argument in place is refused.
    """
    before = versions(args)
    try:
        out = fn(*args)
    except FoldError:
        raise
    except Exception as error:
        shapes = describe_arg_shapes([(arg.dtype, arg.shape) for arg in args])
        add_note(
            error,
            f"while applying {name!r} at depth {depth} to {calls} nodes{_PADDED if padded else ''}, first "
            f"{node_label(name, depth, 0)} (batched argument shapes: {shapes})",
        )
        raise
    check_unchanged(args, before, name, depth)
    return out


def check_outputs(
    out: Any, name: str, depth: int, calls: int, num_outputs: int, *, padded: bool = False
) -> Sequence[_Tensor]:
    """The tensors an op returned for ``calls`` calls, checked: a tensor, or ``num_outputs`` of them
    if its nodes were split (0: used whole; a tuple is then fine until something reads it whole).

    Raises:
        FoldError: not a tensor or a tuple of tensors, a split that does not match, or a
            leading dim that is not rows per call.
    """
    if isinstance(out, _Tensor):
        outputs: Sequence[Any] = (out,)
    # A tuple of types, not ``tuple | list``: dynamo (torch 2.9) breaks the graph on a PEP 604
    # union in isinstance, and this runs inside compiled steps (ruff's UP038 is off in this config).
    elif isinstance(out, (tuple, list)):
        outputs = out
    else:
        raise FoldError(
            f"op {name!r} at depth {depth} returned a {type(out).__name__}; ops must return a tensor or a tuple of tensors"
        )
    if num_outputs and (num_outputs != len(outputs) or isinstance(out, _Tensor)):
        returned = "a single tensor" if isinstance(out, _Tensor) else len(outputs)
        fix = "use the node without .split()" if isinstance(out, _Tensor) else f"call .split({len(outputs)})"
        problem = "split leaves outputs unused" if num_outputs < len(outputs) else "split index out of range"
        raise FoldError(
            f"{problem}: nodes of op {name!r} at depth {depth} were split into {num_outputs} outputs, but it "
            f"returned {returned}; {fix}"
        )
    batched = f"batched{_PADDED}" if padded else "batched"
    for key, value in enumerate(outputs):
        if not isinstance(value, _Tensor):
            raise FoldError(
                f"op {name!r} at depth {depth} returned a {type(value).__name__} as output {key}; ops must return "
                "a tensor or a tuple of tensors"
            )
        where = "" if isinstance(out, _Tensor) else f" as output {key}"
        if value.dim() and value.shape[0] == 0:
            # a filter (x[mask]) that dropped every row: no call can own its rows any more
            raise FoldError(
                f"op {name!r} at depth {depth} ran {calls} calls {batched} and returned shape "
                f"{tuple(value.shape)}{where}: no rows for {calls} calls; every call must own at least one row "
                "(an op that filters rows loses track of which call owns which: mask values instead)"
            )
        if value.dim() == 0 or value.shape[0] % calls:
            raise FoldError(
                f"op {name!r} at depth {depth} ran {calls} calls {batched} and returned shape "
                f"{tuple(value.shape)}{where}: its leading dim must be a multiple of {calls} (each call owns "
                "the same number of rows, in call order)"
            )
    return outputs


# NOTE: under torch.autocast, ops of one model return rows of different float dtypes: an
# nn.Embedding stays float32 while a Linear gives bfloat16. Eager PyTorch runs each call on its own
# rows, and where it joins them (torch.cat) it promotes. A group joins the rows of its calls at each
# position, so it promotes the same way: torch.promote_types, which widens without losing a value
# (bfloat16 -> float32 is exact), so an op that autocasts its input (a Linear) computes what the
# eager call computes. Promotion stays within a kind of number: rows of ints and rows of floats at
# one position are two different kinds of input (indices and values), and joining them would change
# what the op reads, so that group is refused, naming the dtypes.
def _dtype_kind(dtype: torch.dtype) -> str:
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "floating point"
    return "bool" if dtype is torch.bool else "integer"


def gathered_dtype(dtypes: Sequence[torch.dtype]) -> torch.dtype | None:
    """The dtype rows of ``dtypes`` are gathered in at one position: the promoted one, or None
    where they are of different kinds (ints and floats, say) and cannot be joined.

    >>> gathered_dtype([torch.bfloat16, torch.float32])
    torch.float32
    >>> gathered_dtype([torch.int64, torch.float32]) is None
    True
    """
    first, *others = dtypes
    kind = _dtype_kind(first)
    promoted = first
    for dtype in others:
        if dtype is not promoted:
            if _dtype_kind(dtype) != kind:
                return None
            promoted = torch.promote_types(promoted, dtype)
    return promoted


def dtypes_disagree(
    where: str, first: str, first_dtype: torch.dtype, other: str, other_dtype: torch.dtype
) -> str:
    """The message for rows of one position whose dtypes cannot be joined (``first`` and ``other``: who gives them)."""
    return (
        f"{where}: rows disagree in dtype within the group: {first} gives {first_dtype} rows but {other} gives "
        f"{other_dtype}; rows of one position may differ in float precision (under autocast; they are promoted, as "
        f"torch.cat promotes them) but not in kind ({_dtype_kind(first_dtype)} vs {_dtype_kind(other_dtype)}): "
        "convert them where they are made (e.g. .float() or .long() in the op returning them), or use different "
        "ops for the two kinds"
    )


def tuple_used_whole(what: str, name: str, depth: int, count: int) -> FoldError:
    """The error for a node (``what``) read whole whose op returned ``count`` outputs."""
    return FoldError(
        f"{what} is used whole, but op {name!r} at depth {depth} returned {count} outputs; take them apart "
        f"with .split({count})"
    )


# NOTE: ops must not change their arguments in place. A batched argument is the very tensor of
# an earlier result (passed through whole, or a view of one call's rows) or a gathered copy, as
# the executor chooses, and padding copies some more: an in-place change would reach the earlier
# nodes in one kind of plan and not in the other (unpadded [[2, 2], [2, 2]], padded [[1, 1], [2, 2]]).
# Refusing it is the only rule both kinds of plan, and the eager twin, can keep alike. The version
# counters make the check cheap; inference tensors keep none, and a compiled graph (torch.compile
# captures the executor) has no counters to read, so there the check is skipped.


def versions(args: Sequence[Any]) -> list[int] | None:
    """The version counters of an op's tensor arguments before it runs (None where none are kept)."""
    if torch.compiler.is_compiling():
        return None
    try:
        return [arg._version for arg in args]
    except RuntimeError:  # an inference tensor (made under torch.inference_mode) keeps no counter
        return None


def check_unchanged(args: Sequence[Any], before: list[int] | None, name: str, depth: int) -> None:
    """Refuse an op that changed one of its arguments in place (``before``: from :func:`versions`)."""
    if before is None or [arg._version for arg in args] == before:
        return
    position = next(
        i for i, (arg, version) in enumerate(zip(args, before, strict=True)) if arg._version != version
    )
    raise FoldError(
        f"op {name!r} at depth {depth} changed its argument {position} in place; a batched argument may be an "
        "earlier node's own rows or a copy of them, so the change would reach some nodes and not others: return a "
        "new tensor instead (x + 1, not x.add_(1) or x += 1)"
    )
