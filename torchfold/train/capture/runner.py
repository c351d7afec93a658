"""The one seam between the training loop and the ways a step can run: :class:`StepRunner`.

A step is any number of minibatches of this rank (each: a plan, its targets and its sample
count), then one update. The trainer calls :meth:`StepRunner.run_minibatch` for each and
:meth:`StepRunner.update` once, and nothing else; :class:`~torchfold.train.capture.mechanism.StepMechanism`
(or :func:`~torchfold.train.capture.mechanism.step_runner`) chooses the mechanism once, from the
device, the number of processes, the optimizer and ``compile=``:

* :class:`EagerRunner`: the ordinary PyTorch step (``loss.backward()`` inside
  ``optimizer.minibatch(n)``, then ``optimizer.step()``), each minibatch's forward, loss and
  backward optionally compiled by :func:`torch.compile` (:class:`~torchfold.train.capture.compiled.CompiledLoss`);
  the CPU's default, and every device's with ``compile="off"``;
* :class:`XlaRunner`: on XLA, every step as replays of one minibatch program per minibatch and
  one update program (:class:`~torchfold.train.capture.xla_programs.XlaPrograms`), whatever
  their number; with several replicas (threads or processes), an all-reduce of the gradients
  between them, the same programs on every replica;
* :class:`CudaRunner`: on one GPU, a step of one minibatch replayed whole from one CUDA graph
  (:class:`~torchfold.train.capture.cuda_replay.CudaStepReplay`); a step of several runs eagerly (no
  inductor compile on the default path: its compiles took seconds per new minibatch count).

Adding a backend means one more runner here, and its choice in :mod:`.mechanism`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from torchfold.engine.static import StaticPlan
from torchfold.train.capture.compiled import CompiledLoss, CompiledUpdate, check_loss
from torchfold.train.capture.cuda_replay import CudaStepReplay
from torchfold.train.capture.xla_programs import XlaPrograms
from torchfold.train.data.loader import to_device
from torchfold.train.distributed.devices import SentValues, accumulation_dtype, is_xla, synchronize
from torchfold.train.distributed.world import world
from torchfold.train.loss import PlanLoss
from torchfold.train.optim.optimizer import AccumulatingOptimizer, sample_weight

__all__ = ["CudaRunner", "EagerRunner", "StepRunner", "XlaRunner"]


class StepRunner:
    """Runs a step's minibatches, then its update; the trainer's only way to run a step.

    Per step: :meth:`run_minibatch` for each of this rank's minibatches (``sole_minibatch=True``
    when it is the step's only one, in one process: a runner may then run the whole step at once), then
    :meth:`update` on every rank (also one without minibatches), which returns the step's loss
    sum (losses times sample counts with ``reduction="mean"``) as ``(tensor, scale)``: the sum is
    ``float(tensor) * scale``, read back whenever the caller likes.

    ``device`` is the run's (:meth:`StepMechanism.runner
    <torchfold.train.capture.mechanism.StepMechanism.runner>` passes the one it chose for); left out, the
    optimizer's parameters' (:meth:`~torchfold.train.AccumulatingOptimizer.params_device`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        loss: PlanLoss,
        optimizer: AccumulatingOptimizer,
        *,
        device: torch.device | None = None,
    ) -> None:
        self.model, self.loss, self.optimizer = model, loss, optimizer
        #: the run's device, asked of the device policy (never of ``device.type``)
        self.device = device if device is not None else optimizer.params_device()

    def run_minibatch(
        self, plan: Any, targets: Any, num_samples: int, *, sole_minibatch: bool = False
    ) -> None:
        raise NotImplementedError

    def update(self) -> tuple[torch.Tensor | None, float]:
        raise NotImplementedError

    @property
    def captures(self) -> int:
        """How many programs (graphs) this runner has captured so far."""
        return 0

    #: the :func:`torch.compile` capture of minibatches, when this runner uses one
    compiled: CompiledLoss | None = None

    @property
    def replay(self) -> CudaStepReplay | None:
        """The whole-step replay of one-minibatch steps, when this runner has one (on CUDA)."""
        return None

    @property
    def compiles_ahead(self) -> bool:
        """Whether :meth:`warm_up` compiles anything (worth building its layout examples)."""
        return False

    @property
    def ready_to_warm_up(self) -> bool:
        """Whether :meth:`warm_up` can compile now: once the optimizer has its state (a program
        of the update compiled ahead needs it: after the first step, or at a resume)."""
        return bool(self.optimizer.optimizer.state)

    def warm_up(self, examples: Sequence[Any]) -> int:
        """Compile the programs of each example's layout now, without running a step (nothing
        changes), so that no step after it compiles; the number of programs compiled (0 for a
        runner that compiles nothing ahead: the eager and CUDA runners).

        Args:
            examples: minibatches (``.data`` = ``(plan, targets)``, ``.num_samples``), one per
                layout: :meth:`StepLoader.layout_examples() <torchfold.train.StepLoader.layout_examples>`.

        Call it once the optimizer has its state (after the first step, or a resume).
        """
        return 0

    def check(self) -> None:
        """Have the next replay of each captured program check it against a new capture first (the
        trainer calls it at each checkpoint); nothing for a runner that replays nothing."""

    def _loss_weight(self, num_samples: int) -> float:
        """A minibatch's weight in the step's loss sum (:func:`~torchfold.train.optim.optimizer.sample_weight`)."""
        return sample_weight(num_samples, self.optimizer.reduction)


class EagerRunner(StepRunner):
    """The ordinary step: ``optimizer.minibatch(n)`` around each backward, ``optimizer.step()``.

    With ``compiled``, a static plan's forward, loss and backward replay a
    :class:`~torchfold.train.capture.compiled.CompiledLoss` graph instead (``strict``: an unpadded plan is
    refused rather than run eagerly); with ``update``, the optimizer's update is that
    :class:`~torchfold.train.capture.compiled.CompiledUpdate`, handed to the optimizer by
    :meth:`~torchfold.train.AccumulatingOptimizer.computed_step` as every runner's own step is.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        loss: PlanLoss,
        optimizer: AccumulatingOptimizer,
        *,
        compiled: CompiledLoss | None = None,
        update: CompiledUpdate | None = None,
        strict: bool = False,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(model, loss, optimizer, device=device)
        self.compiled = compiled
        #: the optimizer's update, captured (None: the optimizer's own)
        self.compiled_update = update
        self.strict = strict
        #: the step's loss sum so far (None before its first minibatch)
        self._loss_sum: torch.Tensor | None = None
        # On XLA (lazily traced steps, or compiled ones: their gradients reach p.grad through
        # autograd too), each minibatch's gradients and loss are added to buffers
        # that are device data at every minibatch's start, zeros at a step's first: the first
        # minibatch's graph is then every later one's, one program per layout whatever its
        # position in the step (autograd's own accumulation into p.grad makes a first minibatch,
        # which creates p.grad, another graph than a later one, which adds to it)
        # (one replica: with two XLA devices as threads of one process, a step with no minibatch
        # on one of them gave an update graph that a later such step did not repeat; measured by
        # test_xla's replica test, and left as it was)
        self._buffered = is_xla(self.device) and world().size == 1
        # per parameter (id) some minibatch of the step had a gradient for: it, and its weighted sum
        self._acc: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._sent = SentValues()  # the buffers' zeros and the loss weights, as device data

    @property
    def captures(self) -> int:
        return self.compiled.captures if self.compiled is not None else 0

    @property
    def compiles_ahead(self) -> bool:
        # (a compiled step of the user's own, any callable, compiles nothing ahead)
        return isinstance(self.compiled, CompiledLoss) and self.compiled.programs is not None

    @property
    def ready_to_warm_up(self) -> bool:
        # once a step has captured a program (the minibatch's programs only: the update is not
        # compiled ahead). (torch_xla hashed the first graph of a process differently when a
        # warm-up traced it than when the step that replays it did: one compile more.)
        return isinstance(self.compiled, CompiledLoss) and bool(
            self.compiled.programs and self.compiled.programs.programs
        )

    def warm_up(self, examples: Sequence[Any]) -> int:
        if not isinstance(self.compiled, CompiledLoss):
            return 0
        compiled = 0
        for example in examples:
            plan, targets = to_device(example.data, self.device)
            compiled += self.compiled.warm_up(plan, targets)
        return compiled

    def run_minibatch(
        self, plan: Any, targets: Any, num_samples: int, *, sole_minibatch: bool = False
    ) -> None:
        with self.optimizer.minibatch(num_samples):
            if self.compiled is not None and (isinstance(plan, StaticPlan) or self.strict):
                loss = self.compiled(plan, targets)  # forward, loss and backward, captured
            else:
                # padded=True: a static plan's outputs keep their capacity (the build padded the targets)
                loss = check_loss(self.loss(self.model, plan.apply(self.model, padded=True), targets))
                loss.backward()
            # summed here, inside the minibatch (on XLA, its graph, which leaving optimizer.minibatch()
            # cuts): a sum over the step's minibatches at the update would make the update's graph
            # depend on their number, a program per minibatch count
            dtype = torch.promote_types(loss.dtype, accumulation_dtype(loss.device))
            if self._buffered:  # (the weight as a graph input of its own: see SentValues)
                weight = self._sent.full(
                    "loss weight", (), self._loss_weight(num_samples), dtype, self.device
                )
                weighted = loss.detach().to(dtype) * weight
                self._into_buffers()
                # (from a 1-element vector: a 0-dim zero could be an XLA constant)
                start = self._loss_sum
                if start is None:
                    start = self._sent.full("loss sum", (1,), 0.0, dtype, self.device)
                self._loss_sum = start + weighted
            else:
                weighted = loss.detach().to(dtype) * self._loss_weight(num_samples)
                self._loss_sum = weighted if self._loss_sum is None else self._loss_sum + weighted

    def update(self) -> tuple[torch.Tensor | None, float]:
        if self._buffered:
            for p, acc in self._acc.values():
                p.grad = acc  # the step's sum, as autograd would have left it
            self._acc.clear()
        if self.compiled_update is None:
            self.optimizer.step()
        else:
            self.optimizer.computed_step(functools.partial(_compiled_update, self.compiled_update))
        self.optimizer.zero_grad()
        loss_sum, self._loss_sum = self._loss_sum, None
        if loss_sum is not None and self._buffered:
            loss_sum = loss_sum.reshape(())
        # on XLA, the update as a graph of its own (the same every step), not cut at the next host read
        synchronize(self.device)
        return (None, 0.0) if loss_sum is None else (loss_sum, 1.0)

    def _into_buffers(self) -> None:
        """Add this minibatch's gradients (weighted, in ``p.grad``) to the step's buffers and
        clear ``p.grad``, inside the minibatch (whose end cuts XLA's graph)."""
        with torch.no_grad():
            for group in self.optimizer.optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    held = self._acc.get(id(p))
                    acc = (
                        held[1]
                        if held is not None
                        else self._sent.full(id(p), tuple(p.shape), 0.0, p.dtype, self.device)
                    )
                    self._acc[id(p)] = (p, acc + p.grad)
                    p.grad = None


class XlaRunner(StepRunner):
    """XLA: every step replayed, however many minibatches it has, on one device or several replicas (see the module)."""

    def __init__(
        self,
        model: torch.nn.Module,
        loss: PlanLoss,
        optimizer: AccumulatingOptimizer,
        *,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(model, loss, optimizer, device=device)
        self.programs = XlaPrograms(
            model,
            loss,
            optimizer.optimizer,
            minibatch_unit=optimizer.minibatch_unit(),
            reduction=optimizer.reduction,
            max_grad_norm=optimizer.max_grad_norm,
        )
        self._samples = self._count = 0

    @property
    def captures(self) -> int:
        return self.programs.captures

    @property
    def compiles_ahead(self) -> bool:
        return True

    def run_minibatch(
        self, plan: Any, targets: Any, num_samples: int, *, sole_minibatch: bool = False
    ) -> None:
        self.programs.run_minibatch(plan, targets, num_samples)
        self._samples += num_samples
        self._count += 1

    def warm_up(self, examples: Sequence[Any]) -> int:
        base = self.optimizer.optimizer
        lrs = [float(group["lr"]) for group in base.param_groups]
        params = [p for group in base.param_groups for p in group["params"]]
        compiled, graded, samples = 0, set(), 0
        self.programs.max_grad_norm = self.optimizer.max_grad_norm
        for example in examples:
            plan, targets = to_device(example.data, params[0].device)
            found = self.programs.warm_up(plan, targets, example.num_samples)
            if found is not None:
                compiled += 1
                graded |= {id(p) for p in found}
            samples = max(samples, example.num_samples)
        if samples:
            # as a step of two such minibatches (the batch size is an input: any would do)
            with_grad = [p for p in params if id(p) in graded] or [p for p in params if p.requires_grad]
            compiled += self.programs.warm_up_update(lrs, 2 * samples, with_grad)
        return compiled

    def check(self) -> None:
        """Have the next use of each program capture it again and compare (at a checkpoint)."""
        self.programs.check()

    def update(self) -> tuple[torch.Tensor | None, float]:
        samples, count = self._samples, self._count
        self._samples = self._count = 0
        clipped = self.optimizer.max_grad_norm is not None
        self.programs.max_grad_norm = self.optimizer.max_grad_norm
        if world().size == 1:
            if not count:
                return None, 0.0
            loss_sum = self.optimizer.computed_step(
                functools.partial(_update, self.programs, samples),
                num_samples=samples,
                num_minibatches=count,
                clipped=clipped,
            )
            return loss_sum, 1.0
        # several replicas: their gradients summed (a program of its own), then the same update program on each
        samples, count = self.programs.all_reduce(samples, count)
        if not count:
            raise RuntimeError(
                "a step with no minibatch on any replica: the trace gave it no samples, or every replica's loader "
                "skipped them"
            )
        loss_sum = self.optimizer.computed_step(
            functools.partial(_update, self.programs, samples),
            num_samples=samples,
            num_minibatches=count,
            reduced=True,
            clipped=clipped,
        )
        return loss_sum, 1.0  # (zero on a replica without minibatches; the trainer sums over the replicas)


def _update(programs: XlaPrograms, samples: int, lrs: list[float]) -> torch.Tensor:
    return programs.update(lrs, samples)


def _compiled_update(update: CompiledUpdate, lrs: list[float]) -> None:
    update()  # (it reads the rates ``lrs`` from the param groups, where computed_step puts them)


class CudaRunner(EagerRunner):
    """One GPU: a step of one minibatch replayed whole from one CUDA graph; others eagerly."""

    def __init__(
        self,
        model: torch.nn.Module,
        loss: PlanLoss,
        optimizer: AccumulatingOptimizer,
        *,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(model, loss, optimizer, device=device)
        #: the step of one minibatch (``sole_minibatch=True``), forward, backward and update, as one CUDA graph
        self.whole_step_replay = CudaStepReplay(model, loss, optimizer.optimizer)
        self._whole_loss: tuple[torch.Tensor, float] | None = None

    @property
    def captures(self) -> int:
        return int(getattr(self.whole_step_replay, "captures", 0))

    @property
    def replay(self) -> CudaStepReplay | None:
        return self.whole_step_replay

    def run_minibatch(
        self, plan: Any, targets: Any, num_samples: int, *, sole_minibatch: bool = False
    ) -> None:
        if sole_minibatch and isinstance(plan, StaticPlan) and self.whole_step_replay.refused is None:
            # (one minibatch: its weight and the step's divisor cancel, so the graph weighs nothing)
            loss = self.optimizer.computed_step(
                functools.partial(self.whole_step_replay, plan, targets),
                num_samples=num_samples,
                num_minibatches=1,
            )
            self._whole_loss = (loss, self._loss_weight(num_samples))
            return
        super().run_minibatch(plan, targets, num_samples, sole_minibatch=sole_minibatch)

    def update(self) -> tuple[torch.Tensor | None, float]:
        if self._whole_loss is not None:
            loss, self._whole_loss = self._whole_loss, None
            self.optimizer.zero_grad()
            return loss
        return super().update()
