"""Recording a fold: ``Fold.add`` stores deferred calls grouped by (depth, op, arity).

Recording is the hot path of every dynamic model (one ``add`` per tree node), so it only
appends to lists and dictionaries; all checks that can wait for ``apply`` do.
"""

from __future__ import annotations

import struct
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchfold._errors import FoldError
from torchfold.engine import native
from torchfold.engine.devices import is_cuda
from torchfold.engine.draw import draw_fold
from torchfold.engine.node import (
    INT64_MAX,
    INT64_MIN,
    Group,
    Node,
    Op,
    Tape,
    new_node,
    op_name,
    outside_int64,
)
from torchfold.engine.plan import FoldPlan, apply_plan
from torchfold.engine.planner import plan_fold
from torchfold.engine.readiness import Waves, by_readiness, check_schedule
from torchfold.engine.resolve import cuda_device, describe
from torchfold.engine.static.shapes import StaticShapes, envelope_for

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from torchfold.engine.static.shapes import StaticPlan

__all__ = ["Fold"]

_Tensor = torch.Tensor
_LITERALS = (int, float)


class _Bitwise(float):
    """A float in a stored call that equals only a stored float of the same bits.

    Identical calls are recorded once, but ``-0.0 == 0.0`` although eager results tell them apart
    (``copysign``, ``1 / x``, ``atan2``), and ``nan != nan`` unless it is the same object, although
    two NaNs of the same bits give the same results (and a NaN's sign changes them). ``Fold.add``
    stores zeros and NaNs as this, so that two calls are one exactly when their floats' bits are;
    every other float already equals only the floats of its bits.

    >>> _Bitwise(-0.0) == _Bitwise(0.0), _Bitwise("nan") == _Bitwise("nan")
    (False, True)
    """

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return other.__class__ is _Bitwise and _PACK(self) == _PACK(other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(_PACK(self))


_PACK = struct.Struct("<d").pack


def _stored(value: float) -> float:
    """A float as a call's key holds it (see ``_Bitwise``): zeros and NaNs compared by their bits."""
    return value if value and value == value else _Bitwise(value)


def _given(value: Any) -> Any:
    """A stored literal's value as it was given to ``add`` (a plain float for a ``_Bitwise``)."""
    return float(value) if value.__class__ is _Bitwise else value


def _tag(literal: int | float) -> tuple[str, int | float]:
    """An int or float as stored above depth 0, where a bare int is a node's handle (see ``Group``)."""
    return ("int", literal) if literal.__class__ is int else ("float", _stored(literal))


RequestItem = Node | torch.Tensor | int | float  # what the lists given to apply may hold


class Fold:
    """Records deferred node operations and runs each (depth, op) group as one batched call.

    ``add(op, *args)`` returns a :class:`~torchfold.Node` at depth ``1 + max(depth of node
    arguments)`` (``0`` when no argument is a node). ``apply(module, [[nodes], ...])`` then calls
    ``getattr(module, op)`` once per group, with each argument position batched along dim 0:

    * a node argument becomes the rows that node's call produced;
    * an ``int`` becomes one entry of a ``LongTensor`` of shape ``(calls,)`` (a ``float``, of a
      float tensor), created on the fold's device;
    * a tensor argument is passed as is: its leading dimension is its rows.

    Identical calls (same op, same arguments; tensors compared by identity, floats by their bits,
    so ``-0.0`` and ``0.0`` are two calls) are recorded once.

    Args:
        device: where int/float arguments are materialised. ``None`` (default) uses the device
            of the module's first parameter or buffer at ``apply`` time, else the CPU.
        shapes: ``"auto"`` (default): pad plans into static shapes on XLA devices only (one
            :class:`~torchfold.StaticShapes` envelope per module), so XLA compiles each graph
            once instead of once per batch; a :class:`~torchfold.StaticShapes`: pad every plan
            of this fold into it, on any device (``plan`` then returns a
            :class:`~torchfold.StaticPlan`); ``None``: never pad.
        schedule: ``"depth"`` (default): one batched call per op and depth; ``"ready"``: the
            calls of one op run together as soon as what they read has run (DyNet's agenda, as
            :func:`~torchfold.autobatch` runs): the same results in fewer batched calls on graphs
            that mix several ops, at a higher planning cost (see the engine guide).
        cuda: legacy TorchFold flag, same as ``device="cuda"``.
        volatile: legacy TorchFold flag, same as running ``apply`` under ``torch.no_grad()``.

    Example:
        >>> import torch, torchfold
        >>> class Doubler(torch.nn.Module):
        ...     def exp(self, x):
        ...         return 2 * x
        >>> f = torchfold.Fold()
        >>> a = f.add("exp", 1)
        >>> b = f.add("exp", a)
        >>> f.apply(Doubler(), [[a, b]])
        [tensor([2, 4])]
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        shapes: StaticShapes | str | None = "auto",
        schedule: str = "depth",
        cuda: bool = False,
        volatile: bool = False,
    ) -> None:
        if cuda or volatile:
            warnings.warn(
                "Fold(cuda=..., volatile=...) are TorchFold 0.x flags: use Fold(device='cuda') and "
                "torch.no_grad() instead",
                DeprecationWarning,
                stacklevel=2,
            )
        if cuda and device is not None and not is_cuda(device):
            raise ValueError(f"Fold(cuda=True) contradicts device={device!r}; pass only device=")
        self.device: torch.device | None = torch.device("cuda") if cuda else None
        if device is not None:
            self.device = torch.device(device)
        self.volatile = volatile
        if not (shapes is None or shapes == "auto" or isinstance(shapes, StaticShapes)):
            raise ValueError(
                f"Fold(shapes={shapes!r}): shapes must be 'auto' (pad on XLA), None (never pad) or a "
                "torchfold.StaticShapes envelope"
            )
        self.shapes = shapes
        self.schedule = check_schedule(schedule)
        if self.schedule == "ready" and isinstance(shapes, StaticShapes):
            warnings.warn(
                "Fold(schedule='ready', shapes=StaticShapes(...)): readiness groups calls differently from "
                "batch to batch, so the envelope keeps growing (more padding, and on XLA more compiles); "
                "use schedule='depth' with static shapes",
                stacklevel=2,
            )
        self._groups: dict[tuple[int, Op, int], Group] = {}
        self._tape = Tape()  # what this Fold's nodes are numbers into (see Node)
        self._recorder = self._new_recorder()

    def _new_recorder(self) -> Any:
        """What the C ``add`` records into (``_record.c``): this fold's tape and groups; None while
        the C part is off (see ``native.use``)."""
        return native.Recorder(self._tape, self._groups, Node, Group) if native.enabled() else None

    def __getstate__(self) -> dict[str, Any]:  # (copy and pickle: the C recorder is made anew)
        state = dict(self.__dict__)
        state["_recorder"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # NOTE: no recorder yet: it reads the tape's lists, which may not be set at this point. An
        # op that holds this fold (a bound method of a module keeping it) is part of the tape's
        # state, so a copy can build the fold inside its tape's state. The first add (the Python
        # add: the C add leaves every call to it while there is no recorder) makes the recorder.
        self.__dict__.update(state)
        self.__dict__.setdefault("schedule", "depth")  # (a fold pickled before schedules)
        self._recorder = None

    # -- recording --------------------------------------------------------------------------

    def add(self, op: Op, *args: Any) -> Node:
        """Record ``op(*args)`` for later batched execution and return its node.

        Args:
            op: the name of a method of the module given to ``apply``, or a callable.
            *args: nodes of this fold, ints, floats or tensors (leading dim = rows). The op
                must not change its arguments in place (``apply`` refuses it: a batched argument
                is an earlier node's own rows or a copy, as the executor chooses).

        Raises:
            FoldError: an argument is a node of another fold, an int outside int64, or of an
                unsupported type.
        """
        tape = self._tape
        ref = tape.ref  # what this fold's nodes hold (see Node)
        depths = tape.depth
        count = len(args)
        if self._recorder is None and native.enabled():  # a copy's first add (see __setstate__)
            self._recorder = self._new_recorder()
        # Unrolled first: two nodes (binary trees), four (a binary LSTM cell), one node (chains), one int (leaves).
        if (
            count == 2
            and (a := args[0]).__class__ is Node
            and (b := args[1]).__class__ is Node
            and a._ref is ref
            and b._ref is ref
        ):
            left = a._handle
            right = b._handle
            key: tuple[Any, ...] = (left, right)
            depth = depths[left]
            below = depths[right]
            if below > depth:
                depth = below
            depth += 1
            plain = True
        elif (
            count == 4  # an LSTM cell over two children: (h, c) of each
            and (a := args[0]).__class__ is Node
            and (b := args[1]).__class__ is Node
            and (c := args[2]).__class__ is Node
            and (d := args[3]).__class__ is Node
            and a._ref is ref
            and b._ref is ref
            and c._ref is ref
            and d._ref is ref
        ):
            key = (a._handle, b._handle, c._handle, d._handle)
            depth = max(depths[key[0]], depths[key[1]], depths[key[2]], depths[key[3]]) + 1
            plain = True
        elif count == 1 and (a := args[0]).__class__ is Node and a._ref is ref:
            key = (a._handle,)
            depth = depths[key[0]] + 1
            plain = True
        elif count == 1 and a.__class__ is int and INT64_MIN <= a <= INT64_MAX:
            key, depth, plain = args, 0, True
        else:
            depth = 0
            handles: list[Any] = []  # the arguments as stored: nodes by their handles
            ints = floats = tensors = False
            for arg in args:
                cls = arg.__class__
                if cls is Node:
                    if arg._ref is not ref:
                        raise FoldError(
                            f"{arg} passed to {op_name(op)!r} belongs to another Fold; nodes can only be used "
                            "in the Fold that created them (build the whole graph in one Fold)"
                        )
                    handle = arg._handle
                    below = depths[handle]
                    if below >= depth:
                        depth = below + 1
                    handles.append(handle)
                    continue
                if cls is float:
                    floats = True
                elif cls is int:
                    ints = True
                    if not INT64_MIN <= arg <= INT64_MAX:  # would fail only at apply, as a bare OverflowError
                        raise FoldError(
                            f"argument {[a is arg for a in args].index(True) + 1} of {op_name(op)!r} is "
                            f"{outside_int64(arg)}; ints become a LongTensor: pass a float or a tensor instead"
                        )
                elif isinstance(arg, _Tensor):
                    tensors = True
                else:
                    raise FoldError(
                        f"argument {[a is arg for a in args].index(True) + 1} of {op_name(op)!r} is a "
                        f"{type(arg).__name__} ({arg!r}); "
                        "fold arguments must be nodes of this Fold, ints, floats or tensors"
                    )
                handles.append(arg)
            # Identical calls are found by their stored arguments: handles and ints by value, tensors
            # by identity, floats by their bits (-0.0 is not 0.0: see _Bitwise). Floats are tagged so
            # that 1.0 and 1 (a float and a long tensor) stay different calls, and so are ints above
            # depth 0, where a bare int is a node's handle.
            if depth:
                if ints or floats:
                    key = tuple(
                        [
                            a._handle if a.__class__ is Node else (_tag(a) if a.__class__ in _LITERALS else a)
                            for a in args
                        ]
                    )
                else:
                    key = tuple(handles)
                plain = not (ints or floats or tensors)
            elif floats:
                key = tuple([("float", _stored(a)) if a.__class__ is float else a for a in args])
                plain = False
            else:
                key = args
                plain = not tensors
        where = (depth, op, count)
        group = self._groups.get(where)
        if group is None:
            if op.__class__ is not str and not callable(op):
                raise TypeError(f"op must be a method name (str) or a callable, got {op!r}")
            group = self._groups[where] = Group(op, depth, len(self._groups))
            group.source = tape.new_sources(group, 1, output=False)[0]
        if not plain:
            group.plain = False
        nodes = group.nodes
        fresh = len(depths)  # tape.new_handle, without a call frame
        handle = nodes.setdefault(key, fresh)  # (one lookup of the key, new or identical call)
        if handle == fresh:
            tape.index.append(len(nodes) - 1)
            tape.source.append(group.source)
            depths.append(depth)
        node = new_node(Node)  # Node(tape, handle), without a call frame
        node._ref, node._handle = ref, handle
        return node

    # -- running ----------------------------------------------------------------------------

    def apply(
        self, nn: torch.nn.Module | object, nodes: Sequence[Sequence[RequestItem]], *, padded: bool = False
    ) -> list[torch.Tensor]:
        """Run every recorded group once, batched, and return one tensor per list of ``nodes``.

        The rows of each returned tensor are the values of the listed nodes, in list order.
        As in the original TorchFold, a list may also hold tensors, whose rows are concatenated
        with the nodes' (each with as many rows as one node's value), or be all ints (they make
        one ``LongTensor`` on the fold's device) or all floats. Every op name is looked up on
        ``nn`` before anything runs.

        Example:
            >>> import torch, torchfold
            >>> model = torch.nn.Module()  # ops: its attributes, by name, or any callable
            >>> model.square = lambda x: x * x
            >>> f = torchfold.Fold()
            >>> nodes = [f.add(torch.neg, f.add("square", value)) for value in (1, 2)]
            >>> f.apply(model, [nodes, [7, 9]])  # ints, e.g. labels, come back as one LongTensor
            [tensor([-1, -4]), tensor([7, 9])]

        Raises:
            FoldError: unknown op, rows that disagree within a group, a bad split, an empty
                or malformed request.
            Exception: an exception raised inside an op, of its own type (so ``except
                torch.OutOfMemoryError`` still catches it), with a note naming the op, the
                depth, the nodes and the batched argument shapes.
        """
        plan = self.plan(nodes)
        if not isinstance(plan, FoldPlan):  # padded into static shapes
            return plan.apply(nn, padded=padded)
        shapes: list[list[tuple[Any, Any]]] = []
        try:
            return apply_plan(plan, nn, shapes)
        finally:  # print(fold) shows the batched shapes of the last apply (kept here: the plan is not written)
            same = self.schedule == "depth"  # (waves are not the recorded groups: nothing to show)
            for number, group in enumerate(self.groups()):
                group.arg_shapes = shapes[number] if same and number < len(shapes) else None

    def cuda(self) -> Fold:
        """Make int and float arguments on the GPU from now on (the original TorchFold's method); returns the fold.

        Same as ``Fold(device="cuda")``.

        Example:
            >>> import torch, torchfold
            >>> fold = torchfold.Fold()
            >>> if torch.cuda.is_available():
            ...     fold = fold.cuda()

        Raises:
            RuntimeError: CUDA is not available.
        """
        self.device = cuda_device("Fold")
        return self

    def plan(self, nodes: Sequence[Sequence[RequestItem]]) -> FoldPlan | StaticPlan:
        """Plan what ``apply(module, nodes)`` would run: a picklable :class:`~torchfold.FoldPlan`.

        ``fold.plan(nodes).apply(module)`` equals ``fold.apply(module, nodes)``. A plan holds no
        nodes, just op names, index arrays and the tensors given to ``add``: build folds and their
        plans in ``DataLoader`` worker processes, so that the training process only runs tensor ops.

        Raises:
            FoldError: a malformed or empty request, a node of another fold, ints mixed with
                nodes or with floats at one argument position, or a ``nobatch`` node not shared
                by its group.
        """
        if self.schedule == "depth":
            plan = plan_fold(self, nodes)
        else:
            plan = plan_fold(self._waves(), nodes, merges_depths=True)
        envelope = envelope_for(self.shapes)  # "auto" decides when applied, on the module's device
        return plan if envelope is None else envelope.cover(plan)

    # -- inspecting -------------------------------------------------------------------------

    @property
    def tape(self) -> Tape:
        """What this fold's nodes are numbers into: per node its depth, the source (a group's
        results, or one of its outputs) and the call it is (see :class:`~torchfold.engine.node.Tape`).

        The planner, ``print(fold)`` and ``draw`` read the recorded graph through it and
        :meth:`groups`; it only grows, by ``add`` and ``split``.
        """
        return self._tape

    def groups(self) -> list[Group]:
        """The recorded groups in execution order (by depth, then by first use)."""
        return sorted(self._groups.values(), key=lambda g: (g.depth, g.order))

    def arguments(self, group: Group) -> list[tuple[Any, ...]]:
        """Each distinct call of ``group`` (one of :meth:`groups`), its arguments as given to ``add``.

        Example:
            >>> import torchfold
            >>> f = torchfold.Fold()
            >>> a = f.add("leaf", 3)
            >>> b = f.add("pair", a, 2.5)
            >>> f.arguments(f.groups()[1])
            [(Node('leaf', depth=0, index=0), 2.5)]
        """
        tape, nodes = self._tape, group.depth > 0
        return [
            tuple(
                Node(tape, arg)
                if nodes and arg.__class__ is int
                else _given(arg[1])
                if arg.__class__ is tuple
                else arg
                for arg in call
            )
            for call in group.nodes
        ]

    def __len__(self) -> int:
        return sum(len(group.nodes) for group in self._groups.values())

    def _waves(self) -> Waves:
        """This fold regrouped by readiness (``schedule="ready"``); with an envelope of its own, its
        waves keep nodes and tensors apart (``"auto"`` pads on XLA, which readiness is not for:
        see the engine guide)."""
        return by_readiness(self, padded=isinstance(self.shapes, StaticShapes))

    def __repr__(self) -> str:
        if self.schedule == "depth":
            return describe(self)
        waves = len(self._waves().groups()) if len(self) else 0
        return f"{describe(self)}\n  (schedule='ready': planned into {waves} batched calls by readiness)"

    def draw(self, path: str | Path | None = None, **kwargs: Any) -> Figure:
        """Draw the graph by depth, one box per batched group; save it to ``path`` if given.

        Keyword arguments go to :func:`torchfold.engine.draw.draw_fold` (``max_nodes``, ``title``...).
        A fold of more than ``max_groups=200`` groups is refused (slow, unreadable): draw a part
        of it with ``depths=range(start, stop)``.
        """
        return draw_fold(self, path, **kwargs)


# Fold.add in C for the calls dynamic models make per node (nodes or an int into a group that
# exists), the Python add above for every other call: the same nodes, groups and errors. It binds
# to a fold as a function does; a subclass's own add still overrides it.
native.install(Fold, "add", native.FastAdd)
