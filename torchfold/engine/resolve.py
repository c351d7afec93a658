"""Checks around a plan: resolving ops, checking requests, and describing a fold in words.

Everything here runs before any op does, so a mistake in the graph (an unknown op, a
malformed request) is reported before a single tensor is computed. The plan itself
(``FoldPlan``) is built in :mod:`torchfold.engine.planner` and run by :mod:`torchfold.engine.executor`.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from torchfold._errors import FoldError
from torchfold.engine.node import (
    INT64_MAX,
    INT64_MIN,
    Node,
    Op,
    Recording,
    Tape,
    foreign_node,
    ints_and_floats_mixed,
    node_label,
    outside_int64,
    tape_ref_of,
)

__all__ = [
    "check_request_items",
    "check_requests",
    "cuda_device",
    "describe",
    "device_for",
    "module_device",
    "resolve_ops",
]


class _Batched(Protocol):
    """What resolving needs of a batched call (a plan's ``GroupCall``)."""

    op: Op
    name: str
    depth: int
    num_calls: int


def resolve_ops(nn: object, calls: Sequence[_Batched]) -> list[Callable[..., Any]]:
    """The callable each call's op stands for on ``nn``, checked before anything runs."""
    cache: dict[Op, Callable[..., Any]] = {}
    fns = []
    for call in calls:
        fn = cache.get(call.op)
        if fn is None:
            fn = cache[call.op] = _resolve(nn, call)
        fns.append(fn)
    return fns


def _resolve(nn: object, call: _Batched) -> Callable[..., Any]:
    op = call.op
    if not isinstance(op, str):
        return op
    fn = getattr(nn, op, None)
    if callable(fn):
        return fn
    candidates = [name for name in dir(nn) if not name.startswith("_") and callable(getattr(nn, name, None))]
    close = difflib.get_close_matches(op, candidates, n=3)
    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
    what = "is not callable" if hasattr(nn, op) else "does not exist"
    raise FoldError(
        f"unknown op {op!r} at depth {call.depth} ({call.num_calls} nodes, first "
        f"{node_label(call.name, call.depth, 0)}): {type(nn).__name__}.{op} {what}; define a method {op!r} on the module "
        f"passed to apply, or pass a callable as the op{hint}"
    )


def check_requests(fold: Recording, requests: Sequence[Sequence[Any]]) -> None:
    """Reject empty or malformed ``apply`` requests, and nodes of other folds."""
    example = "f.apply(model, [[node_a, node_b], [node_c]])"
    if isinstance(requests, Node) or not isinstance(requests, Sequence) or isinstance(requests, str):
        raise FoldError(f"apply expects a list of lists of nodes, like {example}; got {requests!r}")
    if len(requests) == 0:
        raise FoldError(f"empty request: apply was given no lists of nodes; ask for outputs like {example}")
    ref = fold.tape.ref
    for i, request in enumerate(requests):
        if isinstance(request, Node) or not isinstance(request, Sequence):
            raise FoldError(
                f"request {i} is {request!r}, not a list of nodes; wrap it: {example} "
                "(one output tensor is returned per list)"
            )
        if len(request) == 0:
            raise FoldError(
                f"request {i} is an empty list; every list given to apply needs at least one node"
            )
        # The common case, checked without a Python loop (else find the culprit). The refs are
        # counted, not put in a set: a dead one (a node of a fold that is gone) cannot be hashed.
        if set(map(type, request)) == {Node} and list(map(tape_ref_of, request)).count(ref) == len(request):
            continue
        check_request_items(i, request, Node)
        for j, node in enumerate(request):
            if node.__class__ is Node and (foreign := foreign_node(node, ref)) is not None:
                raise FoldError(f"request {i}, item {j}: {foreign}")


def check_request_items(number: int, request: Sequence[Any], node_type: type) -> None:
    """Items of a request that are not nodes: as in the original TorchFold, tensors (their rows are
    concatenated with the nodes' rows, in list order), or ints (one ``LongTensor``) or floats, each
    kind on its own. Shared by Fold and its eager twin, so that both accept the same requests."""
    first = None  # the kind of item 0: "int", "float" or "rows" (a node or a tensor)
    tensor = None  # the first tensor item
    for j, item in enumerate(request):
        cls = item.__class__
        if cls is int:
            if not INT64_MIN <= item <= INT64_MAX:
                raise FoldError(
                    f"request {number}, item {j} is {outside_int64(item)}; ints become a LongTensor: pass a tensor instead"
                )
            kind = "int"
        elif cls is float:
            kind = "float"
        elif cls is node_type:
            kind = "rows"
        elif isinstance(item, torch.Tensor):
            if item.dim() == 0:
                raise FoldError(
                    f"request {number}, item {j}: a 0-dim tensor ({item!r}) has no rows to concatenate; "
                    "pass x.reshape(1)"
                )
            kind = "rows"
            if tensor is None:
                tensor = item
            elif (item.shape[1:], item.dtype, item.device) != (tensor.shape[1:], tensor.dtype, tensor.device):
                raise FoldError(
                    f"request {number}, item {j}: a tensor of rows {tuple(item.shape[1:])} {item.dtype} on "
                    f"{item.device}, but an earlier one has rows {tuple(tensor.shape[1:])} {tensor.dtype} on "
                    f"{tensor.device}; the items of a request are concatenated: pass same-shaped rows"
                )
        else:
            raise FoldError(
                f"request {number}, item {j} is {item!r}, not a node, an int, a float or a tensor; a request "
                "is concatenated into one tensor (ints: one LongTensor)"
            )
        if first is None:
            first = kind
        elif kind != first:
            where = f"request {number}, item {j}"
            if {kind, first} == {"int", "float"}:
                ints = [x for x in request if x.__class__ is int]
                floats = [x for x in request if x.__class__ is float]
                raise FoldError(ints_and_floats_mixed(where, ints[0], floats[0]))
            literal = first if first != "rows" else kind
            raise FoldError(
                f"{where}: {literal}s and nodes/tensors are mixed in one request; ask for them in separate "
                "lists, or pass the values as tensors"
            )


def module_device(nn: object) -> torch.device:
    """Where the module lives: its first parameter's or buffer's device, else the CPU.

    The first parameter is the one ``nn.parameters()`` yields first, found by walking the
    submodules' registered parameters directly: ``parameters()``'s generators cost ~10 us,
    paid by every ``apply``. A module that overrides ``parameters()`` is not asked.

    >>> module_device(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(2, 2)))
    device(type='cpu')
    """
    if isinstance(nn, torch.nn.Module):
        pending, seen = [nn], set()
        while pending:  # pre-order, as named_modules(): a module's own parameters, then its children's
            module = pending.pop()
            if id(module) in seen:
                continue
            seen.add(id(module))
            for parameter in module._parameters.values():
                if parameter is not None:
                    return parameter.device
            pending.extend(child for child in reversed(module._modules.values()) if child is not None)
        for buffer in nn.buffers():
            return buffer.device
    return torch.device("cpu")


def device_for(owner: object, device: torch.device | str | None = None) -> torch.device:
    """The device to compute on: ``device`` when given, else ``owner``'s, else the CPU.

    The one rule for "which device" in torchfold: a plan's ``apply``, ``StaticPlan.inputs``,
    the training steps and :func:`torchfold.train.run_context` all ask it. ``owner`` is a
    module (its device, :func:`module_device`), a sequence of tensors (the first one's, e.g. an
    optimizer's parameters) or ``None``.

    >>> device_for(torch.nn.Linear(2, 2)), device_for(None, "meta"), device_for([torch.zeros(1)])
    (device(type='cpu'), device(type='meta'), device(type='cpu'))
    """
    if device is not None:
        return device if isinstance(device, torch.device) else torch.device(device)
    if isinstance(owner, (list, tuple)):
        return owner[0].device if owner else torch.device("cpu")
    return module_device(owner)


def cuda_device(owner: str) -> torch.device:
    """Where ``owner.cuda()`` puts int and float arguments; refused clearly on a machine without CUDA."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{owner}.cuda(): CUDA is not available here (torch.cuda.is_available() is False); create the "
            f"{owner} with device='cpu', or leave device unset to follow the module's device"
        )
    return torch.device("cuda")


def _describe_arg(arg: Any, tape: Tape, nodes: bool) -> str:
    """What a stored argument is (see ``Group``): ``int``, ``float``, ``tensor[1, 784]`` or ``op@depth``."""
    if arg.__class__ is int:
        return tape.short_label(arg) if nodes else "int"
    if arg.__class__ is tuple:  # a tagged literal
        return str(arg[0])
    if isinstance(arg, torch.Tensor):
        return f"tensor{list(arg.shape)}"
    return type(arg).__name__


def describe(fold: Recording) -> str:
    """The plan, per depth: op x count and what each argument position holds.

    Before ``apply`` positions are described by kind (``int``, ``tensor[1, 784]``, the producing
    ``op@depth``); after it, by the batched shape each position had.
    """
    groups = fold.groups()
    depths = {g.depth for g in groups}
    lines = [f"Fold: {len(fold)} nodes in {len(groups)} batched groups over {len(depths)} depths"]
    for group in groups:
        if group.arg_shapes is not None:
            args = group.describe_arg_shapes()
        else:
            columns = zip(*group.calls, strict=True)
            nodes = group.depth > 0
            args = ", ".join(
                "|".join(sorted({_describe_arg(a, fold.tape, nodes) for a in col})) for col in columns
            )
        outputs = f" -> {group.num_outputs} outputs" if group.num_outputs else ""
        lines.append(f"  depth {group.depth}: {group.name} x {len(group.nodes)} ({args}){outputs}")
    return "\n".join(lines)
