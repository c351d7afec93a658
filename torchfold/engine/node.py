"""Handles to deferred calls recorded on a :class:`~torchfold.Fold`.

A :class:`Node` names one row block of one batched call: the call's group (same op, same
depth, same number of arguments), its position in that group, which output of a
multi-output op it stands for (``split``) and whether consumers take it batched or as one
shared value (``nobatch``).
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from torchfold._errors import FoldError
from torchfold._validate import check_int
from torchfold.engine import native

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "SPLIT_HINT",
    "SPLIT_MAX",
    "Group",
    "Node",
    "Tape",
    "check_split",
    "describe_arg_shapes",
    "fold_gone",
    "foreign_node",
    "handle_of",
    "ints_and_floats_mixed",
    "literals_and_rows_mixed",
    "new_node",
    "node_label",
    "op_name",
    "outside_int64",
    "tape_ref_of",
]

Op = str | Callable[..., Any]

new_node = object.__new__  # makes a Node without running __init__ (recording's hot path sets its slots)

#: what ``split(num)``'s number is, ending its error
SPLIT_HINT = "how many outputs the op returns (a tuple of that many tensors)"
#: the most outputs ``split(num)`` takes: a split makes a handle per output at once, so a count
#: beyond any tuple an op returns (a row count, a size in bytes) would exhaust memory first
SPLIT_MAX = 2**16

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


def check_split(num: object) -> int:
    """``num`` if it is a count of outputs ``split(num)`` takes (an int in [1, ``SPLIT_MAX``]), else an error.

    >>> check_split(2**40)
    Traceback (most recent call last):
    ...
    ValueError: split(num) must be an int <= 65536, got 1099511627776; how many outputs the op returns (a tuple of that many tensors): return more values than that as one tensor
    """
    num = check_int("split(num)", num, hint=SPLIT_HINT)
    if num > SPLIT_MAX:
        shown = repr(num) if num.bit_length() <= 128 else f"an int of {num.bit_length()} bits"
        raise ValueError(
            f"split(num) must be an int <= {SPLIT_MAX}, got {shown}; {SPLIT_HINT}: return more values than "
            "that as one tensor"
        )
    return num


def fold_gone(handle: int) -> str:
    """The message for a node whose Fold no longer exists (a node refers to its fold weakly)."""
    return (
        f"node {handle} belongs to a Fold that no longer exists; keep the Fold (a variable that holds it) "
        "for as long as you use its nodes"
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


class Tape:
    """What a Fold records per node, as flat lists of ints (see ``Node``), and its groups.

    Every handle ``h`` (a node, one output of a split node, or a ``nobatch`` view of either) is
    a row of three lists: ``depth[h]``, ``source[h]`` (the number of the batched tensor holding
    its rows; ``~source`` for a ``nobatch`` handle) and ``index[h]`` (its call in that group).
    ``Fold.add`` appends to them and stores each call's arguments as a tuple of ints and literals,
    so recording keeps no Python object per node that the cyclic garbage collector tracks.
    A source is one batched tensor that ``apply`` will produce: a group's result, or one output
    of a multi-output group; ``source_group``/``source_output`` say which. ``ref`` is the one weak
    reference to the tape that all its nodes hold.
    """

    __slots__ = (
        "__weakref__",
        "depth",
        "index",
        "nobatch_of",
        "outputs_of",
        "ref",
        "source",
        "source_group",
        "source_output",
    )
    _STATE = ("depth", "index", "nobatch_of", "outputs_of", "source", "source_group", "source_output")

    def __init__(self) -> None:
        self.depth: list[int] = []
        self.source: list[int] = []
        self.index: list[int] = []
        self.source_group: list[Group] = []
        self.source_output: list[int | None] = []
        self.outputs_of: dict[int, int] = {}  # a split handle -> its output 0's handle (the others follow)
        self.nobatch_of: dict[int, int] = {}  # a handle -> its nobatch twin
        self.ref = weakref.ref(self)

    def __getstate__(self) -> dict[str, Any]:  # (copy and pickle: a weak reference is made anew)
        return {name: getattr(self, name) for name in self._STATE}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name in self._STATE:
            setattr(self, name, state[name])
        self.own_ref()

    def own_ref(self) -> weakref.ref[Tape]:
        """``ref``, made first when missing: unpickling may load a node before its tape's state."""
        if not hasattr(self, "ref"):
            self.ref = weakref.ref(self)
        return self.ref

    @property
    def sources(self) -> int:
        return len(self.source_group)

    def new_sources(self, group: Group, count: int, output: bool) -> range:
        first = len(self.source_group)
        for number in range(count):
            self.source_group.append(group)
            self.source_output.append(number if output else None)
        return range(first, first + count)

    def new_handle(self, depth: int, source: int, index: int) -> int:
        handle = len(self.source)
        self.depth.append(depth)
        self.source.append(source)
        self.index.append(index)
        return handle

    def label(self, handle: int) -> str:
        """How handle ``handle`` is shown: ``Node('op', depth=1, index=3, output=0)``."""
        source = self.source[handle]
        batch = source >= 0
        source = source if batch else ~source
        group = self.source_group[source]
        return node_label(group.name, group.depth, self.index[handle], self.source_output[source], batch)

    def short_label(self, handle: int) -> str:
        """``op@depth``, with ``.output`` and `` nobatch`` when they apply (``print(fold)``)."""
        source = self.source[handle]
        batch = source >= 0
        source = source if batch else ~source
        group, output = self.source_group[source], self.source_output[source]
        return (
            f"{group.name}@{group.depth}{'' if output is None else f'.{output}'}{'' if batch else ' nobatch'}"
        )


class Recording(Protocol):
    """What planning, request checks, printing and drawing read of a recorded fold.

    :class:`~torchfold.Fold` is one. The modules above the recorded graph name this, not ``Fold``,
    so that they import downward only (``Fold`` imports them).
    """

    @property
    def tape(self) -> Tape: ...

    @property
    def device(self) -> Any: ...

    @property
    def volatile(self) -> bool: ...

    @property
    def shapes(self) -> object: ...

    def groups(self) -> list[Group]: ...

    def __len__(self) -> int: ...


class Group:
    """All calls of one op at one depth with one arity: they run as one batched call.

    ``nodes`` maps each distinct call's arguments to its handle, in call order (dicts keep it):
    the arguments as ``Fold.add`` stores them, a tuple holding, per position, a node's handle
    (a bare ``int``: only in groups above depth 0, where every call has a node argument), an
    int (at depth 0; above it an int is stored as ``("int", value)``), ``("float", value)`` (a
    zero or NaN ``value`` as a float subclass that compares by its bits: see ``Fold.add``) or a
    tensor. A tuple of ints and tagged literals is one the garbage collector stops tracking at
    its first pass. ``plain`` says that every stored argument is a bare int.
    """

    __slots__ = (
        "arg_shapes",
        "depth",
        "nodes",
        "num_outputs",
        "op",
        "order",
        "output_sources",
        "plain",
        "source",
    )

    def __init__(self, op: Op, depth: int, order: int) -> None:
        self.op = op
        self.depth = depth
        self.order = order  # creation order: groups at the same depth run in this order
        self.source = -1  # the number of the group's result used whole (set by Tape.new_sources)
        self.output_sources: range = range(0)  # the numbers of its outputs, once split
        self.nodes: dict[tuple[Any, ...], int] = {}
        self.plain = True  # every argument a handle (above depth 0) or an int (at depth 0): a 2-d int array
        self.num_outputs = 0  # how many outputs `split` promised; 0 = used as a single tensor
        # (dtype, shape) of each batched argument of the last apply, formatted only when shown
        self.arg_shapes: list[tuple[Any, tuple[int, ...]]] | None = None

    @property
    def calls(self) -> list[tuple[Any, ...]]:
        """The stored arguments of each call, in call order (see the class docstring)."""
        return list(self.nodes)

    @property
    def name(self) -> str:
        return op_name(self.op)

    def describe_arg_shapes(self) -> str:
        """The last apply's batched argument shapes, e.g. ``float32[3x16], int64[3]``."""
        return describe_arg_shapes(self.arg_shapes)

    def __repr__(self) -> str:
        return f"<group {self.name!r} depth {self.depth} x{len(self.nodes)}>"


class Node:
    """A deferred result of ``Fold.add``: use it as an argument to later ``add`` calls or ask for
    its value in ``Fold.apply``.

    A node refers to its fold weakly: keep the fold for as long as you use its nodes (a node of
    a fold that is gone raises :class:`~torchfold.FoldError` when used).

    Example:
        >>> import torchfold
        >>> f = torchfold.Fold()
        >>> a = f.add("leaf", 3)
        >>> a
        Node('leaf', depth=0, index=0)
        >>> b, c = f.add("pair", a).split(2)
        >>> c
        Node('pair', depth=1, index=0, output=1)
        >>> f.add("leaf", 3) == a  # identical calls are recorded once: their handles are equal
        True
    """

    # NOTE: a node is a handle, a number into its fold's tape (``Tape``), not a record. The fold
    # keeps no Node objects: each add returns a fresh one. A fold keeping one object per node made
    # the cyclic garbage collector rescan every node of a growing fold (three quarters of
    # recording's time). A node holds an int and the tape's one weak reference (``Tape.ref``),
    # nothing that can lead back to it, so the nodes the C part makes (``native``) are not tracked
    # by the collector at all: holding a million of them costs it nothing. The fold keeps its
    # tape alive; a node of a fold that is gone says so when used. Two handles of one value
    # compare equal (``==``, and as dict keys) without being one object.
    __slots__ = ("_handle", "_ref")

    def __init__(self, tape: Tape, handle: int) -> None:
        self._ref = tape.ref
        self._handle = handle

    @property
    def _tape(self) -> Tape:
        tape = self._ref()
        if tape is None:
            raise FoldError(fold_gone(self._handle))
        return tape

    def __reduce__(self) -> tuple[Callable[[Tape, int], Node], tuple[Tape, int]]:  # (pickled with its tape)
        return _node_of, (self._tape, self._handle)

    @property
    def _source(self) -> int:
        source = self._tape.source[self._handle]
        return source if source >= 0 else ~source

    @property
    def group(self) -> Group:
        return self._tape.source_group[self._source]

    @property
    def depth(self) -> int:
        return self._tape.depth[self._handle]

    @property
    def op(self) -> Op:
        return self.group.op

    @property
    def index(self) -> int:
        """Its call's position in its group."""
        return self._tape.index[self._handle]

    @property
    def output(self) -> int | None:
        """Which output of a split node it is (None: the whole result)."""
        return self._tape.source_output[self._source]

    @property
    def batch(self) -> bool:
        """False for a ``nobatch`` handle."""
        return self._tape.source[self._handle] >= 0

    def split(self, num: int) -> tuple[Node, ...]:
        """One handle per output of an op that returns a tuple of ``num`` tensors.

        Raises:
            TypeError: ``num`` is not an int.
            ValueError: ``num`` is not in [1, ``SPLIT_MAX``] (65,536).
            FoldError: the node is an output of a split already, or its op was split into
                another number of outputs before.
        """
        tape, handle = self._tape, self._handle
        source = tape.source[handle]
        batch = source >= 0
        group = tape.source_group[source if batch else ~source]
        first = tape.outputs_of.get(handle)
        if first is None or num != group.num_outputs:
            if num.__class__ is not int or not 1 <= num <= SPLIT_MAX:
                check_split(num)
            output = tape.source_output[source if batch else ~source]
            if output is not None:
                raise FoldError(
                    f"{self} is already output {output} of a split; split the original node instead"
                )
            if group.num_outputs != num:
                if group.num_outputs:
                    raise FoldError(
                        f"op {group.name!r} at depth {group.depth} was split into {group.num_outputs} outputs "
                        f"before, now into {num} (at {self}); an op must return the same number of outputs "
                        "for every call"
                    )
                group.output_sources = tape.new_sources(group, num, output=True)
                group.num_outputs = num
            depth, index = tape.depth[handle], tape.index[handle]
            first = tape.outputs_of[handle] = len(tape.source)
            # tape.new_handle per output, without its call frames (a split per node of an LSTM)
            tape.depth.extend([depth] * num)
            tape.index.extend([index] * num)
            tape.source.extend(
                group.output_sources if batch else [~source for source in group.output_sources]
            )
        if num == 2:  # the common case (an LSTM's h and c), without a loop
            # Built in place (new_node + slots), not through __init__: a call frame less per handle.
            one = new_node(Node)
            one._ref, one._handle = tape.ref, first
            two = new_node(Node)
            two._ref, two._handle = tape.ref, first + 1
            return one, two
        return tuple(Node(tape, first + number) for number in range(num))

    def nobatch(self) -> Node:
        """A handle whose value every consumer receives whole, instead of its rows being batched.

        All calls of one group must then pass the same ``nobatch`` node at that argument position
        (e.g. a memory or context shared by many calls).
        """
        tape, handle = self._tape, self._handle
        source = tape.source[handle]
        if source < 0:
            return self
        twin = tape.nobatch_of.get(handle)
        if twin is None:
            twin = tape.nobatch_of[handle] = tape.new_handle(tape.depth[handle], ~source, tape.index[handle])
        return Node(tape, twin)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Node):
            return NotImplemented
        return self._handle == other._handle and self._ref is other._ref

    def __hash__(self) -> int:
        return hash((id(self._ref), self._handle))

    def __repr__(self) -> str:
        tape = self._ref()
        return (
            f"<node {self._handle} of a Fold that no longer exists>"
            if tape is None
            else tape.label(self._handle)
        )


#: A node's handle (its number on its fold's tape), and the weak reference to that tape it holds:
#: the getters of ``Node``'s two slots, for the planner and the request checks, which read them
#: for whole requests at once (``map(handle_of, request)``, no Python frame per node).
handle_of: Callable[[Node], int] = operator.attrgetter("_handle")
tape_ref_of: Callable[[Node], weakref.ref[Tape]] = operator.attrgetter("_ref")


def foreign_node(node: Node, ref: weakref.ref[Tape]) -> str | None:
    """Why ``node`` is not a node of the tape whose reference is ``ref`` (the end of an error
    message): its fold no longer exists, or it belongs to another fold; None when it is that tape's."""
    if node._ref is ref:
        return None
    if node._ref() is None:
        return fold_gone(node._handle)
    return f"{node!r} belongs to another Fold; apply it on its own Fold"


def _node_of(tape: Tape, handle: int) -> Node:
    """A node, unpickled. Its tape may not have its state yet (an op that holds nodes is part of
    the tape's state, so one of them can be loaded first): the tape's ``ref`` is then made here."""
    node = new_node(Node)
    node._ref, node._handle = tape.own_ref(), handle
    return node


# Node.split in C for a group whose outputs are known (every split but its first), the Python
# split above for the rest: the same handles, tape and errors (see Fold.add).
native.install(Node, "split", lambda split: native.FastSplit(split, Node, Tape, Group))
