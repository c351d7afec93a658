"""How a run's steps run, decided once from what is known before its parts exist: :class:`StepMechanism`.

The device, the number of processes, ``compile=`` and a :func:`torch.compile` backend decide
how every step of a run runs (:mod:`.runner`): its Python run at every step (eagerly, lazily on
XLA, or through :func:`torch.compile`, whose guards follow what the code reads), or, with the
opt-in ``compile="replay"``, captured once and replayed without running its Python. Three
things around the steps follow from the same choice and must be known before the model, the
loss and the optimizer are made: whether folds are padded into static shapes (what a captured
step replays, and what XLA needs to repeat its graphs), which options the torch optimizer needs
(``capturable``, ``fused``) and whether a step's loss is read back late (after the next step is
launched). :class:`StepMechanism` answers them, then :meth:`StepMechanism.runner` makes the
:class:`~torchfold.train.capture.runner.StepRunner` for the parts, so that the choice is made in
one place: the trainer, the command line and a loop of your own ask it.

>>> import torch
>>> mechanism = StepMechanism("cpu", compile="on")
>>> mechanism.needs_static_shapes, mechanism.defers_losses
(True, False)
>>> model = torch.nn.Linear(2, 1)
>>> optimizer = mechanism.optimizer(torch.optim.SGD, model.parameters(), lr=0.1)
>>> optimizer.defaults["fused"]
True
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from torchfold._validate import check_int
from torchfold.engine.static.shapes import StaticShapes
from torchfold.train.capture.compiled import (
    COMPILE_CHOICES,
    XLA_PROGRAMS,
    CompiledLoss,
    CompiledUpdate,
    uncapturable_update,
    wants_compile,
)
from torchfold.train.capture.cuda_replay import uncapturable_step
from torchfold.train.capture.runner import CudaRunner, EagerRunner, StepRunner, XlaRunner
from torchfold.train.capture.xla_programs import xla_programs_unavailable
from torchfold.train.distributed.devices import (
    capturable_optimizer,
    fused_optimizer,
    needs_static_shapes,
    on_host,
    runner_kind,
)
from torchfold.train.distributed.world import world
from torchfold.train.loss import PlanLoss
from torchfold.train.optim.optimizer import AccumulatingOptimizer

__all__ = ["REPLAY_CONTRACT", "StepMechanism", "step_runner"]

#: the contract of ``compile="replay"``, said in the warning a replaying runner gives when it is made
REPLAY_CONTRACT = (
    "compile='replay' replays each captured step without running its Python, so a step sees the tensors it "
    "takes as inputs and the values its guard lists (module attributes, the loss's closure, defaults and "
    "globals, captured again every verify_every replays) as they are now, and anything else it reads (a class "
    "attribute, a global first set later, an attribute two objects down, Python's random, an attribute the "
    "step rebinds) as it was when captured: use it only for a step that reads nothing else, else "
    "compile='auto' (docs/design/capture.md)"
)


class StepMechanism:
    """How steps run on ``device`` with ``compile=``: what the run must do around them, and their runner.

    Args:
        device: where the model runs.
        compile: ``"auto"`` (default): every step's Python runs (eagerly on the CPU and CUDA,
            lazily on XLA, whose compiler caches a program per graph it builds), so whatever the
            step reads is read anew; ``"on"``: :func:`torch.compile` (its guards follow what the
            step's code reads; on XLA a program captured from each graph, replayed while its guards
            hold, and a step Dynamo cannot capture as one graph runs its Python lazily instead, with
            one warning); ``"replay"`` (XLA and
            CUDA, opt-in): each step captured once and replayed without running its Python
            (:data:`REPLAY_CONTRACT` says what that assumes); ``"off"``: eager
            (:attr:`compile_choices`).
        backend: a :func:`torch.compile` backend instead of the device's (e.g. ``"aot_eager"``).
        world_size: the number of processes (default: :func:`~torchfold.train.world`'s).

    The optimizer's own options (its learning-rate rule, gradient clipping, an fp16 grad scaler,
    ``capturable``) are read by :meth:`runner`, which falls back to the next best runner, with a
    warning saying why, where the first choice cannot run them.

    Example:
        >>> import torch, torchfold
        >>> mechanism = StepMechanism(torch.device("cpu"))
        >>> mechanism.needs_static_shapes  # eager on the CPU: folds as they come
        False
        >>> model = torch.nn.Linear(2, 1)
        >>> base = mechanism.optimizer(torch.optim.Adam, model.parameters(), lr=0.01)
        >>> opt = torchfold.train.AccumulatingOptimizer(base)
        >>> type(mechanism.runner(model, lambda m, o, t: o[0].sum(), opt)).__name__
        'EagerRunner'
    """

    #: the values ``compile=`` takes
    compile_choices: ClassVar[tuple[str, ...]] = COMPILE_CHOICES

    def __init__(
        self,
        device: torch.device | str,
        *,
        compile: str = "auto",
        backend: str | None = None,
        world_size: int | None = None,
    ) -> None:
        self.device = torch.device(device)
        #: whether ``compile=`` asks for captured steps on this device (the runner may still fall back)
        self.captures_steps = wants_compile(compile, self.device)  # (refuses a choice not in compile_choices)
        self.compile = compile
        self.backend = backend
        self.world_size = world().size if world_size is None else check_int("world_size", world_size)

    def __repr__(self) -> str:
        return (
            f"StepMechanism(device={str(self.device)!r}, compile={self.compile!r}, backend={self.backend!r}, "
            f"world_size={self.world_size})"
        )

    @property
    def needs_static_shapes(self) -> bool:
        """Whether folds must be padded into static shapes (``Fold(shapes=StaticShapes(...))``, e.g.
        :func:`~torchfold.train.fit_static_shapes`): on XLA always (its graphs repeat only then),
        elsewhere where steps are captured (a capture replays one static-shape layout)."""
        return needs_static_shapes(self.device) or self.captures_steps

    def static_shapes(self, **options: Any) -> StaticShapes:
        """The envelope to fit for these steps: ``StaticShapes(**options)``, with one layout of every
        level (``depth_buckets=False``) on XLA when steps are traced lazily (``compile="auto"`` and
        ``"off"``), else one layout per depth bucket (``options`` given here win).

        XLA compiles a layout at the first step that meets it, and a lazily traced step cannot
        compile the others ahead without running the user's step on a batch it was not given: with
        depth buckets a layout first met late stalls the run for a compilation (about 5 s each for
        the SST Tree-LSTM on torch_xla's CPU backend; ``benchmarks/results/xla.md``). One layout pads
        shallow batches to every level instead. Captured steps (``"on"``, ``"replay"``) keep depth
        buckets: their warm-up compiles every layout ahead (not with a ``backend=`` of the user's,
        e.g. ``"openxla"``: one layout then). (The rule reads ``compile=``: a capture that falls back
        to lazy steps, with a warning saying why, keeps depth buckets; on the CPU and CUDA,
        ``compile="on"`` keeps them too.)

        >>> StepMechanism("xla").static_shapes().depth_buckets, StepMechanism("xla", compile="on").static_shapes().depth_buckets
        (False, True)
        >>> StepMechanism("cpu", compile="on").static_shapes(min_rows=4).depth_buckets
        True
        """
        # (compile="on" with a backend of the user's, openxla say, compiles nothing ahead)
        lazy_xla = runner_kind(self.device) == "xla" and (
            self.compile in ("auto", "off")
            or (self.compile == "on" and self.backend not in (None, XLA_PROGRAMS))
        )
        return StaticShapes(**{"depth_buckets": not lazy_xla, **options})

    @property
    def defers_losses(self) -> bool:
        """Whether a step's loss is read back after the next step is launched: in one process on an
        accelerator, so that the host does not wait for the device at every step."""
        return self.world_size == 1 and not on_host(self.device)

    @property
    def optimizer_options(self) -> dict[str, bool]:
        """The options a torch optimizer is made with here, where its class takes them: ``fused=True``
        on the CPU and CUDA (one kernel for all parameters; on the CPU about 5x less time, on CUDA what
        a CUDA graph captures), ``capturable=True`` on XLA (the step count stays on the device, so a
        captured update replays)."""
        options: dict[str, bool] = {}
        if fused_optimizer(self.device):
            options["fused"] = True
        if capturable_optimizer(self.device):
            options["capturable"] = True
        return options

    def optimizer(
        self, optimizer_class: type[torch.optim.Optimizer], params: Iterable[Any], **options: Any
    ) -> torch.optim.Optimizer:
        """``optimizer_class(params, **options)`` with :attr:`optimizer_options` added where the class
        takes them (``options`` given here win).

        >>> import torch
        >>> w = [torch.zeros(1, requires_grad=True)]
        >>> StepMechanism("cpu").optimizer(torch.optim.SGD, w, lr=0.1, fused=False).defaults["fused"]
        False
        """
        accepted = inspect.signature(optimizer_class).parameters
        chosen = {name: value for name, value in self.optimizer_options.items() if name in accepted}
        return optimizer_class(params, **{**chosen, **options})

    def runner(self, model: torch.nn.Module, loss: PlanLoss, optimizer: AccumulatingOptimizer) -> StepRunner:
        """The :class:`~torchfold.train.capture.runner.StepRunner` that runs the steps of ``model``,
        ``loss`` and ``optimizer`` here: the step's Python at every step
        (:class:`~torchfold.train.capture.runner.EagerRunner`; on XLA, lazily), through
        :func:`torch.compile` with ``compile="on"`` (on XLA with the lazy step as its fallback), and with
        ``compile="replay"`` replayed programs on XLA
        (:class:`~torchfold.train.capture.runner.XlaRunner`) or a step of one minibatch replayed whole
        on one GPU (:class:`~torchfold.train.capture.runner.CudaRunner`).

        A runner that cannot be had with this optimizer says why in a warning and the next best one
        is used.
        """
        compile, device, backend = self.compile, self.device, self.backend
        kind = runner_kind(device)
        if not self.captures_steps:
            return EagerRunner(model, loss, optimizer, device=device)
        if optimizer.grad_scaler is not None:
            warnings.warn(
                f"compile={compile!r}: steps run eagerly with a grad_scaler (fp16): a captured update cannot skip "
                "the steps whose gradients overflowed",
                stacklevel=3,
            )
            return EagerRunner(model, loss, optimizer, device=device)
        single = self.world_size == 1 and optimizer.lr_rule != "adascale" and backend is None
        if compile == "replay":
            warnings.warn(REPLAY_CONTRACT, stacklevel=3)
        if compile == "replay" and kind == "xla" and optimizer.lr_rule != "adascale" and backend is None:
            why = xla_programs_unavailable() or uncapturable_update(optimizer.optimizer)
            if (
                why is None
            ):  # (several replicas: the minibatch and update programs, an all-reduce between them)
                return XlaRunner(model, loss, optimizer, device=device)
            warnings.warn(
                f"compile={compile!r}: steps are not replayed on XLA, they run as with compile='off': {why}",
                stacklevel=3,
            )
            return EagerRunner(model, loss, optimizer, device=device)
        if compile == "replay" and single and kind == "cuda":
            why = uncapturable_step(optimizer.optimizer)
            if why is None and optimizer.max_grad_norm is not None:
                why = f"max_grad_norm={optimizer.max_grad_norm}: the captured step does not clip its gradient"
            if why is None:
                return CudaRunner(model, loss, optimizer, device=device)
            warnings.warn(
                f"compile={compile!r}: steps are not replayed as CUDA graphs (they run eagerly): {why}",
                stacklevel=3,
            )
            return EagerRunner(model, loss, optimizer, device=device)
        if compile == "replay":
            why = (
                f"backend={backend!r} is a torch.compile backend"
                if backend is not None
                else "lr_rule='adascale' reads each minibatch's gradient norm"
                if optimizer.lr_rule == "adascale"
                else f"{self.world_size} processes on CUDA (a CUDA graph replays one process's step)"
            )
            warnings.warn(
                f"compile={compile!r}: steps are not replayed, they run as with compile='auto': {why}",
                stacklevel=3,
            )
            return EagerRunner(model, loss, optimizer, device=device)
        # (on XLA a step Dynamo cannot trace whole runs its Python lazily instead, sound as well)
        compiled = CompiledLoss(model, loss, device=device, backend=backend, fallback=kind == "xla")
        update = None
        # (on XLA the update stays lazy: TorchDynamo's compiled update of SGD with momentum was
        # silently wrong in scenarios of scripts/fuzz_replay.py --compile on; benchmarks/results/xla.md)
        if kind not in ("cuda", "xla"):
            reason = uncapturable_update(optimizer.optimizer)
            if reason is None:
                update = CompiledUpdate(optimizer.optimizer, device=device, backend=backend)
            else:
                warnings.warn(
                    f"compile={compile!r}: the forward, loss and backward are captured, but the optimizer's update "
                    f"runs op by op: {reason}",
                    stacklevel=3,
                )
        return EagerRunner(
            model, loss, optimizer, compiled=compiled, update=update, strict=compile == "on", device=device
        )


def step_runner(
    model: torch.nn.Module,
    loss: PlanLoss,
    optimizer: AccumulatingOptimizer,
    *,
    device: torch.device,
    compile: str = "auto",
    backend: str | None = None,
) -> StepRunner:
    """The runner for ``compile=`` on ``device`` (``"auto"``: the step's Python at every step, lazily
    on XLA; ``"on"``: :func:`torch.compile` anywhere; ``"replay"``: replayed steps on XLA and CUDA;
    ``"off"``: eager), chosen once:
    ``StepMechanism(device, compile=compile, backend=backend).runner(model, loss, optimizer)``
    (:meth:`StepMechanism.runner`).

    A runner that cannot be had here says why in a warning and the next best one is used.

    >>> import torch, torchfold
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torchfold.train.AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    >>> type(step_runner(model, lambda m, o, t: o[0].sum(), opt, device=torch.device("cpu"))).__name__
    'EagerRunner'
    """
    return StepMechanism(device, compile=compile, backend=backend).runner(model, loss, optimizer)
