"""Distributed helpers: who am I, which device, a sum all-reduce, and a startup handshake with timeouts.

:func:`world` is the one rule for the number of processes and this one's rank; :func:`run_context`
adds the rest of what a run must agree on, each from one rule: the device (the engine's
:func:`~torchfold.engine.resolve.device_for`, else :func:`default_device`), the process-group
backend, the dtype losses and statistics accumulate in, and where checkpoints are read to; what
each kind of device needs is the device policy's (:mod:`~torchfold.train.distributed.devices`),
whose answers for the run's device :class:`RunContext` gives.

Everything here works in three settings with the same calls:

* a single process (no ``torch.distributed`` group, no torch_xla): world size 1, rank 0, the
  all-reduce does nothing;
* ``torch.distributed`` (gloo on CPU, nccl on CUDA), for example under ``torchrun``;
* torch_xla (TPU, or its CPU backend with ``PJRT_DEVICE=CPU``): used when the tensors live on an
  XLA device; torch_xla is imported only then, so it is never a hard dependency.

A rank that dies or never shows up must make the others fail with a clear error instead of
hanging: :func:`init_distributed` creates the process group with a timeout that also bounds every
collective (gloo enforces it), and first runs a handshake in which every rank checks that all
ranks agree on the world size and on a user-given configuration (trace fingerprint, batch sizes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import importlib.util
import json
import os
import pickle
import sys
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from torchfold._deprecation import warn_renamed
from torchfold._validate import check_int
from torchfold.engine.resolve import device_for
from torchfold.train.distributed import xla_calls
from torchfold.train.distributed.devices import (
    CHECKPOINT_MAP_LOCATION,
    accumulation_dtype,
    checkpoint_map_location,
    is_xla,
    process_group_backend,
    xla_sync,
)

__all__ = [
    "CHECKPOINT_MAP_LOCATION",
    "RunContext",
    "World",
    "abort_replica_threads",
    "accumulation_dtype",
    "all_reduce_sum_",
    "broadcast_parameters",
    "check_same_on_all_ranks",
    "default_device",
    "fingerprint",
    "gather_objects",
    "init_distributed",
    "is_main_process",
    "process_group_backend",
    "run_context",
    "world",
    "world_or",
    "xla_sync",
]

_HANDSHAKE_PREFIX = "torchfold/handshake"
_POLL_S = 0.02
_group_timeout_s: dict[str, float] = {}


def _dist_active() -> bool:
    return dist.is_available() and dist.is_initialized()


def _xla_runtime() -> Any | None:
    """``torch_xla.runtime`` inside a running XLA job, else ``None``.

    Only when torch_xla is already imported (importing it just to ask would make it a hard
    dependency) and its runtime is initialized, as it is in every replica that ``xmp.spawn`` or
    ``torch_xla.launch`` starts. Before that, ``xr.world_size()`` answers 1 and caches it, and
    initializes the runtime, after which ``xmp.spawn`` refuses to start: so it is not asked.
    """
    if "torch_xla" not in sys.modules:
        return None
    import torch_xla.runtime as xr

    if not xla_calls.runtime_initialized():
        return None
    return xr


class World(NamedTuple):
    """How many processes (replicas) share the training, and which one this is.

    Args:
        size: the number of replicas (processes), >= 1: the ``num_replicas`` of a
            :class:`~torchfold.train.StepLoader`, a :class:`~torchfold.train.TraceBatchSampler` and
            an :class:`~torchfold.train.ElasticConfig`.
        rank: this one's, in ``[0, size)``.
        source: where the answer came from: ``"torch.distributed"``, ``"torch_xla"`` or
            ``"single process"``.
    """

    size: int
    rank: int
    source: str


def world(*, warn_unconnected: bool = False) -> World:
    """The one rule for "how many processes, which one am I", used by every part of torchfold.

    In order: an initialized ``torch.distributed`` process group (e.g. under ``torchrun``, after
    :func:`init_distributed`); a torch_xla replica (``xmp.spawn`` / ``torch_xla.launch``: XLA's
    world size and global ordinal); else a single process. Launcher environment variables alone
    (``WORLD_SIZE``) do not count: the processes are not connected until the group exists, so
    create loaders and samplers after it. With ``warn_unconnected`` (where a default is taken:
    loaders, samplers, :class:`~torchfold.train.ElasticConfig`), a launcher's ``WORLD_SIZE`` > 1
    without a process group warns that the answer is one process, naming :func:`init_distributed`.

    >>> world()
    World(size=1, rank=0, source='single process')
    """
    if _dist_active():
        return World(dist.get_world_size(), dist.get_rank(), "torch.distributed")
    xr = _xla_runtime()
    if xr is not None:
        return World(int(xr.world_size()), int(xr.global_ordinal()), "torch_xla")
    launched = os.environ.get("WORLD_SIZE", "").strip()
    if warn_unconnected and launched.isdecimal() and int(launched) > 1:
        warnings.warn(
            f"WORLD_SIZE={launched} is set (a launcher started {launched} processes), but this one has no process "
            "group yet, so this setting plans for 1 process; call torchfold.train.init_distributed() first and "
            "create loaders, samplers and ElasticConfigs after it",
            stacklevel=3,
        )
    return World(1, 0, "single process")


def world_or(size: int | None, rank: int | None) -> tuple[int, int]:
    """``(size, rank)`` with whichever is None taken from :func:`world` (both from the same rule).

    >>> world_or(None, None), world_or(4, 2)
    ((1, 0), (4, 2))
    """
    if size is None or rank is None:
        found = world(warn_unconnected=True)
        size = found.size if size is None else size
        rank = found.rank if rank is None else rank
    return size, rank


def check_rank(rank: object, world_size: int) -> int:
    """``rank`` if it is an int in ``[0, world_size)``, else a TypeError/ValueError naming it (torch's wording)."""
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"rank must be an int, got {type(rank).__name__} {rank!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"Invalid rank {rank}, rank should be in the interval [0, {world_size - 1}]")
    return rank


def get_world_size() -> int:
    """Deprecated: ``world().size`` (see :func:`world`)."""
    warn_renamed("torchfold.train.get_world_size()", "torchfold.train.world().size")
    return world().size


def get_rank() -> int:
    """Deprecated: ``world().rank`` (see :func:`world`)."""
    warn_renamed("torchfold.train.get_rank()", "torchfold.train.world().rank")
    return world().rank


def is_main_process() -> bool:
    """True on rank 0, the process that logs, plots and writes checkpoints.

    >>> is_main_process()
    True
    """
    return world().rank == 0


def default_device(kind: str | None = None) -> torch.device:
    """The device this process computes on when none is named: its XLA device, its CUDA device, else the CPU.

    XLA when torch_xla is imported, or when ``PJRT_DEVICE`` is set and torch_xla is installed
    (then it is imported); else under ``torchrun`` with CUDA the device is ``cuda:LOCAL_RANK``.
    ``kind`` (``"cpu"``, ``"cuda"`` or ``"xla"``) asks for this process's device of that kind.

    >>> default_device().type in ("cpu", "cuda", "xla"), default_device("cpu")
    (True, device(type='cpu'))
    """
    if kind not in (None, "cpu", "cuda", "xla"):
        raise ValueError(f"default_device(kind={kind!r}): kind must be None, 'cpu', 'cuda' or 'xla'")
    if kind == "xla" or (
        kind is None
        and (
            "torch_xla" in sys.modules
            or (os.environ.get("PJRT_DEVICE") and importlib.util.find_spec("torch_xla") is not None)
        )
    ):
        import torch_xla

        return torch.device(torch_xla.device())
    if kind == "cuda" or (kind is None and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError(
                "default_device('cuda'): CUDA is not available here (torch.cuda.is_available() is False); "
                "ask for 'cpu', or leave kind unset"
            )
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class RunContext:
    """What one run trains with, every answer from one rule: ask it instead of choosing again.

    Create it with :func:`run_context`. The device is fixed when it is made; :attr:`world` is
    asked anew each time (:func:`world`), so a context made before the process group exists
    answers the group's size and rank once it does.

    Args:
        device: the device the run computes on.

    >>> ctx = run_context("cpu")
    >>> ctx.device, ctx.world.size, ctx.backend, ctx.accumulation_dtype, ctx.map_location
    (device(type='cpu'), 1, 'gloo', torch.float64, device(type='cpu'))
    """

    device: torch.device

    @property
    def world(self) -> World:
        """How many processes, and which one this is (:func:`world`)."""
        return world()

    @property
    def backend(self) -> str:
        """The process-group backend for this device (:func:`process_group_backend`)."""
        return process_group_backend(self.device)

    @property
    def accumulation_dtype(self) -> torch.dtype:
        """The dtype losses and statistics accumulate in on this device (:func:`accumulation_dtype`)."""
        return accumulation_dtype(self.device)

    @property
    def map_location(self) -> torch.device:
        """Where checkpoints are read to (:func:`~torchfold.train.distributed.devices.checkpoint_map_location`: the host)."""
        return checkpoint_map_location(self.device)

    @property
    def is_xla(self) -> bool:
        """Whether the run is on XLA (:func:`~torchfold.train.distributed.devices.is_xla`): lazy graphs,
        replicas that may be threads of this process."""
        return is_xla(self.device)


def run_context(device: torch.device | str | RunContext | None = None, *, model: object = None) -> RunContext:
    """The :class:`RunContext` of a run on ``device``; left out, ``model``'s device, else :func:`default_device`.

    The trainer, the CLI and :func:`~torchfold.train.captured_step` all make theirs here, so an
    explicit device is honoured everywhere and the default is the same everywhere. A
    :class:`RunContext` is its own answer: the CLI hands its context to the trainer, which then
    works the device out no second time.

    >>> run_context(model=torch.nn.Linear(2, 2)).device, run_context("meta").device
    (device(type='cpu'), device(type='meta'))
    >>> ctx = run_context("cpu")
    >>> run_context(ctx) is ctx, ctx.is_xla, ctx.backend
    (True, False, 'gloo')
    """
    if isinstance(device, RunContext):
        return device
    if device is None and model is None:
        return RunContext(default_device())
    return RunContext(device_for(model, device))


def _timeout_s() -> float | None:
    # Known only for groups that init_distributed created; torch keeps its own copy private.
    return _group_timeout_s.get("default")


def first_line(error: BaseException) -> str:
    r"""An error's first line: torch's distributed errors append a C++ stack trace of dozens of lines.

    >>> first_line(RuntimeError("Connection closed by peer\nException raised from recvBytes"))
    'Connection closed by peer'
    """
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def all_reduce_sum_(tensors: Sequence[torch.Tensor]) -> None:
    """Sum ``tensors`` in place over all ranks (XLA, gloo or nccl); nothing to do in a single process.

    All ranks must call it with tensors of the same shapes, dtypes and order. Tensors of one dtype
    and device travel as one flat buffer, so the cost is one collective per dtype, not per tensor.
    A failure (a peer died, the group's timeout expired) raises ``RuntimeError`` naming this rank.

    Args:
        tensors: tensors to sum in place; all on the same kind of device.

    >>> t = torch.ones(3)
    >>> all_reduce_sum_([t])  # a single process: unchanged
    >>> t
    tensor([1., 1., 1.])
    """
    if not tensors:
        return
    if any(is_xla(t.device) for t in tensors):
        _xla_all_reduce_sum_(tensors)
        return
    if not _dist_active() or dist.get_world_size() == 1:
        return
    for members in _by_dtype(tensors):
        flat = torch.cat([t.reshape(-1) for t in members])
        try:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        except Exception as e:
            timeout = _timeout_s()
            within = f" within the group's timeout of {timeout:g} s" if timeout is not None else ""
            raise RuntimeError(
                f"torchfold: all-reduce of {len(members)} tensors failed on rank {dist.get_rank()} of "
                f"{dist.get_world_size()} ({dist.get_backend()}): another rank died or did not reach the "
                f"same all-reduce{within}. Original error: {first_line(e)}"
            ) from e
        _unflatten_into(flat, members)


def _by_dtype(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def _unflatten_into(flat: torch.Tensor, members: Sequence[torch.Tensor]) -> None:
    offset = 0
    for t in members:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def _xla_all_reduce_sum_(tensors: Sequence[torch.Tensor]) -> None:
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    if xr.world_size() == 1:
        return
    # XLA pairs up the collectives of the replicas by their place in the compiled graph, so the
    # graph holding the all-reduce must be the same on every replica. It is not by itself: a
    # replica without minibatches captured no forward/backward, and its zero gradients are constants
    # where the others have computed values. So: one flat buffer per dtype built by a cat (an op on
    # every replica), materialized by a graph cut, then reduced in a graph of its own.
    groups = _by_dtype(tensors)
    flats = [torch.cat([t.reshape(-1) for t in members]) for members in groups]
    _replica_threads_meet()
    xla_sync()
    xm.all_reduce(xm.REDUCE_SUM, flats)  # a list is reduced in place
    # Run exactly the all-reduce, nothing else, as its own graph (a full sync here can block
    # while holding the GIL until the collective completes: replicas that are threads of one
    # process, as on XLA's CPU backend, then never reach it). Such replicas launch it one at a
    # time: launched together, each may compile the graph itself, and XLA numbers the collectives
    # of two compilations apart, so they would wait for each other in different rendezvous.
    with _launch_lock:
        xla_calls.sync(flats, wait=False)
    for flat, members in zip(flats, groups, strict=True):
        _unflatten_into(flat, members)


# Replicas that are threads of one process (torch_xla's CPU backend with CPU_NUM_DEVICES > 1)
# wait for each other here before an all-reduce, however long the slowest takes to get there
# (a first capture can take a minute). XLA's own rendezvous gives up after seconds.
XLA_THREAD_MEET_TIMEOUT_S = 600.0
_thread_meets: dict[int, threading.Barrier] = {}
_thread_meets_lock = threading.Lock()
_launch_lock = threading.Lock()


def _replica_threads_meet() -> None:
    """Block until every replica thread of this process reaches its next all-reduce (no-op otherwise)."""
    import torch_xla.runtime as xr

    threads = int(xr.addressable_runtime_device_count())
    if threads <= 1:
        return
    with _thread_meets_lock:
        barrier = _thread_meets.setdefault(threads, threading.Barrier(threads))
    try:
        barrier.wait(timeout=XLA_THREAD_MEET_TIMEOUT_S)
    except threading.BrokenBarrierError:
        raise RuntimeError(
            f"torchfold: replica {xr.global_ordinal()} of {threads} XLA replicas in this process waited "
            f"{XLA_THREAD_MEET_TIMEOUT_S:g} s for the others to reach the same all-reduce (or one of them failed); "
            "every replica must take part in every step, also one without minibatches"
        ) from None


def abort_replica_threads() -> None:
    """Release the replica threads of this process waiting for an all-reduce: one of them failed.

    :meth:`TraceTrainer.fit <torchfold.train.TraceTrainer.fit>` calls it when a step raises, so the
    other replicas stop with an error at once instead of waiting out the timeout.
    """
    with _thread_meets_lock:
        for barrier in _thread_meets.values():
            barrier.abort()


def gather_objects(value: Any, *, what: str = "values") -> list[Any]:
    """Every rank's ``value`` (anything picklable), in rank order: a collective, every rank calls it.

    Under ``torch.distributed`` it is ``all_gather_object``; across torch_xla's replicas the
    pickled bytes travel through :func:`all_reduce_sum_` (each rank fills its own row of a zero
    buffer); in a single process it is ``[value]``. ``what`` names the values in errors.

    >>> gather_objects({"seed": 1})
    [{'seed': 1}]
    """
    current = world()
    if current.size == 1:
        return [value]
    if current.source == "torch_xla":
        import torch_xla

        device = torch_xla.device()
        payload = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
        lengths = torch.zeros(current.size, dtype=torch.float32)
        lengths[current.rank] = payload.numel()
        lengths = lengths.to(device)
        all_reduce_sum_([lengths])
        sizes = [int(n) for n in lengths.cpu().tolist()]
        # rows padded to a power of two: pickles whose lengths vary a little (random states) share
        # one shape, so a later gather compiles no new XLA graph
        width = 1 << max(10, (max(sizes) - 1).bit_length())
        rows = torch.zeros(current.size, width, dtype=torch.float32)  # bytes are exact in float32
        rows[current.rank, : payload.numel()] = payload.float()
        rows = rows.to(device)
        all_reduce_sum_([rows])
        host = rows.cpu().to(torch.uint8)
        return [pickle.loads(host[rank, :size].numpy().tobytes()) for rank, size in enumerate(sizes)]
    gathered: list[Any] = [None] * current.size
    try:
        dist.all_gather_object(gathered, value)
    except Exception as e:
        raise RuntimeError(
            f"torchfold: rank {current.rank} could not gather the ranks' {what}: another rank died or did not "
            f"reach the same gather. Original error: {first_line(e)}"
        ) from e
    return gathered


def broadcast_parameters(module: torch.nn.Module, src: int = 0) -> None:
    """Copy ``module``'s parameters and buffers from rank ``src`` to every rank (no-op in one process).

    DistributedDataParallel does this itself when it wraps a module; call it when training a plain
    module with :class:`~torchfold.train.AccumulatingOptimizer` over several processes.

    Args:
        module: the model; the same architecture on every rank.
        src: the rank whose values win (default 0).

    >>> broadcast_parameters(torch.nn.Linear(2, 2))
    """
    if not _dist_active() or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=src)


def fingerprint(value: object) -> str:
    """A short stable hash of a JSON-serializable value (a trace's batch sizes, a config dict).

    Ranks compare fingerprints in the startup handshake instead of whole traces.

    >>> fingerprint([32, 64, 64]) == fingerprint([32, 64, 64]) != fingerprint([32, 64])
    True
    """
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _env_int(name: str, value: int | None, env: str) -> int:
    if value is not None:
        return value
    if env not in os.environ:
        raise ValueError(
            f"{name} was not given and the environment variable {env} is not set; pass {name}= or run under torchrun"
        )
    return int(os.environ[env])


def _mismatches(infos: Mapping[int, Mapping[str, Any]]) -> list[str]:
    keys = sorted({k for info in infos.values() for k in info})
    lines = []
    for key in keys:
        values = {rank: info.get(key, "<missing>") for rank, info in sorted(infos.items())}
        if len({json.dumps(v, sort_keys=True, default=str) for v in values.values()}) > 1:
            per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in values.items())
            lines.append(f"{key} differs ({per_rank})")
    return lines


def _handshake(
    store: dist.Store, rank: int, world_size: int, config: Mapping[str, Any], timeout_s: float
) -> None:
    """Every rank publishes its world size and config, waits for all the others, and compares.

    Rank 0 hosts the store: it leaves only once every other rank that arrived has finished
    reading (or after another ``timeout_s``), so that a rank still comparing gets its own clear
    error instead of a closed connection when rank 0 raises first. The others count themselves
    in and out, so rank 0 also waits for a rank whose world size (and so rank range) is not its own.
    """
    try:
        if rank != 0:
            store.add(f"{_HANDSHAKE_PREFIX}/arrived", 1)
        try:
            _compare(store, rank, world_size, config, timeout_s)
        finally:
            _leave(store, rank, timeout_s)
    except RuntimeError as e:  # a store operation failed: the connection to rank 0 broke
        if rank == 0:
            raise
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0][:100]
        raise RuntimeError(
            f"torchfold: rank {rank} lost the rendezvous store during the startup handshake: rank 0, which "
            f"hosts it, stopped first; its own error says why ({first_line})"
        ) from e


def _leave(store: dist.Store, rank: int, timeout_s: float) -> None:
    if rank != 0:
        # Rank 0 may have gone already (it waits for us only up to its timeout): then there is
        # nobody to tell, and this rank's own outcome must stand, not a broken-pipe error.
        with contextlib.suppress(RuntimeError):
            store.add(f"{_HANDSHAKE_PREFIX}/left", 1)
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        arrived = store.add(f"{_HANDSHAKE_PREFIX}/arrived", 0)
        if store.add(f"{_HANDSHAKE_PREFIX}/left", 0) >= arrived:
            return
        time.sleep(_POLL_S)


def _compare(
    store: dist.Store, rank: int, world_size: int, config: Mapping[str, Any], timeout_s: float
) -> None:
    mine = {"world_size": world_size, **config}
    store.set(f"{_HANDSHAKE_PREFIX}/{rank}", json.dumps(mine, sort_keys=True, default=str))
    keys = {r: f"{_HANDSHAKE_PREFIX}/{r}" for r in range(world_size)}
    infos: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        for r, k in keys.items():  # each rank's entry is written once: read it once
            if r not in infos and store.check([k]):
                infos[r] = json.loads(store.get(k))
        missing = [r for r in keys if r not in infos]
        # A rank that says another world size is a mismatch now: waiting for the ranks it does
        # not count (or that this rank does not) would only end in a timeout.
        if not missing or any(info.get("world_size") != world_size for info in infos.values()):
            break
        if time.monotonic() > deadline:
            joined = sorted(infos)
            said = {r: infos[r].get("world_size") for r in joined}
            raise TimeoutError(
                f"torchfold: rank {rank} waited {timeout_s:g} s for ranks {missing} of world_size={world_size} "
                f"to join the startup handshake; ranks {joined} joined (their world sizes: {said}). A rank died "
                f"before joining, or the processes were started with different world sizes: start every "
                f"process with the same WORLD_SIZE / --nproc_per_node."
            )
        time.sleep(_POLL_S)
    problems = _mismatches(infos)
    if problems:
        raise ValueError(
            f"torchfold: ranks disagree at startup (seen by rank {rank}): {'; '.join(problems)}. "
            f"Start every process with the same world size, trace and configuration."
        )


def _import_group_defaults() -> None:
    """Import, before the process group exists, the torch module that would otherwise keep it alive.

    ``torch.distributed.nn.functional`` gives its functions the default argument
    ``group=group.WORLD``, evaluated at its first import, which the first optimizer triggers
    (through ``torch._dynamo``). Imported once a group exists, those defaults hold that group for
    good: ``destroy_process_group()`` then no longer destroys it, and gloo's worker threads run on
    into the interpreter's shutdown. A worker that frees the tensors of the last collective then
    (the main thread was quicker, on a loaded machine) needs the GIL, which a shutting-down
    interpreter does not give back: the process aborts with SIGABRT ("terminate called without an
    active exception") after a run that succeeded. Imported first, the defaults hold ``None``.
    """
    import torch.distributed.nn.functional  # noqa: F401


def _agent_store_prefix(restart: str, world_size: int) -> str:
    """The keys of this group in the store of torchrun's agent, which outlives its groups.

    The agent keeps one store across the groups it starts, so every group needs keys of its
    own: reading the last group's handshake entries, or gloo's addresses of its dead processes,
    fails the new group (a connect to a closed port until the timeout, or a wrong world size).
    The restart count alone does not tell the groups apart: a node joining a running job
    (``--nnodes=MIN:MAX``) restarts the group without counting a restart. Such a group has that
    node's processes as well, so its world size is larger than the last one's.

    >>> _agent_store_prefix("0", 2), _agent_store_prefix("0", 3)
    ('torchfold/attempt_0/world_2', 'torchfold/attempt_0/world_3')
    """
    return f"torchfold/attempt_{restart}/world_{world_size}"


def init_distributed(
    backend: str = "gloo",
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    timeout: float = 60.0,
    config: Mapping[str, Any] | None = None,
) -> None:
    """Create the default process group after checking that every rank agrees on how to train.

    Arguments left out come from the environment variables that ``torchrun`` sets (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). The handshake fails on every rank with a
    ``ValueError`` naming the differing values when ranks disagree on the world size or on any
    entry of ``config``, and with a ``TimeoutError`` naming the missing ranks when some rank does not
    arrive within ``timeout`` seconds. The same ``timeout`` bounds every later collective of the
    group, so a rank that dies mid-training makes the others raise instead of hang.

    Args:
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (CUDA).
        rank: this process's rank; default ``$RANK``.
        world_size: number of processes; default ``$WORLD_SIZE``.
        master_addr: host of rank 0; default ``$MASTER_ADDR`` or ``127.0.0.1``.
        master_port: a free TCP port on that host; default ``$MASTER_PORT``.
        timeout: seconds to wait for the other ranks, at startup and in each collective (default 60).
        config: JSON-serializable values that must be equal on all ranks, e.g.
            ``{"trace": fingerprint(trace), "minibatch_size": 32}``.

    Example (in every process of a job; not run as a doctest, it creates a process group)::

        init_distributed("gloo", rank=0, world_size=1, master_port=29512, timeout=5.0,
                         config={"trace": fingerprint([64, 128])})
    """
    world_size = check_int("world_size", _env_int("world_size", world_size, "WORLD_SIZE"), 1)
    rank = check_rank(_env_int("rank", rank, "RANK"), world_size)
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = check_int("master_port", _env_int("master_port", master_port, "MASTER_PORT"), 1)
    delta = datetime.timedelta(seconds=timeout)
    try:
        store: dist.Store = dist.TCPStore(
            addr, port, world_size=None, is_master=rank == 0, timeout=delta, wait_for_workers=False
        )
    except Exception as e:
        raise TimeoutError(
            f"torchfold: rank {rank} could not reach the rendezvous at {addr}:{port} within {timeout:g} s "
            f"(rank 0 hosts it; is it running, and is the port free?): {e}"
        ) from e
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is not None:
        store = dist.PrefixStore(_agent_store_prefix(restart, world_size), store)
    _handshake(store, rank, world_size, dict(config or {}), timeout)
    _import_group_defaults()
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=delta)
    _group_timeout_s["default"] = timeout


def check_same_on_all_ranks(config: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` on every rank unless all ranks pass equal ``config`` values.

    For process groups created elsewhere (e.g. by a launcher); :func:`init_distributed` already
    does this check. Bounded by the group's timeout. Nothing to check in a single process.

    Args:
        config: JSON-serializable values that must agree, e.g. ``{"trace": fingerprint(trace)}``.

    >>> check_same_on_all_ranks({"minibatch_size": 32})
    """
    if not _dist_active() or dist.get_world_size() == 1:
        return
    mine = json.loads(json.dumps(dict(config), sort_keys=True, default=str))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    problems = _mismatches(dict(enumerate(gathered)))
    if problems:
        raise ValueError(
            f"torchfold: ranks disagree (seen by rank {dist.get_rank()}): {'; '.join(problems)}. "
            f"Start every process with the same trace and configuration."
        )
