"""The trace-aware training loop on a :class:`~torchfold.train.StepLoader`: plans built in workers, applied here.

:class:`TraceTrainer` runs the steps its loader yields. The loader's ``build(items) ->
(FoldPlan, targets)`` records and compiles every minibatch's folds (in worker processes when it
has ``num_workers``); the trainer applies each plan, computes ``loss(model, outputs, targets)``,
backpropagates it inside ``optimizer.minibatch(num_samples)`` and, after this rank's minibatches
of the step (there may be none), ends the step on every rank together: the
:class:`~torchfold.train.AccumulatingOptimizer` all-reduces the gradients, scales them by the true
global batch and updates with the LR rule. So the number and size of the folds change from step
to step with the trace, while the update equals one step on the whole global batch.

The loop is generic over the structure type: it never looks inside items or targets. For SST
Tree-LSTMs the two halves are :class:`torchfold.examples.models.TreeLSTMBuild` (for the loader) and
:func:`torchfold.examples.models.tree_lstm_loss` (for the trainer).

Around the steps, on the main rank only, as tqdm and Lightning do it: a progress bar when stderr
is a terminal, and otherwise (a log file, a notebook, CI) a log line every ``log_every`` steps
(default :data:`DEFAULT_LOG_EVERY`) and at the last one; ``progress=False`` alone is quiet (step, global batch, learning rate,
loss, samples/s); a checkpoint every
``checkpoint_every`` steps (model, optimizer, loader position, the generators of every rank)
that :meth:`TraceTrainer.resume` continues from exactly. Under ``torchrun`` each process runs
the same code; create the process group first (:func:`torchfold.train.distributed.init_distributed`).

**Elastic.** A checkpoint resumes on any number of processes: a step holds the same samples
however many share it, and its update is their mean, so the parameters follow one uninterrupted
run up to summation order. Random draws: with ``seed=``, the generators are seeded before every
minibatch from ``(seed, step, minibatch position in the step)``, so dropout depends on the
minibatch, not on the process that runs it; with a fixed minibatch size that makes the draws,
too, world-size invariant. Without ``seed``, each rank's generators continue where its
checkpoint left them, which needs the same number of processes; on another number they are
re-seeded from ``(step, rank)`` with a warning. Which generators, and how each is seeded and
saved: :mod:`torchfold.train.rng`.

**Preemption.** During :meth:`TraceTrainer.fit`, SIGTERM (what schedulers send before taking a
machine back) lets the current step finish; then the ranks agree to stop, write one checkpoint
and :meth:`fit` raises :class:`~torchfold.train.preemption.Preempted` (exit code
:data:`~torchfold.train.preemption.PREEMPTED_EXIT_CODE` in the command line). A second SIGTERM,
or ``preemption_timeout`` seconds without reaching the end of the step, exits at once with
status 143 (128 + SIGTERM) and a message (:mod:`torchfold.train.preemption`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from torchfold._deprecation import RenamedAttribute
from torchfold._validate import check_int
from torchfold.engine.static.shapes import StaticPlan
from torchfold.train.capture import CudaRunner, EagerRunner, StepRunner, XlaRunner, step_runner
from torchfold.train.capture.compiled import CompiledLoss
from torchfold.train.capture.cuda_replay import CudaStepReplay
from torchfold.train.capture.xla_replay import XlaStepReplay
from torchfold.train.checkpoint import (
    check_trainer_state,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from torchfold.train.distributed import (
    abort_replica_threads,
    all_reduce_sum_,
    broadcast_parameters,
    gather_objects,
    run_context,
    world,
)
from torchfold.train.loader import Step, StepLoader, to_device
from torchfold.train.loss import PlanLoss
from torchfold.train.optim import AccumulatingOptimizer
from torchfold.train.preemption import PREEMPTED_EXIT_CODE as PREEMPTED_EXIT_CODE  # (imported from here too)
from torchfold.train.preemption import Preempted as Preempted
from torchfold.train.preemption import SigtermGuard
from torchfold.train.rng import derived_seed, rng_state, seed_generators, set_rng_state

__all__ = ["DEFAULT_LOG_EVERY", "PlanLoss", "StepStats", "TraceTrainer"]

#: Steps between log lines where no progress bar is shown (Lightning's ``log_every_n_steps``).
DEFAULT_LOG_EVERY = 50


# a step's loss left on the device: the weighted sum of its minibatches' losses, as (tensor, factor)
_Loss = tuple[torch.Tensor, float]


@dataclass(frozen=True)
class StepStats:
    """What happened in one optimizer step (the same on every rank, except the ``local_`` fields).

    Args:
        step: global step index into the trace.
        epoch: the epoch of the step.
        batch_size: global number of samples in the step.
        num_minibatches: minibatches in the step over all ranks.
        local_minibatches: minibatches this rank ran (may be 0).
        local_nodes: nodes in this rank's plans in the step.
        lr: learning rate of the first parameter group in the update (after the LR rule).
        loss: mean loss over the step's global batch (over all ranks).
        seconds: wall time of the step on this rank.
        num_replicas: processes (replicas) that shared the step (:attr:`World.size`).
        stop_requested: some rank received SIGTERM by the end of the step: the run stops after it.
    """

    step: int
    epoch: int
    batch_size: int
    num_minibatches: int
    local_minibatches: int
    local_nodes: int
    lr: float
    loss: float
    seconds: float
    num_replicas: int = 1
    stop_requested: bool = False

    world_size = RenamedAttribute("num_replicas", "processes that shared the step")


@dataclass
class _Fit:
    """One call of :meth:`TraceTrainer.fit`: the step it stops before, its progress bar, the steps run."""

    end: int
    bar: tqdm
    history: list[StepStats] = dataclasses.field(default_factory=list)


class TraceTrainer:
    """Train a fold model for the steps of a :class:`~torchfold.train.StepLoader`, with checkpoints that resume exactly.

    Every rank constructs the trainer with its own loader (``num_replicas`` = world size,
    ``rank`` = its rank: the defaults once the process group exists) and calls :meth:`fit`; the
    constructor copies rank 0's parameters to all ranks (a torch.distributed collective; torch_xla's
    replicas are not covered: give each the same initial weights, e.g. copies of a model made
    before ``xmp.spawn``, as ``tests/helpers/_xla_trainer_worker.py`` does).

    Args:
        model: the module whose methods are the fold ops; trained in place.
        optimizer: an :class:`~torchfold.train.AccumulatingOptimizer` over ``model``'s parameters (where
            its ``minibatch_size`` is unset, gradients are weighted by the loader's ``batch_size``:
            see :attr:`minibatch_size`; the optimizer itself is left as it is).
        loader: this rank's :class:`~torchfold.train.StepLoader`, with a ``build`` returning
            ``(FoldPlan, targets)`` (a trace, or PopTorch's constant batch, sets the steps).
        loss: ``loss(model, outputs, targets) -> scalar`` (see :class:`PlanLoss`).
        device: where targets go and plans run (default: the model's device); ``trainer.context``
            (:func:`~torchfold.train.run_context`) answers it with the backend, the accumulation
            dtype and where checkpoints are read to.
        checkpoint_dir: directory for ``step-N.pt`` checkpoints (``None``: none are written).
        checkpoint_every: write one every this many steps (0: only at the end of :meth:`fit`).
        keep_checkpoints: how many of the newest checkpoints to keep (default 2).
        log_every: log a line every this many steps, and at the last one, on the main rank (0:
            never); ``None`` (default): every :data:`DEFAULT_LOG_EVERY` steps where ``progress=None``
            finds no terminal, else none (a bar, or ``progress=False``: a quiet run).
        progress: show a tqdm bar; ``None`` (default): on the main rank when stderr is a terminal.
        log: where log lines go (default: ``tqdm.write``, i.e. stdout without breaking the bar).
        on_step: called with every step's :class:`StepStats` on every rank, after any checkpoint,
            and before the next step is launched, on every device: a change it makes (e.g. a
            learning-rate scheduler's ``step()``) applies from the next step. In one process on
            an accelerator, :meth:`fit` without ``on_step`` reads a step's loss back after it has
            launched the next one (the host runs ahead of the device); with ``on_step``, only the
            next step's data is fetched before the loss is read.
        seed: seed every minibatch's random draws (torch, CUDA, XLA, Python's ``random``, NumPy)
            from ``(seed, step, minibatch position)``: world-size invariant dropout and exact
            resumes on any number of processes. ``None`` (default): generators run on.
        handle_sigterm: stop cleanly on SIGTERM during :meth:`fit` (see :class:`~torchfold.train.preemption.Preempted`;
            default ``True``; only in the main thread).
        preemption_timeout: seconds a SIGTERM'd run may take to finish its step and checkpoint
            before it exits anyway (default 120).
        settings: what this run's checkpoints are only valid with, by the names the user knows
            (e.g. a command line's ``{"--hidden-dim": 64}``; plain values). Saved in every
            checkpoint; a resume with a different value is refused naming the setting and both
            values.
        compile: capture each minibatch's forward, loss and backward once per static-shape
            layout and replay it (:class:`~torchfold.train.capture.compiled.CompiledLoss`): ``"auto"``
            (default) on XLA and CUDA, ``"on"`` on any device, ``"off"`` never. Needs the build
            to return static-shape plans (``StaticPlan``); other plans run eagerly. Except on
            CUDA, the optimizer's update is captured too
            (:class:`~torchfold.train.capture.compiled.CompiledUpdate`), if it can be (``Adam`` and
            others need ``capturable=True``; a warning names the fix otherwise). In one
            process, steps of one minibatch are replayed whole (forward, loss, backward and
            update as one graph): on XLA by :class:`~torchfold.train.capture.xla_replay.XlaStepReplay`,
            on CUDA by :class:`~torchfold.train.capture.cuda_replay.CudaStepReplay` (one CUDA graph; the
            optimizer needs ``capturable=True`` or ``fused=True``). Optimizer and tensor hooks
            then run when a step is captured, not at every replay.
        compile_backend: a :func:`torch.compile` backend instead of the device's (``openxla``
            on XLA, ``inductor`` elsewhere), e.g. ``"aot_eager"`` to check a capture quickly.

    Example:
        >>> import torchfold
        >>> from torchfold.examples.datasets import Vocab, generate_sst
        >>> from torchfold.examples.models import TreeLSTM, TreeLSTMBuild, tree_lstm_loss
        >>> trees = generate_sst(40, seed=0)
        >>> vocab = Vocab.build(trees)
        >>> _ = torch.manual_seed(0)
        >>> model = TreeLSTM(len(vocab), embedding_dim=8, hidden_dim=8)
        >>> optimizer = torchfold.train.AccumulatingOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
        ...                                             lr_rule="linear", ref_batch_size=8)
        >>> loader = torchfold.train.StepLoader(trees, 4, build=TreeLSTMBuild(vocab), trace=[8, 16, 4, 12])
        >>> trainer = TraceTrainer(model, optimizer, loader, tree_lstm_loss, progress=False)
        >>> [(s.step, s.batch_size, s.num_minibatches, s.lr) for s in trainer.fit()]  # 40 trees: one epoch
        [(0, 8, 2, 0.01), (1, 16, 4, 0.02), (2, 4, 1, 0.005), (3, 12, 3, 0.015)]
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: AccumulatingOptimizer,
        loader: StepLoader[Any, Any],
        loss: PlanLoss,
        *,
        device: torch.device | str | None = None,
        checkpoint_dir: str | Path | None = None,
        checkpoint_every: int = 0,
        keep_checkpoints: int = 2,
        log_every: int | None = None,
        progress: bool | None = None,
        log: Callable[[str], None] | None = None,
        on_step: Callable[[StepStats], None] | None = None,
        seed: int | None = None,
        handle_sigterm: bool = True,
        preemption_timeout: float = 120.0,
        settings: dict[str, Any] | None = None,
        compile: str = "auto",
        compile_backend: str | None = None,
    ) -> None:
        _check_parts(model, optimizer, loader, loss)
        _check_arguments(checkpoint_every, log_every, keep_checkpoints, seed, preemption_timeout)
        found = world()
        world_size, rank = found.size, found.rank
        if (loader.num_replicas, loader.rank) != (world_size, rank):
            raise ValueError(
                f"the loader is for rank {loader.rank} of {loader.num_replicas} but this process is rank "
                f"{rank} of {world_size}; create the loader after the process group (its defaults then fit)"
            )
        self.model = model
        self.optimizer = optimizer
        self.loader = loader
        self.loss = loss
        #: the run's device, backend, accumulation dtype and checkpoint map_location, one rule each
        self.context = run_context(device, model=model)
        self.device = self.context.device
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every = checkpoint_every
        self.keep_checkpoints = keep_checkpoints
        self.is_main = rank == 0
        self.progress = (
            (self.is_main and sys.stderr.isatty()) if progress is None else progress and self.is_main
        )
        # Left to choose (progress=None): a bar on a terminal, log lines elsewhere. progress=False
        # alone asks for a quiet run, as it did before log lines were the default.
        auto_lines = progress is None and not self.progress
        self.log_every = (DEFAULT_LOG_EVERY if auto_lines else 0) if log_every is None else log_every
        self.log = log if log is not None else tqdm.write
        self.on_step = on_step
        self.seed = seed
        self.handle_sigterm = handle_sigterm
        self.preemption_timeout = float(preemption_timeout)
        self.settings = dict(settings or {})
        self.compile = compile
        self._compile_backend = compile_backend
        #: how every step runs (eagerly, or captured and replayed): chosen once, see ``compile``
        with optimizer.default_minibatch_size(loader.minibatch_size):  # a runner may keep what it weighs by
            self.runner: StepRunner = step_runner(
                model, loss, optimizer, device=self.device, compile=compile, backend=compile_backend
            )
        self._sigterm = SigtermGuard(rank)
        # one process on an accelerator: fit() reads each step's loss while the next step runs
        self._defers = world().size == 1 and self.device.type != "cpu"
        self._ahead: int | None = None  # while a deferred step is reported: the step run after it
        self._warned_unpadded = False
        self.next_step: int = loader.next_step
        broadcast_parameters(model)  # rank 0's initial values win
        self._log_loss = self._log_samples = 0.0
        self._log_time = time.perf_counter()

    @property
    def minibatch_size(self) -> int | None:
        """What each minibatch's gradient is weighted by: the optimizer's ``minibatch_size``, else the
        loader's ``batch_size`` (the optimizer's own setting is left as the user made it)."""
        return (
            self.optimizer.minibatch_size
            if self.optimizer.minibatch_size is not None
            else self.loader.minibatch_size
        )

    @property
    def loss(self) -> PlanLoss:
        """The minibatch loss; setting another one makes the step runner anew (captures included)."""
        return self._loss

    @loss.setter
    def loss(self, value: PlanLoss) -> None:
        if not callable(value):
            raise TypeError(f"loss must be callable as loss(model, outputs, targets), got {value!r}")
        self._loss = value
        if hasattr(self, "runner"):  # a loss set after construction: the runner runs it
            with self.optimizer.default_minibatch_size(self.loader.minibatch_size):
                self.runner = step_runner(
                    self.model,
                    value,
                    self.optimizer,
                    device=self.device,
                    compile=self.compile,
                    backend=self._compile_backend,
                )

    @property
    def compiled(self) -> CompiledLoss | None:
        """The :func:`torch.compile` capture of minibatches, when the runner uses one (else None)."""
        return self.runner.compiled if isinstance(self.runner, EagerRunner) else None

    @property
    def replay(self) -> XlaStepReplay | CudaStepReplay | None:
        """The whole-step replay of one-minibatch steps, when the runner has one (else None)."""
        return self.runner.whole if isinstance(self.runner, XlaRunner | CudaRunner) else None

    # -- running -------------------------------------------------------------------------------

    def _last_step(self, max_steps: int | None, epochs: int | None) -> tuple[int, int | None]:
        """The global step to stop before, and the number of epochs (``None``: bounded by steps)."""
        sampler = self.loader.sampler
        if epochs is None:
            epochs = sampler.num_epochs
        if epochs is None and max_steps is None:
            raise ValueError(
                f"the loader's steps have no end (trace {sampler.trace.source!r}): pass max_steps= or epochs= to fit()"
            )
        end = math.inf
        if epochs is not None:
            if epochs <= self.loader.epoch:
                end = self.next_step
            else:
                end = sampler.trace.epoch(
                    epochs - 1, sampler.dataset_size, drop_last=sampler.drop_last
                ).end_step
        if max_steps is not None:
            end = min(end, max_steps)
        return int(end), epochs

    def fit(self, *, max_steps: int | None = None, epochs: int | None = None) -> list[StepStats]:
        """Train from the current position up to global step ``max_steps`` or the end of ``epochs``.

        Args:
            max_steps: stop before this global trace step (an absolute position, so a resumed run
                given the same value stops at the same place).
            epochs: train until this many epochs are complete (default: every complete epoch the
                trace covers; required, or ``max_steps``, for an unbounded trace).

        Returns:
            the :class:`StepStats` of the steps run.

        Raises:
            Preempted: SIGTERM arrived (on any rank); the run stopped after the step in progress
                and wrote a checkpoint (with a ``checkpoint_dir``).
        """
        for name, value in (("max_steps", max_steps), ("epochs", epochs)):
            check_int(name, value, 0, optional=True)
        end, num_epochs = self._last_step(max_steps, epochs)
        epoch = self.loader.epoch
        self._log_loss = self._log_samples = 0.0
        self._log_time = time.perf_counter()
        sigterm = (
            self._sigterm.handling(self.preemption_timeout, step=lambda: self.next_step)
            if self.handle_sigterm
            else contextlib.nullcontext()
        )
        with (
            sigterm,
            tqdm(
                total=max(0, end - self.next_step), unit="step", disable=not self.progress, dynamic_ncols=True
            ) as bar,
        ):
            run = _Fit(end, bar)
            while self.next_step < end and (num_epochs is None or epoch < num_epochs):
                self.loader.set_epoch(epoch)
                self._fit_epoch(iter(self.loader), run)
                epoch += 1
            if run.history:
                self._final_checkpoint()
        return run.history

    def _fit_epoch(self, steps: Iterator[Step[Any]], run: _Fit) -> None:
        """Run the steps of one epoch until ``run.end``, recording each in ``run``.

        next() only while steps remain: the loader's position is then the trainer's. One process
        on an accelerator: a step's loss is read back while the next one runs (the host does not
        wait for the device at every step); a step that checkpoints, stops or ends the run is read
        back at once.
        """
        pending: tuple[StepStats, _Loss, float] | None = None
        try:
            while self.next_step < run.end and (step := next(steps, None)) is not None:
                started = time.perf_counter()
                if pending is not None and self.on_step is not None:
                    # on_step may change the next step (a learning-rate schedule): it runs
                    # before that step is launched, as on the CPU (only the fetch overlaps)
                    late, pending = pending, None
                    self._complete(run, *late, until=started)
                stats, loss_sum = self._run_step(step, defer=self._defers)
                if pending is not None:  # (cleared first: a failing callback records it once)
                    late, pending = pending, None
                    self._ahead = stats.step
                    try:
                        self._complete(run, *late, until=started)
                    finally:
                        self._ahead = None
                self.next_step = stats.step + 1  # (for _checkpoint_due)
                if loss_sum is not None and not (
                    stats.stop_requested or self._checkpoint_due() or self.next_step >= run.end
                ):
                    pending = (stats, loss_sum, started)
                    continue
                self._complete(run, stats, loss_sum, started)
                if stats.stop_requested:
                    raise Preempted(self.next_step, self._final_checkpoint())
        except BaseException:
            if pending is not None:  # the step before the failure ran: record it if it can be read
                with contextlib.suppress(Exception):
                    self._complete(run, *pending)
            raise
        if pending is not None:
            self._complete(run, *pending)

    def _complete(
        self, run: _Fit, stats: StepStats, loss_sum: _Loss | None, started: float, until: float | None = None
    ) -> None:
        """Read a step's deferred loss (its ``seconds`` then run from ``started`` to ``until``, or
        now), record the step and run what follows it (log, checkpoint)."""
        if loss_sum is not None:
            seconds = (time.perf_counter() if until is None else until) - started
            stats = dataclasses.replace(self._finish(stats, loss_sum), seconds=seconds)
        run.history.append(stats)
        self._after_step(stats, run)

    def _final_checkpoint(self) -> Path | None:
        """Write the checkpoint of the current position unless the last step just wrote it."""
        if self.checkpoint_dir is None:
            return None
        if not self._checkpoint_due():
            return self.save_checkpoint()
        return checkpoint_path(self.checkpoint_dir, self.next_step)

    def _to_device(self, data: Any) -> Any:
        """Where a minibatch meets the trainer's device (the one place: tensors and numpy arrays, no blocking)."""
        return to_device(data, self.device)

    def train_step(self, step: Step[Any]) -> StepStats:
        """Run one step: this rank's minibatches of ``step`` (maybe none), then the update.

        Every rank must call it for every step, also when it has no minibatch in it.
        """
        return self._finish(*self._run_step(step, defer=False))

    def _run_step(self, step: Step[Any], defer: bool) -> tuple[StepStats, _Loss | None]:
        """:meth:`train_step`; with ``defer`` (one process on an accelerator), its loss is left on the
        device, returned beside the stats for :meth:`_finish` to read later, so that the host goes
        on to the next step while the device still runs this one."""
        try:
            return self._train_step(step, defer)
        except BaseException:
            if self.device.type == "xla":  # replicas that are threads of this process: stop them too
                abort_replica_threads()
            raise

    def _finish(self, stats: StepStats, loss: _Loss | None) -> StepStats:
        """``stats`` with the loss of a deferred step read back (a wait for that step only)."""
        if loss is None:
            return stats
        total = float(loss[0]) * loss[1]
        if stats.batch_size and not math.isfinite(total):
            raise FloatingPointError(self._non_finite_loss(stats.step, total / stats.batch_size))
        return dataclasses.replace(stats, loss=total / stats.batch_size if stats.batch_size else math.nan)

    def _train_step(self, step: Step[Any], defer: bool) -> tuple[StepStats, _Loss | None]:
        start = time.perf_counter()
        split = step.split
        self.model.train()
        dtype = self.context.accumulation_dtype
        # the user's optimizer keeps its minibatch_size; ours holds for the step (see minibatch_size)
        with self.optimizer.default_minibatch_size(self.loader.minibatch_size):
            samples, nodes = self._run_minibatches(step)
            summed, scale = self.runner.update()
        loss_sum = summed if summed is not None else torch.zeros((), dtype=dtype, device=self.device)
        if self.optimizer.last_batch_size != split.batch_size:
            raise RuntimeError(
                f"step {split.step}: the ranks together ran {self.optimizer.last_batch_size} samples but the "
                f"loader planned {split.batch_size}; every rank needs a loader with num_replicas = world size "
                "and the same trace, dataset, batch size and seed"
            )
        stats = StepStats(
            step=split.step,
            epoch=split.epoch,
            batch_size=split.batch_size,
            num_minibatches=self.optimizer.last_num_minibatches,  # a split minibatch counts as its parts
            local_minibatches=split.local_minibatches,
            local_nodes=nodes,
            lr=float(self.optimizer.param_groups[0]["lr"]) * self.optimizer.last_lr_factor,
            loss=math.nan,
            seconds=time.perf_counter() - start,
            num_replicas=world().size,
            stop_requested=self._sigterm.received,
        )
        if defer:  # one process: its samples and SIGTERM are the step's; the loss is read later
            return stats, (loss_sum, scale)
        return self._summed_over_ranks(stats, loss_sum * scale, samples, dtype, start), None

    def _run_minibatches(self, step: Step[Any]) -> tuple[int, int]:
        """This rank's minibatches of ``step`` through the runner; their samples and plan nodes."""
        split = step.split
        samples, nodes = 0, 0
        alone = split.local_minibatches == 1 and world().size == 1
        for minibatch in step:
            if self.seed is not None:  # the minibatch's draws, wherever it runs
                seed_generators(derived_seed(self.seed, split.step, minibatch.position), self.device)
            plan, targets = self._to_device(minibatch.data)
            if self.device.type == "xla" and not isinstance(plan, StaticPlan) and not self._warned_unpadded:
                self._warned_unpadded = True
                warnings.warn(
                    "TraceTrainer on XLA got an unpadded plan from the loader's build: every new size compiles a new "
                    "graph; build static-shape plans with padded targets instead (Fold(shapes=StaticShapes(...)) and "
                    "plan.pad, e.g. TreeLSTMBuild(vocab, shapes=...))",
                    stacklevel=3,
                )
            self.runner.minibatch(plan, targets, minibatch.num_samples, alone=alone)
            nodes += len(plan)
            samples += minibatch.num_samples
        return samples, nodes

    def _summed_over_ranks(
        self, stats: StepStats, loss: torch.Tensor, samples: int, dtype: torch.dtype, start: float
    ) -> StepStats:
        """``stats`` with the step's mean loss and stop request over every rank (one all-reduce)."""
        local = [float(samples), float(self._sigterm.received)]
        totals = torch.cat([loss.reshape(1), torch.tensor(local, dtype=dtype, device=self.device)])
        all_reduce_sum_([totals])
        total_loss, total_samples, stopping_ranks = totals.tolist()
        if total_samples and not math.isfinite(total_loss):  # the same sum on every rank: all stop
            raise FloatingPointError(self._non_finite_loss(stats.step, total_loss / total_samples))
        return dataclasses.replace(
            stats,
            loss=total_loss / total_samples if total_samples else math.nan,
            seconds=time.perf_counter() - start,
            stop_requested=stopping_ranks > 0,
        )

    def _non_finite_loss(self, step: int, loss: float) -> str:
        last = latest_checkpoint(self.checkpoint_dir) if self.checkpoint_dir is not None else None
        where = (
            f"the last checkpoint written is {last}: resume from it (or an earlier one) with a lower learning rate"
            if last is not None
            else "no checkpoint was written before it"
        )
        return f"step {step}: the loss became {loss}, so training stopped before saving this step; {where}"

    def _after_step(self, stats: StepStats, run: _Fit) -> None:
        self.next_step = stats.step + 1
        self._log_loss += stats.loss * stats.batch_size if stats.num_minibatches else 0.0
        self._log_samples += stats.batch_size if stats.num_minibatches else 0
        if self._checkpoint_due():
            self.save_checkpoint()
        run.bar.update(1)
        run.bar.set_postfix(batch=stats.batch_size, loss=f"{stats.loss:.3f}", refresh=False)
        if self.log_every and (self.next_step % self.log_every == 0 or self.next_step == run.end):
            self._log_line(stats, run.end)
        if self.on_step is not None:
            self.on_step(stats)

    def _log_line(self, stats: StepStats, end: int) -> None:
        """Log the steps since the last line (on the main rank), and start counting anew."""
        now = time.perf_counter()
        if self.is_main:
            loss = self._log_loss / self._log_samples if self._log_samples else math.nan
            rate = self._log_samples / max(now - self._log_time, 1e-9)
            self.log(
                f"step {self.next_step}/{end} | epoch {stats.epoch} | batch {stats.batch_size} "
                f"({stats.num_minibatches} minibatches) | lr {stats.lr:.4g} | loss {loss:.4f} | "
                f"{rate:.1f} samples/s"
            )
        self._log_loss = self._log_samples = 0.0
        self._log_time = now

    # -- checkpoints -----------------------------------------------------------------------------

    def _checkpoint_due(self) -> bool:
        return (
            self.checkpoint_dir is not None
            and self.checkpoint_every > 0
            and self.next_step % self.checkpoint_every == 0
        )

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume at :attr:`next_step`: model, optimizer, loader, generators.

        A collective: every rank must call it (each contributes its generators' states).
        """
        states = gather_objects(
            rng_state(self.device), what=f"generator states for the checkpoint at step {self.next_step}"
        )
        return {
            "step": self.next_step,
            "world_size": world().size,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "loader": self.loader.state_dict(),
            "rng": states,
            "settings": self.settings,
        }

    def load_state_dict(self, state: dict[str, Any], source: str = "state_dict") -> None:
        """Restore a :meth:`state_dict`; ``source`` (e.g. the file) is named in errors."""
        # before anything is restored
        check_trainer_state(state, source, optimizer=self.optimizer.optimizer, settings=self.settings)
        parts: list[tuple[str, Callable[[Any], Any]]] = [
            ("model", self.model.load_state_dict),
            # with this run's device options: a checkpoint moves between devices (e.g. XLA and the CPU)
            (
                "optimizer",
                lambda saved: self.optimizer.load_state_dict(_on_this_device(saved, self.optimizer)),
            ),
            ("loader", self.loader.load_state_dict),
        ]
        for name, load in parts:
            try:
                load(state[name])
            except (RuntimeError, ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
                detail = " ".join(str(e).split()).rstrip(". ")  # load_state_dict's report spans lines
                raise ValueError(
                    f"{source}: its {name} state does not fit this run: {detail}. Resume with the settings the "
                    "checkpoint was written with, or use another checkpoint directory to start afresh"
                ) from e
        self._restore_generators(state, source)
        self.next_step = int(state["step"])

    def _restore_generators(self, state: dict[str, Any], source: str) -> None:
        """This rank's generator states from ``state``, or, written by another number of processes,
        generators seeded from ``(seed, step, rank)`` (with a warning where there is no ``seed``)."""
        found = world()
        world_size, rank = found.size, found.rank
        saved_world = state["world_size"]
        if saved_world == world_size:
            set_rng_state(state["rng"][rank], self.device)
            return
        # Rank r of K' has no generator state of its own in a checkpoint of K processes.
        seed = derived_seed(0 if self.seed is None else self.seed, int(state["step"]), rank)
        seed_generators(seed, self.device)
        if self.seed is None:
            warnings.warn(
                f"{source} was written by {saved_world} processes and this run has {world_size}: the "
                f"generators are re-seeded from (step, rank), so random draws (dropout) differ from an "
                "uninterrupted run; give TraceTrainer seed= to seed each minibatch's draws world-size invariantly",
                stacklevel=3,
            )

    def save_checkpoint(self, path: str | Path | None = None) -> Path:
        """Write :meth:`state_dict` (rank 0 only) atomically; default ``checkpoint_dir/step-N.pt``.

        A collective: every rank must call it. Keeps the ``keep_checkpoints`` newest in the directory.
        """
        if self._ahead is not None:
            raise RuntimeError(
                f"save_checkpoint() while step {self.next_step - 1} is reported, but step {self._ahead} has run "
                "already (in one process on an accelerator a step is reported after the next one is launched): "
                "the checkpoint would not match its step; use checkpoint_every, or save after fit() returns"
            )
        if path is None:
            if self.checkpoint_dir is None:
                raise ValueError("no path given and the trainer has no checkpoint_dir")
            path = checkpoint_path(self.checkpoint_dir, self.next_step)
        state = self.state_dict()
        path = Path(path)
        if self.is_main:
            save_checkpoint(state, path)
            if self.checkpoint_dir is not None and path.parent == self.checkpoint_dir:
                prune_checkpoints(self.checkpoint_dir, self.keep_checkpoints)
        return path

    def load_checkpoint(self, path: str | Path) -> None:
        """Resume from a checkpoint file (every rank reads it)."""
        # Read where the run context says (the host); loading copies the values into the model's and
        # the optimizer's tensors on their devices.
        self.load_state_dict(load_checkpoint(path, self.context.map_location), source=f"checkpoint {path}")

    def resume(self) -> Path | None:
        """Resume from the newest checkpoint in ``checkpoint_dir``; returns it, or ``None`` if there is none."""
        if self.checkpoint_dir is None:
            return None
        path = latest_checkpoint(self.checkpoint_dir)
        if path is not None:
            self.load_checkpoint(path)
        return path


# Param group options (torch's word; ``settings`` is what a checkpoint is only valid with) that say
# how an update runs on the device, not what it computes: a checkpoint's are those of the device it
# was written on, this run's stand.
_DEVICE_OPTIONS = ("capturable", "fused", "foreach")


def _on_this_device(saved: Any, optimizer: torch.optim.Optimizer) -> Any:
    """``saved`` (an optimizer state dict) with the device options of ``optimizer``'s param groups.

    ``Optimizer.load_state_dict`` takes every group option from the file, ``capturable`` and
    ``fused`` too, and places the step counts by them: a state written on XLA (``capturable``)
    would make the CPU's Adam refuse its parameters, a CPU's (``fused``) XLA's.
    """
    if not isinstance(saved, dict):
        return saved
    if "param_groups" not in saved and isinstance(saved.get("optimizer"), dict):  # torchfold 0.1.0: nested
        return {**saved, "optimizer": _on_this_device(saved["optimizer"], optimizer)}
    groups = saved.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(optimizer.param_groups):
        return saved  # load_state_dict says what does not fit
    return {
        **saved,
        "param_groups": [
            {**group, **{key: current[key] for key in _DEVICE_OPTIONS if key in current}}
            if isinstance(group, dict)
            else group
            for group, current in zip(groups, optimizer.param_groups, strict=True)
        ],
    }


def _check_parts(model: object, optimizer: object, loader: object, loss: object) -> None:
    """TraceTrainer's model, optimizer, loader and loss are of the kinds it runs, or a TypeError says which not."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, AccumulatingOptimizer):
        raise TypeError(
            f"optimizer must be a torchfold AccumulatingOptimizer (it accumulates minibatches and "
            f"all-reduces once per step), got {type(optimizer).__name__}; wrap it: "
            f"AccumulatingOptimizer({type(optimizer).__name__}(...), lr_rule=...)"
        )
    if not isinstance(loader, StepLoader):
        raise TypeError(f"loader must be a torchfold StepLoader, got {type(loader).__name__}")
    if loader.build is None:
        raise ValueError(
            "the loader has no build function: give it build=... returning (FoldPlan, targets) for a minibatch "
            "of items (e.g. torchfold.examples.models.TreeLSTMBuild(vocab))"
        )
    if not callable(loss):
        raise TypeError(f"loss must be callable as loss(model, outputs, targets), got {loss!r}")


def _check_arguments(
    checkpoint_every: object,
    log_every: object,
    keep_checkpoints: object,
    seed: object,
    preemption_timeout: object,
) -> None:
    """TraceTrainer's numeric arguments are in range, or a TypeError/ValueError names the first that is not."""
    check_int("checkpoint_every", checkpoint_every, 0)
    check_int("log_every", log_every, 0, optional=True)
    check_int("keep_checkpoints", keep_checkpoints, 1)
    check_int("seed", seed, 0, optional=True)
    if isinstance(preemption_timeout, bool) or not (
        isinstance(preemption_timeout, (int, float)) and preemption_timeout > 0
    ):
        raise ValueError(
            f"preemption_timeout must be a positive number of seconds, got {preemption_timeout!r}"
        )
