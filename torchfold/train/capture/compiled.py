"""Captured training steps: a static plan's forward, loss and backward compiled once per layout, then replayed.

On an XLA device every eager step is recorded op by op into a lazy graph before XLA runs it;
with static shapes the graph repeats, so XLA compiles it once, but the host still records every op
of every batch. On a GPU the same step is hundreds of small kernel launches. Both costs go when the
step is captured once and replayed: :class:`CompiledLoss` compiles ``loss(model,
layout.run(model, inputs), targets)`` with :func:`torch.compile` once per
:class:`~torchfold.engine.static.StaticLayout` (the structure an envelope version fixes), and
feeds each batch's :class:`~torchfold.engine.static.StaticInputs` (packed index arrays and
columns, fixed shapes) and targets as the graph's inputs; the backward runs the compiled backward
graph, and gradients accumulate in ``.grad`` as usual, so
:class:`~torchfold.train.AccumulatingOptimizer`'s weighting, the all-reduce and the update stay as
they are: a step with a new number of minibatches creates no new program.

Backends: XLA uses :data:`XLA_PROGRAMS`, a backend of torchfold's own
(:class:`~torchfold.train.capture.dynamo_programs.XlaGraphPrograms`: TorchDynamo's guards decide
when a program captured from the graph, forward, loss and backward in one, replays; pass
``backend="openxla"`` for torch_xla's); CUDA and a CPU (when asked, ``compile="on"``; it stays eager by
default) use ``inductor``'s default mode. On CUDA, CUDA graphs come from
:class:`~torchfold.train.capture.cuda_replay.CudaStepReplay`, which replays a whole step of one minibatch;
inductor's own CUDA graphs (``mode="reduce-overhead"``) are not the default: in the trainer,
steps of several minibatches failed with them in a backward ("accessing tensor output of
CUDAGraphs that has been overwritten by a subsequent run"), also with
``torch.compiler.cudagraph_mark_step_begin()`` before every minibatch (the run:
``benchmarks/results/gpu.md``). Pass ``mode=`` to choose them anyway; the losses returned are
then copies.

The optimizer's update can be captured separately, by :class:`CompiledUpdate`. It runs after the
all-reduce, once per step, so the minibatch graphs stay the same whatever the number of
minibatches. ``compile="on"`` uses it on the CPU only: on CUDA a fused optimizer
(``Adam(fused=True)``) is already a few kernels, and on XLA the update stays lazy, since the
differential fuzzer (``scripts/fuzz_replay.py --compile on``) found TorchDynamo's compiled update of
SGD with momentum silently different from the eager one there (``benchmarks/results/xla.md``).
"""

from __future__ import annotations

import threading
import time
import types
import warnings
from collections.abc import Callable, Hashable
from typing import Any, Literal

import torch

from torchfold._errors import add_note
from torchfold._validate import check_int
from torchfold.engine.resolve import device_for
from torchfold.engine.static import StaticLayout, StaticPlan
from torchfold.train.capture.dynamo_programs import XlaGraphPrograms
from torchfold.train.distributed.devices import is_cuda, is_xla, on_host, replays_steps
from torchfold.train.loss import PlanLoss

__all__ = [
    "COMPILE_CHOICES",
    "HOST_MAX_CAPTURES",
    "CompiledLoss",
    "CompiledUpdate",
    "RateTensors",
    "check_loss",
    "compile_backend",
    "uncapturable_update",
    "wants_compile",
]

COMPILE_CHOICES = ("auto", "off", "on", "replay")
#: :class:`CompiledLoss`'s default ``max_captures`` on the CPU (dynamo's own recompile limit is 8 too)
HOST_MAX_CAPTURES = 8
_CAPTURE_LOCK = threading.Lock()
#: ``compile="on"``'s backend on XLA: TorchDynamo's guards, the graph run as a captured program
#: with its backward (:class:`~torchfold.train.capture.dynamo_programs.XlaGraphPrograms`)
XLA_PROGRAMS = "torchfold_xla"
CompileChoice = Literal["auto", "off", "on", "replay"]


def check_loss(loss: Any) -> torch.Tensor:
    """``loss`` if it is a scalar tensor (a minibatch's loss), else a TypeError saying what it is."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise TypeError(
            f"loss must return a scalar tensor (the minibatch's loss), got "
            f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}"
        )
    return loss


def wants_compile(choice: str, device: torch.device) -> bool:
    """Whether ``compile=choice`` captures steps on ``device``: ``"on"`` (:func:`torch.compile`,
    whose guards follow what the step's code reads) and ``"replay"`` (captured once, replayed
    without running the step's Python: XLA and CUDA only); ``"auto"`` and ``"off"`` run every
    step's Python (on XLA, XLA compiles the graphs it builds).

    >>> wants_compile("auto", torch.device("cpu")), wants_compile("on", torch.device("cpu"))
    (False, True)
    >>> wants_compile("replay", torch.device("cpu"))
    Traceback (most recent call last):
    ...
    ValueError: compile='replay' replays captured steps on XLA and CUDA only, not on cpu; use compile='on' (torch.compile) or 'auto' there
    """
    if choice not in COMPILE_CHOICES:
        raise ValueError(f"compile must be one of {COMPILE_CHOICES}, got {choice!r}")
    if choice == "replay" and not replays_steps(device):
        raise ValueError(
            f"compile='replay' replays captured steps on XLA and CUDA only, not on {device}; use compile='on' "
            "(torch.compile) or 'auto' there"
        )
    return choice in ("on", "replay")


def compile_backend(device: torch.device) -> tuple[str, str | None]:
    """The :func:`torch.compile` backend and mode that capture a step on ``device``.

    >>> compile_backend(torch.device("cuda"))
    ('inductor', None)
    """
    if is_xla(device):
        return XLA_PROGRAMS, None
    return "inductor", None


class CompiledLoss:
    """``loss(model, plan.apply(model, padded=True), targets).backward()`` for static plans, compiled once per layout.

    Calling it runs the forward, the loss and the backward (gradients accumulate into ``.grad``
    as after ``loss.backward()``) and returns the loss, detached. Plans
    of one layout (one :attr:`StaticLayout.key <torchfold.engine.static.StaticLayout.key>`)
    replay one compiled graph; a plan of a new layout (the envelope grew: its
    :class:`~torchfold.StaticShapesWarning` says so) is captured once more. Parameters replaced
    or added after a capture are caught by the compiled graph's guards and captured anew, never
    run stale.

    Args:
        model: the module whose methods are the fold ops.
        loss: ``loss(model, outputs, targets) -> scalar``; it must not read values back to the
            host (``.item()``, ``.tolist()``, ``print`` of a tensor): the capture says which op did.
        device: where the model lives (picks the backend).
        backend: a :func:`torch.compile` backend instead of the device's (e.g. ``"aot_eager"``
            to check the capture without generating code).
        mode: the :func:`torch.compile` mode (default: the device's, see :func:`compile_backend`).
        max_captures: capture at most this many layouts; a plan of a later layout runs eagerly
            (the same loss and gradients), with one warning (default: :data:`HOST_MAX_CAPTURES`
            on the CPU, unbounded elsewhere).
        fallback: a step whose forward TorchDynamo cannot trace as one graph (a graph break:
            Python's ``random``, a host read such as ``.item()``) or the backend cannot compile
            runs its Python op by op from then on, for every layout, with one warning naming the
            reason and the line (:attr:`refused`), instead of raising. Nothing of the step has run
            when either fails, so the step then runs once, eagerly.

    NOTE: on the CPU a capture is an inductor compile of the layout's whole unrolled forward and
    backward: tens of seconds to minutes per layout, while a replayed step there, padded, ran no
    faster than an eager one (``benchmarks/results/trainer.md``). So the first capture there warns with
    what it cost, and ``max_captures`` bounds how many a run pays for: an envelope that keeps
    growing (a ``StaticShapes()`` not fitted before training) would otherwise compile at every
    growth. :attr:`captures` and :attr:`compile_seconds` say what was paid.

    Example:
        >>> import torch, torchfold
        >>> from torchfold.train.capture.compiled import CompiledLoss
        >>> class Model(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = torch.nn.Parameter(torch.ones(1))
        ...     def leaf(self, x):
        ...         return (x.float() * self.w).unsqueeze(1)
        >>> model, shapes = Model(), torchfold.StaticShapes(min_rows=4)
        >>> f = torchfold.Fold(shapes=shapes)
        >>> plan = f.plan([[f.add("leaf", 2), f.add("leaf", 3)]])
        >>> step = CompiledLoss(model, lambda m, outputs, t: (outputs[0] * t).sum(), backend="aot_eager")
        >>> loss = step(plan, plan.pad(0, [1.0, 1.0]).unsqueeze(1))
        >>> loss.item(), model.w.grad.item(), step.captures
        (5.0, 5.0, 1)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        loss: PlanLoss,
        *,
        device: torch.device | str | None = None,
        backend: str | None = None,
        mode: str | None = None,
        max_captures: int | None = None,
        fallback: bool = False,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not callable(loss):
            raise TypeError(f"loss must be callable as loss(model, outputs, targets), got {loss!r}")
        check_int("CompiledLoss(max_captures)", max_captures, 1, optional=True)
        self.model = model
        self.loss = loss
        self.device, self.backend, self.mode = _backend_for(list(model.parameters()), device, backend, mode)
        #: the most layouts captured (None: no bound); plans of later layouts run eagerly
        self.max_captures = (
            max_captures if max_captures is not None or not on_host(self.device) else HOST_MAX_CAPTURES
        )
        #: seconds spent in the captures' first runs (dynamo, AOTAutograd and the backend compiling)
        self.compile_seconds = 0.0
        self.fallback = fallback
        #: why steps run op by op instead (with ``fallback``, a graph break), or None
        self.refused: str | None = None
        self._compiled: dict[Hashable, Callable[..., torch.Tensor]] = {}
        self._eager_layouts: set[Hashable] = set()
        #: with the backend ``"torchfold_xla"``, the programs its graphs run as
        self.programs: XlaGraphPrograms | None = None
        if self.backend == XLA_PROGRAMS:
            self.programs = XlaGraphPrograms(lambda: list(model.parameters()))

    @property
    def captures(self) -> int:
        """How many layouts have been captured (one compiled graph each)."""
        return len(self._compiled)

    def __call__(self, plan: StaticPlan, targets: Any) -> torch.Tensor:
        """Forward, loss and backward of ``plan``'s layout's graph (captured on first use); the loss, detached."""
        if not isinstance(plan, StaticPlan):
            raise TypeError(
                f"a captured step needs a static-shape plan (a StaticPlan, from Fold(shapes=StaticShapes(...)) or "
                f"StaticShapes.cover), got {type(plan).__name__}; build padded plans, or train with compile='off'"
            )
        if self.refused is not None:
            return self._run_python(plan, targets)
        layout = plan.layout
        fn = self._compiled.get(layout.key)
        first = fn is None
        if fn is None and self.max_captures is not None and self.captures >= self.max_captures:
            return self._eager(plan, targets)
        if fn is None:
            fn = self._compiled[layout.key] = self._capture(layout)
        inputs = plan.inputs(self.device)
        # a mode of inductor's own (reduce-overhead, max-autotune) may run CUDA graphs on a GPU
        cuda_graphs = is_cuda(self.device) and self.mode is not None
        # Dynamo compiles the forward at the first call and AOTAutograd the backward at the first
        # backward, and neither is safe in two threads at once (torch_xla's replicas on one host
        # may be threads): one captured step at a time in a process.
        with _CAPTURE_LOCK:
            started = time.perf_counter()
            if self.programs is not None:
                self.programs.begin()
            try:
                forward = fn(inputs, targets)
            except Exception as error:
                if first:  # a failed capture: keep nothing half-captured
                    del self._compiled[layout.key]
                if not (self.fallback and _before_running(error)):
                    if first and _is_graph_break(error):
                        add_note(
                            error,
                            f"torchfold: the step of layout {layout.key} cannot be captured as one graph "
                            f"(torch.compile backend {self.backend!r}): {_first_line(error)}{_user_line(error)}. "
                            "Keep host reads (.item(), .tolist(), print, numpy) out of the ops and the loss, or "
                            "train with compile='off'",
                        )
                    raise
                self.refused = f"{_first_line(error)}{_user_line(error)}"
            else:
                try:
                    if self.programs is not None and self.programs.finish(check_loss(forward)):
                        loss = forward.detach()  # (the program ran the backward too)
                    else:
                        loss = self._backward(forward, copy=cuda_graphs)
                except Exception:
                    if first:
                        del self._compiled[layout.key]
                    raise
                if first:
                    self.compile_seconds += time.perf_counter() - started
                    if self.captures == 1 and on_host(self.device) and self.backend == "inductor":
                        warnings.warn(self._host_cost(), stacklevel=3)
                return loss
        # the fallback (none of the step had run): its Python, outside the lock and the error
        warnings.warn(
            f"torchfold: steps run their Python op by op from here on (on XLA, traced lazily), not through "
            f"torch.compile (backend {self.backend!r}), which cannot capture the step as one graph: {self.refused}",
            stacklevel=3,
        )
        return self._run_python(plan, targets)

    def warm_up(self, plan: StaticPlan, targets: Any) -> bool:
        """Compile the program of ``plan``'s layout now, without running a step (nothing changes),
        if that layout has not been met yet: with the backend ``"torchfold_xla"`` only (else
        nothing is compiled ahead); whether a program was compiled. A layout's first step then
        finds its program in XLA's cache."""
        if self.programs is None or self.refused is not None or not isinstance(plan, StaticPlan):
            return False
        key = plan.layout.key
        if key in self._compiled or (self.max_captures is not None and self.captures >= self.max_captures):
            return False
        import torch._dynamo

        if torch._dynamo.config.disable:  # (TORCHDYNAMO_DISABLE: a call would run the step itself)
            return False
        fn = self._capture(plan.layout)
        inputs = plan.inputs(self.device)
        with _CAPTURE_LOCK:
            try:
                compiled = self.programs.warm_up(lambda: fn(inputs, targets))
            except Exception as error:
                if not _is_graph_break(error):
                    raise
                return False  # (TorchDynamo cannot trace it: the layout's first step says why, or falls back)
        self._compiled[key] = fn
        return compiled

    def _host_cost(self) -> str:
        return (
            f"compile='on' on the CPU: the first layout's forward and backward took {self.compile_seconds:.0f} s "
            "to compile, and each new static-shape layout (a deeper depth bucket, or the envelope grew) compiles "
            f"again, up to max_captures={self.max_captures}; and a replayed step, padded, ran no faster than an "
            "eager one on the CPU. Fit the envelope before training (torchfold.train.fit_static_shapes) so that it "
            "does not grow, or train with compile='off'"
        )

    def _eager(self, plan: StaticPlan, targets: Any) -> torch.Tensor:
        """A plan of a layout past ``max_captures``: its forward, loss and backward run eagerly."""
        if not self._eager_layouts:
            warnings.warn(
                f"torchfold: {self.captures} layouts captured (max_captures={self.max_captures}, "
                f"{self.compile_seconds:.0f} s compiling): layout {plan.layout.key} and later new ones run eagerly. "
                "A growing envelope makes a new layout at each growth: fit it before training "
                "(torchfold.train.fit_static_shapes), or raise max_captures",
                stacklevel=3,
            )
        self._eager_layouts.add(plan.layout.key)
        return self._run_python(plan, targets)

    def _run_python(self, plan: StaticPlan, targets: Any) -> torch.Tensor:
        return self._backward(self.loss(self.model, plan.apply(self.model, padded=True), targets), copy=False)

    @staticmethod
    def _backward(loss: Any, copy: bool) -> torch.Tensor:
        check_loss(loss).backward()
        # a CUDA graph's output lives in its memory pool, which the next replay overwrites
        return loss.detach().clone() if copy else loss.detach()

    def _capture(self, layout: StaticLayout) -> Callable[..., torch.Tensor]:
        model, loss = self.model, self.loss

        def step(inputs: Any, targets: Any) -> torch.Tensor:
            return loss(model, layout.run(model, inputs, padded=True), targets)

        # Dynamo keeps its compiled graphs per code object, and would take every layout's graph for
        # a recompilation of one function (up to its recompile limit, checking all their guards on
        # each call): each layout gets a code object of its own, so one graph, one set of guards.
        own = types.FunctionType(
            step.__code__.replace(co_name=f"torchfold_step_{len(self._compiled)}"),
            step.__globals__,
            None,
            None,
            step.__closure__,
        )
        # fullgraph: a graph break would leave part of the step run op by op, silently slow
        backend: Any = self.programs if self.programs is not None else self.backend
        compiled: Callable[..., torch.Tensor] = torch.compile(
            own, backend=backend, mode=self.mode, fullgraph=True, dynamic=False
        )
        return compiled

    def __repr__(self) -> str:
        return (
            f"CompiledLoss(backend={self.backend!r}, mode={self.mode!r}, captures={self.captures}, "
            f"max_captures={self.max_captures})"
        )


def uncapturable_update(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer.step()`` cannot be compiled as one replayable graph, or None if it can.

    An optimizer with a ``capturable`` option left off (Adam, AdamW and others by default) keeps
    its step count on the host and turns the bias corrections into Python numbers: a compiled
    update would be compiled anew at every step.

    >>> uncapturable_update(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)) is None
    True
    """
    for number, group in enumerate(optimizer.param_groups):
        if group.get("capturable") is False and not group.get("fused"):
            return (
                f"{type(optimizer).__name__} param group {number} has capturable=False, which keeps its step "
                f"count on the host; create it with capturable=True (e.g. {type(optimizer).__name__}(params, "
                "..., capturable=True))"
            )
    # Without a capturable option (Adagrad): a state kept on the host beside a parameter on the
    # device cannot be an input of the device's graph.
    for group in optimizer.param_groups:
        for param in group["params"]:
            for key, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor) and value.device != param.device and on_host(value.device):
                    return (
                        f"{type(optimizer).__name__} keeps its state {key!r} on the host (cpu) while the parameters "
                        f"are on {param.device}, and has no capturable option to keep it there; use an optimizer "
                        "with capturable=True (e.g. Adam), or compile='off'"
                    )
    return None


class RateTensors:
    """Each param group's learning rate as a 0-dim tensor beside its parameters, for a captured update.

    A Python float would be a constant of the captured graph (a new graph per value); a tensor
    is an input. The last tensor made for a group is reused while its rate is unchanged (a new
    one is a transfer to the device).

    >>> rates = RateTensors()
    >>> like = torch.zeros(2)
    >>> rates(0, 0.5, like) is rates(0, 0.5, like), float(rates(0, 0.25, like))
    (True, 0.25)
    """

    def __init__(self) -> None:
        self._rates: dict[int, tuple[float, torch.Tensor]] = {}

    def __call__(self, number: int, rate: float, like: torch.Tensor) -> torch.Tensor:
        """Group ``number``'s ``rate`` as a 0-dim tensor of ``like``'s dtype on ``like``'s device."""
        last = self._rates.get(number)
        if (
            last is not None
            and last[0] == rate
            and last[1].device == like.device
            and last[1].dtype == like.dtype
        ):
            return last[1]
        tensor = torch.tensor(rate, dtype=like.dtype, device=like.device)
        self._rates[number] = (rate, tensor)
        return tensor


class CompiledUpdate:
    """``optimizer.step()`` compiled with :func:`torch.compile`: one graph per optimizer state, replayed.

    The parameters, gradients and optimizer state are the graph's inputs and are updated in
    place, as by the plain step; the learning rate and the other numbers of the param groups
    are inputs too, so a learning-rate rule changing them at every step compiles nothing new.
    Compiling happens at the first step (and once more when the optimizer creates its state,
    e.g. momentum buffers, at its first step).

    Args:
        optimizer: a ``torch.optim`` optimizer whose update can be captured (see
            :func:`uncapturable_update`).
        device: where the parameters live (picks the backend, as :class:`CompiledLoss`).
        backend, mode: as :class:`CompiledLoss`'s.

    Raises:
        ValueError: the optimizer cannot be captured (the message names the fix).

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> optimizer = torch.optim.SGD([w], lr=0.5)
        >>> update = CompiledUpdate(optimizer, backend="aot_eager")
        >>> w.grad = torch.ones(2)
        >>> update()
        >>> w.detach()
        tensor([0.5000, 0.5000])
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        device: torch.device | str | None = None,
        backend: str | None = None,
        mode: str | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        reason = uncapturable_update(optimizer)
        if reason is not None:
            raise ValueError(f"the optimizer's update cannot be captured: {reason}")
        self.optimizer = optimizer
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.device, self.backend, self.mode = _backend_for(params, device, backend, mode)
        if self.backend == XLA_PROGRAMS:
            # (XlaGraphPrograms captures a step's loss with its backward; an update on XLA goes
            # through torch_xla's own backend)
            self.backend = "openxla"
        self._warned = False
        #: why the update runs uncompiled (torch.compile failed on it), or None
        self._uncompiled: str | None = None
        self._rates = RateTensors()  # per group: its last rate, as a tensor
        # Not fullgraph: torch.optim's step breaks the graph on purpose once, before the update.
        self._step: Callable[[], Any] = torch.compile(optimizer.step, backend=self.backend, mode=self.mode)

    def __call__(self) -> None:
        """Run the update (a step of the wrapped optimizer); uncompiled, with a warning, if the
        optimizer can no longer be captured (a loaded state dict turned ``capturable`` off)."""
        if self._uncompiled is not None:
            self.optimizer.step()
            return
        reason = uncapturable_update(self.optimizer)
        if reason is not None:
            if not self._warned:
                self._warned = True
                warnings.warn(f"the optimizer's update now runs uncaptured: {reason}", stacklevel=2)
            self.optimizer.step()
            return
        # A Python float learning rate would be a constant of the graph (a new graph per value):
        # each group's goes in as a 0-dim tensor for the step, and is a float again afterwards
        groups = self.optimizer.param_groups
        rates = [group["lr"] for group in groups]
        failed: Exception | None = None
        try:
            for number, (group, rate) in enumerate(zip(groups, rates, strict=True)):
                if not isinstance(rate, torch.Tensor) and group["params"]:
                    group["lr"] = self._rates(number, rate, group["params"][0])
            with _CAPTURE_LOCK:  # torch.compile is not safe in two threads at once (replicas may be threads)
                try:
                    self._step()
                except Exception as error:
                    if not _is_graph_break(error):
                        raise
                    failed = error  # (TorchDynamo failed tracing or compiling the update's frame, before running it)
        finally:
            for group, rate in zip(groups, rates, strict=True):
                group["lr"] = rate
        if failed is not None:
            self._uncompiled = f"{type(failed).__name__}: {_first_line(failed)}"
            warnings.warn(
                f"the optimizer's update runs uncompiled from here on: torch.compile failed on "
                f"{type(self.optimizer).__name__}.step ({self._uncompiled})",
                stacklevel=2,
            )
            self.optimizer.step()

    def __repr__(self) -> str:
        return (
            f"CompiledUpdate({type(self.optimizer).__name__}, backend={self.backend!r}, mode={self.mode!r})"
        )


def _backend_for(
    params: list[torch.Tensor], device: torch.device | str | None, backend: str | None, mode: str | None
) -> tuple[torch.device, str, str | None]:
    """The device (default: the first parameter's, else the CPU: :func:`~torchfold.engine.resolve.device_for`),
    and the backend and mode to compile with there (default: :func:`compile_backend`'s; a backend
    given alone has no mode)."""
    device = device_for(params, device)
    default_backend, default_mode = compile_backend(device)
    chosen = backend if backend is not None else default_backend
    if chosen == XLA_PROGRAMS and not is_xla(device):
        raise ValueError(
            f"backend={XLA_PROGRAMS!r} captures programs on XLA devices only, not on {device}; leave backend out "
            "(the device's own) or name a torch.compile backend"
        )
    if chosen in ("openxla", XLA_PROGRAMS):
        _check_torch_xla()
    return device, chosen, mode if mode is not None or backend is not None else default_mode


def _is_graph_break(error: BaseException) -> bool:
    return type(error).__module__.startswith("torch._dynamo")


def _before_running(error: BaseException) -> bool:
    """Whether a compiled forward failed before any of it ran: TorchDynamo stopped tracing the frame
    (``fullgraph``: a graph break) or the backend failed to compile the graph it traced. (Dynamo
    applies a frame's side effects, such as an attribute rebound, after its graph has run.)"""
    from torch._dynamo.exc import BackendCompilerFailed, Unsupported

    return isinstance(error, (Unsupported, BackendCompilerFailed))


def _user_line(error: BaseException) -> str:
    """Where in the user's code dynamo stopped: `` at FILE:LINE (CODE)``, from its message."""
    lines = str(error).splitlines()
    if "from user code:" not in lines:
        return ""
    frames = [i for i, line in enumerate(lines) if line.strip().startswith('File "')]
    if not frames:
        return ""
    last = frames[-1]
    location = lines[last].strip().removeprefix("File ").replace('", line ', ":").replace('"', "")
    code = lines[last + 1].strip() if last + 1 < len(lines) else ""
    return f" at {location}" + (f" ({code})" if code else "")


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _check_torch_xla() -> None:
    try:
        import torch_xla  # (registers the openxla backend; XLA_PROGRAMS captures through it too)
    except ImportError as error:
        raise ImportError(
            "compiled steps on XLA need torch_xla (pip install 'torchfold[xla]'); or train with compile='off'"
        ) from error
    version = getattr(torch_xla, "__version__", "0")
    if tuple(int(part) for part in version.split(".")[:2] if part.isdigit()) < (2, 3):
        warnings.warn(
            f"torch_xla {version} is older than 2.3, with which compiled training steps were not tried; "
            "expect graph breaks",
            stacklevel=3,
        )
