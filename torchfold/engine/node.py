"""Handles to deferred calls recorded on a :class:`~torchfold.Fold`.

A :class:`Node` names one row block of one batched call: the call's group (same op, same
depth, same number of arguments), its position in that group, which output of a
multi-output op it stands for (``split``) and whether consumers take it batched or as one
shared value (``nobatch``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torchfold._errors import FoldError

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "Group",
    "Node",
    "Owner",
    "describe_arg_shapes",
    "ints_and_floats_mixed",
    "literals_and_rows_mixed",
    "new_node",
    "node_label",
    "op_name",
    "outside_int64",
]

Op = str | Callable[..., Any]

new_node = object.__new__  # makes a Node without running __init__ (recording's hot path sets its slots)

# ints become int64 tensors: what fits
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


def outside_int64(value: int) -> str:
    """An int too large for a LongTensor, as messages name it (its size only when its digits would be a page)."""
    shown = repr(value) if value.bit_length() <= 128 else f"an int of {value.bit_length()} bits"
    return f"{shown}, outside int64 [-2**63, 2**63 - 1]"


def literals_and_rows_mixed(where: str, literals: str) -> str:
    """The message for ints (or floats) batched with nodes or tensors at one argument position."""
    return (
        f"{where}: {literals} and nodes/tensors are mixed at one position; pass either {literals} everywhere or "
        f"tensors/nodes everywhere (e.g. wrap the {literals} as tensors of the right shape)"
    )


def ints_and_floats_mixed(where: str, int_value: int, float_value: float) -> str:
    """The message for ints and floats batched together (one tensor can only have one dtype)."""
    return (
        f"{where}: ints and floats are mixed ({int_value!r} and {float_value!r}); batched "
        f"together they make one tensor of one dtype: pass floats everywhere ({float(int_value)!r}, not {int_value!r})"
    )


def op_name(op: Op) -> str:
    """A readable name for an op given as a method name or a callable."""
    if isinstance(op, str):
        return op
    return getattr(op, "__qualname__", None) or getattr(op, "__name__", None) or repr(op)


def node_label(name: str, depth: int, index: int, output: int | None = None, batch: bool = True) -> str:
    """How a node is shown (``repr`` and messages): ``Node('op', depth=1, index=3, output=0)``."""
    extra = "" if output is None else f", output={output}"
    extra += "" if batch else ", nobatch"
    return f"Node({name!r}, depth={depth}, index={index}{extra})"


def describe_arg_shapes(shapes: Sequence[tuple[Any, tuple[int, ...]]] | None) -> str:
    """Batched argument shapes as ``float32[3x16], int64[3]``."""
    return ", ".join(
        f"{str(dtype).removeprefix('torch.')}[{'x'.join(map(str, shape))}]" for dtype, shape in shapes or ()
    )


class Owner:
    """What a Fold's nodes point to instead of the Fold (see ``Node.owner``); numbers its sources.

    A source is one batched tensor that ``apply`` will produce: a group's result, or one output
    of a multi-output group. Numbering them lets ``apply`` plan gathers with integer arrays.
    """

    __slots__ = ("sources",)

    def __init__(self) -> None:
        self.sources = 0

    def new_sources(self, count: int) -> range:
        first = self.sources
        self.sources += count
        return range(first, first + count)


class Group:
    """All calls of one op at one depth with one arity: they run as one batched call."""

    __slots__ = (
        "arg_shapes",
        "calls",
        "depth",
        "nodes",
        "num_outputs",
        "op",
        "order",
        "output_sources",
        "source",
    )

    def __init__(self, op: Op, depth: int, order: int, source: int) -> None:
        self.op = op
        self.depth = depth
        self.order = order  # creation order: groups at the same depth run in this order
        self.source = source  # the number of the group's result used whole
        self.output_sources: range = range(0)  # the numbers of its outputs, once split
        self.calls: list[tuple[Any, ...]] = []  # the arguments of each call, in call order
        # each distinct call's node, by its arguments; emptied when the Fold goes (see Fold.__del__)
        self.nodes: dict[tuple[Any, ...], Node] = {}
        self.num_outputs = 0  # how many outputs `split` promised; 0 = used as a single tensor
        # (dtype, shape) of each batched argument of the last apply, formatted only when shown
        self.arg_shapes: list[tuple[Any, tuple[int, ...]]] | None = None

    @property
    def name(self) -> str:
        return op_name(self.op)

    def describe_arg_shapes(self) -> str:
        """The last apply's batched argument shapes, e.g. ``float32[3x16], int64[3]``."""
        return describe_arg_shapes(self.arg_shapes)

    def __repr__(self) -> str:
        return f"<group {self.name!r} depth {self.depth} x{len(self.calls)}>"


class Node:
    """A deferred result of ``Fold.add``: use it as an argument to later ``add`` calls or ask for
    its value in ``Fold.apply``.

    Example:
        >>> import torchfold
        >>> f = torchfold.Fold()
        >>> a = f.add("leaf", 3)
        >>> a
        Node('leaf', depth=0, index=0)
        >>> b, c = f.add("pair", a).split(2)
        >>> c
        Node('pair', depth=1, index=0, output=1)
    """

    # Handles are made once per value: split() and nobatch() return cached nodes, so two handles
    # of one value are the same object and identical calls deduplicate by identity.
    # `owner` is the recording Fold's token, not the Fold itself: a node pointing at its Fold
    # would make every Fold a reference cycle, freed only by Python's cyclic garbage collector
    # (whose full passes rescan every live object: seconds per epoch with a dataset in memory).
    # A split's outputs are cached as a chain, not a tuple: `_next` of a split node is its output
    # 0, `_next` of output i is output i + 1. Recording makes millions of nodes, and each object
    # that lives through a garbage-collector pass is one more to rescan in the next full pass.
    __slots__ = ("_next", "_nobatch", "batch", "group", "index", "output", "owner", "source")

    def __init__(
        self,
        owner: Owner,
        group: Group,
        index: int,
        output: int | None = None,
        batch: bool = True,
        source: int = -1,
    ):
        self.owner = owner
        self.group = group
        self.index = index
        self.output = output
        self.batch = batch
        self.source = group.source if source < 0 else source  # the number of the tensor holding its rows
        self._next: Node | None = None
        self._nobatch: Node | None = None

    @property
    def depth(self) -> int:
        return self.group.depth

    @property
    def op(self) -> Op:
        return self.group.op

    def split(self, num: int) -> tuple[Node, ...]:
        """One handle per output of an op that returns a tuple of ``num`` tensors."""
        group = self.group
        first = self._next
        if first is not None and self.output is None and num == group.num_outputs:
            outputs: tuple[Node, ...] = (first,)
            while (first := first._next) is not None:
                outputs += (first,)
            return outputs
        if (num.__class__ is not int and (isinstance(num, bool) or not isinstance(num, int))) or num < 1:
            raise ValueError(f"split(num) needs a positive int, got {num!r}")
        if self.output is not None:
            raise FoldError(
                f"{self} is already output {self.output} of a split; split the original node instead"
            )
        if group.num_outputs != num:
            if group.num_outputs:
                raise FoldError(
                    f"op {group.name!r} at depth {group.depth} was split into {group.num_outputs} outputs "
                    f"before, now into {num} (at {self}); an op must return the same number of outputs "
                    "for every call"
                )
            group.output_sources = self.owner.new_sources(num)
            group.num_outputs = num
        owner, index, batch, sources = self.owner, self.index, self.batch, group.output_sources
        if num == 2:  # the common case (an LSTM's h and c), without a loop
            # Built in place (new_node + slots), not through __init__: a call frame less per
            # handle, and recording makes two of these for every LSTM node.
            first = new_node(Node)
            first.owner, first.group, first.index, first.output = owner, group, index, 0
            first.batch, first.source, first._nobatch = batch, sources[0], None
            second = new_node(Node)
            second.owner, second.group, second.index, second.output = owner, group, index, 1
            second.batch, second.source, second._nobatch, second._next = batch, sources[1], None, None
            self._next = first
            first._next = second
            return first, second
        node = self
        for output, source in enumerate(sources):
            node._next = node = Node(owner, group, index, output, batch, source)
        return self.split(num)

    def nobatch(self) -> Node:
        """A handle whose value every consumer receives whole, instead of its rows being batched.

        All calls of one group must then pass the same ``nobatch`` node at that argument position
        (e.g. a memory or context shared by many calls).
        """
        if self._nobatch is None:
            self._nobatch = Node(self.owner, self.group, self.index, self.output, False, self.source)
        return self._nobatch

    def __repr__(self) -> str:
        return node_label(self.group.name, self.group.depth, self.index, self.output, self.batch)
