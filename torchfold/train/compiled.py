"""Captured training steps: a static plan's forward, loss and backward compiled once per layout, then replayed.

On an XLA device every eager step is traced op by op into a lazy graph before XLA runs it; with
static shapes the graph repeats, so XLA compiles it once, but the host still traces every op of
every batch. On a GPU the same step is hundreds of small kernel launches. Both costs go when the
step is captured once and replayed: :class:`CompiledLoss` compiles ``loss(model,
layout.run(model, inputs), targets)`` with :func:`torch.compile` once per
:class:`~torchfold.engine.static.StaticLayout` (the structure an envelope version fixes), and
feeds each batch's :class:`~torchfold.engine.static.StaticInputs` (packed index arrays and
columns, fixed shapes) and targets as the graph's inputs; the backward runs the compiled backward
graph, and gradients accumulate in ``.grad`` as usual, so
:class:`~torchfold.train.AccumulatingOptimizer`'s weighting, the all-reduce and the update stay as
they are: a step with a new number of minibatches creates no new program.

Backends: XLA uses ``openxla``; CUDA uses ``inductor`` with ``mode="reduce-overhead"`` (CUDA
graphs); a CPU uses ``inductor`` when asked (``compile="on"``), and stays eager by default.

NOTE: the optimizer's update is not part of the captured graph: on XLA it is traced lazily (a few
ops per parameter, the same small graph every step, compiled once), on CUDA it runs eagerly.
Keeping it out keeps checkpoints, resumes and LR rules exactly as they are without capture.
"""

from __future__ import annotations

import threading
import types
import warnings
from collections.abc import Callable, Hashable
from typing import Any, Literal

import torch

from torchfold._errors import add_note
from torchfold.engine.static import StaticLayout, StaticPlan

__all__ = ["COMPILE_CHOICES", "CompiledLoss", "check_loss", "compile_backend", "wants_compile"]

COMPILE_CHOICES = ("auto", "off", "on")
_CAPTURE_LOCK = threading.Lock()
CompileChoice = Literal["auto", "off", "on"]
LossFn = Callable[[torch.nn.Module, list[torch.Tensor], Any], torch.Tensor]


def check_loss(loss: Any) -> torch.Tensor:
    """``loss`` if it is a scalar tensor (a minibatch's loss), else a TypeError saying what it is."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise TypeError(
            f"loss must return a scalar tensor (the minibatch's loss), got "
            f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}"
        )
    return loss


def wants_compile(choice: str, device: torch.device) -> bool:
    """Whether ``compile=choice`` captures steps on ``device``: ``auto`` does on XLA and CUDA.

    >>> wants_compile("auto", torch.device("cpu")), wants_compile("on", torch.device("cpu"))
    (False, True)
    """
    if choice not in COMPILE_CHOICES:
        raise ValueError(f"compile must be one of {COMPILE_CHOICES}, got {choice!r}")
    return device.type in ("xla", "cuda") if choice == "auto" else choice == "on"


def compile_backend(device: torch.device) -> tuple[str, str | None]:
    """The :func:`torch.compile` backend and mode that capture a step on ``device``.

    >>> compile_backend(torch.device("cuda"))
    ('inductor', 'reduce-overhead')
    """
    if device.type == "xla":
        return "openxla", None
    if device.type == "cuda":
        return "inductor", "reduce-overhead"  # CUDA graphs: one launch replays the step's kernels
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

    Example:
        >>> import torch, torchfold
        >>> from torchfold.train.compiled import CompiledLoss
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
        loss: LossFn,
        *,
        device: torch.device | str | None = None,
        backend: str | None = None,
        mode: str | None = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not callable(loss):
            raise TypeError(f"loss must be callable as loss(model, outputs, targets), got {loss!r}")
        if device is None:
            first = next(iter(model.parameters()), None)
            device = first.device if first is not None else torch.device("cpu")
        self.model = model
        self.loss = loss
        self.device = torch.device(device)
        default_backend, default_mode = compile_backend(self.device)
        self.backend = backend if backend is not None else default_backend
        self.mode = mode if mode is not None or backend is not None else default_mode
        if self.backend == "openxla":
            _check_torch_xla()
        self._compiled: dict[Hashable, Callable[..., torch.Tensor]] = {}

    @property
    def captures(self) -> int:
        """How many layouts have been captured (one compiled graph each)."""
        return len(self._compiled)

    def __call__(self, plan: StaticPlan, targets: Any) -> torch.Tensor:
        """Forward, loss and backward of ``plan``'s layout's graph (captured on first use); the loss, detached."""
        if not isinstance(plan, StaticPlan):
            raise TypeError(
                f"a captured step needs a static-shape plan (a StaticPlan, from Fold(shapes=StaticShapes(...)) or "
                f"StaticShapes.fit), got {type(plan).__name__}; build padded plans, or train with compile='off'"
            )
        layout = plan.layout
        fn = self._compiled.get(layout.key)
        first = fn is None
        if fn is None:
            fn = self._compiled[layout.key] = self._capture(layout)
        inputs = plan.inputs(self.device)
        # Dynamo compiles the forward at the first call and AOTAutograd the backward at the first
        # backward, and neither is safe in two threads at once (torch_xla's replicas on one host
        # may be threads): one captured step at a time in a process.
        with _CAPTURE_LOCK:
            try:
                return self._backward(fn(inputs, targets))
            except Exception as error:
                if first:  # a failed capture: say why, and keep nothing half-captured
                    if _is_graph_break(error):
                        add_note(
                            error,
                            f"torchfold: the step of layout {layout.key} cannot be captured as one graph "
                            f"(torch.compile backend {self.backend!r}): {_first_line(error)}{_user_line(error)}. "
                            "Keep host reads (.item(), .tolist(), print, numpy) out of the ops and the loss, or "
                            "train with compile='off'",
                        )
                    del self._compiled[layout.key]
                raise

    @staticmethod
    def _backward(loss: Any) -> torch.Tensor:
        check_loss(loss).backward()
        return loss.detach()

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
        # fullgraph: a graph break would leave part of the step traced op by op, silently slow
        compiled: Callable[..., torch.Tensor] = torch.compile(
            own, backend=self.backend, mode=self.mode, fullgraph=True, dynamic=False
        )
        return compiled

    def __repr__(self) -> str:
        return f"CompiledLoss(backend={self.backend!r}, mode={self.mode!r}, captures={self.captures})"


def _is_graph_break(error: BaseException) -> bool:
    return type(error).__module__.startswith("torch._dynamo")


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
        import torch_xla  # registers the openxla backend
    except ImportError as error:
        raise ImportError(
            "compiled steps on XLA need torch_xla (pip install 'torchfold[xla]'); or train with compile='off'"
        ) from error
    version = getattr(torch_xla, "__version__", "0")
    if tuple(int(part) for part in version.split(".")[:2] if part.isdigit()) < (2, 3):
        warnings.warn(
            f"torch_xla {version} is older than 2.3, whose openxla backend compiles training steps; "
            "expect graph breaks",
            stacklevel=3,
        )
