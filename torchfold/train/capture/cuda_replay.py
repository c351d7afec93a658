"""Whole training steps on a CUDA GPU, captured once per layout in a CUDA graph and replayed.

:class:`~torchfold.train.capture.compiled.CompiledLoss` compiles a step's forward, loss and backward
with :func:`torch.compile`; the update then runs eagerly, every call passes dynamo's guards,
and every kernel is a launch from the host. A step of one minibatch in one process can be one
CUDA graph instead: :class:`CudaStepReplay` runs the
first step of each :attr:`StaticLayout.key <torchfold.engine.static.StaticLayout.key>` eagerly
(the warm-up CUDA graphs need: it creates the optimizer's state and the library's workspaces),
captures forward, loss, backward and the optimizer's update in one ``torch.cuda.CUDAGraph``
right after it, and from then on copies each batch's index arrays, targets and learning rates
into the graph's input buffers and replays it: a few copies and one launch per step, whatever
the depth of the trees.

A CUDA graph reads and writes fixed addresses, so what a graph depends on is checked at every
step: the layout, the module's parameters and the optimizer's (which tensors, where their data
lives, shapes, dtypes, ``requires_grad``), the module's buffers, the optimizer's state tensors (a
loaded state dict installs new ones), its options but the learning rate (an input), the shapes
of the batch's tensors, and what the XLA programs' guard reads
(:class:`~torchfold.train.capture.guards.StepGuard`: every module's ``training`` flag, Python
numbers in module attributes, the loss's closure and globals, and where the tensors kept as
plain attributes live). A change in any of them is a new warm-up and capture, never a stale
graph (a guarded value that keeps changing is refused, named); graphs made for memory that is
no longer the parameters' or the state's are dropped then. Optimizer hooks and tensor hooks run
when a step is captured, not when it is replayed.
"""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from torchfold.engine.static import StaticInputs, StaticPlan
from torchfold.train.capture._replay import (
    Options,
    StepReplay,
    at_rates_without_grads,
    gradients_into,
    target_tensors,
)
from torchfold.train.capture.compiled import check_loss
from torchfold.train.capture.guards import StepGuard
from torchfold.train.distributed.devices import is_cuda
from torchfold.train.loss import PlanLoss

__all__ = ["CudaStepReplay", "uncapturable_step"]


def uncapturable_step(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer.step()`` cannot run inside a CUDA graph, or None if it can.

    A CUDA graph replays the kernels of its capture: the optimizer must keep its step count on
    the device and take its learning rate as a tensor, as ``capturable=True`` or ``fused=True``
    optimizers do (``torch.optim.Adam``, ``AdamW``, ``SGD(fused=True)``, ...).

    >>> w = [torch.zeros(1, requires_grad=True)]
    >>> uncapturable_step(torch.optim.Adam(w, capturable=True)) is None
    True
    >>> print(uncapturable_step(torch.optim.SGD(w, lr=0.1)))
    SGD param group 0 has neither capturable=True nor fused=True; create it with one of them (e.g. SGD(params, ..., fused=True))
    """
    for number, group in enumerate(optimizer.param_groups):
        if not group.get("capturable") and not group.get("fused"):
            name = type(optimizer).__name__
            if "capturable" not in group and "fused" not in group:
                return (
                    f"{name} has neither a capturable nor a fused option; use an optimizer with one (e.g. "
                    "torch.optim.Adam(params, ..., fused=True))"
                )
            option = "capturable=True" if "capturable" in group else "fused=True"
            return (
                f"{name} param group {number} has neither capturable=True nor fused=True; create it with one of "
                f"them (e.g. {name}(params, ..., {option}))"
            )
    return None


class _Graph:
    """One captured step: the graph, its input buffers (the batch's tensors, the learning
    rates, with the last rate written to each) and its loss (overwritten by every replay)."""

    __slots__ = ("batch", "graph", "inputs", "loss", "rates", "written")

    def __init__(
        self,
        graph: torch.cuda.CUDAGraph,
        inputs: StaticInputs,
        batch: list[torch.Tensor],
        rates: list[torch.Tensor],
        written: list[float],
        loss: torch.Tensor,
    ) -> None:
        self.graph, self.inputs, self.batch, self.rates, self.written, self.loss = (
            graph,
            inputs,
            batch,
            rates,
            written,
            loss,
        )


class CudaStepReplay(StepReplay):
    """One training step of one minibatch (forward, loss, backward, update) as one replayed CUDA graph.

    Calling it with a :class:`~torchfold.engine.static.StaticPlan`, its targets (tensors on the
    GPU) and the learning rate of each parameter group runs the step: the parameters and the
    optimizer's state are updated in place, the gradients are left ``None``, and the loss (a
    scalar tensor on the GPU, not read back) is returned. The first step of each layout (and of
    each parameter, state or options change, see the module's notes) runs eagerly and captures
    the graph after it; the others replay it. A step that cannot be captured (it reads a value
    back to the host, or its targets hold more than tensors) runs eagerly instead, with one
    warning, and :attr:`refused` says why: run the next steps another way.

    Whatever holds the parameters' gradient accumulators must let go of them before a step, or
    its capture fails: an ``AccumulatingOptimizer`` does when a step goes through its
    :meth:`~torchfold.train.AccumulatingOptimizer.computed_step` (what the trainer's runner
    does).

    Args:
        model: the module whose methods are the fold ops, on a CUDA device.
        loss: ``loss(model, outputs, targets) -> scalar``, as for
            :class:`~torchfold.train.capture.compiled.CompiledLoss`.
        optimizer: the ``torch.optim`` optimizer to update with, made with ``capturable=True``
            or ``fused=True`` (see :func:`uncapturable_step`).

    Raises:
        ValueError: the optimizer's update cannot be captured (the message names the fix).

    Example (on a GPU)::

        replay = CudaStepReplay(model, tree_lstm_loss, torch.optim.Adam(model.parameters(), fused=True))
        for plan, targets in batches:  # StaticPlans of one envelope, targets padded on the GPU
            loss = replay(plan, targets, [1e-3])
    """

    def __init__(
        self,
        model: torch.nn.Module,
        loss: PlanLoss,
        optimizer: torch.optim.Optimizer,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not callable(loss):
            raise TypeError(f"loss must be callable as loss(model, outputs, targets), got {loss!r}")
        reason = uncapturable_step(optimizer)
        if reason is not None:
            raise ValueError(f"the optimizer's update cannot be captured in a CUDA graph: {reason}")
        super().__init__(model, loss, optimizer)
        self._graphs: dict[tuple[Any, ...], _Graph] = {}
        self._captured = 0
        #: what the Python side of a step reads besides the graph's inputs, read before every replay
        self.guard = StepGuard(model, loss)

    @property
    def captures(self) -> int:
        """How many CUDA graphs have been captured (one per layout and parameter, state or options
        change), the ones since dropped included."""
        return self._captured

    def __call__(self, plan: StaticPlan, targets: Any, lrs: list[float]) -> torch.Tensor:
        """Run one step of ``plan`` with learning rate ``lrs[i]`` for param group ``i``; the loss."""
        self._check_call(plan, lrs)
        groups = self.optimizer.param_groups
        if not all(group["params"] for group in groups):
            raise ValueError("a replayed step needs parameters in every param group; remove the empty groups")
        reason = uncapturable_step(self.optimizer)  # e.g. a loaded state dict turned capturable off
        if reason is not None:
            self._refuse(f"the optimizer's update cannot be captured in a CUDA graph: {reason}")
            return self._eager_step(plan, targets, lrs)
        options, reason = self._options(plan)
        if reason is not None:
            self._refuse(reason)
            return self._eager_step(plan, targets, lrs)
        batch, reason = target_tensors(targets)
        if reason is not None:
            self._refuse(reason)
            return self._eager_step(plan, targets, lrs)
        params = [p for group in groups for p in group["params"]]
        device = params[0].device
        if not is_cuda(device):
            raise ValueError(
                f"CudaStepReplay needs the model on a CUDA device, its parameters are on {device}"
            )
        key = self._key(plan, params, batch, options)
        why = self.guard.admit(key[:-2], key[-2])  # (the guard's values, then its tensors' addresses)
        if why is not None:
            self._refuse(why)
            return self._eager_step(plan, targets, lrs)
        captured = self._graphs.get(key)
        if captured is None:
            return self._warm_up_and_capture(plan, targets, batch, lrs, params, options)
        inputs = captured.inputs
        inputs.ints.copy_(torch.from_numpy(plan.ints), non_blocking=True)
        inputs.floats.copy_(torch.from_numpy(plan.floats), non_blocking=True)
        for buffer, tensor in zip(inputs.given, plan.given, strict=True):
            buffer.copy_(tensor, non_blocking=True)
        for buffer, tensor in zip(captured.batch, batch, strict=True):
            buffer.copy_(tensor, non_blocking=True)
        for number, (rate, lr) in enumerate(zip(captured.rates, lrs, strict=True)):
            if captured.written[number] != lr:  # a kernel per change, none while the rate stays
                rate.fill_(lr)
                captured.written[number] = lr
        captured.graph.replay()
        for p in params:  # the graph's gradients are its own buffers, written at every replay
            p.grad = None
        return captured.loss.clone()  # the next replay overwrites the graph's own

    def _key(
        self, plan: StaticPlan, params: list[torch.Tensor], batch: list[torch.Tensor], options: Options
    ) -> tuple[Any, ...]:
        """Everything a captured graph depends on besides its inputs' values (addresses included)."""
        state = self.optimizer.state
        return (
            plan.layout.key,
            tuple(
                (id(p), p.data_ptr(), tuple(p.shape), p.dtype, p.requires_grad)
                for p in (*params, *self.model.parameters())
            ),
            tuple((id(b), b.data_ptr(), tuple(b.shape), b.dtype) for b in self.model.buffers()),
            tuple(
                (id(p), name, value.data_ptr(), tuple(value.shape), value.dtype)
                if isinstance(value, torch.Tensor)
                else (id(p), name, type(value).__name__)
                for p in params
                for name, value in sorted(state.get(p, {}).items())
            ),
            (plan.ints.shape, plan.floats.shape, tuple((tuple(g.shape), g.dtype) for g in plan.given)),
            tuple((tuple(t.shape), t.dtype, t.device) for t in batch),
            options,
            self.model.training,
            # what the guard reads (a Python number of the loss is a constant of the graph), and
            # where the tensors kept as plain attributes live (the graph reads them there)
            self.guard.values(),
            tuple(t.data_ptr() for t in self.guard.tensors()),
        )

    def _warm_up_and_capture(
        self,
        plan: StaticPlan,
        targets: Any,
        batch: list[torch.Tensor],
        lrs: list[float],
        params: list[torch.Tensor],
        options: Options,
    ) -> torch.Tensor:
        """This step eagerly, on the graph's own input buffers and on a side stream (CUDA graphs
        want their kernels' lazy set-up done before capture); then the capture; the step's loss."""
        device = params[0].device
        inputs = plan.inputs(device)
        # the graph's buffers from now on: tensors of their own (a given tensor already on the
        # GPU comes back as it is from inputs(), and the next batches are copied into the buffers)
        inputs = StaticInputs(inputs.ints, inputs.floats, tuple(tensor.clone() for tensor in inputs.given))
        buffers = [tensor.clone() for tensor in batch]
        static_targets = _rebuilt(targets, iter(buffers))
        rates = [torch.tensor(lr, dtype=params[0].dtype, device=device) for lr in lrs]
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        synced: str | None = None  # where the step reads back to the host, if it does
        with (
            torch.cuda.stream(side),
            at_rates_without_grads(self.optimizer, rates),
            warnings.catch_warnings(),
        ):
            # capturable=True optimizers warn when they step outside a capture: this one step must
            warnings.filterwarnings("ignore", message=".*capturable=True.*")
            try:
                # a host read in the ops or the loss would break the capture: found here, by its line
                with _host_syncs_raise():
                    loss = check_loss(
                        self.loss(
                            self.model, plan.layout.run(self.model, inputs, padded=True), static_targets
                        )
                    )
            except RuntimeError as error:
                if "synchronizing CUDA operation" not in str(error):
                    raise
                synced = _user_frame(error)
            else:
                gradients_into(loss, params)
                self.optimizer.step()
                # no autograd graph outlives the warm-up: its gradient accumulators were made on
                # the side stream, and the capture must make its own
                loss = loss.detach()
        current.wait_stream(side)
        if synced is not None:
            self._refuse(
                f"the step reads a value back to the host (.item(), .tolist(), float() of a tensor, a copy to the "
                f"CPU){synced}, which a CUDA graph cannot replay"
            )
            return self._eager_step(plan, targets, lrs)
        key = self._key(plan, params, batch, options)  # the warm-up made the optimizer's state
        graph = torch.cuda.CUDAGraph()
        try:
            with (
                at_rates_without_grads(self.optimizer, rates),
                _capture_flags(self.optimizer),
                _capturing(graph, current),
            ):
                captured = check_loss(
                    self.loss(self.model, plan.layout.run(self.model, inputs, padded=True), static_targets)
                )
                gradients_into(captured, params)
                self.optimizer.step()
                captured = captured.detach()
        except Exception as error:  # the step ran (eagerly, above); the next ones go another way
            torch.cuda.synchronize(device)
            cause = _original(error)
            self._refuse(f"its capture in a CUDA graph failed: {_first_line(cause)}{_user_frame(cause)}")
            return loss
        # graphs captured on other memory (an earlier state dict, a parameter since moved) can
        # never match again: dropped, with their memory
        memory = key[1:4]
        self._graphs = {k: g for k, g in self._graphs.items() if k[1:4] == memory}
        self._graphs[key] = _Graph(graph, inputs, buffers, rates, list(lrs), captured)
        self._captured += 1
        return loss

    def __repr__(self) -> str:
        return f"CudaStepReplay({type(self.optimizer).__name__}, captures={self.captures})"


@contextmanager
def _capturing(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> Iterator[None]:
    """``torch.cuda.graph(graph)``, with ``stream`` current again afterwards, also when the capture
    fails (``torch.cuda.graph`` leaves its own capture stream current when ending it raises)."""
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            yield
    finally:
        torch.cuda.set_stream(stream)


@contextmanager
def _capture_flags(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Inside, fused param groups say ``capturable=True`` too: a fused update keeps its step
    count on the device and takes a tensor learning rate, so it can be captured, but
    ``torch.optim`` checks only the ``capturable`` flag before a capture."""
    flipped = [group for group in optimizer.param_groups if "capturable" in group and not group["capturable"]]
    try:
        for group in flipped:
            group["capturable"] = True
        yield
    finally:
        for group in flipped:
            group["capturable"] = False


@contextmanager
def _host_syncs_raise() -> Iterator[None]:
    """Inside, a CUDA operation that waits for the GPU (a read back to the host) raises a RuntimeError."""
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def _original(error: BaseException) -> BaseException:
    """The first error of a chain: a failed capture's own error (raised while ending the capture)
    hides the one that broke it."""
    while error.__context__ is not None and error.__context__ is not error:
        error = error.__context__
    return error


def _rebuilt(targets: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """``targets`` with its tensors replaced, in :func:`~torchfold.train.capture._replay.target_tensors`' order."""
    if isinstance(targets, torch.Tensor):
        return next(tensors)
    if isinstance(targets, tuple):
        parts = [_rebuilt(part, tensors) for part in targets]
        return type(targets)(*parts) if hasattr(targets, "_fields") else tuple(parts)
    if isinstance(targets, list):
        return [_rebuilt(part, tensors) for part in targets]
    rebuilt = {name: _rebuilt(targets[name], tensors) for name in sorted(targets)}
    return {name: rebuilt[name] for name in targets}


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


_LIBRARY = (Path(torch.__file__).parent, Path(__file__).parents[1])


def _user_frame(error: BaseException) -> str:
    """`` at FILE:LINE (CODE)``: the innermost frame of the error outside torch and torchfold's
    training half (the user's loss or op that did what a capture cannot), or ``""``."""
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        path = Path(frame.filename)
        if not any(path.is_relative_to(root) for root in _LIBRARY) and "contextlib" not in path.name:
            return f" at {frame.filename}:{frame.lineno} ({(frame.line or '').strip()})"
    return ""
