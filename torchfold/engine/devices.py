"""The engine's questions about a device, answered here and nowhere else in the engine.

The rest of the engine asks these instead of comparing ``device.type`` itself, so what a kind of
device means (the host's memory, XLA's lazy graphs and their static shapes, CUDA) is decided in
one place. The training half asks the same functions through its own device policy,
:mod:`torchfold.train.distributed.devices`, which adds the questions of a training run (backend,
accumulation dtype, step runner). Each accepts a :class:`torch.device` or a string torch parses
(``"cpu"``, ``"cuda:1"``, ``"xla"``).
"""

from __future__ import annotations

import torch

__all__ = ["is_cuda", "is_xla", "needs_static_shapes", "of_kind", "on_host"]

DeviceLike = torch.device | str


def _kind(device: DeviceLike) -> str:
    return (device if isinstance(device, torch.device) else torch.device(device)).type


def of_kind(device: DeviceLike, kind: str) -> bool:
    """Whether ``device`` is of ``kind`` (``"cpu"``, ``"cuda"``, ``"xla"``, ``"mps"``...), for a kind given as a value.

    Where the kind is fixed, ask the question it stands for instead (:func:`on_host`,
    :func:`is_cuda`, :func:`is_xla`).

    >>> of_kind("cuda:1", "cuda"), of_kind(torch.device("cpu"), "xla")
    (True, False)
    """
    return _kind(device) == kind


def on_host(device: DeviceLike) -> bool:
    """Whether ``device`` is the host (the CPU): its tensors need no copy to reach numpy or a pickle.

    >>> on_host("cpu"), on_host("cuda:0"), on_host("meta")
    (True, False, False)
    """
    return _kind(device) == "cpu"


def is_cuda(device: DeviceLike) -> bool:
    """Whether ``device`` is a CUDA GPU (its graphs, streams, fp16 loss scaling and nccl).

    >>> is_cuda("cuda:1"), is_cuda("cpu")
    (True, False)
    """
    return _kind(device) == "cuda"


def is_xla(device: DeviceLike) -> bool:
    """Whether ``device`` is an XLA device (TPU, or torch_xla's CPU backend): lazy tensors, whose
    pending operations run when the graph is cut (a sync), each new shape compiling a new graph.

    >>> is_xla("xla:0"), is_xla(torch.device("cpu"))
    (True, False)
    """
    return _kind(device) == "xla"


def needs_static_shapes(device: DeviceLike) -> bool:
    """Whether folds on ``device`` are padded to static shapes by default (``shapes="auto"``).

    On XLA: every new shape compiles a new graph, so the shapes must repeat. Elsewhere an
    unpadded fold runs as fast (a captured step asks for static shapes of its own).

    >>> needs_static_shapes("xla"), needs_static_shapes("cuda"), needs_static_shapes("cpu")
    (True, False, False)
    """
    return is_xla(device)
