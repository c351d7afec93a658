"""Every call the replayed XLA programs make into torch_xla's private ``_XLAC`` module, in one place.

The replays of :mod:`~torchfold.train.capture.xla_programs` (and the all-reduce of
:mod:`~torchfold.train.distributed.world`) capture a step's program once (torch_xla's term: it
traces the step lazily into a graph), compile it, and from then on run the compiled graph directly
on the tensors that play each of its inputs' roles. torch_xla has no public API for this; its own
dynamo bridge is built on the same private calls (graph hashes, the device data behind a captured
graph's inputs, running a cached graph).
They live here so that the next torch_xla version changes one file, and
:func:`replay_unavailable` says which of them a torch_xla lacks.

NOTE: torch_xla keeps a cache of 0-dim tensors moved to a device, keyed by value: equal scalars
share one device buffer, and a Python number inside a captured step is the same buffer as a
tensor of that value made earlier. A capture over such a buffer has one input for both, which no binding
can take apart. :func:`own_buffers` gives tensors a buffer of their own (a computed one) before
they are captured; the runner's own scalars are 1-element vectors, which are never cached.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchfold.engine.devices import is_xla

__all__ = [
    "CAPTURE_LOCK",
    "NEEDED",
    "HostReads",
    "compilations",
    "compile_graph",
    "data_ids",
    "device_data",
    "executions",
    "graph_hash",
    "materialize",
    "needs_materialization",
    "own_buffers",
    "replay_unavailable",
    "replica_threads",
    "run_graph",
    "runtime_initialized",
    "seed_id",
    "sync",
]

#: the private calls a replay needs
NEEDED = (
    "_get_graph_hash",
    "_get_tensors_xla_device_data_node",
    "_xla_warm_up_cache",
    "_run_cached_graph",
    "_check_tensor_need_materialization",
    "_xla_sync_multi",
    "_get_seed_info_id",
)
#: one capture at a time in a process (torch_xla's lazy graph is not safe in two threads; replicas may be threads)
CAPTURE_LOCK = threading.Lock()


def replay_unavailable() -> str | None:
    """Why this torch_xla cannot replay captured programs (None if it can).

    >>> isinstance(replay_unavailable(), str | None)
    True
    """
    try:
        import torch_xla
    except ImportError:
        return "torch_xla is not installed"
    missing = [name for name in NEEDED if not hasattr(torch_xla._XLAC, name)]
    if missing:
        return f"torch_xla {getattr(torch_xla, '__version__', '?')} lacks {', '.join(missing)}"
    return None


def _xlac() -> Any:
    import torch_xla

    return torch_xla._XLAC


def device_data(tensors: Sequence[torch.Tensor]) -> tuple[list[int], list[torch.Tensor]]:
    """The device data that the lazy graphs of ``tensors`` read, each once: its id and value (the
    inputs of a compiled capture, in its parameter order)."""
    ids, values = _xlac()._get_tensors_xla_device_data_node(list(tensors))
    return list(ids), list(values)


def data_ids(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The id of the device data each of ``tensors`` (materialized) holds, one per tensor."""
    read = _xlac()._get_tensors_xla_device_data_node
    return [read([tensor])[0][0] for tensor in tensors]


def needs_materialization(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """For each tensor: whether it is a pending computation (not device data)."""
    return list(_xlac()._check_tensor_need_materialization(list(tensors)))


def graph_hash(roots: Sequence[torch.Tensor]) -> Any:
    """The hash of the lazy graph computing ``roots`` (the key of XLA's compilation cache)."""
    return _xlac()._get_graph_hash(list(roots))


def compile_graph(roots: Sequence[torch.Tensor]) -> None:
    """Compile the lazy graph computing ``roots`` into XLA's cache, without running it."""
    _xlac()._xla_warm_up_cache(list(roots), [])


def run_graph(graph: Any, arguments: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Run the cached graph ``graph`` on ``arguments`` (its inputs, in its parameter order)."""
    return list(_xlac()._run_cached_graph(graph, list(arguments)))


def seed_id() -> int:
    """The id of the device data that holds the random seed (a captured step that reads it draws random numbers)."""
    return int(_xlac()._get_seed_info_id())


def sync(tensors: Sequence[torch.Tensor], *, wait: bool = True, sync_data: bool = True) -> None:
    """Run the pending computations of ``tensors`` (only those), leaving them device data
    (``wait=False``: launched, not waited for; ``sync_data=False``: the tensors keep their
    pending graph until it has run)."""
    _xlac()._xla_sync_multi(list(tensors), devices=[], wait=wait, sync_xla_data=sync_data)


def runtime_initialized() -> bool:
    """Whether torch_xla's runtime has started in this process (asking ``torch_xla.runtime``
    would start it, and fix the number of devices)."""
    return bool(_xlac()._xla_runtime_is_initialized())


def materialize(live: Sequence[torch.Tensor]) -> None:
    """Make every tensor of ``live`` device data, as a program's inputs must be: a pending
    operation (e.g. after ``load_state_dict``) is run."""
    pending = [t for t, need in zip(live, needs_materialization(live), strict=True) if need]
    if pending:
        sync(pending)


def own_buffers(
    live: Sequence[torch.Tensor], computed: Callable[[torch.Tensor], bool] = lambda tensor: False
) -> list[torch.Tensor]:
    """Give each tensor of ``live`` that may share its device buffer (a 0-dim tensor: torch_xla's
    scalar cache; or one whose buffer another of ``live`` holds) a computed buffer of its own,
    values kept, so that a capture over ``live`` has one input per tensor and none shared with a
    constant of the capture. ``computed(tensor)``: whether a tensor is known to hold a buffer a
    program computed (a result of an earlier replay), left as it is. Returns the tensors given a
    new buffer.

    A small program per tensor (the same program for every 0-dim tensor of one dtype: compiled
    once), run before a capture, never in a replay."""
    seen: dict[int, int] = {}
    ids = data_ids(live)
    shared = []
    for number, (tensor, data) in enumerate(zip(live, ids, strict=True)):
        first = seen.setdefault(data, number)
        if (first != number and live[first] is not tensor) or (tensor.dim() == 0 and not computed(tensor)):
            shared.append(tensor)
    tensors = list({id(t): t for t in shared}.values())
    with torch.no_grad():
        for tensor in tensors:
            # out of place: an in-place change would give the old buffer away (donate it) at the
            # sync, under whatever else holds it (torch_xla's scalar cache)
            fresh = tensor.logical_or(torch.zeros_like(tensor)) if tensor.dtype == torch.bool else tensor + 0
            sync([fresh])
            tensor.data = fresh
    return tensors


def replica_threads() -> bool:
    """Whether several XLA devices of this process run replicas as threads (XLA's CPU backend
    with ``CPU_NUM_DEVICES``): their graphs then count in one process-wide number of executions."""
    import torch_xla.runtime as xr

    return runtime_initialized() and xr.addressable_device_count() > 1


def executions() -> int:
    """How many graphs torch_xla has run in this process (a host read runs one)."""
    import torch_xla.debug.metrics as met

    return int(met.counter_value("ExecuteComputation") or 0)


def compilations() -> int:
    """How many programs torch_xla has compiled in this process: its own ``CompileTime`` metric's
    count (every compile, the replays' captures, the all-reduce's and the host reads' alike)."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


_ATEN = torch.ops.aten


class HostReads(TorchDispatchMode):
    """Inside ``with HostReads() as reads:``, whether the code of *this thread* read an XLA tensor's
    value back to the host (``.item()``, ``float()``, ``bool()``, ``.tolist()``, ``.cpu()``,
    ``print``): :meth:`happened`.

    A read runs the pending graph, so torch_xla's process-wide count of executed graphs
    (:func:`executions`) tells one in a process of one replica. Replicas that are threads of one
    process (XLA's CPU backend with ``CPU_NUM_DEVICES``) all add to that count, so there a graph
    another replica ran would read as a read of this one's, by chance. The ops that read a value
    back (``_local_scalar_dense``, a copy to the host) are seen here as they are dispatched, in the
    thread that runs them (a dispatch mode is thread-local); the count of executions is still
    compared where no other replica can run graphs.
    """

    def __init__(self) -> None:
        super().__init__()
        #: how many ops of this thread read an XLA tensor back to the host inside the ``with``
        self.count = 0
        self._executed = 0
        self._threads = False

    def __enter__(self) -> HostReads:
        self._threads = replica_threads()
        self._executed = executions()
        super().__enter__()
        return self

    def happened(self) -> bool:
        """Whether a value was read back to the host since entering (by this thread, with replicas
        that are threads; by anything in the process otherwise)."""
        return self.count > 0 or (not self._threads and executions() != self._executed)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if _reads_back(func, args, kwargs):
            self.count += 1
        return func(*args, **kwargs)


def _on_xla(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and is_xla(value.device)


def _reads_back(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether the op ``func(*args, **kwargs)`` moves an XLA tensor's value to the host."""
    packet = getattr(func, "overloadpacket", None)
    if packet is _ATEN._local_scalar_dense:
        return _on_xla(args[0])
    if packet is _ATEN._to_copy:
        device = kwargs.get("device")
        return _on_xla(args[0]) and device is not None and not is_xla(device)
    if packet is _ATEN.copy_:
        return len(args) > 1 and _on_xla(args[1]) and not _on_xla(args[0])
    return False
