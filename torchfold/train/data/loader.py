"""A step loader: one item per optimizer step, minibatches built (folds recorded) in worker processes.

:class:`StepLoader` is a thin layer over ``torch.utils.data.DataLoader`` with PopTorch's batching
model. Each optimizer step has a global batch (``Step.batch_size``); the loader cuts it into
minibatches of ``minibatch_size`` samples, deals them to the ``num_replicas`` processes (minibatch ``j`` of a
step to rank ``j % num_replicas``, so a rank may get several, one or none) and yields, per
step, this rank's minibatches as one :class:`Step`. The global batch is either PopTorch's
constant ``minibatch_size * num_replicas * gradient_accumulation`` or, with ``trace=``, what a
:class:`~torchfold.train.BatchSizeTrace` says for that step. Either way the split is the one of
:class:`~torchfold.train.TraceBatchSampler` (the loader drives one), so ranks read disjoint samples of
one seeded permutation that changes with :meth:`StepLoader.set_epoch`.

With ``build``, every minibatch's items go through ``build(items) -> (FoldPlan, targets)`` in
``num_workers`` worker processes (recording and planning the folds there), ``prefetch_factor``
minibatches ahead per worker; the training process only applies plans. The loader owns its
position: :meth:`StepLoader.state_dict` (no arguments) resumes after the last step it handed
out, also with workers and read-ahead in flight (the read-ahead is simply built again).
"""

from __future__ import annotations

import copy
import dataclasses
import multiprocessing
import os
import pickle
import threading
import traceback
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, NoReturn, TypeVar

import numpy as np
import torch
import torch.utils.data

from torchfold._deprecation import RenamedAttribute, warn_renamed
from torchfold._errors import add_note
from torchfold._validate import check_int
from torchfold.engine.plan import FoldPlan
from torchfold.engine.static.shapes import StaticPlan, StaticShapesOverflow, StaticShapesWarning
from torchfold.train.data.envelope import seeded_pass
from torchfold.train.data.sampler import StepSplit, TraceBatchSampler
from torchfold.train.distributed.world import world_or
from torchfold.train.persample import SampleMinibatch
from torchfold.train.schedule.trace import TraceLike

__all__ = ["Minibatch", "Step", "StepLoader", "to_device"]

T = TypeVar("T")
R = TypeVar("R")

_STATE_VERSION = 1


@dataclass(frozen=True)
class Minibatch(Generic[R]):
    """One minibatch of a step: what ``build`` made of its items, how many samples, which ones.

    Args:
        data: ``build(items)`` (e.g. ``(plan, targets)``), or the list of items without ``build``.
        num_samples: how many samples it holds: give it to ``optimizer.minibatch(num_samples)``.
        indices: the dataset indices of its items.
        position: its number among the step's minibatches over all ranks (minibatch ``j`` is on
            rank ``j % num_replicas``); with a fixed ``minibatch_size`` it names the same
            samples on any number of ranks, so it can seed the minibatch's random draws. A
            minibatch split in parts (its plan did not fit a frozen envelope) keeps its position
            for the first part; part ``k`` gets ``position + k * num_minibatches`` (the step's
            planned count over all ranks), so positions stay unique and the same on any number of ranks.
    """

    data: R
    num_samples: int
    indices: list[int]
    position: int = 0


@dataclass(frozen=True)
class Step(Generic[R]):
    """This rank's minibatches of one optimizer step (possibly none), and how the step is split.

    Iterating a step gives its :class:`Minibatch` es; ``split`` says the step's global batch and
    how its minibatches are spread over the ranks.
    """

    split: StepSplit
    minibatches: tuple[Minibatch[R], ...]

    @property
    def plan(self) -> StepSplit:
        """Deprecated: :attr:`split` (a plan is a compiled fold)."""
        warn_renamed("Step.plan", "Step.split")
        return self.split

    def __iter__(self) -> Iterator[Minibatch[R]]:
        return iter(self.minibatches)

    def __len__(self) -> int:
        return len(self.minibatches)

    @property
    def step(self) -> int:
        """The global step index (counts across epochs)."""
        return self.split.step

    @property
    def batch_size(self) -> int:
        """The step's global batch size (over all ranks)."""
        return self.split.batch_size


def to_device(data: Any, device: torch.device) -> Any:
    """``data`` with its tensors and numpy arrays as tensors on ``device`` (tuples, lists, dicts walked).

    Copies are ``non_blocking``: nothing waits for the device. A :class:`FoldPlan` stays as it is;
    it materialises its arguments on the module's device when applied.

    >>> to_device((np.array([1, 2]), [torch.ones(1)], "label"), torch.device("cpu"))
    (tensor([1, 2]), [tensor([1.])], 'label')
    """
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=True)
    if isinstance(data, np.ndarray):
        return torch.from_numpy(data).to(device, non_blocking=True)
    if isinstance(data, tuple):
        parts = [to_device(part, device) for part in data]
        return type(data)(*parts) if hasattr(data, "_fields") else tuple(parts)  # a namedtuple keeps its type
    if isinstance(data, list):
        return [to_device(part, device) for part in data]
    if isinstance(data, dict):
        return {key: to_device(value, device) for key, value in data.items()}
    return data


def _portable(error: BaseException, message: str) -> BaseException:
    """``error`` if it survives pickling (so a worker can send it back), else one of its type with ``message``.

    A type that cannot be made from a message alone (or pickled) falls back to ``RuntimeError``.
    """
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        pass
    kind = type(error)
    try:
        clone = kind.__new__(kind, message)
        clone.args = (message,)
        pickle.loads(pickle.dumps(clone))
        str(clone)
        return clone
    except Exception:
        return RuntimeError(f"{kind.__name__}: {message}")


class _BuildFailure:
    """A failed minibatch, sent back as data: the exception itself reaches the training loop.

    DataLoader re-creates a worker's exception as ``type(message)``, which turns every exception
    whose constructor takes other arguments (UnicodeDecodeError, JSONDecodeError,
    CalledProcessError, most user exceptions) into a RuntimeError, and a StopIteration into the
    end of the iteration. A return value crosses unharmed.
    """

    def __init__(self, error: BaseException, where: str) -> None:
        self.error = error
        self.where = where

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled only to leave a worker: say so, with the worker's traceback (lost in the pickle).
        info = torch.utils.data.get_worker_info()
        worker = f" {info.id}" if info is not None else ""
        frames = "".join(traceback.format_tb(self.error.__traceback__)).rstrip()
        notes = [
            *getattr(self.error, "__notes__", []),
            f"Traceback in DataLoader worker process{worker} (most recent call last):\n{frames}",
        ]
        return (_BuildFailure._arrived, (_portable(self.error, str(self.error)), self.where, notes))

    @staticmethod
    def _arrived(error: BaseException, where: str, notes: list[str]) -> _BuildFailure:
        # Some exceptions pickle through their constructor's arguments only, dropping the notes.
        error.__notes__ = notes
        return _BuildFailure(error, where)

    def raise_it(self) -> NoReturn:
        if isinstance(self.error, StopIteration):
            # Raised as it is, it would end the loop over the steps as if the epoch were over.
            raise RuntimeError(
                f"build raised StopIteration for the minibatch of {self.where}; a StopIteration would end the "
                "training loop silently, so it is raised as this RuntimeError (the original is its __cause__)"
            ) from self.error
        raise self.error


# What a build may hold that cannot be copied, and is safe to share with its copy: the locks of
# its cache or its tokenizer (copy.deepcopy raises "cannot pickle '_thread.lock' object").
_LOCKS = (type(threading.Lock()), type(threading.RLock()))
# What copy.deepcopy shares rather than copies: a search for locks need not look inside them.
_ATOMIC = (type, types.FunctionType, types.BuiltinFunctionType, types.CodeType, weakref.ref, property)


class _Discard:
    def write(self, data: bytes) -> int:
        return len(data)


class _LockFinder(pickle.Pickler):
    """Walks an object as pickling would, collecting the locks it holds (not descending into them)."""

    def __init__(self) -> None:
        super().__init__(_Discard(), protocol=pickle.HIGHEST_PROTOCOL)
        self.locks: dict[int, Any] = {}  # by id: copy.deepcopy's memo

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _LOCKS):
            self.locks[id(obj)] = obj
            return id(obj)
        return 0 if isinstance(obj, _ATOMIC) else None


def _private_copy(build: Any) -> tuple[Any, Exception | None]:
    """A deep copy of ``build`` to build with and leave ``build``'s state as it is; its locks are
    shared, not copied. ``(None, why)`` when it cannot be copied even so.

    >>> class Cached:
    ...     def __init__(self):
    ...         self.lock, self.cache = threading.Lock(), {}
    >>> build = Cached()
    >>> clone, why = _private_copy(build)
    >>> clone.lock is build.lock, clone.cache is build.cache, why
    (True, False, None)
    """
    try:
        return copy.deepcopy(build), None
    except Exception as error:
        why = error
    try:
        finder = _LockFinder()
        finder.dump(build)
        if finder.locks:
            # copy.deepcopy takes what its memo holds for an object as its copy: the lock itself
            return copy.deepcopy(build, dict(finder.locks)), None
    except Exception as error:
        why = error
    return None, why


class _Builder(torch.utils.data.Dataset["Minibatch[Any] | tuple[Minibatch[Any], ...] | _BuildFailure"]):
    """What the workers run: ``dataset[i]`` for a minibatch's indices, then ``build`` on the items."""

    def __init__(self, dataset: Sequence[Any], build: Callable[[list[Any]], Any] | None) -> None:
        self.dataset = dataset
        self.build = build

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices: list[int]) -> Minibatch[Any] | tuple[Minibatch[Any], ...] | _BuildFailure:
        where = f"dataset indices {indices}" if len(indices) <= 64 else f"{len(indices)} dataset indices"
        try:
            return self._build(indices)
        except Exception as e:
            add_note(e, f"torchfold.train.StepLoader: while building the minibatch of {where}")
            return _BuildFailure(e, where)

    def _build(self, indices: list[int]) -> Minibatch[Any] | tuple[Minibatch[Any], ...]:
        items = [self.dataset[i] for i in indices]
        if self.build is None:
            return Minibatch(items, len(indices), list(indices))
        parts = self._fitted(indices, items)
        return parts[0] if len(parts) == 1 else tuple(parts)

    def _fitted(self, indices: list[int], items: list[Any]) -> list[Minibatch[Any]]:
        """``build(items)`` as one minibatch, or, when its plan does not fit a frozen envelope
        (:class:`~torchfold.StaticShapesOverflow`), as halves built the same way: the optimizer
        weighs each part by its samples, so the step is exactly the same, and no new graph is
        compiled. Only a sample that does not fit alone grows the envelope (one warning naming it)."""
        assert self.build is not None
        try:
            data = self.build(items)
        except StaticShapesOverflow as overflow:
            if len(items) > 1:
                half = (len(items) + 1) // 2
                return self._fitted(indices[:half], items[:half]) + self._fitted(indices[half:], items[half:])
            shapes = overflow.shapes
            warnings.warn(
                f"sample {indices[0]} of the dataset does not fit the frozen static shapes (version {shapes.version}) "
                "even alone, so they grow for it: expect one new compilation; fit the envelope on data that holds "
                "samples like it (torchfold.train.fit_static_shapes)",
                StaticShapesWarning,
                stacklevel=2,
            )
            frozen, shapes.frozen = shapes.frozen, False
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", StaticShapesWarning)  # said above, naming the sample
                    data = self.build(items)
            finally:
                shapes.frozen = frozen
        self._check(data, indices)
        return [Minibatch(data, len(indices), list(indices))]

    def _check(self, data: Any, indices: list[int]) -> None:
        if not (
            isinstance(data, tuple)
            and len(data) == 2
            and isinstance(data[0], FoldPlan | StaticPlan | SampleMinibatch)
        ):
            got = type(data).__name__
            if isinstance(data, tuple):
                got = f"a tuple of {len(data)} ({', '.join(type(part).__name__ for part in data)})"
            raise TypeError(
                f"build returned {got} for the minibatch of dataset indices {indices[:8]}"
                f"{'...' if len(indices) > 8 else ''}; it must return (FoldPlan or StaticPlan, targets), e.g. "
                "(fold.plan([nodes]), labels)"
            )


# Loaders that may own worker processes. A process forked from their owner (another loader's
# worker, a user's fork) inherits copies: there the workers are not its children, and a copy
# being collected must not try to stop them (DataLoader's iterator asserts, and says so on stderr).
_LOADERS: weakref.WeakSet[StepLoader[Any, Any]] = weakref.WeakSet()


def _disown_after_fork() -> None:
    for loader in list(_LOADERS):
        loader._closed = True
        iterator = getattr(loader._loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown"):
            iterator._shutdown = True  # DataLoader's own flag: nothing left to stop in this process


os.register_at_fork(after_in_child=_disown_after_fork)


def _first(batch: Minibatch[Any]) -> Minibatch[Any]:
    return batch  # collate_fn: a minibatch is already whole (module level: spawn pickles it)


class StepLoader(Generic[T, R]):
    """Yield one :class:`Step` per optimizer step: this rank's minibatches of that step, built ahead.

    The loop stays ordinary (``optimizer`` an :class:`~torchfold.train.AccumulatingOptimizer`)::

        for epoch in range(epochs):
            loader.set_epoch(epoch)
            for step in loader:
                for mb in step:                          # may be none on some ranks
                    plan, targets = mb.data
                    with optimizer.minibatch(mb.num_samples):
                        loss_fn(model, plan.apply(model), targets).backward()
                optimizer.step()                         # every rank, every step
                optimizer.zero_grad()

    Args:
        dataset: the items (indexable, with ``len()``), e.g. a list of trees.
        minibatch_size: samples per minibatch on one replica (PopTorch's ``batch_size``; default 1,
            unless ``max_device_batch_size`` is given). A step's global batch is
            :attr:`Step.batch_size`.
        build: ``build(items) -> (FoldPlan, targets)``, run for each minibatch in the workers
            (record the items on a ``Fold`` and return ``fold.plan(...)`` and the targets, numpy
            preferred). ``None`` (default): a minibatch is the list of its items. A minibatch
            whose plan does not fit a frozen :class:`~torchfold.StaticShapes` envelope (the
            build raises :class:`~torchfold.StaticShapesOverflow`; see
            :func:`~torchfold.train.fit_static_shapes`) is built again as halves, until each
            fits: the step then holds more minibatches (:attr:`Step.split` counts them), and
            the same samples, so the optimizer's step is the same.
        trace: the global batch size of every step (a :class:`~torchfold.train.BatchSizeTrace`, a
            list or an int, or a string as the command line's ``--trace`` takes: a ``step,batchsize``
            CSV path, ``"32,64,96"``, ``"linear:32:256:1000"``; see :func:`~torchfold.train.as_trace`);
            every size a multiple of ``minibatch_size``. ``None`` (default): PopTorch's constant
            ``minibatch_size * num_replicas * gradient_accumulation``.
        device_iterations: PopTorch's optimizer steps per host step (default 1). The loader hands
            out one step at a time, so it only enters :attr:`combined_batch_size` and its check.
        num_replicas: processes (replicas) sharing each step (PopTorch's ``replication_factor``;
            default: this run's,
            :func:`~torchfold.train.world`: the ``torch.distributed`` group's, torch_xla's
            replicas, else 1); each reads a disjoint part of every step.
        gradient_accumulation: minibatches per replica per step (default 1; without ``trace``).
        rank: this process (default: this run's, :func:`~torchfold.train.world`).
        shuffle: a new seeded permutation every epoch (default ``True``), the same on every rank.
        seed: the permutation's seed, the same on every rank (default 0).
        drop_last: ``False`` (default): the samples left at the end of an epoch make a last,
            smaller step (short minibatches, some ranks maybe idle). ``True``: they are left out
            of that epoch (:attr:`dropped_samples` says how many).
        num_workers: worker processes that build minibatches (default 0: in this process, when
            asked). With workers, building runs ahead of training.
        prefetch_factor: minibatches each worker builds ahead (default 2; needs workers).
        multiprocessing_context: ``"spawn"``, ``"forkserver"``, ``"fork"`` or a context (default:
            Python's). Under ``spawn``, ``build`` and the dataset are pickled to the workers and the
            training script must guard its entry point with ``if __name__ == "__main__":``.
        worker_init_fn: called in each worker with its id at start (e.g. ``gc.freeze()``).
        timeout: seconds to wait for a worker's minibatch before raising (default 0: no limit).
        device: move each minibatch's tensors and numpy arrays there, without blocking (default:
            leave them where they are).
        max_device_batch_size: instead of ``minibatch_size``, for elastic training: the most samples
            one replica processes at once (AIkit's maximum GPU batch size). Each step's global
            batch (``trace`` is then required) is cut into as few minibatches per replica as
            that allows, so the accumulation follows the number of replicas present (see
            :class:`~torchfold.train.ElasticConfig`).
        max_accumulation_steps: with ``max_device_batch_size``: refuse a trace whose global batch
            needs more minibatches per replica than this (default: no limit).
        batch_size: deprecated keyword for ``minibatch_size`` (emits a ``FutureWarning``).
        replication_factor: deprecated keyword for ``num_replicas`` (emits a ``FutureWarning``).

    Every ``iter()`` is a pass, as with a ``DataLoader``: it goes on from the last step handed out
    (:attr:`next_step`), to the end of the current epoch; once an epoch has been handed out
    completely, the next ``iter()`` starts the next epoch (as ``set_epoch(epoch + 1)`` would), so a
    loop without ``set_epoch`` trains every epoch too. An iteration left early (``break``) is
    continued by the next ``iter()``. A bounded trace whose steps have all been handed out raises
    ``ValueError`` at the next ``iter()``.

    Worker processes start with the first iteration and stay for the next ones (no start-up cost
    per epoch or resume); an iteration left early (``break``) simply drops what they built ahead.
    :meth:`close` (or leaving a ``with`` block, or the loader being garbage-collected) stops them.

    Raises:
        TypeError / ValueError: bad arguments, before any worker starts; worker errors are raised
            in the training loop with the worker's traceback and the failing dataset indices.

    Example (101 items in minibatches of 6: 16 full steps and one of 5; with ``drop_last`` those
    5 wait for the next epoch's permutation):

    >>> loader = StepLoader(list(range(101)), minibatch_size=6, shuffle=False)
    >>> len(loader), loader.combined_batch_size
    (17, 6)
    >>> steps = list(loader)
    >>> [len(mb.data) for step in steps[-2:] for mb in step]
    [6, 5]
    >>> StepLoader(list(range(101)), minibatch_size=6, drop_last=True).dropped_samples
    5
    >>> ranks = [StepLoader(list(range(10)), 2, trace=[4, 4, 2], num_replicas=2, rank=r, shuffle=False)
    ...          for r in range(2)]
    >>> [[mb.indices for mb in step] for step in ranks[1]]  # rank 0 has the last step alone
    [[[2, 3]], [[6, 7]], []]
    >>> elastic = StepLoader(list(range(48)), trace=48, max_device_batch_size=8, shuffle=False)
    >>> [mb.num_samples for mb in next(iter(elastic))]  # one replica: 6 minibatches of at most 8
    [8, 8, 8, 8, 8, 8]
    """

    def __init__(
        self,
        dataset: Sequence[T],
        minibatch_size: int | None = None,
        *,
        build: Callable[[list[T]], R] | None = None,
        trace: TraceLike | None = None,
        device_iterations: int = 1,
        num_replicas: int | None = None,
        gradient_accumulation: int = 1,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_workers: int = 0,
        prefetch_factor: int | None = None,
        multiprocessing_context: str | Any = None,
        worker_init_fn: Callable[[int], None] | None = None,
        timeout: float = 0,
        device: torch.device | str | None = None,
        max_device_batch_size: int | None = None,
        max_accumulation_steps: int | None = None,
        batch_size: int | None = None,
        replication_factor: int | None = None,
    ) -> None:
        if replication_factor is not None:
            if num_replicas is not None:
                raise TypeError(
                    f"give num_replicas={num_replicas}, not also the deprecated replication_factor="
                    f"{replication_factor} (its old name)"
                )
            warnings.warn(
                "StepLoader(replication_factor=) is deprecated; use num_replicas= (processes sharing each step)",
                FutureWarning,
                stacklevel=2,
            )
            num_replicas = replication_factor
        if batch_size is not None:
            if minibatch_size is not None:
                raise TypeError(
                    f"give minibatch_size={minibatch_size}, not also the deprecated batch_size={batch_size} (its old name)"
                )
            warnings.warn(
                "StepLoader(batch_size=) is deprecated; use minibatch_size= (samples per minibatch on one replica)",
                FutureWarning,
                stacklevel=2,
            )
            minibatch_size = batch_size
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise TypeError(
                f"dataset must be indexable and have len() (a list, a map-style Dataset), got {type(dataset).__name__}"
            )
        if max_device_batch_size is not None:
            if minibatch_size is not None:
                raise TypeError(
                    f"give minibatch_size={minibatch_size} (a fixed minibatch size) or max_device_batch_size="
                    f"{max_device_batch_size} (minibatches fitted to the replicas present), not both"
                )
            if trace is None:
                raise ValueError(
                    "max_device_batch_size needs trace= (the global batch of every step, an int for a constant one): "
                    "the minibatches are cut from it"
                )
        elif minibatch_size is None:
            minibatch_size = 1
        else:
            check_int("minibatch_size", minibatch_size)
        check_int("device_iterations", device_iterations)
        check_int("gradient_accumulation", gradient_accumulation)
        # One rule for both, so they cannot come from different places (XLA's size, rank 0).
        num_replicas, rank = world_or(num_replicas, rank)
        check_int("num_replicas", num_replicas)
        check_int("num_workers", num_workers, minimum=0)
        if prefetch_factor is not None:
            check_int("prefetch_factor", prefetch_factor)
            if num_workers == 0:
                raise ValueError(
                    f"prefetch_factor={prefetch_factor} needs worker processes to build ahead; pass num_workers >= 1 "
                    "or leave prefetch_factor=None"
                )
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 0:
            raise ValueError(f"timeout must be a number of seconds >= 0 (0: no limit), got {timeout!r}")
        if timeout and num_workers == 0:
            raise ValueError(
                f"timeout={timeout!r} bounds the wait for a worker process's minibatch, and num_workers=0 starts "
                "none; pass num_workers >= 1 or leave timeout=0"
            )
        if build is not None and not callable(build):
            raise TypeError(f"build must be callable as build(items) -> (FoldPlan, targets), got {build!r}")
        if trace is not None and gradient_accumulation != 1:
            raise ValueError(
                f"gradient_accumulation={gradient_accumulation} with a trace: the trace sets every step's global "
                "batch, and so its minibatches; leave gradient_accumulation=1"
            )
        if len(dataset) == 0:
            raise ValueError("dataset is empty; a loader needs at least one item")
        self.combined_batch_size: int | None = None
        if trace is None:
            assert minibatch_size is not None
            self.combined_batch_size = (
                minibatch_size * device_iterations * num_replicas * gradient_accumulation
            )
            if self.combined_batch_size > len(dataset):
                raise ValueError(
                    f"the combined batch size minibatch_size * device_iterations * num_replicas * "
                    f"gradient_accumulation = {minibatch_size} * {device_iterations} * {num_replicas} * "
                    f"{gradient_accumulation} = {self.combined_batch_size} is larger than the dataset "
                    f"({len(dataset)} items); lower one of them"
                )
            trace = minibatch_size * num_replicas * gradient_accumulation
        try:
            self.sampler = TraceBatchSampler(
                len(dataset),
                trace,
                minibatch_size=minibatch_size,
                num_replicas=num_replicas,
                rank=rank,
                shuffle=shuffle,
                seed=seed,
                drop_last=drop_last,
                max_device_batch_size=max_device_batch_size,
                max_accumulation_steps=max_accumulation_steps,
            )
        except ValueError as e:
            if "minibatch_size" in str(e):
                add_note(
                    e,
                    f"torchfold.train.StepLoader: minibatch_size={minibatch_size} (samples per minibatch on one replica)",
                )
            raise
        if num_workers and build is not None:
            method: str = (
                multiprocessing.get_start_method()
                if multiprocessing_context is None
                else multiprocessing_context
                if isinstance(multiprocessing_context, str)
                else multiprocessing_context.get_start_method()
            )
            if method != "fork":
                try:
                    pickle.dumps(build)
                except Exception as e:
                    raise TypeError(
                        f"build {build!r} cannot be pickled for {method!r} worker processes ({e}); define it at "
                        "module level (or as an instance of a module-level class), not as a lambda or a local function"
                    ) from e
        # The split settings (minibatch_size, max_device_batch_size, num_replicas, rank) are the
        # sampler's: read through properties, never kept twice.
        self.dataset = dataset
        self.build = build
        self.device_iterations = device_iterations
        self.gradient_accumulation = gradient_accumulation
        self.num_workers = num_workers
        self.device = torch.device(device) if device is not None else None
        self._loader = torch.utils.data.DataLoader(
            _Builder(dataset, build),
            batch_size=None,
            sampler=self.sampler,
            collate_fn=_first,  # type: ignore[arg-type]
            num_workers=num_workers,
            prefetch_factor=prefetch_factor if num_workers else None,
            persistent_workers=num_workers > 0,  # no start-up cost per epoch or resume (spawn: seconds)
            multiprocessing_context=multiprocessing_context if num_workers else None,
            worker_init_fn=worker_init_fn,
            timeout=timeout,
            # DataLoader draws its workers' base seed at every iter(): from its own generator, not
            # torch's global one, which the training loop's dropout must find where a resume left it.
            generator=torch.Generator().manual_seed(seed),
        )
        self._next_step = self.sampler.epoch_steps.first_step
        self._generation = 0  # bumped by every iter(): an older iteration may not go on
        self._closed = False
        # A worker process (fork) inherits this object: only the process that made it stops its workers.
        self._owner_pid = os.getpid()
        if num_workers:
            _LOADERS.add(self)

    # -- the split (the sampler's) -------------------------------------------------------------------

    @property
    def minibatch_size(self) -> int | None:
        """Samples per minibatch on one replica (the sampler's); ``None`` with ``max_device_batch_size``."""
        return self.sampler.minibatch_size

    batch_size = RenamedAttribute("minibatch_size", "samples per minibatch on one replica")

    @property
    def max_device_batch_size(self) -> int | None:
        """The most samples one replica processes at once, or ``None`` with a fixed ``minibatch_size``."""
        return self.sampler.max_device_batch_size

    @property
    def num_replicas(self) -> int:
        """Processes (replicas) sharing each step (the sampler's)."""
        return self.sampler.num_replicas

    replication_factor = RenamedAttribute("num_replicas", "processes sharing each step")

    @property
    def rank(self) -> int:
        """This process's rank among the ``num_replicas`` ones."""
        return self.sampler.rank

    # -- position --------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self.sampler.epoch

    @property
    def next_step(self) -> int:
        """The global step the next ``iter()`` starts at (after the last step handed out)."""
        return self._next_step

    @property
    def num_epochs(self) -> int | None:
        """Epochs to train: the trace's complete ones, or its one truncated epoch (``None``: unbounded, as PopTorch's constant)."""
        return self.sampler.num_epochs if self.sampler.trace.num_steps is not None else None

    @property
    def dropped_samples(self) -> int:
        """Samples left out of the current epoch (only with ``drop_last=True``)."""
        return len(self.dataset) - self.sampler.epoch_steps.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: its permutation (``seed + epoch``) and its steps.

        Optional in a loop that runs every epoch to its end: once an epoch has been handed out
        completely, the next ``iter()`` starts the next epoch with its own permutation (as
        ``set_epoch(epoch + 1)`` would). Call it to choose the epoch yourself (to skip or repeat
        one), with the same value on every rank. Setting the current epoch again changes nothing,
        so after :meth:`load_state_dict`, calling it with the resumed epoch keeps the mid-epoch
        position; setting another epoch starts that epoch from its first step.
        """
        if epoch != self.sampler.epoch:
            self.sampler.set_epoch(epoch)
            self._next_step = self.sampler.epoch_steps.first_step
            self._generation += 1

    def steps(self) -> list[StepSplit]:
        """The splits of the steps the next ``iter()`` yields.

        The rest of the current epoch from :attr:`next_step`; the whole next epoch when the
        current one has been handed out completely.
        """
        if self._epoch_done():
            return self.sampler.step_splits(self.sampler.epoch + 1)
        self._anchor()
        return self.sampler.steps()

    def layout_examples(self, *, max_minibatches: int | None = None, seed: int = 0) -> list[Minibatch[R]]:
        """One minibatch of each static-shape layout that a pass over the dataset makes: what a
        runner compiles its programs on before training needs them (a warm-up).

        The pass is :func:`~torchfold.train.data.envelope.seeded_pass`, the one an envelope is fitted
        to, in minibatches of the loader's size (``minibatch_size``, or ``max_device_batch_size``),
        built here, in this process, with a deep copy of ``build`` (the envelope and its counters
        stay as they are; the locks the build holds, of a cache or a tokenizer, are shared with the
        copy); a minibatch that does not fit a frozen envelope is split as in training. Builds that
        make no :class:`~torchfold.StaticPlan` have no layout: the list is then empty; so is it,
        with a warning saying why, for a build that cannot be copied.

        Args:
            max_minibatches: build at most this many minibatches (default: the whole pass).
            seed: the permutation's seed.

        Example:
            >>> import torchfold
            >>> from torchfold.examples.datasets import Vocab, generate_sst
            >>> from torchfold.examples.models import TreeLSTMBuild, tree_lstm_shapes
            >>> trees = generate_sst(40, seed=0)
            >>> vocab = Vocab.build(trees)
            >>> shapes = tree_lstm_shapes(trees, vocab, 8)
            >>> loader = StepLoader(trees, 8, build=TreeLSTMBuild(vocab, shapes=shapes), trace=[16])
            >>> examples = loader.layout_examples()
            >>> len({example.data[0].layout.key for example in examples}) == len(examples) >= 1
            True
        """
        check_int("layout_examples(max_minibatches)", max_minibatches, optional=True)
        if self.build is None:
            return []
        size = self.minibatch_size or self.max_device_batch_size or 1
        # NOTE: a copy, so that building here leaves the build (its envelope, growing or frozen,
        # and its counters) as training left it: training is the same with or without a warm-up,
        # and the layouts stay those of the workers' copies
        build, why = _private_copy(self.build)
        if build is None:
            name = type(self.build).__name__
            warnings.warn(
                f"StepLoader.layout_examples: no examples, so each layout's programs compile when training first "
                f"meets it: the build ({name}) cannot be copied ({type(why).__name__}: {why}), and its examples "
                f"are built with a copy, to leave the build's state (its StaticShapes envelope) as training left "
                f"it. Give {name} a __deepcopy__ that shares what cannot be copied to warm up",
                stacklevel=2,
            )
            return []
        builder = _Builder(self.dataset, build)
        found: dict[Any, Minibatch[R]] = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StaticShapesWarning)  # training says it, for its own minibatch
            for indices in seeded_pass(len(self.dataset), size, seed, max_minibatches):
                built = builder._build(indices)
                for part in built if isinstance(built, tuple) else (built,):
                    plan = part.data[0] if isinstance(part.data, tuple) and part.data else None
                    if isinstance(plan, StaticPlan):
                        found.setdefault(plan.layout.key, part)
        return list(found.values())

    def __len__(self) -> int:
        """Steps the next ``iter()`` yields (see :meth:`steps`)."""
        return len(self.steps())

    def _epoch_done(self) -> bool:
        return self._next_step >= self.sampler.epoch_steps.end_step

    def _anchor(self) -> None:
        self.sampler.seek(self._next_step)

    def state_dict(self) -> dict[str, Any]:
        """The position after the last step handed out, and the settings it is only valid with.

        The same on every rank (rank 0 may save it for all); ints, bools and strings only
        (``torch.load(weights_only=True)`` reads it).
        """
        self._anchor()  # the sampler has read ahead for the workers: our position is the one handed out
        return {"version": _STATE_VERSION, "sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the position saved by :meth:`state_dict` (mid-epoch too); an iteration in progress ends.

        The state may come from a run with another ``num_replicas``: a step holds the same
        samples whatever the number of replicas.

        Raises:
            ValueError: the state was saved with another trace, dataset size, batch size,
                per-device maximum, seed, shuffle or drop_last.
        """
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION or "sampler" not in state:
            raise ValueError(
                f"state must come from StepLoader.state_dict() (version {_STATE_VERSION}, with 'sampler'), got "
                f"{sorted(state) if isinstance(state, dict) else type(state).__name__}"
            )
        self.sampler.load_state_dict(state["sampler"])
        self._next_step = int(state["sampler"]["next_step"])
        self._generation += 1

    # -- iterating -------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Step[R]]:
        if self._closed:
            raise RuntimeError("the StepLoader is closed; make a new one")
        if self._epoch_done():
            # Every iter() is a pass: after a complete epoch, the next one (as set_epoch(epoch + 1)),
            # so `for epoch in ...: for step in loader:` trains every epoch, and a resume from a
            # state saved at an epoch's end goes on exactly as the run that saved it.
            self._next_epoch()
        self._generation += 1
        generation = self._generation
        self._anchor()  # at our position: an abandoned iteration's read-ahead is simply dropped
        splits = self.sampler.steps()
        return self._steps(splits, generation)

    def _next_epoch(self) -> None:
        trace, epoch = self.sampler.trace, self.sampler.epoch
        if trace.num_steps is not None and self._next_step >= trace.num_steps:
            raise ValueError(
                f"the StepLoader has handed out every step of its trace {trace.source!r} ({trace.num_steps} steps, "
                f"the last in epoch {epoch}); iterating it again needs a longer trace, or load_state_dict() / "
                "set_epoch() to go back"
            )
        self.set_epoch(epoch + 1)

    def _steps(self, splits: list[StepSplit], generation: int) -> Iterator[Step[R]]:
        if not splits:
            return
        batches = iter(self._loader)
        for split in splits:
            if self._generation != generation or self._closed:
                raise RuntimeError(
                    "this StepLoader iteration was superseded (a new iter(), set_epoch(), load_state_dict() or "
                    "close()); iterate the loader again"
                )
            minibatches = []
            for i in range(split.local_minibatches):
                got: Minibatch[Any] | tuple[Minibatch[Any], ...] | _BuildFailure = next(batches)
                if isinstance(got, _BuildFailure):
                    got.raise_it()
                position = i * self.num_replicas + self.rank
                for part, minibatch in enumerate(got if isinstance(got, tuple) else (got,)):
                    # the parts of a split minibatch: positions past the step's planned ones
                    minibatch = dataclasses.replace(
                        minibatch, position=position + part * split.num_minibatches
                    )
                    if self.device is not None:
                        minibatch = dataclasses.replace(
                            minibatch, data=to_device(minibatch.data, self.device)
                        )
                    minibatches.append(minibatch)
            if len(minibatches) != split.local_minibatches:
                # Split minibatches: count the ones that run. (A rank knows its own splits only: the
                # other ranks' counts stay as planned.)
                counts = list(split.minibatches)
                counts[split.rank] = len(minibatches)
                split = dataclasses.replace(split, minibatches=tuple(counts))
            self._next_step = split.step + 1
            yield Step(split, tuple(minibatches))

    # -- shutting down ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the worker processes and drop what they built ahead (safe to call more than once)."""
        self._closed = True
        if os.getpid() != self._owner_pid:
            return  # a copy in another process (a forked worker's): the workers are not its children
        iterator = getattr(self._loader, "_iterator", None)
        if iterator is not None:
            # DataLoader keeps persistent workers in its iterator; this is how it stops them itself.
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            self._loader._iterator = None

    def __enter__(self) -> StepLoader[T, R]:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()

    def __repr__(self) -> str:
        how = (
            f"combined_batch_size={self.combined_batch_size}"
            if self.combined_batch_size is not None
            else f"trace={self.sampler.trace.source!r}"
        )
        size = (
            f"minibatch_size={self.minibatch_size}"
            if self.max_device_batch_size is None
            else f"max_device_batch_size={self.max_device_batch_size}"
        )
        return (
            f"StepLoader({len(self.dataset)} items, {size}, {how}, "
            f"rank {self.rank} of {self.num_replicas}, num_workers={self.num_workers})"
        )
