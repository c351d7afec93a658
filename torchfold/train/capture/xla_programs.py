"""A step of any number of minibatches on XLA as two replayed programs: a minibatch's and the update's.

A step of ``k`` minibatches used to go through :func:`torch.compile` and the optimizer wrapper's
Python weighting, and a new ``k`` could mean a new program. Here every step is made of two kinds
of programs, each captured once and replayed from XLA's compilation cache:

* the **minibatch program**, one per envelope layout (and model state structure): forward, loss,
  backward, and the weighted accumulation of the gradients into persistent buffers
  (``acc + weight * grad``), plus the step's loss sum (``loss_sum + loss_weight * loss``); every
  per-minibatch value (the plan's packed indices and columns, the targets, the sample weight) is
  a fixed-shape device tensor input, so a step of ``k`` minibatches replays it ``k`` times and
  ``k`` never enters a program;
* the **update program**, one per optimizer state structure: the division of the accumulated
  gradients by the step's sample count (a tensor input), the optimizer's update with the
  learning rates as tensor inputs, and the zeroing of the buffers. The optimizer's other options
  (betas, eps, momentum, weight decay...) are read at every step: when they change (a
  ``OneCycleLR``), the update's Python is traced again, and the same compiled program runs on
  the values they give (XLA makes a Python number a parameter of the graph, not part of it).

Every tensor a program reads is an input bound by its role, never by its value or its device
buffer: the module's parameters, buffers and tensors kept as plain attributes, the optimizer's
state, the accumulation buffers, the batch's tensors, and the runner's own numbers (sample
weights, learning rates, divisors), which are 1-element vectors made for their role alone
(torch_xla shares one buffer among equal 0-dim tensors, and with a capture's own constants).
What a program depends on besides its inputs is its key: the layout, every module parameter and
buffer (which tensor, shape, dtype, ``requires_grad``), the batch's tensor shapes, the
optimizer's state structure, and what a
:class:`~torchfold.train.capture.guards.StepGuard` reads before every replay (every module's
``training`` flag, numbers kept in module attributes, the loss function, its closure and
globals). A guarded value that keeps changing (more than :data:`~torchfold.train.capture.guards.MAX_VALUES` values for one
layout) is refused with a warning naming it. What a captured step reads from elsewhere is
checked by capturing it again: at a program's second use, every ``verify_every`` replays, and at
:meth:`XlaPrograms.check` (the trainer's checkpoints): a second capture that differs refuses
replays with a warning, a later one raises (earlier replays may have used an old value). A step
that draws random numbers, or reads a value back to the host, is refused too. A refused runner
runs the steps lazily (op by op), as without capture.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple, TypeVar

import torch

from torchfold.engine.static import StaticPlan
from torchfold.train.capture._replay import Options, at_rates_without_grads, options_now, target_tensors
from torchfold.train.capture.compiled import check_loss, uncapturable_update
from torchfold.train.capture.guards import StepGuard
from torchfold.train.capture.xla_capture import (
    Computed,
    Program,
    Refused,
    compile_program,
    graph_sources,
    positions,
    restored_afterwards,
    same_constants,
)
from torchfold.train.capture.xla_linear import transposed_weights, transposes_here
from torchfold.train.data.loader import to_device
from torchfold.train.distributed import xla_calls
from torchfold.train.distributed.devices import SentValues
from torchfold.train.distributed.world import all_reduce_sum_
from torchfold.train.distributed.xla_calls import CAPTURE_LOCK, HostReads, materialize, replay_unavailable
from torchfold.train.loss import PlanLoss
from torchfold.train.optim.optimizer import sample_weight

__all__ = [
    "VERIFY_EVERY",
    "XlaPrograms",
    "graph_sources",
    "xla_programs_unavailable",
]

#: replays of a program between two captures that check it (0: never)
VERIFY_EVERY = 100

_T = TypeVar("_T")


def xla_programs_unavailable() -> str | None:
    """Why this torch_xla cannot replay captured programs (None if it can): the graph-cache calls
    are those of :func:`~torchfold.train.distributed.xla_calls.replay_unavailable`.

    >>> isinstance(xla_programs_unavailable(), str | None)
    True
    """
    return replay_unavailable()


def _sync() -> None:
    import torch_xla

    torch_xla.sync()


class _MinibatchSetup(NamedTuple):
    """What a minibatch program reads and is keyed by (see ``XlaPrograms._minibatch_setup``)."""

    trainable: list[torch.Tensor]
    buffers: list[torch.Tensor]
    accs: list[torch.Tensor]
    inputs: Any
    weight: torch.Tensor
    loss_weight: torch.Tensor
    loss_sum: torch.Tensor
    live: list[torch.Tensor]
    key: Hashable
    #: the key but what the guard reads, and what it reads
    base: Hashable
    guarded: tuple[Hashable, ...]


class _UpdateSetup(NamedTuple):
    """What the update program reads and is keyed by (see ``XlaPrograms._update_setup``)."""

    accs: list[torch.Tensor]
    rates: list[torch.Tensor]
    divisors: list[torch.Tensor]
    slots: list[tuple[torch.Tensor, str]]
    live: list[torch.Tensor]
    key: Hashable
    #: the optimizer's options (but the learning rates) at this step: not in the key (see ``update``)
    options: Options


class XlaPrograms:
    """Steps of any number of minibatches on one XLA device, as replayed minibatch and update programs.

    Per step: :meth:`run_minibatch` once per minibatch (it accumulates the minibatch's gradient,
    weighted by its sample count, into persistent buffers, and its loss into the step's loss
    sum), then :meth:`update` once (the optimizer's update on the step's mean gradient; the
    buffers are zeroed). The results equal ``AccumulatingOptimizer``'s ``minibatch()`` /
    ``step()`` in one process.

    Args:
        model: the module whose methods are the fold ops, on an XLA device.
        loss: ``loss(model, outputs, targets) -> scalar``.
        optimizer: the ``torch.optim`` optimizer (capturable: e.g. ``Adam(..., capturable=True)``).
        minibatch_unit: what a sample count is measured in (``AccumulatingOptimizer.minibatch_unit()``:
            its ``minibatch_size``, or 1).
        reduction: ``"mean"`` (losses averaged over a minibatch's samples) or ``"sum"``. With
            ``minibatch_unit``, what the minibatches' gradients and losses are weighted by, and the
            step's gradient divided by: :func:`~torchfold.train.optim.optimizer.sample_weight`, the
            optimizer's own rule.
        transpose_weights: capture ``F.linear`` against transposed weight copies (XLA's CPU backend).
        verify_every: capture a program again after this many replays and compare (0: never).
        max_grad_norm: clip the step's mean gradient to this total 2-norm before the update
            (``torch.nn.utils.clip_grad_norm_``), inside the update program.

    Raises:
        RuntimeError: this torch_xla cannot replay programs (see :func:`xla_programs_unavailable`).
        ValueError: the optimizer's update cannot be captured (the message names the fix).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        loss: PlanLoss,
        optimizer: torch.optim.Optimizer,
        *,
        minibatch_unit: float = 1.0,
        reduction: str = "mean",
        transpose_weights: bool | None = None,
        verify_every: int = VERIFY_EVERY,
        max_grad_norm: float | None = None,
    ) -> None:
        why = xla_programs_unavailable()
        if why is not None:
            raise RuntimeError(f"steps cannot be replayed on XLA: {why}; train with compile='off'")
        reason = uncapturable_update(optimizer) or _host_state(optimizer)
        if reason is not None:
            raise ValueError(f"the optimizer's update cannot be captured: {reason}")
        if verify_every < 0:
            raise ValueError(f"verify_every must be >= 0 (0: never), got {verify_every}")
        self.model, self.loss, self.optimizer = model, loss, optimizer
        sample_weight(1, reduction)  # (raises for a reduction other than "mean" or "sum", naming it)
        self.unit = float(minibatch_unit)
        self.reduction = reduction
        if transpose_weights is None:
            transpose_weights = transposes_here()
        self.transpose_weights = transpose_weights
        #: replays of a program between two captures that check it (0: never)
        self.verify_every = verify_every
        #: the total 2-norm the update clips the step's mean gradient to (None: no clipping)
        self.max_grad_norm = max_grad_norm
        #: what the Python side of a step reads besides the programs' inputs, read before every replay
        self.guard = StepGuard(model, loss)
        #: why steps are no longer replayed (then they run lazily, op by op), or None
        self.refused: str | None = None
        self._minibatch: dict[Hashable, Program] = {}
        self._update: dict[Hashable, Program] = {}
        self._sent = SentValues()  # the programs' numbers and first loss sums (see _scalar)
        # tensors whose device buffer a program computed (its results): no 0-dim one of them is
        # torch_xla's cached scalar, so a capture need not give it a buffer of its own
        self._computed = Computed()
        self._acc: dict[int, torch.Tensor] = {}  # per parameter (id): its accumulated gradient
        self._has_grad: set[int] = set()  # parameters some minibatch of this step had a gradient for
        self._loss_sum: torch.Tensor | None = None
        self._minibatches = 0
        self._steps = 0  # updates so far

    # -- public --------------------------------------------------------------------------------

    @property
    def captures(self) -> int:
        """How many programs have been captured and compiled (minibatch and update programs)."""
        return len(self._minibatch) + len(self._update)

    def run_minibatch(self, plan: Any, targets: Any, num_samples: int) -> None:
        """Accumulate one minibatch of ``num_samples`` samples (forward, loss, backward) into the step."""
        params = self._params()
        targets = to_device(targets, params[0].device)  # a replayed program reads device tensors only
        if self.refused is not None or not isinstance(plan, StaticPlan):  # an unpadded plan: run op by op
            self._lazy_minibatch(plan, targets, num_samples)
            return
        setup, why = self._minibatch_setup(plan, targets, num_samples)
        if setup is None:
            self._refuse(str(why))
            self._lazy_minibatch(plan, targets, num_samples)
            return
        if not self._follows(setup.base, setup.guarded):
            self._lazy_minibatch(plan, targets, num_samples)
            return
        trainable, buffers, live, key = setup.trainable, setup.buffers, setup.live, setup.key
        with CAPTURE_LOCK:
            materialize(live)
            program = self._minibatch.get(key)
            if program is not None and program.verified and self._due(program):
                self._check(
                    program,
                    "minibatch",
                    [*params, *buffers],
                    lambda: self._capture_minibatch(plan, targets, setup, run=False)[0],
                )
            # replayed once verified, and in the step it was captured in (a schedule changes between steps)
            if program is not None and (program.verified or program.step == self._steps):
                results = program.run(live)
            else:
                try:
                    captured, found = self._capture_minibatch(plan, targets, setup)
                except Refused as refusal:  # this minibatch's capture still counts: run as it is
                    self._refuse(str(refusal))
                    self._store_minibatch(refusal.roots, trainable, buffers, len(refusal.roots))
                    _sync()
                    return
                if program is not None:  # the second capture: the same graph, the same constants?
                    self._verify(program, captured)
                else:
                    captured.step = self._steps
                    self._minibatch[key] = captured
                self._store_minibatch(found, trainable, buffers, len(found))
                return
        # a replay: its results are the roots that changed, in the captured order
        full: list[Any] = [None] * (len(trainable) + len(buffers) + 1)
        for where, value in zip(program.outputs, results, strict=True):
            full[where] = value
        self._store_minibatch(full, trainable, buffers, len(full))

    def warm_up(self, plan: Any, targets: Any, num_samples: int) -> list[torch.Tensor] | None:
        """Compile the minibatch program of ``plan``'s layout now, without running it: the
        parameters, buffers, optimizer state and the step under way stay as they are, and the first
        minibatch of that layout replays the program (after its second capture, as always) instead
        of compiling it. Returns the parameters the minibatch has gradients for (what
        :meth:`warm_up_update` needs), or None: no program (a program of this layout exists, or
        the plan cannot be replayed)."""
        params = self._params()
        targets = to_device(targets, params[0].device)
        if self.refused is not None or not isinstance(plan, StaticPlan):
            return None
        setup, _ = self._minibatch_setup(plan, targets, num_samples, first=True)
        if setup is None or not self._follows(setup.base, setup.guarded):
            return None
        ahead = self._compile_ahead(
            self._minibatch,
            setup.live,
            setup.key,
            [*params, *setup.buffers],
            lambda: self._capture_minibatch(plan, targets, setup, run=False),
        )
        if ahead is None:
            return None
        captured, _ = ahead
        self._minibatch[setup.key] = captured  # (captured.step: none, so the first use verifies it)
        changed = set(captured.outputs)
        return [p for number, p in enumerate(setup.trainable) if number in changed]

    def update(self, lrs: list[float], batch_size: int) -> torch.Tensor:
        """The step's update with learning rate ``lrs[i]`` for param group ``i``, on the mean gradient
        over ``batch_size`` samples; returns the step's loss sum (losses times sample counts with
        ``reduction="mean"``) and starts a new step."""
        self._check_rates(lrs)
        if not self._minibatches and not self._has_grad:
            raise RuntimeError("update() with no minibatch in the step")
        params = self._params()
        # (a replica without minibatches in this step, its gradients summed in by all_reduce: no loss of its own)
        loss_sum = self._loss_sum if self._loss_sum is not None else self._zero_sum(params[0].device)
        divisor = self._divisor(batch_size)
        try:
            if self.refused is not None:
                self._lazy_update(lrs, divisor)
                return loss_sum
            graded = [p for p in params if id(p) in self._has_grad]
            setup, why = self._update_setup(lrs, divisor, graded)
            if setup is None:
                self._refuse(str(why))
                self._lazy_update(lrs, divisor)
                return loss_sum
            live, key, slots = setup.live, setup.key, setup.slots
            with CAPTURE_LOCK:
                materialize(live)
                program = self._update.get(key)
                if program is not None and program.options != setup.options:
                    program = self._for_options(program, params, graded, setup)
                if program is not None and program.verified and self._due(program):
                    self._check(
                        program,
                        "update",
                        params,
                        lambda: self._capture_update(params, graded, setup, run=False)[0],
                    )
                if program is None or not program.verified:
                    try:
                        captured, found, new_slots = self._capture_update(params, graded, setup)
                    except Refused as refusal:  # this update's capture still counts: run as it is
                        self._refuse(str(refusal))
                        state = self.optimizer.state
                        made = [(p, name) for p in params for name in sorted(state.get(p, {}))]
                        self._store_update(refusal.roots, params, graded, made)
                        _sync()
                        return loss_sum
                    if program is not None:  # the second capture: the same graph, the same constants?
                        self._verify(program, captured)
                    elif new_slots == slots:  # a program that creates the state is not one to replay
                        captured.step = self._steps
                        captured.options = setup.options
                        self._update[key] = captured
                    self._store_update(found, params, graded, new_slots)
                    return loss_sum
                results = program.run(live)
            full: list[Any] = [None] * (len(params) + len(slots) + len(graded))
            for where, value in zip(program.outputs, results, strict=True):
                full[where] = value
            self._store_update(full, params, graded, slots)
            return loss_sum
        finally:
            self._steps += 1
            self._loss_sum = None
            self._has_grad.clear()
            self._minibatches = 0

    def check(self) -> None:
        """Have the next use of every program capture it again and compare, before it is replayed
        (the trainer calls it at each checkpoint): a program that no longer matches its new
        capture raises there (see :meth:`_check`)."""
        for program in [*self._minibatch.values(), *self._update.values()]:
            program.due = program.verified

    def all_reduce(self, num_samples: int, num_minibatches: int) -> tuple[int, int]:
        """Sum the step's accumulated gradients over the replicas (processes, or threads of one),
        before :meth:`update`; every replica calls it once per step, also one without minibatches.
        Returns the step's samples and minibatches over all replicas.

        The all-reduce is a program of its own (:func:`~torchfold.train.distributed.world.all_reduce_sum_`),
        the same at every step; the minibatch and update programs stay those of one device, so
        every replica replays the same programs. With the gradients goes what each replica had a
        gradient for, so that a parameter no replica has one for is left out of the update, as by
        ``AccumulatingOptimizer.synchronize``.
        """
        params = self._params()
        trainable = [p for p in params if p.requires_grad]
        accs = [self._acc_of(p) for p in trainable]
        local = [
            float(num_samples),
            float(num_minibatches),
            *(float(id(p) in self._has_grad) for p in trainable),
        ]
        stats = torch.tensor(local, dtype=torch.float32).to(params[0].device)
        all_reduce_sum_([*accs, stats])
        totals = stats.tolist()  # (read back: which parameters the update program steps is part of its key)
        self._has_grad = {id(p) for p, had in zip(trainable, totals[2:], strict=True) if had > 0}
        return round(totals[0]), round(totals[1])

    def warm_up_update(self, lrs: list[float], batch_size: int, graded: Sequence[torch.Tensor]) -> bool:
        """Compile the update program now, without running it (nothing changes), for a step whose
        minibatches have gradients for ``graded`` (see :meth:`warm_up`); whether one was compiled
        (not: it exists, the optimizer has no state yet, or the update cannot be replayed).

        Warm up after the optimizer has its state (after a first step, or a resume): an update
        that creates the state is a program of its own, which no later step replays.
        """
        self._check_rates(lrs)
        if self.refused is not None or not self.optimizer.state:
            return False
        params = self._params()
        setup, _ = self._update_setup(lrs, self._divisor(batch_size), list(graded))
        if setup is None:
            return False
        ahead = self._compile_ahead(
            self._update,
            setup.live,
            setup.key,
            params,
            lambda: self._capture_update(params, list(graded), setup, run=False),
        )
        if ahead is None:
            return False
        captured, _, new_slots = ahead
        if new_slots != setup.slots:  # the update would create state: not the program steps replay
            return False
        captured.options = setup.options
        self._update[setup.key] = captured
        return True

    def _for_options(
        self, program: Program, params: list[torch.Tensor], graded: list[torch.Tensor], setup: _UpdateSetup
    ) -> Program | None:
        """The update ``program`` for the optimizer's options now, which differ from those it was
        captured with (a ``OneCycleLR`` cycling Adam's betas, a weight-decay schedule): the
        optimizer's Python traced again (never run; XLA makes the options' values parameters of
        the graph, not part of it), and ``program`` reads the new capture's constants: no new
        program, no compile. None: the new capture is another graph (an option that selects
        other code, e.g. a weight decay that becomes 0), dropped: the step captures it anew."""
        try:
            with restored_afterwards(params, self.optimizer, self._computed):
                captured, _, slots = self._capture_update(params, graded, setup, run=False)
        except Refused:
            captured = None  # (the step's own capture says why)
        if captured is None or captured.graph != program.graph or slots != setup.slots:
            del self._update[setup.key]
            return None
        captured.options = setup.options
        program.rebind(captured)
        return program

    def _compile_ahead(
        self,
        programs: dict[Hashable, Program],
        live: list[torch.Tensor],
        key: Hashable,
        changed: list[torch.Tensor],
        capture: Callable[[], _T],
    ) -> _T | None:
        """``capture()`` (a capture with ``run=False``: compiled, never run) unless ``programs`` has
        ``key``, with ``changed`` and the optimizer's state put back afterwards (:func:`restored_afterwards`);
        its result, or None: the program exists, or its capture is refused (refused from now on:
        the steps would be)."""
        with CAPTURE_LOCK:
            materialize(live)
            if key in programs:
                return None
            for attempt in range(3):
                try:
                    with restored_afterwards(changed, self.optimizer, self._computed):
                        return capture()
                except Refused as refusal:
                    # (replicas that are threads count each other's graphs: a capture put back
                    # unchanged may be tried again)
                    if refusal.host_read and attempt < 2 and xla_calls.replica_threads():
                        continue
                    self._refuse(str(refusal))
                    return None
            return None

    # -- what a program reads --------------------------------------------------------------------

    def _minibatch_setup(
        self, plan: StaticPlan, targets: Any, num_samples: int, *, first: bool = False
    ) -> tuple[_MinibatchSetup | None, str | None]:
        """A minibatch program's inputs (``live``) and key, or why it cannot be replayed.
        ``first``: as the step's first minibatch (a loss sum of zero)."""
        params = self._params()
        device = params[0].device
        trainable = [p for p in params if p.requires_grad]
        accs = [self._acc_of(p) for p in trainable]
        guarded = self.guard.values()
        # the module's buffers, and tensors kept as plain attributes: inputs, written back if the step changes them
        held = {id(b) for b in self.model.buffers()}
        buffers = [*self.model.buffers(), *(t for t in self.guard.tensors() if id(t) not in held)]
        held = {id(q) for q in params}
        others = [p for p in self.model.parameters() if id(p) not in held]
        inputs = plan.inputs(device)
        batch, why = target_tensors(targets)
        if why is not None:
            return None, why
        weight = self._scalar("weight", sample_weight(num_samples, self.reduction, self.unit), params[0])
        loss_weight = self._scalar("loss weight", sample_weight(num_samples, self.reduction), None, device)
        loss_sum = self._loss_sum if self._loss_sum is not None and not first else self._zero_sum(device)
        data = [inputs.ints, inputs.floats, *inputs.given, *batch]
        live = [*params, *others, *buffers, *accs, weight, loss_weight, loss_sum, *data]
        base = (
            plan.layout.key,
            _describe(params),
            _describe(others),
            tuple((tuple(b.shape), b.dtype) for b in buffers),
            tuple((tuple(t.shape), t.dtype) for t in data),
            self.model.training,
            id(self.loss),
        )
        setup = _MinibatchSetup(
            trainable,
            buffers,
            accs,
            inputs,
            weight,
            loss_weight,
            loss_sum,
            live,
            (base, guarded),
            base,
            guarded,
        )
        return setup, None

    def _update_setup(
        self, lrs: list[float], divisor: float, graded: list[torch.Tensor]
    ) -> tuple[_UpdateSetup | None, str | None]:
        """The update program's inputs (``live``), key and the optimizer's state slots, or why it
        cannot be replayed."""
        groups = self.optimizer.param_groups
        options, why = options_now(self.optimizer)
        why = why or uncapturable_update(self.optimizer) or _host_state(self.optimizer)
        if why is not None:
            return None, why
        params = self._params()
        if not all(group["params"] for group in groups):
            raise ValueError("a replayed step needs parameters in every param group; remove the empty groups")
        accs = [self._acc_of(p) for p in graded]
        state = self.optimizer.state
        slots = [(p, name) for p in params for name in sorted(state.get(p, {}))]
        rates = [
            self._scalar(f"learning rate {number}", float(rate), group["params"][0])
            for number, (group, rate) in enumerate(zip(groups, lrs, strict=True))
        ]
        divisors = [self._scalar("divisor", divisor, p) for p in graded]
        states = [state[p][name] for p, name in slots]
        live = [*params, *accs, *states, *rates, *divisors]
        key = (
            _describe(params),
            tuple(id(p) for p in graded),
            tuple((id(p), name, tuple(t.shape), t.dtype) for (p, name), t in zip(slots, states, strict=True)),
            self.max_grad_norm,
        )
        return _UpdateSetup(accs, rates, divisors, slots, live, key, options), None

    def _check_rates(self, lrs: list[float]) -> None:
        groups = self.optimizer.param_groups
        if len(lrs) != len(groups):
            raise ValueError(f"lrs has {len(lrs)} learning rates for {len(groups)} param groups")

    def _divisor(self, batch_size: int) -> float:
        return sample_weight(batch_size, self.reduction, self.unit)

    # -- capturing -----------------------------------------------------------------------------

    def _capture_minibatch(
        self, plan: StaticPlan, targets: Any, setup: _MinibatchSetup, *, run: bool = True
    ) -> tuple[Program, list[Any]]:
        position = positions(setup.live, self._computed)
        reads = HostReads()  # (this thread's reads: replicas may be threads)
        linear = transposed_weights() if self.transpose_weights else contextlib.nullcontext()
        trainable = setup.trainable
        with reads, torch.enable_grad(), linear:
            loss = check_loss(
                self.loss(self.model, plan.layout.run(self.model, setup.inputs, padded=True), targets)
            )
            grads = torch.autograd.grad(loss, trainable, allow_unused=True) if trainable else ()
        with torch.no_grad():
            weight = setup.weight.reshape(())
            new_accs = [
                acc if grad is None else acc + grad * weight.to(grad.dtype)
                for acc, grad in zip(setup.accs, grads, strict=True)
            ]
            total = setup.loss_sum + loss.detach().to(setup.loss_sum.dtype) * setup.loss_weight.reshape(
                ()
            )  # (1,)
        return compile_program([*new_accs, *setup.buffers, total], position, setup.live, reads, run=run)

    def _store_minibatch(
        self, found: list[Any], trainable: list[torch.Tensor], buffers: list[torch.Tensor], count: int
    ) -> None:
        for p, value in zip(trainable, found[: len(trainable)], strict=True):
            if value is not None:
                self._acc[id(p)] = value
                self._computed.add(value)
                self._has_grad.add(id(p))
        with torch.no_grad():
            for b, value in zip(buffers, found[len(trainable) : count - 1], strict=True):
                if value is not None:
                    b.data = value
                    self._computed.add(b)
        self._loss_sum = found[count - 1]
        self._minibatches += 1

    def _capture_update(
        self, params: list[torch.Tensor], graded: list[torch.Tensor], setup: _UpdateSetup, *, run: bool = True
    ) -> tuple[Program, list[Any], list[tuple[torch.Tensor, str]]]:
        position = positions(setup.live, self._computed)
        reads = HostReads()
        rates = _rates_for(self.optimizer, setup.rates)
        with reads, at_rates_without_grads(self.optimizer, rates), _PowersOfNumbers():
            for p, acc, divisor in zip(graded, setup.accs, setup.divisors, strict=True):
                p.grad = acc / divisor.reshape(())
            if self.max_grad_norm is not None and graded:
                torch.nn.utils.clip_grad_norm_(graded, self.max_grad_norm)
            self.optimizer.step()
        state = self.optimizer.state
        slots = [(p, name) for p in params for name in sorted(state.get(p, {}))]
        zeros = [torch.zeros_like(acc) for acc in setup.accs]
        program, found = compile_program(
            [*params, *(state[p][name] for p, name in slots), *zeros], position, setup.live, reads, run=run
        )
        return program, found, slots

    def _store_update(
        self,
        found: list[Any],
        params: list[torch.Tensor],
        graded: list[torch.Tensor],
        slots: list[tuple[torch.Tensor, str]],
    ) -> None:
        state = self.optimizer.state
        with torch.no_grad():
            for p, value in zip(params, found[: len(params)], strict=True):
                if value is not None:
                    p.data = value
                    self._computed.add(p)
            for (p, name), value in zip(slots, found[len(params) : len(params) + len(slots)], strict=True):
                if value is not None:
                    state[p][name] = value
                    self._computed.add(value)
        for p, value in zip(graded, found[len(params) + len(slots) :], strict=True):
            if value is not None:
                self._acc[id(p)] = value
                self._computed.add(value)

    # -- the lazy way (refused) ----------------------------------------------------------------

    def _lazy_minibatch(self, plan: Any, targets: Any, num_samples: int) -> None:
        """The same minibatch run op by op (no replay): into the buffers, as a replay would."""
        import torch_xla

        params = [p for p in self._params() if p.requires_grad]
        device = self._params()[0].device
        loss = check_loss(self.loss(self.model, plan.apply(self.model, padded=True), targets))
        grads = torch.autograd.grad(loss, params, allow_unused=True) if params else ()
        weight = sample_weight(num_samples, self.reduction, self.unit)
        with torch.no_grad():
            for p, grad in zip(params, grads, strict=True):
                if grad is not None:
                    self._acc[id(p)] = self._acc_of(p) + grad * weight
                    self._has_grad.add(id(p))
            loss_sum = self._loss_sum if self._loss_sum is not None else self._zero_sum(device)
            self._loss_sum = loss_sum + loss.detach().float() * sample_weight(num_samples, self.reduction)
        self._minibatches += 1
        torch_xla.sync()

    def _lazy_update(self, lrs: list[float], divisor: float) -> None:
        import torch_xla

        params = self._params()
        with at_rates_without_grads(self.optimizer, lrs):
            graded = [p for p in params if id(p) in self._has_grad]
            for p in graded:
                p.grad = self._acc[id(p)] / divisor
            if self.max_grad_norm is not None and graded:
                torch.nn.utils.clip_grad_norm_(graded, self.max_grad_norm)
            self.optimizer.step()
        for p in params:
            if id(p) in self._acc:
                self._acc[id(p)] = torch.zeros_like(p)
        torch_xla.sync()

    # -- helpers -------------------------------------------------------------------------------

    def _params(self) -> list[torch.Tensor]:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if not params:
            raise ValueError("the optimizer has no parameters")
        return params

    def _acc_of(self, p: torch.Tensor) -> torch.Tensor:
        acc = self._acc.get(id(p))
        if acc is None or acc.shape != p.shape or acc.dtype != p.dtype or acc.device != p.device:
            # sent from the host: device data, not one more (tiny) program to compile; its own
            # tensor, not a SentValues one (an all-reduce sums into the accumulators in place)
            acc = self._acc[id(p)] = torch.zeros(p.shape, dtype=p.dtype).to(p.device)
        return acc

    def _scalar(
        self, role: str, value: float, like: torch.Tensor | None, device: torch.device | None = None
    ) -> torch.Tensor:
        """``value`` for ``role`` (a sample weight, a learning rate...) as a 1-element vector on the
        device (in ``like``'s dtype, else float32), made once per role and value: a tensor no
        other role and no constant of a capture shares (a 0-dim one would be torch_xla's cached
        scalar of that value); the programs read it as a scalar."""
        dtype = like.dtype if like is not None else torch.float32
        where = like.device if like is not None else device
        assert where is not None
        return self._sent.full(role, (1,), value, dtype, where)

    def _zero_sum(self, device: torch.device) -> torch.Tensor:
        """A step's first loss sum: a 1-element zero vector sent to the device (a 0-dim zero would
        be a constant of torch_xla's, materialized by a program of its own). The loss sums a
        step's programs add up are 1-element vectors too."""
        return self._sent.full("loss sum", (1,), 0.0, torch.float32, device)

    def _follows(self, base: Hashable, guarded: tuple[Hashable, ...]) -> bool:
        """Whether programs may follow the guard's values ``guarded`` on ``base`` (a program per
        value); a value that keeps changing is refused here, named."""
        why = self.guard.admit(base, guarded)
        if why is not None:
            self._refuse(why)
        return why is None

    def _due(self, program: Program) -> bool:
        return program.due or (self.verify_every > 0 and program.replays >= self.verify_every)

    def _check(
        self, program: Program, kind: str, changed: list[torch.Tensor], capture: Callable[[], Program]
    ) -> None:
        """Capture ``program``'s step again (never run: ``changed`` and the optimizer's state are put
        back) and compare: a program that no longer matches its new capture has replayed a value that
        is not its input, and that is an error, not a warning."""
        since = program.replays
        program.replays, program.due = 0, False
        try:
            with restored_afterwards(changed, self.optimizer, self._computed):
                captured = capture()
        except Refused as refusal:
            if refusal.host_read and xla_calls.replica_threads():
                program.due = True  # (maybe another replica's graph: the next use checks again)
                return
            why = str(refusal)
        else:
            if same_constants(program, captured):
                return
            why = "its new capture is another graph, or reads other constants"
        raise RuntimeError(
            f"the replayed {kind} program no longer matches its step ({why}): a value the step reads changed "
            f"within the last {since} replays, and it is neither an input (a parameter, buffer or tensor attribute "
            "of the model, optimizer state, the batch) nor a value the guard reads (module attributes, the loss's "
            "closure and globals); those steps used its old value. Keep such a value in a module attribute or a "
            "buffer (see the capture guide), or train with compile='off'"
        )

    def _verify(self, program: Program, captured: Program) -> None:
        """``program`` may be replayed if a second capture of it is the same graph on the same
        constants; otherwise a value it reads is not among its inputs: refused."""
        if same_constants(program, captured):
            program.verified = True
        else:
            self._refuse(
                "a value the step reads is neither a parameter, a buffer, optimizer state nor a batch tensor, and "
                "changed between steps (a Python number in the loss or the ops?); replaying would keep its first value"
            )

    def _refuse(self, why: str) -> None:
        if self.refused is None:
            self.refused = why
            warnings.warn(f"steps are not replayed (they run op by op): {why}", stacklevel=4)

    def __repr__(self) -> str:
        return f"XlaPrograms({type(self.optimizer).__name__}, captures={self.captures})"


class _PowersOfNumbers(torch.overrides.TorchFunctionMode):
    """Inside, a power of a Python number or to one (``beta1 ** step`` in Adam's capturable update)
    takes the number as a 0-dim tensor: torch_xla makes such a number a constant of the graph (its
    hash changes with it), every other op's a parameter, so a schedule of Adam's betas would be a
    new graph at every step instead of the same program on other values."""

    _POWERS = frozenset({"pow", "pow_", "__pow__", "__rpow__", "__ipow__", "float_power"})

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in self._POWERS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if tensors:
                like = tensors[0]  # (a float in its floating dtype: a float64 step keeps its precision)
                dtype = like.dtype if like.is_floating_point() else None
                args = tuple(
                    torch.tensor(a, dtype=dtype if isinstance(a, float) else None).to(like.device)
                    if isinstance(a, int | float) and not isinstance(a, bool)
                    else a
                    for a in args
                )
        return func(*args, **kwargs)


def _describe(params: Sequence[torch.Tensor]) -> tuple[Hashable, ...]:
    return tuple((id(p), tuple(p.shape), p.dtype, p.requires_grad) for p in params)


def _rates_for(optimizer: torch.optim.Optimizer, rates: list[torch.Tensor]) -> list[torch.Tensor]:
    """The learning-rate inputs as the optimizer's update reads them, 0-dim. ``torch.optim.SGD``
    turns a learning-rate tensor into a Python number (a read back to the host) unless it
    requires grad; then it multiplies by the tensor (the same product)."""
    scalars = [rate.reshape(()) for rate in rates]
    if isinstance(optimizer, torch.optim.SGD):
        return [rate.detach().requires_grad_() for rate in scalars]
    return scalars


def _host_state(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the optimizer's state cannot be an XLA program's input (a tensor of it on the host)."""
    for p, state in optimizer.state.items():
        for name, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != p.device:
                return (
                    f"{type(optimizer).__name__} keeps its state {name!r} on {value.device}, not beside the "
                    f"parameters on {p.device}"
                )
    return None
