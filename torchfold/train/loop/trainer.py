"""The trace-aware training loop on a :class:`~torchfold.train.StepLoader`: plans built in workers, applied here.

:class:`TraceTrainer` runs the steps its loader yields. The loader's ``build(items) ->
(FoldPlan, targets)`` records and plans every minibatch's folds (in worker processes when it
has ``num_workers``); the trainer applies each plan, computes ``loss(model, outputs, targets)``,
backpropagates it inside ``optimizer.minibatch(num_samples)`` and, after this rank's minibatches
of the step (there may be none), ends the step on every rank together: the
:class:`~torchfold.train.AccumulatingOptimizer` all-reduces the gradients, scales them by the true
global batch and updates with the LR rule. So the number and size of the folds change from step
to step with the trace, while the update equals one step on the whole global batch.

The loop is generic over the structure type: it never looks inside items or targets. For SST
Tree-LSTMs the two halves are :class:`torchfold.examples.models.TreeLSTMBuild` (for the loader) and
:func:`torchfold.examples.models.tree_lstm_loss` (for the trainer). Under ``torchrun`` each process
runs the same code; create the process group first (:func:`torchfold.train.distributed.world.init_distributed`).

The loop only loops; around the steps, other modules do the rest: how a step runs
(:mod:`torchfold.train.capture`), its loss read back (:mod:`torchfold.train.loop.stats`; in one process
on an accelerator a step after the next one is launched, :mod:`torchfold.train.loop.deferral`), the bar
and log lines on the main rank (:mod:`torchfold.train.loop.progress`), the checkpoints every
``checkpoint_every`` steps that :meth:`TraceTrainer.resume` continues from exactly, on any number
of processes (:mod:`torchfold.train.loop.trainer_state`), the generators (:mod:`torchfold.train.loop.rng`).

**Preemption.** During :meth:`TraceTrainer.fit`, SIGTERM lets the current step finish; then the
ranks agree to stop, write one checkpoint and :meth:`fit` raises
:class:`~torchfold.train.loop.preemption.Preempted` (:mod:`torchfold.train.loop.preemption`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchfold._validate import check_int
from torchfold.engine.static.shapes import StaticPlan
from torchfold.train.capture import StepMechanism, StepRunner
from torchfold.train.data.loader import Minibatch, Step, StepLoader, to_device
from torchfold.train.distributed.devices import compiled_graphs, is_xla, same_device
from torchfold.train.distributed.world import (
    RunContext,
    abort_replica_threads,
    broadcast_parameters,
    run_context,
    world,
)
from torchfold.train.loop.arguments import (
    Evaluate,
    check_arguments,
    check_evaluation,
    check_loader_rank,
    check_parts,
    ends_epoch,
    fit_end,
    warn_if_unpadded,
)
from torchfold.train.loop.checkpoint import (
    checkpoint_path,
    keep_hyperparameters,
    latest_checkpoint,
    load_checkpoint,
    set_aside_checkpoints,
)
from torchfold.train.loop.deferral import DeferredReport
from torchfold.train.loop.preemption import (
    PREEMPTED_EXIT_CODE as PREEMPTED_EXIT_CODE,  # (imported from here too)
)
from torchfold.train.loop.preemption import Preempted as Preempted
from torchfold.train.loop.preemption import SigtermGuard
from torchfold.train.loop.progress import (
    DEFAULT_LOG_EVERY,
    MetricsCallback,
    StepProgress,
    default_log,
    progress_defaults,
)
from torchfold.train.loop.rng import derived_seed, seed_generators
from torchfold.train.loop.stats import StepLoss, StepStats, read_loss, step_stats, summed_over_ranks
from torchfold.train.loop.targets import check_target_rows, probe_target_rows
from torchfold.train.loop.threads import set_intra_op_threads
from torchfold.train.loop.trainer_state import (
    checkpoint_due,
    load_trainer_state,
    non_finite_loss_message,
    trainer_state,
    write_checkpoint,
)
from torchfold.train.loss import PlanLoss
from torchfold.train.optim.optimizer import AccumulatingOptimizer, check_max_grad_norm
from torchfold.train.optim.precision import ScaledLoss, autocast, check_precision, grad_scaler

__all__ = ["DEFAULT_LOG_EVERY", "PlanLoss", "StepStats", "TraceTrainer"]


def _sole_minibatch(local_minibatches: int) -> bool:
    """Whether this rank's ``local_minibatches`` are the step's only minibatch (one minibatch, in one
    process): ``runner.run_minibatch(..., sole_minibatch=True)`` may then run the whole step at once
    (forward, backward and update)."""
    return local_minibatches == 1 and world().size == 1


def _mechanism(compile: str | StepMechanism, backend: str | None, device: torch.device) -> StepMechanism:
    """The trainer's :class:`StepMechanism`: ``compile`` itself when it is one made for this run
    (its device, its number of processes, no other backend)."""
    if not isinstance(compile, StepMechanism):
        return StepMechanism(device, compile=compile, backend=backend)
    differences = []
    if not same_device(compile.device, device):
        differences.append(f"the trainer's device is {device}")
    if compile.world_size != world().size:
        differences.append(f"the run has {world().size} process(es), it was made for {compile.world_size}")
    if backend is not None:
        differences.append(f"compile_backend={backend!r} (give the backend to the StepMechanism)")
    if differences:
        raise ValueError(
            f"compile={compile!r} was made for another run ({'; '.join(differences)}): make it with "
            "StepMechanism(device, compile=..., backend=...) after init_distributed(), or pass compile='auto'"
        )
    return compile


@dataclass
class _FitCall:
    """One call of :meth:`TraceTrainer.fit`: the step it stops before, its bar and log lines, the steps run."""

    end: int
    progress: StepProgress
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
            its ``minibatch_size`` is unset, gradients are weighted by the loader's ``minibatch_size``:
            see :attr:`minibatch_size`; the optimizer itself is left as it is).
        loader: this rank's :class:`~torchfold.train.StepLoader`, with a ``build`` returning
            ``(FoldPlan, targets)`` (a trace, or PopTorch's constant batch, sets the steps).
        loss: ``loss(model, outputs, targets) -> scalar`` (see :class:`PlanLoss`).
        device: where targets go and plans run (default: the model's device); ``trainer.context``
            (:func:`~torchfold.train.run_context`) answers it with the backend, the accumulation
            dtype and where checkpoints are read to. A :class:`~torchfold.train.RunContext` (the
            CLI's) is taken as the trainer's context, its device worked out once.
        checkpoint_dir: directory for ``step-N.pt`` checkpoints (``None``: none are written); one that
            holds checkpoints already is resumed from (see ``resume``).
        resume: where ``checkpoint_dir`` holds checkpoints, ``True`` (default) continues from the
            newest (:meth:`resume`) at construction: a checkpoint of another run (other ``settings``,
            another optimizer, ``lr`` or ``momentum``, model, or a trace whose first steps are not
            the ones it took) is refused with a ValueError naming the difference (a longer trace
            that begins with the steps taken trains on); ``False`` starts at step 0 and first moves the old checkpoints to
            a new ``checkpoint_dir/earlier-N`` (:func:`~torchfold.train.loop.checkpoint.set_aside_checkpoints`),
            so that nothing is overwritten and a later resume continues this run.
        override_hyperparameters: on resume, train on with this run's values of these
            hyperparameters (``"lr"``, ``"momentum"``) instead of refusing a checkpoint written with
            others (:func:`~torchfold.train.loop.checkpoint.keep_hyperparameters`).
        checkpoint_every: write one every this many steps (0: only at the end of :meth:`fit`).
        keep_checkpoints: how many of the newest checkpoints to keep (default 2).
        log_every: log a line every this many steps, and at the last one, on the main rank (0:
            never); ``None`` (default): every :data:`DEFAULT_LOG_EVERY` steps where ``progress=None``
            finds no terminal, else none (a bar, or ``progress=False``: a quiet run).
        progress: show a tqdm bar; ``None`` (default): on the main rank when stderr is a terminal.
        log: where log lines go (default: the ``torchfold`` logger at INFO, shown on stderr where
            the program has not configured :mod:`logging`: :mod:`torchfold.train.loop.progress`).
        on_metrics: ``callback(step, metrics)`` or a list of them, called on the main rank with
            every log line's numbers (``train/loss``, ``train/lr``, ``train/batch_size``,
            ``train/samples_per_s``) and every evaluation's (``eval/<name>``), e.g. a
            :class:`~torchfold.train.loop.tensorboard.TensorBoardWriter`.
        on_step: called with every step's :class:`StepStats` on every rank, before the checkpoint
            that follows the step (what it records is written before a checkpoint covers the step,
            and what it changes is saved in it) and before the next step is launched: a change it
            makes (e.g. a scheduler's ``step()``) applies from the next step on every device.
            Without it, in one process on an accelerator, a step's loss is read back after the next
            step is launched.
        seed: seed every minibatch's random draws (torch, CUDA, XLA, Python's ``random``, NumPy)
            from ``(seed, step, minibatch position)``: world-size invariant dropout and exact
            resumes on any number of processes. ``None`` (default): generators run on.
        handle_sigterm: stop cleanly on SIGTERM during :meth:`fit` (see :class:`~torchfold.train.loop.preemption.Preempted`;
            default ``True``; only in the main thread).
        preemption_timeout: seconds a SIGTERM'd run may take to finish its step and checkpoint
            before it exits anyway (default 120).
        settings: what this run's checkpoints are only valid with, by the names the user knows
            (e.g. a command line's ``{"--hidden-dim": 64}``; plain values). Saved in every
            checkpoint; a resume with a different value is refused naming the setting and both
            values.
        max_grad_norm: clip each step's gradient (the mean over its global batch, after the
            all-reduce) to this total norm before the update: sets the optimizer's
            :attr:`~torchfold.train.AccumulatingOptimizer.max_grad_norm` (default: the optimizer's own,
            ``None`` unless given there).
        precision: ``"fp32"`` (default), ``"bf16"`` (each minibatch's forward and loss under
            ``torch.autocast`` to bfloat16, on any device) or ``"fp16"`` (float16 with a
            ``GradScaler``: CUDA only); :mod:`torchfold.train.optim.precision`. The parameters and the
            update keep their dtype.
        evaluate: ``evaluate(model, eval_data) -> {"name": value}``, called on every rank in
            ``model.eval()`` and ``torch.no_grad()`` (and ``precision``'s autocast) after the steps
            ``eval_every`` and ``eval_every_epochs`` name; its metrics go into that step's
            :attr:`StepStats.metrics`, a log line and ``on_metrics``. The same signature as a
            task's ``evaluate``.
        eval_data: what ``evaluate`` gets beside the model (e.g. the validation samples).
        eval_every: evaluate after every this many steps (counted from step 0).
        eval_every_epochs: evaluate after the last step of every this many epochs (default 1 where
            ``evaluate`` is given and ``eval_every`` is not).
        num_threads: intra-op CPU threads for this process; ``None`` (default): the user's choice
            where one was made (``OMP_NUM_THREADS``, ``torch.set_num_threads``), else
            :data:`~torchfold.train.loop.threads.DEFAULT_THREADS` (:mod:`torchfold.train.loop.threads`); set
            when :meth:`fit` starts, and said once in the log.
        compile: how steps run (:class:`~torchfold.train.StepMechanism`): ``"auto"`` (default)
            runs every step's Python, so whatever it reads is read anew (on XLA lazily: XLA
            compiles a program per graph and reuses it); ``"on"``: :func:`torch.compile` (its guards
            follow what the step reads; on XLA a program captured from each graph replays while
            its guards hold, the step's Python run lazily where it cannot capture the step whole); ``"replay"`` (XLA and CUDA, opt-in):
            each step captured once per static-shape layout and replayed without running its
            Python, faster where the host's time per step counts, for a step that reads nothing
            but its inputs and the values its guard lists (its warning says the contract);
            ``"off"``: eager. Capturing needs the build to return static-shape plans
            (``StaticPlan``; others run eagerly) and an update that can be captured (``Adam`` and
            others need ``capturable=True``, or ``fused=True`` on CUDA; a warning names the fix
            otherwise). Optimizer and tensor hooks then run when a step is captured, not at every
            replay.
            A :class:`~torchfold.train.StepMechanism` made for this run's device (as ``train`` makes
            one to pad its folds and build its optimizer) is taken as it is: the run decides once.
        compile_backend: a :func:`torch.compile` backend instead of the device's (``"torchfold_xla"``
            on XLA, ``inductor`` elsewhere; ``"openxla"`` is torch_xla's), e.g. ``"aot_eager"`` to check a capture quickly.
        warm_up: with steps captured on XLA (``compile="on"`` or ``"replay"``), compile the programs of every static-shape layout
            that a pass over the dataset makes (:meth:`StepLoader.layout_examples()
            <torchfold.train.StepLoader.layout_examples>`) after the first step (with
            ``"replay"``, once the optimizer has its state: after the first step, or at a
            resume), so that no later step stops to compile
            (default ``True``); the compiling counts in the time of the step before.

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
        device: torch.device | str | RunContext | None = None,
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
        compile: str | StepMechanism = "auto",
        compile_backend: str | None = None,
        warm_up: bool = True,
        resume: bool = True,
        override_hyperparameters: Collection[str] = (),
        max_grad_norm: float | None = None,
        precision: str = "fp32",
        evaluate: Evaluate | None = None,
        eval_data: Any = None,
        eval_every: int | None = None,
        eval_every_epochs: int | None = None,
        on_metrics: MetricsCallback | Sequence[MetricsCallback] = (),
        num_threads: int | None = None,
    ) -> None:
        check_parts(model, optimizer, loader, loss)
        check_arguments(checkpoint_every, log_every, keep_checkpoints, seed, preemption_timeout)
        check_int("num_threads", num_threads, 1, optional=True)
        self.eval_every, self.eval_every_epochs = check_evaluation(evaluate, eval_every, eval_every_epochs)
        rank = check_loader_rank(loader)
        if max_grad_norm is not None:
            optimizer.max_grad_norm = check_max_grad_norm(max_grad_norm)
        self.model = model
        self.optimizer = optimizer
        self.loader = loader
        #: the run's device, backend, accumulation dtype and checkpoint map_location, one rule each
        self.context = run_context(device, model=model)
        self.device = self.context.device
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every = checkpoint_every
        self.keep_checkpoints = keep_checkpoints
        self.is_main = rank == 0
        self.progress, self.log_every = progress_defaults(progress, log_every, self.is_main)
        self.log = log if log is not None else default_log()
        self.on_metrics: tuple[MetricsCallback, ...] = (
            (on_metrics,) if callable(on_metrics) else tuple(on_metrics)
        )
        self.evaluate, self.eval_data = evaluate, eval_data
        self.num_threads = num_threads
        #: ``"fp32"``, ``"bf16"`` or ``"fp16"``: the autocast each minibatch's forward and loss run in
        self.precision = check_precision(precision, self.device)
        if self.precision == "fp16":  # the optimizer unscales the step's gradient and skips overflows
            optimizer.grad_scaler = grad_scaler(self.precision, self.device)
        self.on_step = on_step
        self.seed = seed
        self.handle_sigterm = handle_sigterm
        self.preemption_timeout = float(preemption_timeout)
        self.settings = dict(settings or {})
        #: how steps run here (``compile``, the device, the processes): it makes :attr:`runner`
        self.mechanism = _mechanism(compile, compile_backend, self.device)
        self.compile = self.mechanism.compile
        self.loss = loss  # (makes the runner)
        self._sigterm = SigtermGuard(rank)
        # one process on an accelerator: fit() reads each step's loss while the next step runs
        self._defers = self.mechanism.defers_losses
        self._deferred: DeferredReport[tuple[_FitCall, StepStats, StepLoss, float]] = DeferredReport(
            lambda held, until: self._complete(*held, until=until)
        )
        self._warned_unpadded = False
        self._probed_targets = False  # (unpadded plans: the first minibatch's targets checked padded once)
        self.warm_up = warm_up
        self._warmed = False
        #: how many graphs the compiler made during the last :meth:`fit` in this process, by its own count
        #: (:func:`~torchfold.train.distributed.devices.compiled_graphs`): reported at the end of a compiled run
        self.compiled_graphs = 0
        self.next_step: int = loader.next_step
        broadcast_parameters(model)  # rank 0's initial values win
        #: the checkpoint this run resumed from at construction (``resume``), else None
        self.resumed_from: Path | None = None
        #: per hyperparameter kept over the last resume's checkpoint: (the checkpoint's value, this run's)
        self.overridden: dict[str, tuple[float, float]] = {}
        if self.checkpoint_dir is not None and resume:
            self.resumed_from = self.resume(override=override_hyperparameters)
        elif self.checkpoint_dir is not None:
            self._set_aside()

    @property
    def minibatch_size(self) -> int | None:
        """What each minibatch's gradient is weighted by: the optimizer's ``minibatch_size``, else the
        loader's ``minibatch_size`` (the optimizer itself is left as the user made it)."""
        own = self.optimizer.minibatch_size
        return own if own is not None else self.loader.minibatch_size

    @property
    def loss(self) -> PlanLoss:
        """The minibatch loss; setting another one makes the step runner anew (captures included)."""
        return self._loss

    @loss.setter
    def loss(self, value: PlanLoss) -> None:
        if not callable(value):
            raise TypeError(f"loss must be callable as loss(model, outputs, targets), got {value!r}")
        self._loss = value
        #: how every step runs (eagerly, or captured and replayed): chosen once, see ``compile``
        with self.optimizer.default_minibatch_size(self.loader.minibatch_size):  # a runner may keep it
            scaler = self.optimizer.grad_scaler
            self.runner: StepRunner = self.mechanism.runner(
                self.model, ScaledLoss(value, scaler) if scaler is not None else value, self.optimizer
            )

    @property
    def compiled(self) -> Any:
        """The runner's :attr:`~torchfold.train.capture.StepRunner.compiled`: the :func:`torch.compile`
        capture of minibatches (a :class:`~torchfold.train.capture.compiled.CompiledLoss`), when the
        runner uses one (else None)."""
        return self.runner.compiled

    @property
    def replay(self) -> Any:
        """The runner's :attr:`~torchfold.train.capture.StepRunner.replay`: the whole-step replay of
        one-minibatch steps (a :class:`~torchfold.train.capture.cuda_replay.CudaStepReplay`), when the
        runner has one (on CUDA; else None)."""
        return self.runner.replay

    # -- running -------------------------------------------------------------------------------

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
        end, num_epochs = fit_end(self.loader, self.next_step, max_steps, epochs)
        epoch = self.loader.epoch
        sigterm = (
            self._sigterm.handling(self.preemption_timeout, step=lambda: self.next_step)
            if self.handle_sigterm
            else contextlib.nullcontext()
        )
        threads = set_intra_op_threads(self.num_threads)  # (the fold workers run one each: DataLoader's rule)
        if threads is not None and self.is_main and (self.progress or self.log_every):
            self.log(threads)
        progress = StepProgress(
            self.next_step, end, self.progress, self.log_every, self.log, self.is_main, self.on_metrics
        )
        compiled_before = compiled_graphs(self.device)
        with sigterm, progress:
            run = _FitCall(end, progress)
            while self.next_step < end and (num_epochs is None or epoch < num_epochs):
                self.loader.set_epoch(epoch)
                self._fit_epoch(iter(self.loader), run)
                epoch += 1
            if run.history:
                self._final_checkpoint()
        self._report_compilations(compiled_graphs(self.device) - compiled_before)
        return run.history

    def _report_compilations(self, count: int) -> None:
        """Keep and say how many graphs the compiler made during :meth:`fit` (a compiled run, or XLA)."""
        self.compiled_graphs = count
        if not (self.mechanism.captures_steps or is_xla(self.device)):
            return
        if self.is_main and (self.progress or self.log_every):
            compiler = "torch_xla" if is_xla(self.device) else "torch.compile"
            self.log(f"compiled: {count} graphs by {compiler} in this run (this process)")

    def _fit_epoch(self, steps: Iterator[Step[Any]], run: _FitCall) -> None:
        """Run the steps of one epoch until ``run.end``, recording each in ``run``.

        next() only while steps remain: the loader's position is then the trainer's. One process
        on an accelerator: a step's loss is read back while the next one runs (the host does not
        wait for the device at every step); a step that checkpoints, stops or ends the run is read
        back at once.
        """
        deferred = self._deferred
        with deferred.reporting_the_last():
            while self.next_step < run.end and (step := next(steps, None)) is not None:
                self._warm_up_once()
                started = time.perf_counter()
                if self.on_step is not None:
                    # on_step may change the next step (a learning-rate schedule): it runs
                    # before that step is launched, as on the CPU (only the fetch overlaps)
                    deferred.report(until=started)
                stats, loss_sum = self._run_step(step, defer=self._defers)
                deferred.report(until=started, ahead=stats.step)
                self.next_step = stats.step + 1  # (for the checkpoint's turn)
                if loss_sum is not None and not (
                    stats.stop_requested
                    or self._checkpoint_due()
                    or self._evaluation_due(stats.epoch)
                    or self.next_step >= run.end
                ):
                    deferred.hold((run, stats, loss_sum, started))
                    continue
                self._complete(run, stats, loss_sum, started)
                if stats.stop_requested:
                    raise Preempted(self.next_step, self._final_checkpoint())

    def _warm_up_once(self) -> None:
        """The runner's programs for every layout, compiled once the runner is ready to (after the
        first step; see ``warm_up``)."""
        if self._warmed or not self.warm_up or not self.runner.ready_to_warm_up:
            return
        self._warmed = True
        if not self.runner.compiles_ahead:  # (no layout examples to build for nothing)
            return
        started = time.perf_counter()
        with autocast(self.precision, self.device):  # the programs the steps run
            compiled = self.runner.warm_up(self.loader.layout_examples())
        if compiled and self.is_main and (self.progress or self.log_every):
            self.log(f"warm-up: compiled {compiled} programs in {time.perf_counter() - started:.1f} s")

    def _complete(
        self,
        run: _FitCall,
        stats: StepStats,
        loss_sum: StepLoss | None,
        started: float,
        until: float | None = None,
    ) -> None:
        """Read a step's deferred loss (its ``seconds`` then run from ``started`` to ``until``, or
        now), record the step and run what follows it: the bar and log, ``on_step``, a checkpoint."""
        if loss_sum is not None:
            seconds = (time.perf_counter() if until is None else until) - started
            stats = dataclasses.replace(
                read_loss(stats, loss_sum, self._non_finite_loss_message), seconds=seconds
            )
        self.next_step = stats.step + 1
        metrics = self.run_evaluation() if self._evaluation_due(stats.epoch) else None
        if metrics is not None:
            stats = dataclasses.replace(stats, metrics=metrics)
        run.history.append(stats)
        run.progress.step(stats, self.next_step)
        if metrics is not None:
            run.progress.evaluated(self.next_step, metrics)
        if self.on_step is not None:
            self.on_step(stats)
        # After on_step: a record of the step it writes (a history line) is on disk before the
        # checkpoint that covers the step, so a run killed in between repeats the step instead of
        # losing its line; and what it changes for the next step (a learning rate) is saved too.
        if self._checkpoint_due():
            self.save_checkpoint()

    def _evaluation_due(self, epoch: int) -> bool:
        """Whether the step before ``next_step``, of ``epoch``, is followed by an evaluation
        (``eval_every``, ``eval_every_epochs``)."""
        if self.evaluate is None:
            return False
        if self.eval_every and self.next_step % self.eval_every == 0:
            return True
        return bool(
            self.eval_every_epochs
            and (epoch + 1) % self.eval_every_epochs == 0
            and ends_epoch(self.loader, epoch, self.next_step)
        )

    def run_evaluation(self) -> dict[str, float]:
        """``evaluate(model, eval_data)`` now, in ``model.eval()``, ``torch.no_grad()`` and the run's
        autocast; its metrics as floats (the model goes back to training mode)."""
        if self.evaluate is None:
            raise ValueError("the trainer has no evaluate= to run")
        self.model.eval()
        try:
            with torch.no_grad(), autocast(self.precision, self.device):
                found = self.evaluate(self.model, self.eval_data)
        finally:
            self.model.train()
        if not isinstance(found, Mapping):
            raise TypeError(
                f"evaluate must return a mapping of metric names to numbers, got {type(found).__name__}"
            )
        try:
            return {str(name): float(value) for name, value in found.items()}
        except (TypeError, ValueError) as e:
            raise TypeError(f"evaluate's metrics must be numbers (a float or a 0-dim tensor): {e}") from e

    def _non_finite_loss_message(self, step: int, loss: float) -> str:
        return non_finite_loss_message(step, loss, self.checkpoint_dir)

    def train_step(self, step: Step[Any]) -> StepStats:
        """Run one step: this rank's minibatches of ``step`` (maybe none), then the update.

        Every rank must call it for every step, also when it has no minibatch in it.
        """
        stats, loss = self._run_step(step, defer=False)
        return read_loss(stats, loss, self._non_finite_loss_message)

    def _run_step(self, step: Step[Any], defer: bool) -> tuple[StepStats, StepLoss | None]:
        """:meth:`train_step`; with ``defer`` (one process on an accelerator), its loss is left on the
        device, returned beside the stats to be read later (:func:`~torchfold.train.loop.stats.read_loss`),
        so that the host goes on to the next step while the device still runs this one."""
        try:
            return self._train_step(step, defer)
        except BaseException:
            if self.context.is_xla:  # replicas that are threads of this process: stop them too
                abort_replica_threads()
            raise

    def _train_step(self, step: Step[Any], defer: bool) -> tuple[StepStats, StepLoss | None]:
        start = time.perf_counter()
        split = step.split
        self.model.train()
        dtype = self.context.accumulation_dtype
        # the user's optimizer keeps its minibatch_size; ours holds for the step (see minibatch_size)
        with self.optimizer.default_minibatch_size(self.loader.minibatch_size):
            samples, nodes = self._run_minibatches(step)
            summed, scale = self.runner.update()
        loss_sum = summed if summed is not None else torch.zeros((), dtype=dtype, device=self.device)
        stats = step_stats(split, self.optimizer, nodes, start, self._sigterm.received)
        if defer:  # one process: its samples and SIGTERM are the step's; the loss is read later
            return stats, (loss_sum, scale)
        stop, loss = self._sigterm.received, loss_sum * scale
        return summed_over_ranks(
            stats, loss, samples, stop, dtype, start, self._non_finite_loss_message
        ), None

    def _run_minibatches(self, step: Step[Any]) -> tuple[int, int]:
        """This rank's minibatches of ``step`` through the runner; their samples and plan nodes."""
        split = step.split
        samples, nodes = 0, 0
        sole = _sole_minibatch(split.local_minibatches)
        for minibatch in step:
            if self.seed is not None:  # the minibatch's draws, wherever it runs
                seed_generators(derived_seed(self.seed, split.step, minibatch.position), self.device)
            self._check_targets(minibatch)
            plan, targets = to_device(minibatch.data, self.device)
            self._warned_unpadded = self._warned_unpadded or warn_if_unpadded(plan, self.device)
            # NOTE: the runner's backward runs inside the autocast too (the eager runner's run_minibatch()
            # is forward, loss and backward); autograd gives each op's backward its forward's dtype
            with autocast(self.precision, self.device):
                self.runner.run_minibatch(plan, targets, minibatch.num_samples, sole_minibatch=sole)
            nodes += len(plan)
            samples += minibatch.num_samples
        return samples, nodes

    def _check_targets(self, minibatch: Minibatch[Any]) -> None:
        """Refuse targets left unpadded (:mod:`torchfold.train.loop.targets`): those of every padded
        plan; where plans are not padded, those of the first minibatch, built once into static shapes."""
        data = minibatch.data
        if not isinstance(data, tuple) or len(data) != 2:
            return  # (the runner says what a minibatch must be)
        plan, targets = data
        if isinstance(plan, StaticPlan):
            check_target_rows(plan, targets)
        elif not self._probed_targets:
            self._probed_targets = True
            dataset = self.loader.dataset
            probe_target_rows(self.loader.build, [dataset[index] for index in minibatch.indices])

    # -- checkpoints (what they hold and how a run resumes: torchfold.train.loop.trainer_state) ----------

    def _checkpoint_due(self) -> bool:
        return checkpoint_due(self.checkpoint_dir, self.checkpoint_every, self.next_step)

    def _final_checkpoint(self) -> Path | None:
        """Write the checkpoint of the current position unless the last step just wrote it."""
        if self.checkpoint_dir is None:
            return None
        if not self._checkpoint_due():
            return self.save_checkpoint()
        return checkpoint_path(self.checkpoint_dir, self.next_step)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume at :attr:`next_step`: model, optimizer, loader, generators.

        A collective: every rank must call it (each contributes its generators' states).
        """
        return trainer_state(
            self.next_step, self.model, self.optimizer, self.loader, self.settings, self.device
        )

    def load_state_dict(self, state: dict[str, Any], source: str = "state_dict") -> None:
        """Restore a :meth:`state_dict`; ``source`` (e.g. the file) is named in errors."""
        self.next_step = load_trainer_state(
            state,
            source,
            model=self.model,
            optimizer=self.optimizer,
            loader=self.loader,
            settings=self.settings,
            seed=self.seed,
            device=self.device,
        )

    def save_checkpoint(self, path: str | Path | None = None) -> Path:
        """Write :meth:`state_dict` (rank 0 only) atomically; default ``checkpoint_dir/step-N.pt``.

        A collective: every rank must call it. Keeps the ``keep_checkpoints`` newest in the directory.
        The step runner checks its replayed programs against a new trace at their next use (a
        value they read that changed unseen is an error then, see :meth:`StepRunner.check`).
        """
        self.runner.check()
        if self._deferred.ahead is not None:
            raise RuntimeError(
                f"save_checkpoint() while step {self.next_step - 1} is reported, but step {self._deferred.ahead} has "
                "run already (in one process on an accelerator a step is reported after the next one is launched): "
                "the checkpoint would not match its step; use checkpoint_every, or save after fit() returns"
            )
        if path is None:
            if self.checkpoint_dir is None:
                raise ValueError("no path given and the trainer has no checkpoint_dir")
            path = checkpoint_path(self.checkpoint_dir, self.next_step)
        state = self.state_dict()
        path = Path(path)
        if self.is_main:
            write_checkpoint(state, path, self.checkpoint_dir, self.keep_checkpoints)
        return path

    def load_checkpoint(self, path: str | Path) -> None:
        """Resume from a checkpoint file (every rank reads it)."""
        # Read where the run context says (the host); loading copies the values into the model's and
        # the optimizer's tensors on their devices.
        self.load_state_dict(load_checkpoint(path, self.context.map_location), source=f"checkpoint {path}")

    def resume(self, *, override: Collection[str] = ()) -> Path | None:
        """Resume from the newest checkpoint in ``checkpoint_dir``; returns it, or ``None`` if there is none.

        (The constructor does it unless given ``resume=False``.) A checkpoint written with another
        optimizer, ``lr`` or ``momentum`` is refused naming it (a
        :class:`~torchfold.train.loop.checkpoint.HyperparameterMismatch`), unless the name is in
        ``override``: then this run's value is kept. Other differences (``settings``, the model,
        the trace) are refused by :meth:`load_state_dict`.
        """
        if self.checkpoint_dir is None:
            return None
        path = latest_checkpoint(self.checkpoint_dir)
        if path is None:
            return None
        source = f"checkpoint {path}"
        state = load_checkpoint(path, self.context.map_location)
        with keep_hyperparameters(state, self.optimizer, source, override=override) as kept:
            self.load_state_dict(state, source=source)
        self.overridden = dict(kept)
        if self.is_main:
            overridden = "".join(
                f"; {name} {value} kept instead of the checkpoint's {saved}"
                for name, (saved, value) in kept.items()
            )
            self.log(f"resumed from {path} at step {self.next_step}{overridden}")
        return path

    def _set_aside(self) -> None:
        """``resume=False``: the main rank moves the checkpoints in ``checkpoint_dir`` to ``earlier-N``."""
        if self.checkpoint_dir is None or not self.is_main:
            return
        moved = set_aside_checkpoints(self.checkpoint_dir)
        if moved is not None:
            aside, count = moved
            self.log(
                f"moved the {count} earlier checkpoint(s) in {self.checkpoint_dir} to {aside} (resume=False: "
                "this run starts at step 0)"
            )
