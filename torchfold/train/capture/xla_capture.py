"""Capturing a lazily traced XLA graph as a program, and replaying it: the parts every XLA replay shares.

A *program* is one graph torch_xla traced, compiled into its cache under the graph's hash, with,
for each of its inputs, where a replay takes it from: a position among the *live* tensors the
caller passes at every replay (bound by position, never by value or device buffer), or a constant
of the capture. :class:`~torchfold.train.capture.xla_programs.XlaPrograms` (``compile="replay"``)
and :class:`~torchfold.train.capture.dynamo_programs.XlaGraphPrograms` (``compile="on"``) capture
and replay their programs with these.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import torch

from torchfold.train.distributed import xla_calls
from torchfold.train.distributed.devices import is_xla
from torchfold.train.distributed.xla_calls import HostReads

__all__ = [
    "Computed",
    "Program",
    "Refused",
    "compile_program",
    "graph_sources",
    "positions",
    "same_constants",
]


class Program:
    """One captured graph: its hash, where each graph input comes from, which roots it returns."""

    __slots__ = ("constants", "due", "graph", "options", "outputs", "replays", "sources", "step", "verified")

    def __init__(self, graph: Any, sources: list[tuple[int, Any]], outputs: list[int]) -> None:
        #: the step it was captured in (the runner's count): a second capture in a later step verifies it
        self.step = -1
        self.graph = graph
        # per graph input: (0, position among the live tensors) or (1, a constant of the capture)
        self.sources = sources
        # the positions (among the roots of the capture) of the results the graph returns
        self.outputs = outputs
        # the capture's constants as host values, compared with the second capture's (then verified)
        self.constants: list[torch.Tensor] = [value.cpu() for kind, value in sources if kind == 1]
        self.verified = False
        #: replays since the last capture that checked it, and whether its next use checks it anyway
        self.replays = 0
        self.due = False
        #: an update program's optimizer options, whose values its constants hold (None: a minibatch's)
        self.options: Hashable | None = None

    def rebind(self, captured: Program) -> None:
        """Read ``captured``'s constants from now on: a capture of the same graph whose constants
        differ only by what the optimizer's options gave (see ``XlaPrograms.update``)."""
        self.sources, self.constants, self.options = captured.sources, captured.constants, captured.options

    def run(self, live: list[torch.Tensor]) -> list[torch.Tensor]:
        self.replays += 1
        return xla_calls.run_graph(
            self.graph, [live[where] if kind == 0 else where for kind, where in self.sources]
        )


class Computed:
    """The tensors known to hold a device buffer that a program computed, by identity (a
    tensor's ``==`` is elementwise, so no set of tensors), held weakly."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref[torch.Tensor]] = {}

    def add(self, tensor: torch.Tensor) -> None:
        if len(self._refs) > 4096:  # (drop the dead)
            self._refs = {key: ref for key, ref in self._refs.items() if ref() is not None}
        self._refs[id(tensor)] = weakref.ref(tensor)

    def holds(self, tensor: torch.Tensor) -> bool:
        ref = self._refs.get(id(tensor))
        return ref is not None and ref() is tensor

    def discard(self, tensor: torch.Tensor) -> None:
        """``tensor`` no longer holds a buffer a program computed (another was put back in it)."""
        if self.holds(tensor):
            del self._refs[id(tensor)]


class Refused(Exception):
    """A capture that cannot be replayed; its message says why, ``roots`` are the captured step's results
    (pending: a sync runs them op by op, as without capture)."""

    def __init__(self, why: str, roots: list[torch.Tensor], *, host_read: bool = False) -> None:
        super().__init__(why)
        self.roots = roots
        #: refused for a graph run during the capture (a read back to the host, or, with replicas
        #: that are threads, possibly another replica's graph)
        self.host_read = host_read


def positions(live: list[torch.Tensor], computed: Computed) -> dict[int, int]:
    """Each live tensor's position, by the id of the device data it holds (the id a captured graph
    names its input by), taken just before a capture: each tensor is given a buffer of its own
    first (:func:`~torchfold.train.distributed.xla_calls.own_buffers`; ``computed``: the tensors
    that hold one already), so that no two roles, nor a role and a constant of the capture, share one."""
    for tensor in xla_calls.own_buffers(live, computed.holds):
        computed.add(tensor)
    ids = xla_calls.data_ids(live)
    position: dict[int, int] = {}
    for number, data in enumerate(ids):
        first = position.setdefault(data, number)
        if first != number and live[first] is not live[number]:
            raise RuntimeError(
                f"the inputs {first} and {number} of a program to capture hold one device buffer; "
                "please report this torch_xla version"
            )
    return position


def graph_sources(
    ids: Sequence[int], values: Sequence[torch.Tensor], position: dict[int, int], live: Sequence[torch.Tensor]
) -> list[tuple[int, Any]]:
    """Per graph input: ``(0, its position among the live tensors)``, or ``(1, the value)`` for a
    constant of the capture (device data that no live tensor held before it, e.g. a Python number).

    An input bound to a live tensor must have its shape and dtype: anything else is a binding
    error, raised here rather than replayed."""
    sources: list[tuple[int, Any]] = []
    for number, value in zip(ids, values, strict=True):
        where = position.get(number)
        if where is None:
            sources.append((1, value))
            continue
        tensor = live[where]
        if tensor.shape != value.shape or tensor.dtype != value.dtype:
            raise RuntimeError(
                f"a captured program's input of shape {tuple(value.shape)} and dtype {value.dtype} was bound to "
                f"live tensor {where} of shape {tuple(tensor.shape)} and dtype {tensor.dtype}; please report this "
                "torch_xla version"
            )
        sources.append((0, where))
    return sources


def compile_program(
    roots: list[torch.Tensor],
    position: dict[int, int],
    live: list[torch.Tensor],
    reads: HostReads,
    *,
    run: bool = True,
) -> tuple[Program, list[Any]]:
    """Compile the captured graph ending in ``roots`` (those that changed: the others are returned
    as ``None``), run it once on its own inputs; the program and each root's value (``run=False``:
    compiled only, every value ``None``; the caller drops the capture)."""
    changed = xla_calls.needs_materialization(roots)
    outputs = [where for where, need in enumerate(changed) if need]
    kept = [roots[where] for where in outputs]
    ids, values = xla_calls.device_data(kept)
    if reads.happened():
        raise Refused(
            "something read a value back to the host inside the step (.item(), .tolist(), float() of a "
            "tensor), which cuts the graph",
            list(roots),
            host_read=True,
        )
    if xla_calls.seed_id() in ids:
        raise Refused(
            "it draws random numbers (dropout?), and a replay would repeat the draws of its capture",
            list(roots),
        )
    graph = xla_calls.graph_hash(kept)
    xla_calls.compile_graph(kept)
    program = Program(graph, graph_sources(ids, values, position, live), outputs)
    found: list[Any] = [None] * len(roots)
    if not run:
        return program, found
    results = xla_calls.run_graph(graph, values)
    for where, value in zip(outputs, results, strict=True):
        found[where] = value
    return program, found


def same_constants(program: Program, other: Program) -> bool:
    if program.graph != other.graph or len(program.constants) != len(other.constants):
        return False
    return all(
        a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
        for a, b in zip(program.constants, other.constants, strict=True)
    )


@contextlib.contextmanager
def restored_afterwards(
    tensors: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer | None = None,
    computed: Computed | None = None,
) -> Iterator[None]:
    """Inside, a step may be captured (never run): afterwards ``tensors`` (materialized: device
    data), their gradients and the optimizer's state (if given) are what they were before, whatever
    the capture did to them in place (an update), and state the capture created is gone. Each
    tensor put back is dropped from ``computed`` (its buffer may again be one torch_xla shares, as
    before the capture gave it one of its own).

    The capture's pending operations are dropped with it: a program compiled from it waits in
    XLA's cache for the step that will run it (:meth:`XlaPrograms.warm_up`), or is compared with
    the program a step replays (:meth:`XlaPrograms.check`).
    """

    def held(value: Any) -> Any:  # a tensor's device data as a tensor of its own (in-place ops leave it)
        if not isinstance(value, torch.Tensor):
            return value
        if not is_xla(value.device):
            return value.clone()
        return xla_calls.device_data([value])[1][0]

    kept = [held(t) for t in tensors]
    grads = [t.grad for t in tensors]
    state = optimizer.state if optimizer is not None else {}
    # each state tensor, and its device data: the same objects are put back (a program's inputs
    # may be these objects), their data as it was (the capture changed some in place)
    before = {p: {name: (value, held(value)) for name, value in entry.items()} for p, entry in state.items()}
    try:
        yield
    finally:
        with torch.no_grad():
            for tensor, value, grad in zip(tensors, kept, grads, strict=True):
                tensor.data = value
                tensor.grad = grad
                if computed is not None:
                    computed.discard(tensor)
            for p in [p for p in state if p not in before]:
                del state[p]
            for p, entry in before.items():
                restored: dict[str, Any] = {}
                for name, (value, data) in entry.items():
                    if isinstance(value, torch.Tensor):
                        value.data = data
                        if computed is not None:
                            computed.discard(value)
                    restored[name] = value
                state[p] = restored
