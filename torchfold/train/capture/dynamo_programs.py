"""TorchDynamo decides, a captured XLA program runs: ``compile="on"``'s backend on XLA.

:class:`~torchfold.train.capture.compiled.CompiledLoss` compiles a layout's forward and loss with
:func:`torch.compile`. TorchDynamo interprets the step's bytecode, guards every value the code
read (globals, class and instance attributes, numpy scalars, functions kept in attributes...),
turns the tensors it read into the graph's inputs, and replays the frame's side effects (an
attribute the step rebinds) after the graph has run. What runs in place of the graph is the
backend's: here an :class:`XlaGraphPrograms`, which at a graph's first call runs it lazily on its
inputs together with the gradients of the loss (one lazily traced step, the same ops as the
step's own Python), and captures that as one XLA program; every later call whose guards hold
replays the program on the call's inputs, without running or tracing any Python of the step.

So the program runs only when TorchDynamo has checked that the step's code would trace the same
graph, which is what a replay needs and a hand-written list of places cannot give. The program's
outputs are the graph's (the loss and the values of side effects), the inputs it changed in
place, and the loss's gradient for each of the model's parameters; its inputs are the graph's
inputs and the model's parameters, bound by position, never by value. The gradients reach
``.grad`` through each parameter's gradient accumulator, so the hooks an optimizer wrapper weighs
a minibatch with run at every step, as after ``loss.backward()``.

A graph whose step a program would not repeat runs lazily at every call instead (its first call's
lazy step is the eager step, which is what ran), with one warning per reason: it draws random
numbers or reads a value back to the host; it reads a tensor on the host (TorchDynamo makes a
numpy value one, read with ``.item()`` inside the graph); a tensor input that needs gradients is
not one of the model's parameters (``loss.backward()`` would give it one); a parameter has a
tensor hook (``register_hook``: the capture's gradient would run it, and ``.grad`` again); it
changes a view in place; it keeps tensors of its own (``get_attr``); its loss is not one of its
outputs, or does not need gradients; or it runs under ``torch.no_grad()``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torchfold.train.capture.xla_capture import (
    Computed,
    Program,
    Refused,
    compile_program,
    positions,
    restored_afterwards,
)
from torchfold.train.capture.xla_linear import transposed_weights, transposes_here
from torchfold.train.distributed import xla_calls
from torchfold.train.distributed.devices import is_xla
from torchfold.train.distributed.xla_calls import HostReads

__all__ = ["WarmedUp", "XlaGraphPrograms"]


class _Graph:
    """One graph TorchDynamo traced, and the program captured from it (once its loss is known)."""

    __slots__ = ("gm", "graded", "mutated", "outputs", "params", "program", "refused")

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm
        self.program: Program | None = None
        self.outputs = 0  # how many outputs the graph has
        self.mutated: list[int] = []  # inputs the graph changes in place (their places among the inputs)
        self.graded: list[int] = []  # the trainable parameters it gives a gradient (their places among them)
        #: which parameters, trainable or not, it was captured with
        self.params: tuple[tuple[int, bool], ...] = ()
        #: why this graph runs lazily at every call (None: it is replayed, or not captured yet)
        self.refused: str | None = None
        if any(node.op == "get_attr" for node in gm.graph.nodes):
            # (TorchDynamo lifts a module's parameters and buffers as inputs; a tensor the graph
            # keeps as its own attribute would be a constant of the capture, changed in place unseen)
            self.refused = (
                "its graph keeps tensors of its own (get_attr), which a program would hold as constants"
            )


class WarmedUp(Exception):
    """Raised by a graph's program in a warm-up (:meth:`XlaGraphPrograms.warm_up`), before
    TorchDynamo would apply the step's side effects: whether a program was compiled."""

    def __init__(self, compiled: bool) -> None:
        super().__init__("warmed up")
        self.compiled = compiled


class _Pending:
    """A graph's first call, run lazily: what :meth:`XlaGraphPrograms.finish` needs to capture it."""

    __slots__ = ("args", "graph", "live", "outputs", "position", "reads")

    def __init__(
        self, graph: _Graph, args: list[Any], live: list[Any], position: dict[int, int], reads: HostReads
    ) -> None:
        self.graph, self.args, self.live, self.position, self.reads = graph, args, live, position, reads
        self.outputs: list[Any] = []


class XlaGraphPrograms:
    """A :func:`torch.compile` backend for XLA whose graphs run as captured programs, with their backward.

    Use it through :class:`~torchfold.train.capture.compiled.CompiledLoss` (``compile="on"`` on
    XLA): around each call of the compiled step, :meth:`begin` and then :meth:`finish` with the
    loss the step returned. :meth:`finish` says whether the program ran the backward too (the
    gradients are then in each parameter's ``.grad``, added as ``loss.backward()`` would); when
    it did not (TorchDynamo ran the step's Python itself, or the graph runs lazily), the caller
    runs ``loss.backward()`` as usual.

    Args:
        params: the tensors whose gradients a program computes: the model's parameters (a graph
            whose loss needs the gradient of another tensor runs lazily).
    """

    def __init__(self, params: Callable[[], Sequence[torch.Tensor]]) -> None:
        self._params = params
        self._graphs: list[_Graph] = []
        self._pending: _Pending | None = None
        self._grads: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._warming = False
        self._reached = False  # (in a warm-up: whether the call reached a graph's program)
        self._warned: set[str] = set()  # the kinds of reason a graph runs lazily, said once each
        self._loss_at = 0  # where the last graph captured had its loss (a warm-up's guess)
        self._computed = Computed()
        # on XLA's CPU backend, products read transposed copies of the weights (see xla_linear)
        self._transposes: bool | None = None

    @property
    def programs(self) -> int:
        """How many programs have been captured."""
        return sum(graph.program is not None for graph in self._graphs)

    @property
    def lazy_reasons(self) -> list[str]:
        """Why each graph that runs lazily at every call does."""
        return [graph.refused for graph in self._graphs if graph.refused is not None]

    # -- torch.compile's side ------------------------------------------------------------------

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        graph = _Graph(gm)
        self._graphs.append(graph)
        if graph.refused is not None:
            self._say(graph.refused)

        def run(*args: Any) -> Any:
            return self._run(graph, list(args))

        return run

    def _run(self, graph: _Graph, args: list[Any]) -> Any:
        if self._warming:
            self._reached = True
            raise WarmedUp(graph.program is None and graph.refused is None and self._warm(graph, args))
        if graph.refused is not None:
            return graph.gm(*args)
        params = list(self._params())
        if graph.program is not None and graph.params != _identities(params):
            graph.program = None  # (parameters added, replaced or frozen since: captured again)
        if graph.program is None:
            why = self._unreplayable(args, params)
            if why is not None:
                self._refuse(graph, why)
                return graph.gm(*args)
        # a program's inputs are device data: a pending one (made or changed in place since, e.g.
        # by the user's code between steps) is run first
        xla_calls.materialize([value for value in (*args, *params) if isinstance(value, torch.Tensor)])
        if graph.program is None:
            self._pending = self._trace(graph, args, params)
            return tuple(self._pending.outputs)
        live = [*args, *params]
        program = graph.program
        found: list[Any] = [None] * (graph.outputs + len(graph.mutated) + len(graph.graded))
        for where, value in zip(program.outputs, program.run(live), strict=True):
            found[where] = value
            self._computed.add(value)
        count = graph.outputs
        with torch.no_grad():
            for place, value in zip(graph.mutated, found[count : count + len(graph.mutated)], strict=True):
                args[place].data = value
                self._computed.add(args[place])
        trainable = [p for p in params if p.requires_grad]
        self._grads = [
            (trainable[place], value)
            for place, value in zip(graph.graded, found[count + len(graph.mutated) :], strict=True)
        ]
        return tuple(found[:count])

    def _unreplayable(self, args: list[Any], params: list[torch.Tensor]) -> str | None:
        """Why a graph called on ``args`` cannot be captured now (None: it can)."""
        if not torch.is_grad_enabled():
            return "the step runs under torch.no_grad()"
        tensors = [value for value in args if isinstance(value, torch.Tensor)]
        host = [value for value in tensors if not is_xla(value.device)]
        if host:
            return (
                f"its graph reads a tensor on the host ({host[0].device}, TorchDynamo makes a numpy value one), whose "
                "value a program would keep"
            )
        ours = {id(p) for p in params}
        if any(value.requires_grad and id(value) not in ours for value in tensors):
            return "a tensor it reads needs gradients but is not one of the model's parameters"
        if any(p.requires_grad and p._backward_hooks for p in params):
            return (
                "a parameter has a tensor hook (register_hook), which the capture's gradient would run twice"
            )
        return None

    def _say(self, why: str) -> None:
        kind = why.split(",")[0].split("(")[0]
        if kind in self._warned:
            return
        self._warned.add(kind)
        warnings.warn(
            f"torchfold: compile='on' runs a step's graph lazily (traced op by op at every step), not as a "
            f"captured program: {why}",
            stacklevel=2,
        )

    def _refuse(self, graph: _Graph, why: str) -> None:
        """``graph`` runs lazily at every call from now on, with a warning saying why (once per kind)."""
        graph.refused = why
        self._say(why)

    def _trace(self, graph: _Graph, args: list[Any], params: list[torch.Tensor]) -> _Pending:
        """Run ``graph`` lazily on ``args``, with grad: the step a capture is made of."""
        live = [*args, *params]
        # each input's device buffer, by position, before the trace reads them (a 0-dim input is
        # given a buffer of its own first: torch_xla shares one among equal scalars)
        pending = _Pending(graph, args, live, positions(live, self._computed), HostReads())
        if self._transposes is None:
            self._transposes = transposes_here()
        linear = transposed_weights() if self._transposes else contextlib.nullcontext()
        with pending.reads, linear:
            pending.outputs = list(graph.gm(*args))
        return pending

    def _warm(self, graph: _Graph, args: list[Any]) -> bool:
        """Compile ``graph``'s program into XLA's cache without running it, on ``args`` (an example
        of its layout); whether one was compiled. Its loss is taken to be where the last graph
        captured had it: its first use captures it again (then the compiled program is found in
        the cache), so a wrong guess costs a compilation, never a wrong step."""
        params = list(self._params())
        if self._unreplayable(args, params) is not None:
            return False
        tensors = [value for value in args if isinstance(value, torch.Tensor)]
        xla_calls.materialize([*tensors, *params])
        with restored_afterwards([*tensors, *params], computed=self._computed):  # (what the trace changed)
            pending = self._trace(graph, args, params)
            if self._loss_at >= len(pending.outputs):
                return False
            loss = pending.outputs[self._loss_at]
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.requires_grad:
                return False
            roots, _, _, _ = self._roots(pending, loss)
            try:
                compile_program(roots, pending.position, pending.live, pending.reads, run=False)
            except Refused:
                return False
        return True

    # -- the caller's side ---------------------------------------------------------------------

    def begin(self, *, warm_up: bool = False) -> None:
        """Before a call of the compiled step (``warm_up``: a call that only compiles, see :meth:`warm_up`)."""
        self._pending, self._grads, self._warming, self._reached = None, None, warm_up, False

    def warm_up(self, call: Callable[[], Any]) -> bool:
        """Compile, without running it, the program of the graph that ``call`` (a first call of a
        compiled step, on an example of a layout not met yet) makes TorchDynamo trace; whether one
        was compiled. Nothing changes: the program raises :class:`WarmedUp` before TorchDynamo
        applies the step's side effects, and what the trace changed in place is put back.

        Raises:
            RuntimeError: ``call`` returned without reaching a program (TorchDynamo ran the step's
                Python itself): the step ran, its side effects with it.
        """
        self.begin(warm_up=True)
        try:
            call()
        except WarmedUp as done:
            return done.compiled
        finally:
            reached = self._reached
            self.begin()
        raise RuntimeError(
            "torchfold: a warm-up ran the step instead of compiling it (TorchDynamo did not compile the step's "
            f"frame{'' if reached else ', and no program was reached'}): its side effects were applied once; "
            "please report this torch version"
        )

    def finish(self, loss: torch.Tensor) -> bool:
        """After a call that returned ``loss``: capture a graph run for the first time, and put the
        gradients a program computed into ``.grad``. Whether the gradients are there (else the
        caller runs ``loss.backward()``)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            return self._capture(pending, loss)
        grads, self._grads = self._grads, None
        if grads is None:
            return False
        _add_grads(grads)
        return True

    def _roots(
        self, pending: _Pending, loss: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[int], list[int], list[tuple[torch.Tensor, torch.Tensor]]]:
        """What a program of ``pending``'s trace computes: the graph's outputs, the inputs it
        changed in place and the loss's gradients; with the places of those inputs among the
        graph's, of the parameters with a gradient among the trainable ones, and those gradients.
        (The lazy graph is kept: a capture refused after this leaves ``loss.backward()`` to the caller.)"""
        args = pending.args
        trainable = [p for p in pending.live[len(args) :] if p.requires_grad]
        grads = (
            torch.autograd.grad(loss, trainable, allow_unused=True, retain_graph=True) if trainable else ()
        )
        graded = [place for place, g in enumerate(grads) if g is not None]
        lazy = [(trainable[place], grads[place]) for place in graded]
        tensors = [place for place, value in enumerate(args) if isinstance(value, torch.Tensor)]
        changed = xla_calls.needs_materialization([args[place] for place in tensors])
        mutated = [place for place, need in zip(tensors, changed, strict=True) if need]
        roots = [*pending.outputs, *(args[place] for place in mutated), *(g for _, g in lazy)]
        return roots, mutated, graded, lazy

    def _capture(self, pending: _Pending, loss: torch.Tensor) -> bool:
        graph, outputs = pending.graph, pending.outputs
        at = [place for place, value in enumerate(outputs) if value is loss]
        if not at or not loss.requires_grad:
            self._refuse(graph, "the step's loss is not one of its graph's outputs, or needs no gradient")
            return False
        roots, mutated, graded, lazy = self._roots(pending, loss)
        if any(pending.args[place]._is_view() for place in mutated):
            self._refuse(graph, "its graph changes a view in place, whose base a program would not change")
            return False
        try:
            program, found = compile_program(roots, pending.position, pending.live, pending.reads)
        except Refused as why:
            self._refuse(graph, str(why))
            return False
        if any(value is None for value in found):
            # (a root that is an input as it was: the program would not give it back, rare)
            self._refuse(graph, "a result of the step's graph is one of its inputs as it was")
            return False
        graph.program, graph.outputs = program, len(outputs)
        graph.mutated, graph.graded = mutated, graded
        graph.params = _identities(pending.live[len(pending.args) :])
        self._loss_at = at[0]
        with torch.no_grad():
            for root, value in zip(roots, found, strict=True):
                root.data = value
                self._computed.add(root)
        _add_grads(lazy)
        return True


def _identities(params: Sequence[torch.Tensor]) -> tuple[tuple[int, bool], ...]:
    return tuple((id(p), p.requires_grad) for p in params)


def _add_grads(grads: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each gradient into its parameter's ``.grad`` as ``loss.backward()`` would put it: through the
    parameter's gradient accumulator, so that its hooks run (the optimizer wrapper's weighting of
    the minibatch); the program's gradients are the loss's, unweighted."""
    if grads:
        torch.autograd.backward([p for p, _ in grads], [g for _, g in grads])
