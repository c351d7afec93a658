"""A distributed batch sampler whose global batch size follows a :class:`~torchfold.train.BatchSizeTrace`.

:class:`TraceBatchSampler` is a ``Sampler[list[int]]`` for ``DataLoader(batch_sampler=...)``. Each
optimizer step ``s`` of the trace takes the next ``trace[s]`` indices of the epoch's permutation
(shared by all ranks: seeded with ``seed + epoch``) and cuts them into minibatches of
``minibatch_size``. Minibatch ``j`` of a step goes to rank ``j % num_replicas``, so a rank gets
``ceil((k - rank) / num_replicas)`` of the step's ``k`` minibatches: several (it accumulates
gradients over them), one, or none.

A rank never receives a fake minibatch for a step in which it has none (repeating a sample would
skew BatchNorm statistics and the gradient). Instead the sampler simply yields nothing for that
step (so the default ``DataLoader`` collation never sees an empty batch), and says so in its
**step splits**: :meth:`TraceBatchSampler.steps` lists, for every step the next ``iter()`` covers, a
:class:`StepSplit` with ``num_minibatches`` (over all ranks), ``local_minibatches`` (this rank's,
possibly 0), ``minibatches`` (per rank), ``batch_size`` and ``local_samples``. The training loop
walks the splits, draws ``split.local_minibatches`` batches from the loader for each step, and then
ends the step on every rank, so that a rank without data still joins the gradient all-reduce
(with zero gradients). With torchfold's ``AccumulatingOptimizer``::

    sampler = TraceBatchSampler(dataset, "trace.csv", minibatch_size=32)
    loader = DataLoader(dataset, batch_sampler=sampler)
    for epoch in range(sampler.num_epochs):
        sampler.set_epoch(epoch)
        batches = iter(loader)
        for split in sampler.steps():
            for _ in range(split.local_minibatches):     # may be 0 on some ranks
                x, y = next(batches)
                optimizer.backward(loss_fn(model(x), y), num_samples=len(y))
            optimizer.step()                             # every rank, every step
            optimizer.zero_grad()
            if split.step % 100 == 99:
                sampler.seek(split.step + 1)               # the DataLoader may have read ahead
                save(sampler.state_dict(), ...)

Epochs follow :meth:`BatchSizeTrace.epoch`: the step counter is global across epochs, a step
never crosses an epoch boundary, and ``drop_last`` says what happens to the samples that do not
fill the epoch's last step (a final smaller step, or left out with the step moving to the next
epoch). Only the last step of an epoch (``drop_last=False``) can have a minibatch shorter than
``minibatch_size``.

**A per-device maximum instead of a minibatch size** (``max_device_batch_size=``, Run:AI AIkit's
elastic rule): each step's global batch is cut into the minibatches
:meth:`ElasticConfig.minibatch_sizes <torchfold.train.ElasticConfig.minibatch_sizes>` gives for the
ranks present, ``ceil(batch / (num_replicas * max))`` per rank, as even as possible and never
above the maximum. So the accumulation follows the number of ranks (global 256, maximum 64: 4
minibatches on 1 rank, 2 each on 2, 1 each on 4), and the trace's sizes need not be multiples of
anything.

**World-size invariance.** A step's samples are the next ``trace[s]`` of the shared permutation,
whatever the number of ranks: only how they are cut and dealt depends on ``num_replicas``. With a
fixed ``minibatch_size`` even the minibatches are the same (minibatch ``j`` of a step holds the
same samples on 1 rank or 8). So ``state_dict()`` / ``load_state_dict()`` resume
exactly mid-epoch, on the same number of ranks or another one. The state does not depend on the
rank, so one rank can save it for all.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Sampler

from torchfold._deprecation import warn_renamed
from torchfold._validate import SEED_MAX, check_int
from torchfold.train.distributed.elastic import ElasticConfig
from torchfold.train.distributed.world import check_rank, world_or
from torchfold.train.schedule.trace import BatchSizeTrace, EpochSteps, TraceLike, as_trace

__all__ = ["StepSplit", "TraceBatchSampler", "TraceMismatch", "minibatches_per_rank"]

_STATE_VERSION = 1
# Settings a saved position is only valid with. The number of ranks is not one of them: a step
# holds the same samples on any number (see the module docstring).
_OPTIONAL_SETTINGS = {"max_device_batch_size": None, "max_accumulation_steps": None}


class TraceMismatch(ValueError):
    """A saved position whose steps taken are not the first steps of this run's trace.

    Attributes:
        source: what holds the position (``"sampler state"``, a checkpoint file).
        taken: the steps the position has taken.
        step: the first of them that differs.
        saved: its batch size there.
        here: its batch size in this run's trace, ``None`` where that trace has ended.
        trace: this run's trace (its source: a file name, a spec).
    """

    def __init__(
        self, source: str, taken: int, step: int, saved: int, here: int | None, *, trace: str
    ) -> None:
        self.source, self.taken, self.step, self.saved, self.here, self.trace = (
            source,
            taken,
            step,
            saved,
            here,
            trace,
        )
        differs = (
            f"trace {trace!r} has only {step} steps"
            if here is None
            else f"its step {step} had batch size {saved}, and trace {trace!r} has {here} there"
        )
        super().__init__(
            f"{source} has taken {taken} steps of another trace: {differs}; resume with a trace whose first "
            f"{taken} steps are the ones taken (it may go on longer), or start afresh"
        )

    def from_source(self, source: str) -> TraceMismatch:
        """The same difference, held by ``source`` (e.g. ``"checkpoint ck/step-8.pt"``)."""
        return TraceMismatch(source, self.taken, self.step, self.saved, self.here, trace=self.trace)


def minibatches_per_rank(batch_size: int, minibatch_size: int, num_replicas: int) -> tuple[int, ...]:
    """How many minibatches each rank gets in a step of ``batch_size`` samples.

    Minibatch ``j`` goes to rank ``j % num_replicas``; the last minibatch may be short.

    >>> minibatches_per_rank(96, 32, 2)
    (2, 1)
    >>> minibatches_per_rank(32, 32, 4)
    (1, 0, 0, 0)
    """
    for name, value in (
        ("batch_size", batch_size),
        ("minibatch_size", minibatch_size),
        ("num_replicas", num_replicas),
    ):
        check_int(name, value)
    k = -(-batch_size // minibatch_size)
    return tuple(max(0, -(-(k - rank) // num_replicas)) for rank in range(num_replicas))


@dataclass(frozen=True)
class StepSplit:
    """How one optimizer step is split across ranks: its global batch and each rank's minibatches.

    (Formerly ``StepPlan``: in torchfold a *plan* is a compiled fold, :class:`~torchfold.FoldPlan`.)

    Args:
        step: global step index into the trace (counts across epochs).
        epoch: the epoch the step belongs to.
        batch_size: global number of samples in the step (the trace's, or fewer for the final
            step of an epoch with ``drop_last=False``).
        rank: the rank this split was made for.
        minibatches: number of minibatches of each rank in this step.
        local_samples: number of samples in this rank's minibatches.
    """

    step: int
    epoch: int
    batch_size: int
    rank: int
    minibatches: tuple[int, ...]
    local_samples: int

    @property
    def num_minibatches(self) -> int:
        """Minibatches in the step over all ranks (what gradients are averaged over)."""
        return sum(self.minibatches)

    @property
    def local_minibatches(self) -> int:
        """Minibatches this rank processes (and accumulates) in the step; may be 0."""
        return self.minibatches[self.rank]


class TraceBatchSampler(Sampler[list[int]]):
    """Yield this rank's minibatches of dataset indices, step by step as a batch-size trace says.

    Args:
        dataset: the dataset (anything with ``len()``) or its number of samples.
        trace: the global batch size of every step: a :class:`BatchSizeTrace`, a list of ints, an
            int (constant), or a string as the command line's ``--trace`` takes (a ``step,batchsize``
            CSV path, ``"32,64,96"``, ``"linear:32:256:1000"``: :func:`~torchfold.train.as_trace`).
        minibatch_size: samples per minibatch (per forward pass on one rank); every batch size in
            the trace must be a multiple of it (except an epoch's last step). Give it or
            ``max_device_batch_size``.
        num_replicas: number of ranks (default: this run's, :func:`~torchfold.train.world`: the
            ``torch.distributed`` group's, torch_xla's, else 1).
        rank: this rank (default: this run's, :func:`~torchfold.train.world`).
        shuffle: draw a random permutation each epoch (``True``) or go in index order.
        seed: random seed; must be the same on every rank.
        drop_last: what to do with samples that do not fill an epoch's last step (see
            :meth:`BatchSizeTrace.epoch`): ``False`` runs them as a final smaller step, ``True``
            leaves them out of this epoch.
        max_device_batch_size: instead of ``minibatch_size``: the most samples one rank processes
            at once; each step is cut into as few minibatches per rank as that allows (see
            :class:`~torchfold.train.ElasticConfig`).
        max_accumulation_steps: with ``max_device_batch_size``, refuse a trace whose global batch
            needs more minibatches per rank than this on ``num_replicas`` ranks (default: no limit).

    >>> sampler = TraceBatchSampler(10, [4, 4, 8, 6, 4], minibatch_size=2, num_replicas=2, rank=1, shuffle=False)
    >>> list(sampler)  # steps of 4, 4 and the 2 samples left: rank 1 has nothing in the last one
    [[2, 3], [6, 7]]
    >>> [(p.step, p.batch_size, p.num_minibatches, p.local_minibatches) for p in sampler.steps()]
    [(0, 4, 2, 1), (1, 4, 2, 1), (2, 2, 1, 0)]
    >>> sampler.set_epoch(1)
    >>> list(sampler), [p.batch_size for p in sampler.steps()]
    ([[2, 3], [8, 9]], [6, 4])
    >>> elastic = TraceBatchSampler(10, [10], max_device_batch_size=3, num_replicas=2, shuffle=False)
    >>> elastic.steps()[0].minibatches, list(elastic)  # 10 = 3 + 3 + 2 + 2: rank 0 gets slots 0 and 2
    ((2, 2), [[0, 1, 2], [6, 7]])
    """

    def __init__(
        self,
        dataset: Sized | int,
        trace: TraceLike,
        minibatch_size: int | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        max_device_batch_size: int | None = None,
        max_accumulation_steps: int | None = None,
    ) -> None:
        if isinstance(dataset, bool):
            raise TypeError(f"dataset should be a dataset with len() or its size as an int, got {dataset!r}")
        if isinstance(dataset, int):
            dataset_size = dataset
        elif isinstance(dataset, Sized):
            dataset_size = len(dataset)
        else:
            raise TypeError(
                f"dataset should be a dataset with len() or its size as an int, got {type(dataset).__name__}"
            )
        if dataset_size <= 0:
            raise ValueError(f"dataset size should be a positive integer, got {dataset_size}")
        if (minibatch_size is None) == (max_device_batch_size is None):
            raise TypeError(
                "give either minibatch_size (samples per minibatch) or max_device_batch_size (the most samples "
                f"per rank at once), not {'both' if minibatch_size is not None else 'neither'}"
            )
        if minibatch_size is not None:
            check_int("minibatch_size", minibatch_size)
            if max_accumulation_steps is not None:
                raise TypeError(
                    "max_accumulation_steps goes with max_device_batch_size, not with minibatch_size"
                )
        else:
            check_int("max_device_batch_size", max_device_batch_size)
        if max_accumulation_steps is not None:
            check_int("max_accumulation_steps", max_accumulation_steps)
        num_replicas, rank = world_or(num_replicas, rank)
        check_int("num_replicas", num_replicas)
        check_rank(rank, num_replicas)
        for name, flag in (("shuffle", shuffle), ("drop_last", drop_last)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} should be a bool, got {type(flag).__name__} {flag!r}")
        check_int("seed", seed, minimum=0)
        if seed > SEED_MAX:  # torch's generators take a signed 64-bit seed, and the epoch is added to it
            raise ValueError(f"seed must be an int from 0 to 2**63 - 1 ({SEED_MAX}), got {seed}")
        self.trace: BatchSizeTrace = as_trace(trace)
        if minibatch_size is not None:
            self.trace.check_minibatch_size(minibatch_size)
        self.dataset_size = dataset_size
        self.minibatch_size = minibatch_size
        self.max_device_batch_size = max_device_batch_size
        self.max_accumulation_steps = max_accumulation_steps
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        if max_accumulation_steps is not None and max_device_batch_size is not None:
            sizes = self.trace.batch_sizes if self.trace.num_steps is not None else (self.trace[0],)
            first_steps = {size: step for step, size in reversed(list(enumerate(sizes)))}
            for size, step in sorted(first_steps.items(), key=lambda item: item[1]):
                try:
                    self.minibatch_sizes(size)
                except ValueError as e:
                    raise ValueError(f"{self.trace.where(step)}: {e}") from None
        self.epoch = 0
        self._start_step = 0  # global step the next iteration starts at (mid-epoch after a resume)
        self._epoch_steps = self.trace.epoch(0, dataset_size, drop_last=drop_last)
        self._splits: list[StepSplit] | None = None  # step_splits() of the current epoch, made on demand
        self._position = 0  # global step a resume starts at: see state_dict()
        self._sample_order = _SampleOrder(self)

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch: its permutation (``seed + epoch``) and its steps of the trace.

        .. warning::
            Call this at the start of every epoch, before creating the ``DataLoader`` iterator and
            before :meth:`steps`, with the same value on every rank. Otherwise every epoch yields
            the same order and the same steps. After :meth:`load_state_dict`, calling it with the
            resumed epoch keeps the mid-epoch position. Lightning calls it for you, and so does a
            ``DataLoader`` that accelerate prepared, through :attr:`sampler`.

        Raises:
            ValueError: the trace is too short for ``epoch``.
        """
        check_int("epoch", epoch, minimum=0)
        if epoch == self.epoch:
            return
        self._epoch_steps = self.trace.epoch(epoch, self.dataset_size, drop_last=self.drop_last)
        self.epoch = epoch
        self._start_step = self._position = self._epoch_steps.first_step
        self._splits = None

    @property
    def num_epochs(self) -> int | None:
        """Epochs to train over this dataset: every complete epoch the trace covers (``None``: unbounded).

        A trace shorter than one epoch has one, truncated: its steps are what there is to train
        (see :meth:`BatchSizeTrace.epoch`). A longer trace's steps after its last complete epoch
        are reachable with ``set_epoch`` but not counted, so every counted epoch sees the dataset.
        """
        if self.trace.num_steps is None:
            return None
        full = self.trace.num_full_epochs(self.dataset_size, drop_last=self.drop_last)
        if full:
            return full
        return self.trace.num_epochs(self.dataset_size, drop_last=self.drop_last)

    @property
    def epoch_steps(self) -> EpochSteps:
        """The current epoch's steps (global indices and actual batch sizes), from its start."""
        return self._epoch_steps

    def step_splits(self, epoch: int | None = None) -> list[StepSplit]:
        """The split of every step of ``epoch`` (default: the current epoch), from its first step."""
        if epoch is None or epoch == self.epoch:
            if self._splits is None:
                self._splits = self._make_splits(self._epoch_steps)
            return list(self._splits)
        return self._make_splits(self.trace.epoch(epoch, self.dataset_size, drop_last=self.drop_last))

    def step_plan(self, epoch: int | None = None) -> list[StepSplit]:
        """Deprecated: :meth:`step_splits`."""
        warn_renamed("TraceBatchSampler.step_plan()", "TraceBatchSampler.step_splits()")
        return self.step_splits(epoch)

    def minibatch_sizes(self, batch_size: int) -> list[int]:
        """How a step of ``batch_size`` samples is cut: minibatch ``j`` goes to rank ``j % num_replicas``.

        >>> TraceBatchSampler(100, [64, 64], minibatch_size=32).minibatch_sizes(100)  # an epoch's last step: short
        [32, 32, 32, 4]
        >>> TraceBatchSampler(100, [100], max_device_batch_size=32, num_replicas=2).minibatch_sizes(100)
        [25, 25, 25, 25]
        """
        if self.max_device_batch_size is not None:
            config = ElasticConfig(
                batch_size,
                self.max_device_batch_size,
                num_replicas=self.num_replicas,
                rank=self.rank,  # the cut is the same for every rank; never this process's world()
                max_accumulation_steps=self.max_accumulation_steps,
            )
            return config.minibatch_sizes()
        m = self.minibatch_size
        assert m is not None
        return [min(m, batch_size - start) for start in range(0, batch_size, m)]

    def _make_splits(self, steps: EpochSteps) -> list[StepSplit]:
        splits = []
        r = self.num_replicas
        for step, size in zip(steps.steps, steps.batch_sizes, strict=True):
            sizes = self.minibatch_sizes(size)
            counts = tuple(len(sizes[rank::r]) for rank in range(r))
            splits.append(StepSplit(step, steps.epoch, size, self.rank, counts, sum(sizes[self.rank :: r])))
        return splits

    def steps(self) -> list[StepSplit]:
        """The splits of the steps the next ``iter()`` covers: the current epoch from its resume point.

        ``sum(p.local_minibatches for p in sampler.steps()) == len(sampler)``.
        """
        skip = self._start_step - self._epoch_steps.first_step
        return self.step_splits()[skip:]

    def _permutation(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.dataset_size)
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_size, generator=g)

    def _resume_offset(self) -> int:
        """Samples of the current epoch that the steps before the resume point took."""
        steps = self._epoch_steps
        return sum(steps.batch_sizes[: self._start_step - steps.first_step])

    def _order(self) -> list[int]:
        """The indices the next ``iter()`` takes, in order, over all ranks (see :attr:`sampler`)."""
        return self._permutation()[self._resume_offset() : self._epoch_steps.num_samples].tolist()

    @property
    def sampler(self) -> _SampleOrder:
        """The order the steps take the dataset's indices in: what ``BatchSampler.sampler`` is to a ``BatchSampler``.

        Its ``set_epoch`` is this sampler's :meth:`set_epoch`: Lightning's loop and accelerate's
        prepared ``DataLoader`` set the epoch through ``loader.batch_sampler.sampler``, and so
        reach the trace's steps. Iterating it gives the current epoch's indices from the resume
        point, over all ranks (the same on every rank); this rank's minibatches are cut from it.

        >>> sampler = TraceBatchSampler(6, [2, 4, 4, 2], minibatch_size=2, shuffle=False)
        >>> sampler.sampler.set_epoch(1)  # as Lightning does, at the start of the second epoch
        >>> sampler.epoch, [s.step for s in sampler.steps()], list(sampler.sampler)
        (1, [2, 3], [0, 1, 2, 3, 4, 5])
        """
        return self._sample_order

    def __iter__(self) -> Iterator[list[int]]:
        steps = self._epoch_steps
        skip = self._start_step - steps.first_step
        indices = self._order()
        r, pos = self.num_replicas, 0
        self._position = self._start_step
        for step, size in zip(steps.steps[skip:], steps.batch_sizes[skip:], strict=True):
            sizes = self.minibatch_sizes(size)
            last = max((j for j in range(len(sizes)) if j % r == self.rank), default=-1)
            start = pos
            for j, length in enumerate(sizes):
                if j % r == self.rank:
                    # Handing out this rank's last minibatch of the step: once the caller asks
                    # for a state, it has trained it, so a resume starts at the next step.
                    self._position = step + 1 if j == last else step
                    yield indices[start : start + length]
                start += length
            pos += size
        self._position = steps.end_step

    def __len__(self) -> int:
        """Number of minibatches this rank yields in the current epoch (from its resume point)."""
        return sum(p.local_minibatches for p in self.steps())

    def seek(self, next_step: int) -> None:
        """Set the position: the next ``iter()`` and :meth:`state_dict` start at global step ``next_step``.

        For callers that read ahead of training (a ``DataLoader`` with workers, another rank's
        view): the sampler's own count then runs ahead of the steps the optimizer completed.
        ``next_step`` must lie in the current epoch or be its end.
        """
        steps = self._epoch_steps
        check_int("next_step", next_step, minimum=0)
        if not steps.first_step <= next_step <= steps.end_step:
            raise ValueError(
                f"next_step={next_step} is outside epoch {self.epoch}, which runs steps "
                f"{steps.first_step}..{steps.end_step - 1}; call set_epoch() for the epoch that step belongs to"
            )
        self._start_step = self._position = next_step

    def state_dict(self) -> dict[str, Any]:
        """The position to resume from, and the settings it is only valid with (PyTorch's ``Stateful``).

        The position is the step after the last one whose minibatches this sampler has handed out
        to this rank: exact for a loop that draws each minibatch when it trains it (no read-ahead)
        on rank 0, which has a minibatch in every step; a rank idle in the last steps, or a
        ``DataLoader`` with workers reading ahead, tells it with :meth:`seek` first
        (:class:`~torchfold.train.StepLoader` does). Before any iteration it is the resume point
        (the epoch's start after :meth:`set_epoch`).

        The state is the same on every rank (rank 0 may save it for all) and holds only ints,
        bools and strings (safe for ``torch.load(weights_only=True)``).
        """
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "next_step": self._position,
            "num_replicas": self.num_replicas,  # for the record: a resume may have another number
            # the batch sizes of the steps taken: a resume needs only those the same, so that a
            # longer trace trains on (and a refusal names the step where the traces part)
            "trace_steps": self.trace.run_lengths(self._position),
            # the whole trace, which states without trace_steps are checked against (and which
            # earlier versions of torchfold check)
            **self._legacy_trace(),
            **self._settings(),
        }

    def _legacy_trace(self) -> dict[str, Any]:
        return {
            "trace_num_steps": -1 if self.trace.num_steps is None else self.trace.num_steps,
            "trace_fingerprint": self.trace.fingerprint(),
        }

    def _settings(self) -> dict[str, Any]:
        """What a saved position is only valid with besides the steps taken (checked in this order on load)."""
        return {
            "dataset_size": self.dataset_size,
            "minibatch_size": self.minibatch_size,
            "max_device_batch_size": self.max_device_batch_size,
            "max_accumulation_steps": self.max_accumulation_steps,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def _check_steps_taken(self, runs: Any, next_step: int) -> None:
        """Refuse a trace whose first ``next_step`` steps are not the saved ones (``runs``:
        :meth:`BatchSizeTrace.run_lengths`): a :class:`TraceMismatch` naming the first that differs."""
        if not (
            isinstance(runs, list)
            and all(
                isinstance(run, (list, tuple))
                and len(run) == 2
                and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in run)
                for run in runs
            )
            and sum(count for _, count in runs) == next_step
        ):
            raise ValueError(
                f"sampler state's 'trace_steps' is not a list of [batch size, steps] runs covering its "
                f"{next_step} steps, got {runs!r}; expected a dict from TraceBatchSampler.state_dict()"
            )
        found = self.trace.first_difference(runs)
        if found is not None:
            raise TraceMismatch("sampler state", next_step, *found, trace=self.trace.source)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the position saved by :meth:`state_dict` (also mid-epoch), on any number of ranks.

        A trace that goes on past the saved one, or differs from it only in steps not yet taken,
        is taken: the run trains on with it.

        Raises:
            ValueError: this trace's first steps are not the batch sizes of the steps taken (the
                message names the first step that differs and both sizes), or the state was saved
                with a different dataset size, minibatch size, per-device maximum, seed, shuffle or
                drop_last (the message names both values).
        """
        if not isinstance(state, dict):
            raise TypeError(
                f"state should be a dict from TraceBatchSampler.state_dict(), got {type(state).__name__}"
            )
        current = self._settings()
        state = {**_OPTIONAL_SETTINGS, **state}  # states of torchfold 0.2 lack them: they were unset
        missing = sorted({"version", "epoch", "next_step", *current} - set(state))
        if missing:
            raise ValueError(
                f"sampler state is missing {missing}; expected a dict from TraceBatchSampler.state_dict()"
            )
        if state["version"] != _STATE_VERSION:
            raise ValueError(
                f"sampler state version {state['version']!r} is not supported (expected {_STATE_VERSION})"
            )
        for key in ("epoch", "next_step"):
            check_int(
                f"sampler state's {key!r}",
                state[key],
                None,
                hint="expected a dict from TraceBatchSampler.state_dict()",
            )
        epoch, next_step = state["epoch"], state["next_step"]
        if "trace_steps" in state:
            self._check_steps_taken(state["trace_steps"], next_step)
        else:  # a state of torchfold 0.3 or earlier: the same trace, all of it
            current = {**self._legacy_trace(), **current}
        for key in current:
            if state.get(key) != current[key]:
                what = "trace" if key.startswith("trace") else key
                raise ValueError(
                    f"sampler state was saved with {key}={state.get(key)!r} but this sampler has "
                    f"{key}={current[key]!r} (trace {self.trace.source!r}); resume with the same {what} "
                    "or start a fresh sampler"
                )
        steps = self.trace.epoch(epoch, self.dataset_size, drop_last=self.drop_last)
        if not steps.first_step <= next_step <= steps.end_step:
            raise ValueError(
                f"sampler state has next_step={next_step}, outside its epoch {epoch} "
                f"(steps {steps.first_step}..{steps.end_step - 1}); the state is corrupt"
            )
        self.epoch, self._epoch_steps = epoch, steps
        self._start_step = self._position = next_step
        self._splits = None


class _SampleOrder(Sampler[int]):
    """:attr:`TraceBatchSampler.sampler`: a view of its epoch's order, whose ``set_epoch`` is the owner's.

    NOTE: Lightning (``_set_sampler_epoch``) calls ``set_epoch`` on ``loader.sampler`` and
    ``loader.batch_sampler.sampler`` only, never on the batch sampler itself; accelerate's
    ``DataLoaderDispatcher`` likewise. A ``DataLoader(batch_sampler=...)``'s own ``sampler`` is a
    ``SequentialSampler`` that knows no epoch, so without this view the trace sampler would stay
    at epoch 0 and every epoch would repeat the first's order and steps.
    """

    def __init__(self, owner: TraceBatchSampler) -> None:
        self._owner = owner

    def set_epoch(self, epoch: int) -> None:
        """:meth:`TraceBatchSampler.set_epoch` of the owner."""
        self._owner.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        return iter(self._owner._order())

    def __len__(self) -> int:
        owner = self._owner
        return owner.epoch_steps.num_samples - owner._resume_offset()
