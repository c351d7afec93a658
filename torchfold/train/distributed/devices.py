"""The training half's device policy: every question a run asks about its device, answered here.

The rest of :mod:`torchfold.train` (and :mod:`torchfold.cli`) asks these functions, or the
:class:`~torchfold.train.RunContext` that answers them for the run's device, instead of comparing
``device.type`` itself. The engine's own questions (:func:`on_host`, :func:`is_cuda`,
:func:`is_xla`, :func:`needs_static_shapes`) come from :mod:`torchfold.engine.devices` and are
re-exported here, so a training module imports one place. Each function accepts a
:class:`torch.device` or a string torch parses.

================================  ===========  ==========  =========
question                          CPU          CUDA        XLA
================================  ===========  ==========  =========
:func:`needs_static_shapes`       no           no          yes
:func:`replays_steps`            no           yes         yes
:func:`runner_kind`               compiled     cuda        xla
:func:`process_group_backend`     gloo         nccl        gloo
:func:`accumulation_dtype`        float64      float64     float32
:func:`fused_optimizer`           True         True        None
:func:`capturable_optimizer`      False        False       True
:func:`checkpoint_map_location`   cpu          cpu         cpu
:func:`synchronize`               nothing      nothing     graph cut
:func:`compiled_graphs`           dynamo's     dynamo's    torch_xla's
================================  ===========  ==========  =========

A number a graph reads (a sample weight, a divisor, a learning rate) reaches an XLA graph as
device data through one :class:`SentValues` cache, so that its value never selects a graph.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Literal

import torch

from torchfold.engine.devices import DeviceLike, is_cuda, is_xla, needs_static_shapes, of_kind, on_host
from torchfold.train.distributed.xla_calls import compilations as xla_compilations

__all__ = [
    "CHECKPOINT_MAP_LOCATION",
    "RunnerKind",
    "SentValues",
    "accumulation_dtype",
    "capturable_optimizer",
    "checkpoint_map_location",
    "compiled_graphs",
    "fused_optimizer",
    "is_cuda",
    "is_xla",
    "needs_static_shapes",
    "of_kind",
    "on_host",
    "process_group_backend",
    "replays_steps",
    "runner_kind",
    "same_device",
    "synchronize",
    "xla_sync",
]

#: The step mechanism a device replays captured steps with: ``"xla"`` (one program per minibatch
#: and one per update), ``"cuda"`` (a whole step from a CUDA graph), ``"compiled"``
#: (:func:`torch.compile` of each minibatch's forward, loss and backward, and of the update).
RunnerKind = Literal["xla", "cuda", "compiled"]

#: Where checkpoints are read to, whatever the run's device: the host. Loading a state dict then
#: copies the values into the model's and the optimizer's tensors on their devices; reading straight
#: onto an XLA device breaks a resume there.
CHECKPOINT_MAP_LOCATION = torch.device("cpu")


def process_group_backend(device: DeviceLike) -> str:
    """The ``torch.distributed`` backend for a run on ``device``: ``"nccl"`` for CUDA, else ``"gloo"``.

    >>> process_group_backend("cuda:1"), process_group_backend("cpu")
    ('nccl', 'gloo')
    """
    return "nccl" if is_cuda(device) else "gloo"


def accumulation_dtype(device: DeviceLike) -> torch.dtype:
    """The dtype losses and step statistics accumulate in on ``device``: float64, where the device has it.

    XLA (TPUs) and MPS have no float64 arithmetic: float32 there.

    >>> accumulation_dtype("cpu"), accumulation_dtype("mps")
    (torch.float64, torch.float32)
    """
    return torch.float32 if is_xla(device) or of_kind(device, "mps") else torch.float64


def checkpoint_map_location(device: DeviceLike) -> torch.device:
    """Where a run on ``device`` reads checkpoints to: :data:`CHECKPOINT_MAP_LOCATION` (the host) on every device.

    >>> checkpoint_map_location("xla:0")
    device(type='cpu')
    """
    del device  # the same on every device: the state is copied onto its device by load_state_dict
    return CHECKPOINT_MAP_LOCATION


def replays_steps(device: DeviceLike) -> bool:
    """Whether ``compile="replay"`` (steps captured once and replayed without running their Python)
    has a mechanism on ``device``: XLA's programs and CUDA graphs, nothing on the CPU.

    >>> replays_steps("xla"), replays_steps("cuda:0"), replays_steps("cpu")
    (True, True, False)
    """
    return is_xla(device) or is_cuda(device)


def compiled_graphs(device: DeviceLike) -> int:
    """How many graphs this process has compiled for ``device`` so far, by the compiler's own count:
    on XLA torch_xla's (its ``CompileTime`` metric: every program, the replayed steps' and any other),
    elsewhere :func:`torch.compile`'s (dynamo's unique graphs: each captured layout's forward and
    backward, each update). A run reports the difference over its steps.

    >>> compiled_graphs("cpu") >= 0
    True
    """
    if is_xla(device):
        return xla_compilations()
    from torch._dynamo.utils import counters  # (not at import: loading dynamo takes a second)

    return int(counters["stats"]["unique_graphs"])


def runner_kind(device: DeviceLike) -> RunnerKind:
    """How captured steps replay on ``device`` (:data:`RunnerKind`); the step runner falls back to
    an eager step where the run cannot have it (several processes, a grad scaler, an optimizer
    whose update cannot be captured).

    >>> runner_kind("xla:0"), runner_kind("cuda"), runner_kind("cpu")
    ('xla', 'cuda', 'compiled')
    """
    if is_xla(device):
        return "xla"
    if is_cuda(device):
        return "cuda"
    return "compiled"


def same_device(first: DeviceLike, second: DeviceLike) -> bool:
    """Whether ``first`` and ``second`` name one device: the same kind, and the same index where
    both give one (``"cuda"`` is the current CUDA device, so it matches ``"cuda:0"``).

    >>> same_device("cuda", "cuda:0"), same_device("cuda:0", "cuda:1"), same_device("cpu", "xla:0")
    (True, False, False)
    """
    first, second = torch.device(first), torch.device(second)
    if first.type != second.type:
        return False
    return first.index is None or second.index is None or first.index == second.index


def fused_optimizer(device: DeviceLike) -> bool | None:
    """The ``fused=`` to create a torch optimizer with on ``device``: ``True`` on the CPU and CUDA
    (one kernel for all parameters: 5x less time on the CPU), else ``None`` (torch's default).

    >>> fused_optimizer("cpu"), fused_optimizer("cuda"), fused_optimizer("xla")
    (True, True, None)
    """
    return True if on_host(device) or is_cuda(device) else None


def capturable_optimizer(device: DeviceLike) -> bool:
    """The ``capturable=`` to create a torch optimizer with on ``device``: ``True`` on XLA, where the
    step count must stay on the device for a captured update to replay.

    >>> capturable_optimizer("xla"), capturable_optimizer("cpu")
    (True, False)
    """
    return is_xla(device)


def xla_sync() -> None:
    """Cut and launch the pending lazy XLA graph (``torch_xla.sync``; ``xm.mark_step`` before 2.4)."""
    import torch_xla

    sync = getattr(torch_xla, "sync", None)
    if sync is None:
        import torch_xla.core.xla_model as xm

        sync = xm.mark_step
    sync()


def synchronize(device: DeviceLike) -> None:
    """End the work queued so far on ``device`` as a unit of its own: on XLA, cut the lazy graph
    and launch it (:func:`xla_sync`), so that the same graph repeats; elsewhere nothing (the
    CPU runs eagerly and CUDA's streams keep their order without a cut).

    >>> synchronize("cpu")  # nothing to do
    """
    if is_xla(device):
        xla_sync()


class SentValues:
    """Tensors filled on the host and sent to their device, made once per role, shape, value,
    dtype and device, and never changed in place: a graph reads each as device data.

    This is how the training half gives XLA a number (a sample weight, a divisor, a learning
    rate, an accumulator's zeros): torch_xla makes a Python number a constant when it is 0 or
    1, and one graph input shared by equal numbers of other roles otherwise, so a weight that
    is sometimes 1, or equal to a divisor, would make another graph; a sent tensor is a graph
    input of its own whatever its value. ``role`` keeps roles apart (two roles of one value are
    two tensors). At most ``limit`` are kept; past that the cache starts afresh.

    Example:
        >>> sent = SentValues()
        >>> one = sent.full("weight", (), 1.0, torch.float32, torch.device("cpu"))
        >>> one is sent.full("weight", (), 1.0, torch.float32, torch.device("cpu"))
        True
        >>> one is sent.full("divisor", (), 1.0, torch.float32, torch.device("cpu"))
        False
    """

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._made: dict[tuple[Any, ...], torch.Tensor] = {}

    def full(
        self, role: Hashable, shape: tuple[int, ...], value: float, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """``torch.full(shape, value, dtype=dtype)`` sent to ``device``, made once for ``role``."""
        key = (role, shape, value, dtype, device)
        tensor = self._made.get(key)
        if tensor is None:
            if len(self._made) >= self.limit:
                self._made.clear()
            tensor = self._made[key] = torch.full(shape, value, dtype=dtype).to(device)
        return tensor
