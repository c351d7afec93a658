"""Whole training steps on XLA, traced once per layout and replayed from XLA's compilation cache.

:class:`~torchfold.train.capture.compiled.CompiledLoss` and
:class:`~torchfold.train.capture.compiled.CompiledUpdate` capture a step with :func:`torch.compile`'s
``openxla`` backend: three programs per step (forward, backward, update), each behind dynamo's
guards, and torch_xla's bridge writes the parameters back with lazy copies that the next step
must wait for. A step of one minibatch on one device can be one program instead:
:class:`XlaStepReplay` traces forward, loss, backward and the optimizer's update once per
:attr:`StaticLayout.key <torchfold.engine.static.StaticLayout.key>` into one lazy XLA graph,
compiles it, and from then on runs the compiled graph directly with the batch's tensors, the
current parameters, optimizer state and learning rates as its inputs; the results become the
new parameters and state (no copy). The host does a few dictionary lookups per step, whatever
the depth of the trees.

This module is the only one that uses torch_xla's private graph-cache calls
(``_get_graph_hash``, ``_get_tensors_xla_device_data_node``, ``_xla_warm_up_cache``,
``_run_cached_graph``: the calls torch_xla's own dynamo bridge is built on). If they are
missing (another torch_xla version), :func:`replay_unavailable` says so and the trainer keeps the
``torch.compile`` path, with a warning.

What a replayed graph depends on is checked at every step, never assumed: the layout, the
parameters (which tensors, shapes, dtypes, ``requires_grad``), the module's buffers (which
tensors, shapes, dtypes: their values are inputs, and a buffer the step changes is written
back), the shapes and dtypes of the batch's tensors, the optimizer's groups (every option but
the learning rate, which is an input) and its state (names, shapes, dtypes), and the module's
``training`` flag. A change in any of them is a new capture, never a stale graph. Only the
tensors the step changes are written back: a frozen parameter, or one without a gradient, stays
as it is. A step that draws random numbers (dropout) would replay the draws of its capture: it
is refused and runs lazily (traced op by op, as without capture), with a warning. Optimizer hooks
and tensor hooks run when a step is traced, not when it is replayed.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import torch

from torchfold.engine.static import StaticPlan
from torchfold.train.capture._replay import (
    StepReplay,
    gradients_into,
    stepping,
    target_tensors,
)
from torchfold.train.capture.compiled import RateTensors, check_loss, uncapturable_update
from torchfold.train.capture.xla_linear import transposed_weights
from torchfold.train.loader import to_device
from torchfold.train.loss import PlanLoss

__all__ = ["TRACE_LOCK", "XlaStepReplay", "executions", "graph_sources", "replay_unavailable", "untouched"]

_NEEDED = (
    "_get_graph_hash",
    "_get_tensors_xla_device_data_node",
    "_xla_warm_up_cache",
    "_run_cached_graph",
    "_xla_get_tensor_id",
    "_check_tensor_need_materialization",
    "_xla_sync_multi",
    "_get_seed_info_id",
)
#: one lazy trace at a time in a process (tracing is not safe in two threads; replicas may be threads)
TRACE_LOCK = threading.Lock()


def replay_unavailable() -> str | None:
    """Why this torch_xla cannot replay whole steps (None if it can).

    >>> isinstance(replay_unavailable(), str | None)
    True
    """
    try:
        import torch_xla
    except ImportError:
        return "torch_xla is not installed"
    missing = [name for name in _NEEDED if not hasattr(torch_xla._XLAC, name)]
    if missing:
        return f"torch_xla {getattr(torch_xla, '__version__', '?')} lacks {', '.join(missing)}"
    return None


class _Capture:
    """One traced step: its graph's hash, where each graph input comes from and where each result
    goes, or why it cannot be replayed (then its steps run lazily, traced op by op)."""

    __slots__ = ("graph", "refused", "slots", "sources", "targets")

    def __init__(
        self,
        graph: Any,
        sources: list[tuple[int, Any]],
        targets: list[int] | None = None,
        slots: list[tuple[int, str]] | None = None,
        refused: str | None = None,
    ) -> None:
        self.graph = graph
        # per graph input: (0, position in the step's inputs) or (1, a constant of the trace)
        self.sources = sources
        # per graph result but the loss (the last): the position it replaces among the step's
        # parameters, buffers and then optimizer state ``slots`` (a tensor the step leaves
        # as it was is no result)
        self.targets = targets or []
        # the optimizer's state after the step: (parameter number, name); the first step makes it
        self.slots = slots or []
        self.refused = refused


class XlaStepReplay(StepReplay):
    """One training step of one minibatch (forward, loss, backward, update) as one replayed XLA graph.

    Calling it with a :class:`~torchfold.engine.static.StaticPlan`, its targets (tensors on the
    device, or on the host: they are moved) and the learning rate of each parameter group runs the step: the parameters and the
    optimizer's state are replaced by the graph's results, the gradients are left ``None``, and
    the loss (a scalar tensor on the device, not read back) is returned. The first step of each
    layout (and of each optimizer state structure: its first step creates the state) traces and
    compiles the graph; the others replay it. A step that cannot be replayed (it draws random
    numbers, reads a value back to the host, or its targets hold more than tensors) runs lazily
    instead, with one warning, and :attr:`refused` says why: run the next steps another way.

    Args:
        model: the module whose methods are the fold ops, on an XLA device.
        loss: ``loss(model, outputs, targets) -> scalar``, as for
            :class:`~torchfold.train.capture.compiled.CompiledLoss`.
        optimizer: the ``torch.optim`` optimizer to update with; its update must be capturable
            (e.g. ``Adam(..., capturable=True)``).
        transpose_weights: trace ``F.linear`` (``nn.Linear``) against a transposed copy of each
            weight, made once per step (:func:`~torchfold.train.capture.xla_linear.transposed_weights`):
            XLA's CPU backend runs the forward products several times faster so. ``None``
            (default): on XLA's CPU backend only.

    Raises:
        RuntimeError: this torch_xla lacks the graph-cache calls (see :func:`replay_unavailable`).
        ValueError: the optimizer's update cannot be captured (the message names the fix).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        loss: PlanLoss,
        optimizer: torch.optim.Optimizer,
        *,
        transpose_weights: bool | None = None,
    ) -> None:
        why = replay_unavailable()
        if why is not None:
            raise RuntimeError(f"whole steps cannot be replayed on XLA: {why}; train with compile='off'")
        reason = uncapturable_update(optimizer)
        if reason is not None:
            raise ValueError(f"the optimizer's update cannot be captured: {reason}")
        super().__init__(model, loss, optimizer)
        if transpose_weights is None:
            import torch_xla.runtime

            transpose_weights = str(torch_xla.runtime.device_type()).upper() == "CPU"
        #: whether steps are traced with ``F.linear`` against transposed copies of the weights
        self.transpose_weights = transpose_weights
        self._captures: dict[Hashable, _Capture] = {}
        self._rates = RateTensors()

    @property
    def captures(self) -> int:
        """How many graphs have been traced and compiled (one per layout and optimizer state structure)."""
        return sum(capture.refused is None for capture in self._captures.values())

    def __call__(self, plan: StaticPlan, targets: Any, lrs: list[float]) -> torch.Tensor:
        """Run one step of ``plan`` with learning rate ``lrs[i]`` for param group ``i``; the loss."""
        return self._step(plan, targets, lrs, dry=False)

    def warm_up(self, plan: StaticPlan, targets: Any, lrs: list[float]) -> bool:
        """Compile the step program of ``plan``'s layout now, without running it (nothing changes:
        the parameters, buffers and optimizer state stay as they are), so that the first step of
        that layout replays it instead of compiling; whether a program was compiled (not: it
        exists already, or the step cannot be replayed).

        Warm up after the optimizer has its state (after a first step, or a resume): a step
        that creates the state is a program of its own, which no later step replays.
        """
        before = self.captures
        self._step(plan, targets, lrs, dry=True)
        return self.captures > before

    def _step(self, plan: StaticPlan, targets: Any, lrs: list[float], *, dry: bool) -> Any:
        import torch_xla

        xla = torch_xla._XLAC
        self._check_call(plan, lrs)
        groups = self.optimizer.param_groups
        # targets on the host (a loader's numpy arrays or CPU tensors) go to the parameters' device
        device = next((p.device for group in groups for p in group["params"]), None)
        if device is not None:
            targets = to_device(targets, device)
        reason = uncapturable_update(self.optimizer)
        if reason is not None:  # e.g. a loaded state dict turned capturable off
            if dry:
                return None
            self._refuse(f"the optimizer's update cannot be captured: {reason}")
            return self._lazy_step(plan, targets, lrs)
        options, reason = self._options(plan)
        if reason is not None:
            if dry:
                return None
            self._refuse(reason)
            return self._lazy_step(plan, targets, lrs)
        params = [p for group in groups for p in group["params"]]
        buffers = list(self.model.buffers())
        state = self.optimizer.state
        slots = [(p, name) for p in params for name in sorted(state.get(p, {}))]
        if not all(group["params"] for group in groups):
            raise ValueError("a replayed step needs parameters in every param group; remove the empty groups")
        rates = [
            self._rates(number, rate, group["params"][0])
            for number, (group, rate) in enumerate(zip(groups, lrs, strict=True))
        ]
        inputs = plan.inputs(params[0].device)
        batch, why = target_tensors(targets)
        data = [inputs.ints, inputs.floats, *inputs.given, *batch]
        # a module parameter the optimizer does not hold is an input too, never a constant of the trace
        held = {id(p) for p in params}
        others = [p for p in self.model.parameters() if id(p) not in held]
        live = [*params, *buffers, *(state[p][name] for p, name in slots), *rates, *data, *others]
        key = (self._key(plan, params, buffers, slots, data, options), _describe(others))
        with TRACE_LOCK:
            materialize(live)
            capture = self._captures.get(key)
            if dry:
                if capture is None and why is None and self.refused is None:
                    with untouched([*params, *buffers], self.optimizer):
                        _, capture = self._trace(
                            plan, inputs, targets, params, buffers, rates, live, why, dry=True
                        )
                    if capture.refused is None:  # (a refusal warned: the steps of this layout would be)
                        self._captures[key] = capture
                return None
            if capture is None or capture.refused is not None:
                loss, capture = self._trace(plan, inputs, targets, params, buffers, rates, live, why)
                self._captures[key] = capture
                return loss
            arguments = [live[where] if kind == 0 else where for kind, where in capture.sources]
            results = xla._run_cached_graph(capture.graph, arguments)
            self._write_back(params, buffers, capture, results)
        return results[-1]

    def _write_back(
        self,
        params: list[torch.Tensor],
        buffers: list[torch.Tensor],
        capture: _Capture,
        results: list[torch.Tensor],
    ) -> None:
        """The graph's results become the parameters, buffers and optimizer state they replace (no copy)."""
        tensors = [*params, *buffers]
        state = self.optimizer.state
        with torch.no_grad():
            for where, value in zip(capture.targets, results[:-1], strict=True):
                if where < len(tensors):
                    tensors[where].data = value
                else:
                    number, name = capture.slots[where - len(tensors)]
                    state[params[number]][name] = value

    def _key(
        self,
        plan: StaticPlan,
        params: list[torch.Tensor],
        buffers: list[torch.Tensor],
        slots: list[tuple[Any, str]],
        data: list[torch.Tensor],
        options: Hashable,
    ) -> Hashable:
        """Everything a traced step depends on besides its inputs' values."""
        tensors = tuple((id(p), tuple(p.shape), p.dtype, p.requires_grad) for p in params)
        return (
            plan.layout.key,
            tensors,
            tuple((id(b), tuple(b.shape), b.dtype) for b in buffers),
            tuple((tuple(t.shape), t.dtype) for t in data),
            tuple((id(p), name, tuple(state.shape), state.dtype) for p, name, state in self._states(slots)),
            options,
            self.model.training,
        )

    def _states(self, slots: list[tuple[Any, str]]) -> list[tuple[Any, str, torch.Tensor]]:
        state = self.optimizer.state
        return [(p, name, state[p][name]) for p, name in slots]

    def _trace(
        self,
        plan: StaticPlan,
        inputs: Any,
        targets: Any,
        params: list[torch.Tensor],
        buffers: list[torch.Tensor],
        rates: list[torch.Tensor],
        live: list[torch.Tensor],
        why: str | None,
        *,
        dry: bool = False,
    ) -> tuple[torch.Tensor | None, _Capture]:
        """Trace the step lazily; compile it and run it once on this batch (or, refused, run the
        trace as it is); the loss and the capture. ``dry``: compile only (the caller puts back
        what the trace changed in place: :func:`untouched`); no loss."""
        import torch_xla

        xla = torch_xla._XLAC
        # by the device data each holds, as xla_programs._positions does (and why)
        data = xla._get_tensors_xla_device_data_node
        position = {data([t])[0][0]: number for number, t in enumerate(live)}
        executed = executions()
        linear = transposed_weights() if self.transpose_weights else contextlib.nullcontext()
        with stepping(self.optimizer, rates), linear:
            loss = check_loss(
                self.loss(self.model, plan.layout.run(self.model, inputs, padded=True), targets)
            )
            gradients_into(loss, params)
            self.optimizer.step()
        state = self.optimizer.state
        number_of = {id(p): number for number, p in enumerate(params)}
        slots = [(number_of[id(p)], name) for p in params for name in sorted(state.get(p, {}))]
        roots = [*params, *buffers, *(state[params[n]][name] for n, name in slots), loss.detach()]
        # a tensor the step left as it was (a frozen parameter, one without a gradient, an
        # untouched buffer) is device data, not a result of the graph
        changed = xla._check_tensor_need_materialization(roots)
        targets_of = [where for where, need in enumerate(changed[:-1]) if need]
        roots = [root for root, need in zip(roots, changed, strict=True) if need]
        ids, values = xla._get_tensors_xla_device_data_node(roots)
        if why is None and executions() != executed:
            why = (
                "something read a value back to the host inside the step (.item(), .tolist(), a Python number "
                "from a tensor; e.g. torch.optim.SGD turns a tensor learning rate into one), which cuts the graph"
            )
        if why is None and xla._get_seed_info_id() in ids:
            why = "it draws random numbers (dropout?), and a replay would repeat the draws of its capture"
        if why is not None:  # run the trace as it is: an ordinary lazy step
            self._refuse(why)
            if dry:
                return None, _Capture(None, [], refused=why)
            torch_xla.sync()
            return roots[-1], _Capture(None, [], refused=why)
        graph = xla._get_graph_hash(roots)
        xla._xla_warm_up_cache(roots, [])
        capture = _Capture(graph, [], targets_of, slots)
        if dry:
            capture.sources = graph_sources(ids, values, position)
            return None, capture
        # this step's results: the compiled graph on this step's inputs (the trace is dropped)
        results = xla._run_cached_graph(graph, list(values))
        self._write_back(params, buffers, capture, results)
        # a device data knows the tensor that made it: a parameter or state the last replay made,
        # a batch tensor sent this step; any other is a constant of the trace (e.g. a scalar)
        capture.sources = graph_sources(ids, values, position)
        return results[-1], capture

    def _lazy_step(self, plan: StaticPlan, targets: Any, lrs: list[float]) -> torch.Tensor:
        """One ordinary step, traced op by op (the optimizer's own update) and run; the loss."""
        import torch_xla

        loss = self._eager_step(plan, targets, lrs)
        torch_xla.sync()
        return loss

    def __repr__(self) -> str:
        return f"XlaStepReplay({type(self.optimizer).__name__}, captures={self.captures})"


def graph_sources(
    ids: Sequence[int], values: Sequence[torch.Tensor], position: dict[int, int]
) -> list[tuple[int, Any]]:
    """Per graph input: ``(0, its position among the live tensors)``, or ``(1, the value)`` for a
    constant of the trace (device data that no live tensor held before it, e.g. a scalar)."""
    return [
        (0, position[number]) if number in position else (1, value)
        for number, value in zip(ids, values, strict=True)
    ]


def _describe(tensors: Sequence[torch.Tensor]) -> tuple[Hashable, ...]:
    return tuple((id(t), tuple(t.shape), t.dtype, t.requires_grad) for t in tensors)


def materialize(live: list[torch.Tensor]) -> None:
    """Make every tensor of ``live`` device data, as a program's inputs must be: a pending
    operation (e.g. after ``load_state_dict``) is run."""
    import torch_xla

    xla = torch_xla._XLAC
    pending = [t for t, need in zip(live, xla._check_tensor_need_materialization(live), strict=True) if need]
    if pending:
        xla._xla_sync_multi(pending, devices=[], wait=True, sync_xla_data=True)


@contextlib.contextmanager
def untouched(tensors: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Inside, a step may be traced (never run): afterwards ``tensors`` (materialized: device
    data) and the optimizer's state are what they were before, whatever the trace did to them in
    place (an update), and state the trace created is gone; gradients are ``None``.

    The trace's pending operations are dropped with it: a program compiled from it
    (``_xla_warm_up_cache``) waits in XLA's cache for the step that will run it, the warm-up
    of :meth:`XlaStepReplay.warm_up` and :meth:`~torchfold.train.capture.xla_programs.XlaPrograms.warm_up`.
    """
    import torch_xla

    data = torch_xla._XLAC._get_tensors_xla_device_data_node

    def held(value: Any) -> Any:  # a tensor's device data as a tensor of its own (in-place ops leave it)
        if not isinstance(value, torch.Tensor):
            return value
        if value.device.type != "xla":
            return value.clone()
        return data([value])[1][0]

    kept = [held(t) for t in tensors]
    state = optimizer.state
    before = {p: {name: held(value) for name, value in entry.items()} for p, entry in state.items()}
    try:
        yield
    finally:
        with torch.no_grad():
            for tensor, value in zip(tensors, kept, strict=True):
                tensor.data = value
                tensor.grad = None
        for p in [p for p in state if p not in before]:
            del state[p]
        for p, entry in before.items():
            state[p] = entry


def executions() -> int:
    """How many graphs torch_xla has run in this process (a host read runs one)."""
    import torch_xla.debug.metrics as met

    return int(met.counter_value("ExecuteComputation") or 0)
