"""The recorder: ``Fold.add`` against a plain reference recorder, and what the garbage collector sees.

``Fold`` records into its tape (flat lists of ints, calls stored as tuples of handles) and
compiles a group's calls as whole arrays. :class:`ReferenceFold` below records the plain way,
one Python object per node holding its arguments, and says for every group and argument
position which node (group, output, call), literal or tensor each call reads. On random
programs (``test_fold_properties.run_program``: splits, ``nobatch``, dedup, ints, floats, tensors
mixed with nodes) the compiled plan must read exactly that.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import math
import pickle
import re
import struct
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine.test_fold_properties import PLANNERS, compaction, instruction, requested, run_program
from torchfold import EagerFold, Fold, FoldError
from torchfold.engine import native
from torchfold.engine.ir import Arg, Gather
from torchfold.engine.node import SPLIT_MAX, Node
from torchfold.engine.plan import FoldPlan

Item = tuple[Any, ...]  # ("node", group number, output, call), ("int", v), ("float", v), ("tensor", id)


class ReferenceNode:
    def __init__(self, fold: ReferenceFold, key: tuple[Any, ...], index: int, output: int | None = None,
                 batch: bool = True) -> None:  # fmt: skip
        self.fold, self.key, self.index, self.output, self.batch = fold, key, index, output, batch
        self.depth: int = key[0]

    def split(self, num: int) -> tuple[ReferenceNode, ...]:
        return tuple(ReferenceNode(self.fold, self.key, self.index, k, self.batch) for k in range(num))

    def nobatch(self) -> ReferenceNode:
        return ReferenceNode(self.fold, self.key, self.index, self.output, False)

    def same(self) -> tuple[Any, ...]:
        return (self.key, self.index, self.output, self.batch)


def _identified(arg: Any) -> Any:
    """What makes a literal or tensor argument the same: a tensor's identity, a float's bits, an int."""
    if isinstance(arg, torch.Tensor):
        return id(arg)
    return struct.pack("<d", arg) if isinstance(arg, float) else arg


class ReferenceFold:
    """Groups calls by (depth, op, arity) in first-use order; identical calls once (tensors by
    identity, floats by their bits: -0.0 is not 0.0)."""

    def __init__(self) -> None:
        self.groups: dict[tuple[Any, ...], list[tuple[Any, ...]]] = {}
        self.seen: dict[tuple[Any, ...], ReferenceNode] = {}

    def add(self, op: Any, *args: Any) -> ReferenceNode:
        depth = 1 + max((a.depth for a in args if isinstance(a, ReferenceNode)), default=-1)
        key = (depth, op, len(args))
        same = tuple(a.same() if isinstance(a, ReferenceNode) else (type(a), _identified(a)) for a in args)
        if (key, same) not in self.seen:
            calls = self.groups.setdefault(key, [])
            self.seen[(key, same)] = ReferenceNode(self, key, len(calls))
            calls.append(args)
        return self.seen[(key, same)]

    def expected(self, requests: list[list[Any]]) -> tuple[list[tuple[Any, ...]], list[list[Item]]]:
        """Per group in running order: (op, depth, calls, per position the items read); per request its items."""
        order = sorted(self.groups, key=lambda key: (key[0], list(self.groups).index(key)))
        number = {key: n for n, key in enumerate(order)}

        def item(arg: Any) -> Item:
            if isinstance(arg, ReferenceNode):
                return ("node", number[arg.key], arg.output, arg.index)
            if isinstance(arg, torch.Tensor):
                return ("tensor", id(arg))
            return ("int" if isinstance(arg, int) else "float", arg)

        groups = []
        for key in order:
            calls = self.groups[key]
            columns = []
            for column in zip(*calls, strict=True):
                shared = [a for a in column if isinstance(a, ReferenceNode) and not a.batch]
                columns.append([("shared", *item(shared[0])[1:])] if shared else [item(a) for a in column])
            groups.append((key[1], key[0], len(calls), columns))
        return groups, [[item(a) for a in request] for request in requests]


def _read(plan: FoldPlan, arg: Arg | Gather, calls: int) -> list[list[Item]]:
    """What a plan's argument (or request) reads, per position it fills, as reference items."""

    def node(source: int, call: int) -> Item:
        step, output = plan.source_owner[source]
        return ("node", step, output, call)

    if isinstance(arg, Gather):
        pieces, item_call = arg.items()
        items = [
            node(int(piece), int(call)) if isinstance(piece, int) else ("tensor", id(piece))
            for piece, call in zip((arg.pieces[p] for p in pieces), item_call, strict=True)
        ]
        bounds = np.cumsum([0, *arg.sizes])
        return [items[a:b] for a, b in itertools.pairwise(bounds)]
    kind, value = arg.kind, arg.value
    if kind == "whole":
        return [[node(value, call) for call in range(plan.groups[plan.source_owner[value][0]].num_calls)]]
    if kind == "rows":
        return [[node(*value)]]
    if kind == "shared":
        return [[("shared", *node(*value)[1:])]]
    if kind in ("ints", "floats"):
        return [[(kind[:-1], v) for v in value.tolist()]]
    tensors = value if kind == "concat" else [value]
    return [[("tensor", id(t)) for t in tensors]]


def planned(plan: FoldPlan) -> tuple[list[tuple[Any, ...]], list[list[Item]]]:
    """The plan in the reference's terms (see ``ReferenceFold.expected``)."""
    groups = []
    for group in plan.groups:
        columns: list[list[Item]] = [[] for _ in range(group.arity)]
        for position, arg in group.fixed:
            (columns[position],) = _read(plan, arg, group.num_calls)
        for gather in group.gathers:
            for position, items in zip(gather.positions, _read(plan, gather, group.num_calls), strict=True):
                columns[position] = items
        groups.append((group.op, group.depth, group.num_calls, columns))
    return groups, [_read(plan, request, 0)[0] for request in plan.requests]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    program=st.lists(instruction, min_size=1, max_size=40),
    picks=st.lists(st.integers(0, 1000), max_size=12),
    planner=st.sampled_from(PLANNERS),
)
def test_the_recorder_plans_what_a_plain_reference_recorder_records(
    program: list[tuple[Any, ...]], picks: list[int], planner: str
) -> None:
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(1, 5, generator=generator) for _ in range(3)]
    fold, reference = Fold(), ReferenceFold()
    with compaction(False, planner):  # groups of nodes planned in C, in Python lists or as numpy arrays
        plan = fold.plan(requested(run_program(fold, program, inputs), picks))
    expected = reference.expected(requested(run_program(reference, program, inputs), picks))
    assert isinstance(plan, FoldPlan)
    assert planned(plan) == expected
    assert len(fold) == sum(len(calls) for calls in reference.groups.values())


def _structure(plan: FoldPlan) -> list[Any]:
    """A plan as built, not only what it reads: each group's fixed arguments and its gathers
    (pieces, index, positions), and whether they run combined."""

    def value(arg: Arg) -> Any:
        if isinstance(arg.value, np.ndarray):
            return (arg.value.dtype.str, arg.value.tolist())
        if isinstance(arg.value, torch.Tensor):
            return id(arg.value)
        if isinstance(arg.value, list):
            return [id(t) for t in arg.value]
        return arg.value

    return [
        (
            [(position, arg.kind, value(arg)) for position, arg in group.fixed],
            [
                (
                    [p if isinstance(p, int) else id(p) for p in g.pieces],
                    g.piece_calls,
                    None if g.index is None else (g.index.dtype.str, g.index.tolist()),
                    g.positions,
                    g.sizes,
                    g.total_calls,
                )
                for g in group.gathers
            ],
            group.combined,
        )
        for group in plan.groups
    ]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    program=st.lists(instruction, min_size=1, max_size=40),
    picks=st.lists(st.integers(0, 1000), max_size=12),
    trees=st.integers(1, 12),
)
def test_the_c_planner_builds_the_plan_the_python_planner_builds(
    program: list[tuple[Any, ...]], picks: list[int], trees: int
) -> None:
    """Not only the same reads (above): the same gathers, index arrays and combining, on random
    programs and on forests of LSTM cells (groups of many calls, read out of order)."""
    assert native.enabled()
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(1, 5, generator=generator) for _ in range(3)]
    fold = Fold()
    requests = requested(run_program(fold, program, inputs), picks)
    forest = Fold()
    roots = _record_forest(forest, trees)
    built = {}
    for planner in PLANNERS:
        with compaction(False, planner):
            built[planner] = (_structure(fold.plan(requests)), _structure(forest.plan([roots])))
    assert built["C"] == built["lists"] == built["arrays"]


def test_the_reference_comparison_tells_children_apart() -> None:
    """The comparison above can fail: a plan whose calls read their children swapped differs."""

    def record(recorder: Any, swap: bool) -> list[list[Any]]:
        leaves = [recorder.add("leaf", i) for i in range(3)]
        second = (leaves[1], leaves[0]) if swap else (leaves[0], leaves[1])
        return [[recorder.add("pair", leaves[2], leaves[0]), recorder.add("pair", *second)]]

    fold = Fold()
    plan = fold.plan(record(fold, swap=False))
    assert isinstance(plan, FoldPlan)
    reference = ReferenceFold()
    assert planned(plan) == reference.expected(record(reference, swap=False))
    swapped = ReferenceFold()
    assert planned(plan) != swapped.expected(record(swapped, swap=True))


def _record_forest(fold: Fold, trees: int) -> list[Any]:
    """Balanced binary trees of 16 distinct leaves each, with an LSTM-like two-output split per node."""
    roots = []
    for tree in range(trees):
        level = [fold.add("leaf", tree * 16 + word).split(2) for word in range(16)]
        while len(level) > 1:
            level = [fold.add("node", *level[i], *level[i + 1]).split(2) for i in range(0, len(level), 2)]
        roots.append(level[0][0])
    return roots


def test_recording_a_large_fold_leaves_nothing_per_node_for_the_garbage_collector() -> None:
    """The objects the cyclic GC tracks grow by (nearly) nothing per recorded node: a fold keeps
    ints and tuples of ints, which the collector stops tracking, and no node objects; the nodes
    the C part makes, the roots the caller holds here among them, are not tracked either."""
    fold = Fold()
    _record_forest(fold, 2)  # groups made, first allocations done
    gc.collect()
    before = len(gc.get_objects())
    roots = _record_forest(fold, 500)
    gc.collect()
    nodes = 500 * 31
    growth = (len(gc.get_objects()) - before) / nodes
    assert len(fold) == nodes  # the two trees recorded first are recorded again: once
    # Python nodes are tracked: the roots the caller holds, 1/31 per node
    limit = 0.002 if native.BUILT else 0.05
    assert growth < limit, f"{growth:.4f} tracked objects per node"
    assert len(roots) == 500


@pytest.mark.skipif(not native.BUILT, reason="the C part was not built")
def test_nodes_made_in_c_are_untracked_and_an_op_holding_nodes_is_still_collected() -> None:
    class Holder(torch.nn.Module):
        def leaf(self, x: torch.Tensor) -> torch.Tensor:
            return x

    holder = Holder()
    fold = Fold()
    fold.add(holder.leaf, 0)  # the group, made in Python
    holder.nodes = [fold.add(holder.leaf, i) for i in range(1, 100)]  # made in C
    pair = fold.add("pair", *holder.nodes[:2])
    pair.split(2)
    holder.outputs = fold.add("pair", *holder.nodes[2:4]).split(2)  # a known split: in C
    assert not any(gc.is_tracked(n) for n in [*holder.nodes, *holder.outputs])
    # a cycle holder -> fold -> its group -> holder.leaf -> holder, with the nodes hanging off it:
    # a node holds its tape's weak reference, so the cycle is found and freed
    holder.fold = fold
    gone = weakref.ref(holder)
    del holder, fold, pair
    gc.collect()
    assert gone() is None


class HoldsNodes(torch.nn.Module):
    """An op's owner that keeps nodes (module level: pickled by reference)."""

    def leaf(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.mark.parametrize("copy", ["pickle", "deepcopy"])
def test_a_node_loaded_before_its_tape_has_its_state_is_rebuilt_with_the_tapes_ref(copy: str) -> None:
    # The op (a bound method of a module holding nodes) is part of the tape's state, so a node
    # given first is loaded before its tape's state: it still gets the tape's one weak reference.
    import copy as copying

    holder, fold = HoldsNodes(), Fold()
    holder.nodes = [fold.add(holder.leaf, i) for i in range(3)]
    duplicate = (
        pickle.loads(pickle.dumps((holder.nodes[1], fold)))
        if copy == "pickle"
        else copying.deepcopy((holder.nodes[1], fold))
    )
    node, loaded = duplicate
    assert node._ref is loaded._tape.ref and loaded.add(HoldsNodes.leaf, 0) is not None
    assert repr(node) == "Node('HoldsNodes.leaf', depth=0, index=1)"
    inner = next(iter(loaded._groups.values())).op.__self__.nodes
    assert all(n._ref is loaded._tape.ref for n in inner) and inner[1] == node


@pytest.mark.skipif(not native.BUILT, reason="the C part was not built")
def test_a_node_whose_ref_is_not_its_tapes_own_is_split_in_python() -> None:
    fold = Fold()
    fold.add("pair", fold.add("leaf", 0), fold.add("leaf", 1)).split(2)  # the group's outputs known
    node = fold.add("pair", fold.add("leaf", 2), fold.add("leaf", 3))
    node._ref = weakref.ref(fold._tape, lambda _: None)  # a weak reference with a callback: not tape.ref
    outputs = node.split(2)
    assert all(output._ref is fold._tape.ref for output in outputs)  # made from the tape, as Python does
    assert all(gc.is_tracked(output) for output in outputs)  # by the Python split


def test_a_node_of_a_fold_that_is_gone_says_so_and_nodes_pickle_with_their_fold() -> None:
    fold = Fold()
    leaf = fold.add("leaf", 1)
    left, right = fold.add("pair", leaf, leaf).split(2)
    copied, nodes = pickle.loads(pickle.dumps((fold, [leaf, right])))
    assert nodes == [copied.add("leaf", 1), copied.add("pair", nodes[0], nodes[0]).split(2)[1]]
    assert nodes[0] != leaf and repr(nodes[1]) == repr(right) == "Node('pair', depth=1, index=0, output=1)"
    del fold
    assert repr(left) == "<node 2 of a Fold that no longer exists>"
    for use in (lambda: left.split(2), lambda: leaf.split(2), lambda: left.depth, lambda: leaf.nobatch()):
        with pytest.raises(
            FoldError, match=r"^node \d belongs to a Fold that no longer exists; keep the Fold"
        ):
            use()
    with pytest.raises(
        FoldError, match=r"<node 0 of a Fold that no longer exists> passed to 'pair' belongs to another"
    ):
        copied.add("pair", leaf, nodes[0])


# -- Fold.add in C (torchfold.engine._record) against the Python add it wraps ------------------


class PythonFold(Fold):
    """A fold that records with the Python ``Fold.add`` alone (its own ``add`` overrides the C one)."""

    add = getattr(Fold.add, "__wrapped__", Fold.add)  # type: ignore[assignment]


@contextlib.contextmanager
def python_split() -> Iterator[None]:
    """``Node.split`` is the Python split alone while inside (nodes of every fold share it)."""
    fast = Node.split
    Node.split = getattr(fast, "__wrapped__", fast)  # type: ignore[method-assign]
    try:
        yield
    finally:
        Node.split = fast  # type: ignore[method-assign]


def _recorded(fold: Fold) -> tuple[Any, ...]:
    """Everything a fold recorded: its tape and its groups, with each group's calls in order."""
    tape = fold._tape
    groups = [
        (
            g.op,
            g.depth,
            g.order,
            g.source,
            list(g.output_sources),
            g.num_outputs,
            g.plain,
            list(g.nodes.items()),
        )
        for g in fold.groups()
    ]
    sources = [
        (fold.groups().index(g), output)
        for g, output in zip(tape.source_group, tape.source_output, strict=True)
    ]
    return (tape.depth, tape.source, tape.index, sources, tape.outputs_of, tape.nobatch_of, groups)


def test_fold_add_is_built_in_c() -> None:
    """The development environments build the extension: a failed build (it is optional) would
    leave the Python add alone and the comparisons below comparing it with itself."""
    assert native.BUILT and native.enabled(), (
        "torchfold.engine._record is not built: run `pip install -e .` (or `make env`) with a C compiler"
    )
    assert type(Fold.add).__name__ == "FastAdd" and PythonFold.add is not Fold.add
    assert type(Node.split).__name__ == "FastSplit"
    with python_split():
        assert type(Node.split).__name__ == "function"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    program=st.lists(instruction, min_size=1, max_size=40), picks=st.lists(st.integers(0, 1000), max_size=12)
)
def test_the_c_add_records_what_the_python_add_records(
    program: list[tuple[Any, ...]], picks: list[int]
) -> None:
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(1, 5, generator=generator) for _ in range(3)]
    fast, python = Fold(), PythonFold()
    fast_values = run_program(fast, program, inputs)
    with python_split():
        python_values = run_program(python, program, inputs)
    assert [repr(v) for v in fast_values] == [repr(v) for v in python_values]
    assert _recorded(fast) == _recorded(python)
    fast_plan, python_plan = (
        fast.plan(requested(fast_values, picks)),
        python.plan(requested(python_values, picks)),
    )
    assert isinstance(fast_plan, FoldPlan) and isinstance(python_plan, FoldPlan)
    assert planned(fast_plan) == planned(python_plan)


def test_the_c_add_records_lstm_cells_and_leaves_what_the_python_add_records() -> None:
    """Four nodes per call (a binary LSTM cell over split children), leaves by int, dedup."""
    fast, python = Fold(), PythonFold()

    def in_python(trees: int) -> list[str]:
        with python_split():
            return [repr(r) for r in _record_forest(python, trees)]

    assert [repr(r) for r in _record_forest(fast, 20)] == in_python(20)
    assert _recorded(fast) == _recorded(python)
    # every call again: identical calls are found, nothing new is recorded
    assert [repr(r) for r in _record_forest(fast, 20)] == in_python(20)
    assert _recorded(fast) == _recorded(python) and len(fast) == 20 * 31


def test_the_c_add_leaves_new_groups_odd_calls_and_errors_to_the_python_add() -> None:
    fold = Fold()
    leaf = fold.add(op="leaf")  # keywords, no arguments: the Python add
    assert repr(leaf) == "Node('leaf', depth=0, index=0)" and fold.add("leaf") == leaf
    big = 2**63
    with pytest.raises(FoldError, match=r"argument 1 of 'leaf' is 9223372036854775808, outside int64"):
        fold.add("leaf", big)
    other = Fold().add("leaf", 1)
    fold.add("pair", leaf, leaf)  # the group exists: the next call with a node of another fold is refused
    with pytest.raises(FoldError, match="belongs to another Fold"):
        fold.add("pair", leaf, other)
    with pytest.raises(TypeError, match="unhashable type: 'list'"):
        fold.add(["not", "an", "op"], leaf)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="op must be a method name"):
        fold.add(3, leaf)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'op'"):
        fold.add()  # type: ignore[call-arg]
    with pytest.raises(FoldError, match=r"argument 1 of 'leaf' is a bool \(True\)"):
        fold.add("leaf", True)  # an int subclass: not an int to either add


def test_a_subclass_add_overrides_the_c_add_and_super_reaches_it() -> None:
    calls: list[str] = []

    class Logged(Fold):
        def add(self, op: Any, *args: Any) -> Any:
            calls.append(op)
            return super().add(op, *args)

    fold = Logged()
    a, b = fold.add("leaf", 1), fold.add("leaf", 2)
    fold.add("pair", a, b)
    assert calls == ["leaf", "leaf", "pair"] and len(fold) == 3


def test_a_copied_or_pickled_fold_records_on_in_c() -> None:
    import copy
    import pickle

    fold = Fold()
    leaves = [fold.add("leaf", i) for i in range(3)]
    fold.add("pair", leaves[0], leaves[1])
    for twin in (copy.deepcopy(fold), pickle.loads(pickle.dumps(fold))):
        first, second = twin.add("leaf", 0), twin.add("leaf", 1)  # recorded before: the same handles
        assert (first._handle, second._handle) == (leaves[0]._handle, leaves[1]._handle)
        twin.add("pair", second, first)
        assert len(twin) == 5 and len(fold) == 4
        assert twin._recorder is not None and twin._recorder is not fold._recorder


class _ShiftingOp:
    """An op whose hash and equality follow a value that changes (a callable, not a str)."""

    def __init__(self) -> None:
        self.value = 0

    def __hash__(self) -> int:
        return hash(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ShiftingOp) and other.value == self.value

    def __call__(self, *args: Any) -> Any:
        return args[0]


def test_an_op_whose_hash_changes_is_looked_up_anew_by_both_adds() -> None:
    def record(fold: Fold) -> list[tuple[int, int]]:
        op = _ShiftingOp()
        leaf = fold.add("leaf", 1)
        fold.add(op, leaf)
        fold.add(op, leaf)  # the group exists: the C add's path
        op.value = 1  # now another key of the groups dict: a new group
        fold.add(op, leaf)
        return [(g.depth, len(g.nodes)) for g in fold.groups()]

    assert record(Fold()) == record(PythonFold()) == [(0, 1), (1, 1), (1, 1)]


def test_python_code_run_by_the_group_lookup_cannot_pull_the_arguments_away() -> None:
    """An op's __hash__ runs inside the C add; dropping an argument node's handle there must
    leave the call recorded as given (the C add holds its own references to it)."""
    fold = Fold()
    leaves = [fold.add("leaf", i) for i in range(400)]
    _, second = leaves[-1].split(2)  # its handle, a large int, is held by this node alone
    given = second._handle
    armed = False

    class Dropping:
        def __call__(self, *args: Any) -> Any:
            return args[0]

        def __hash__(self) -> int:
            if armed:
                second._handle = None  # type: ignore[assignment]
                _ = [float(i) for i in range(1000)]  # the freed memory, reused
            return 1

    op = Dropping()
    fold.add(op, leaves[0])  # the group (depth 1, op, 1), made by the Python add
    armed = True
    node = fold.add(op, second)
    group = fold._groups[(1, op, 1)]
    assert list(group.nodes)[-1] == (given,) and node._handle == len(fold._tape.depth) - 1


def test_what_the_c_add_reads_by_slot_is_checked_to_be_what_it_expects() -> None:
    from torchfold.engine._record import Recorder
    from torchfold.engine.node import Group, Node, Tape

    fold = Fold()
    fold.add("leaf", 1)
    fold._groups[(0, "x", 1)] = 7  # type: ignore[index]  # not a Group: the Python add, which says so
    with pytest.raises(AttributeError, match="'int' object has no attribute 'nodes'"):
        fold.add("x", 1)

    class Borrowing:  # Node's slot descriptors on a type without those slots
        __slots__ = ()
        _ref = Node._ref
        _handle = Node._handle

    with pytest.raises(TypeError, match=r"Borrowing\._ref is not a writable object slot"):
        Recorder(fold._tape, fold._groups, Borrowing, Group)
    with pytest.raises(TypeError, match=r"^Recorder: node_type int does not support the garbage collector"):
        Recorder(fold._tape, fold._groups, int, Group)
    tape = Tape()
    tape.ref = weakref.ref(fold._tape)  # the nodes it would make would point to another tape
    with pytest.raises(TypeError, match=r"tape\.ref must be weakref\.ref\(tape\)"):
        Recorder(tape, {}, Node, Group)


def test_fold_add_pickles_and_copies_as_the_function_it_wraps() -> None:
    import copy
    import pickle

    assert pickle.loads(pickle.dumps(Fold.add)) is Fold.add
    assert copy.deepcopy(Fold.add) is Fold.add


def test_node_split_pickles_and_copies_as_the_function_it_wraps() -> None:
    import copy
    import inspect
    import pickle

    assert pickle.loads(pickle.dumps(Node.split)) is Node.split
    assert copy.deepcopy(Node.split) is Node.split
    assert str(inspect.signature(Node.split)) == "(self, num: 'int') -> 'tuple[Node, ...]'"
    assert Node.split.__doc__ and Node.split.__doc__.startswith("One handle per output")
    assert repr(Node.split).startswith("<Node.split in C, wrapping <function Node.split")


# -- Node.split in C against the Python split it wraps -----------------------------------------


def _splits(fold: Fold) -> list[Any]:
    """Splits of every kind, recorded on ``fold``; what each returned, or the error it raised."""
    results: list[Any] = []

    def attempt(call: Any) -> None:
        try:
            results.append(repr(call()))
        except (FoldError, TypeError, ValueError) as error:
            results.append(f"{type(error).__name__}: {error}")

    leaves = [fold.add("leaf", i) for i in range(4)]
    attempt(lambda: leaves[0].split(2))  # the group's first split: the Python split
    attempt(lambda: leaves[1].split(2))  # its outputs known: the C split
    attempt(lambda: leaves[1].split(2))  # split before: the same handles
    attempt(lambda: leaves[2].nobatch().split(2))  # a nobatch handle's outputs are nobatch
    attempt(lambda: leaves[2].split(2))
    attempt(lambda: leaves[3].split(3))  # another number of outputs than the group's
    attempt(lambda: leaves[3].split(0))
    attempt(lambda: leaves[3].split(True))  # type: ignore[arg-type]  # a bool is not a count
    attempt(lambda: leaves[3].split(2.0))  # type: ignore[arg-type]
    attempt(lambda: leaves[1].split(2)[0].split(2))  # an output of a split
    attempt(lambda: leaves[3].split(num=2))  # a keyword: the Python split
    wide = [fold.add("wide", leaf) for leaf in leaves]  # more outputs than the C split makes
    attempt(lambda: [node.split(12) for node in wide])
    pair = fold.add("pair", leaves[0], leaves[1])
    attempt(lambda: pair.split(2))
    attempt(lambda: fold.add("pair", leaves[2], leaves[3]).split(2))
    attempt(lambda: pair.split(2))
    return results


def test_the_c_split_splits_as_the_python_split_does() -> None:
    fast, python = Fold(), PythonFold()
    fast_results = _splits(fast)
    with python_split():
        python_results = _splits(python)
    assert fast_results == python_results
    assert _recorded(fast) == _recorded(python)
    assert (
        fast_results[1]
        == "(Node('leaf', depth=0, index=1, output=0), Node('leaf', depth=0, index=1, output=1))"
    )
    assert fast_results[1] == fast_results[2]
    assert "nobatch" in fast_results[3]
    assert fast_results[5].startswith(
        "FoldError: op 'leaf' at depth 0 was split into 2 outputs before, now into 3"
    )
    assert fast_results[7].startswith("TypeError: split(num)")


def test_what_the_c_split_reads_by_slot_is_checked_to_be_what_it_expects() -> None:
    from torchfold.engine._record import FastSplit
    from torchfold.engine.node import Group, Tape

    fold = Fold()
    leaves = [fold.add("leaf", i) for i in range(3)]
    leaves[0].split(2)
    leaves[1]._ref = weakref.ref(fold)  # not a Tape's: the Python split, which fails
    with pytest.raises(AttributeError, match="'Fold' object has no attribute 'source'"):
        leaves[1].split(2)
    leaves[2]._handle = 10**30  # not a row of the tape: the Python split, which says so
    with pytest.raises(IndexError):
        leaves[2].split(2)
    fold._tape.outputs_of = {}  # type: ignore[misc]  # the tape's own dict replaced: still read by slot
    assert [n._handle for n in fold.add("leaf", 7).split(2)] == [
        len(fold._tape.source) - 2,
        len(fold._tape.source) - 1,
    ]

    class Borrowing:  # Tape's slot descriptors on a type without those slots
        __slots__ = ()
        depth = Tape.depth

    with pytest.raises(TypeError, match=r"Borrowing\.depth is not a writable object slot"):
        FastSplit(Node.split.__wrapped__, Node, Borrowing, Group)  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match=r"^FastSplit: node_type int does not support the garbage collector"):
        FastSplit(Node.split.__wrapped__, int, Tape, Group)  # type: ignore[attr-defined]


class _Sums(torch.nn.Module):
    def leaf(self, i: torch.Tensor) -> torch.Tensor:
        return i

    def pair(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b


@pytest.mark.skipif(not native.BUILT, reason="the C part was not built")
def test_one_switch_turns_the_c_part_off_and_on() -> None:
    """``native.use`` swaps ``Fold.add`` and ``Node.split`` for the Python functions they wrap and
    plans in Python, for the process or a block; a fold made while it was off records in C later."""
    fast_add, fast_split = Fold.add, Node.split
    with native.use(False):
        assert not native.enabled()
        assert Fold.add is fast_add.__wrapped__ and Node.split is fast_split.__wrapped__
        fold = Fold()
        assert fold._recorder is None
        leaves = [fold.add("leaf", i) for i in range(3)]
        with native.use(True):  # nested: on inside, off again after
            assert native.enabled() and Fold.add is fast_add
        assert Fold.add is not fast_add
    assert native.enabled() and Fold.add is fast_add and Node.split is fast_split
    pair = fold.add("pair", leaves[0], leaves[1])  # the first add with it on makes the recorder
    assert type(fold._recorder).__name__ == "Recorder"
    assert (pair._handle, fold.add("pair", leaves[1], leaves[2])._handle) == (3, 4)
    assert [t.tolist() for t in fold.apply(_Sums(), [[pair, leaves[2]]])] == [[1, 2]]
    native.use(False)  # as a plain call, until switched back
    try:
        assert Fold.add is not fast_add and not native.enabled()
    finally:
        native.use(True)
    assert Fold.add is fast_add
    with pytest.raises(TypeError, match=r"^native.use\(on=1\): on must be True or False$"):
        native.use(1)  # type: ignore[arg-type]


def test_without_the_c_part_torchfold_records_and_plans_in_python() -> None:
    """As installed where no C compiler was found: the extension missing, everything in Python."""
    import subprocess
    import sys

    code = """
import sys
sys.modules["torchfold.engine._record"] = None  # the import fails, as when it was not built
import torch, torchfold
from torchfold.engine import native
from torchfold.engine.node import Node
assert not native.BUILT and not native.enabled()
try:
    native.use(True)
except RuntimeError as e:
    assert "installed without its C part" in str(e), e
else:
    raise AssertionError("native.use(True) without the C part")
native.use(False)
assert type(Node.split).__name__ == "function" and type(torchfold.Fold.add).__name__ == "function"

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(8, 3)
        self.mix = torch.nn.Linear(6, 6)
    def leaf(self, word):
        return self.embed(word).repeat(1, 2).split(3, dim=1)
    def node(self, h1, c1, h2, c2):
        return self.mix(torch.cat((h1 + c1, h2 * c2), 1)).split(3, dim=1)

model, fold = Model(), torchfold.Fold()
level = [fold.add("leaf", w).split(2) for w in (1, 2, 3, 4)]
root = fold.add("node", *fold.add("node", *level[0], *level[1]).split(2), *fold.add("node", *level[2], *level[3]).split(2))
(out,) = fold.apply(model, [[root.split(2)[0]]])
def eager(w):
    return model.leaf(torch.tensor([w]))
def cell(a, b):
    return model.node(*a, *b)
expected = cell(cell(eager(1), eager(2)), cell(eager(3), eager(4)))[0]
torch.testing.assert_close(out, expected)
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_the_c_planner_reads_a_group_and_leaves_its_scratch_as_given() -> None:
    from torchfold.engine import _record
    from torchfold.engine.planner import _Planner

    fold = Fold()
    leaves = [fold.add("leaf", i) for i in range(6)]
    for i in range(3):
        fold.add("pair", leaves[i], leaves[5 - i])
    tape, group = fold._tape, fold._groups[(1, "pair", 2)]
    blank = bytearray(b"\xff") * (_record.SCRATCH_BYTES_PER_SOURCE * tape.sources)
    scratch = bytearray(blank)
    found = _record.plain_group(group.nodes, 2, tape.source, tape.index, _Planner(fold).source_calls, scratch)
    # both positions read the leaves (source 0, 6 calls): one gather, out of order
    index = np.array([0, 1, 2, 5, 4, 3], dtype=np.int64).tobytes()
    assert found == ([], [([0], [6], index, [0, 1])])
    assert scratch == blank
    shared = leaves[0].nobatch()
    fold.add("pair", shared, leaves[1])  # a nobatch handle: left to the Python planner
    planner = _Planner(fold)
    blank = bytearray(b"\xff") * (_record.SCRATCH_BYTES_PER_SOURCE * tape.sources)
    scratch = bytearray(blank)
    assert _record.plain_group(group.nodes, 2, tape.source, tape.index, planner.source_calls, scratch) is None
    assert scratch == blank
    assert (
        _record.plain_group(group.nodes, 2, tape.source, tape.index, planner.source_calls, bytearray(8))
        is None
    )


def test_python_code_run_by_the_split_lookup_cannot_pull_the_tape_away() -> None:
    """A key of ``outputs_of`` whose hash matches a handle runs its ``__eq__`` inside the C split;
    replacing the tape's dict and lists there must not crash it (it holds its own references and
    reads the lists after the look-up)."""
    fold = Fold()
    first, second = fold.add("pair", fold.add("leaf", 1)), fold.add("pair", fold.add("leaf", 2))
    first.split(2)  # the group's first split (Python): its outputs known from here
    tape, handle = fold._tape, second._handle

    class Colliding:
        def __hash__(self) -> int:
            return hash(handle)

        def __eq__(self, other: object) -> bool:
            tape.outputs_of = dict(tape.outputs_of)  # type: ignore[misc]  # frees the dict being searched
            tape.source_output = list(tape.source_output)  # type: ignore[misc]
            gc.collect()
            return False

    tape.outputs_of[Colliding()] = 0  # type: ignore[index]
    outputs = second.split(2)
    assert [repr(n) for n in outputs] == [
        "Node('pair', depth=1, index=1, output=0)",
        "Node('pair', depth=1, index=1, output=1)",
    ]


def test_a_split_whose_recorded_outputs_are_not_rows_of_the_tape_goes_to_python() -> None:
    import sys

    fold = Fold()
    first, second = fold.add("leaf", 1), fold.add("leaf", 2)
    first.split(2)
    fold._tape.outputs_of[second._handle] = sys.maxsize  # beyond the tape (and a C integer, once added to)
    assert [n._handle for n in second.split(2)] == [sys.maxsize, sys.maxsize + 1]


# -- what both recorders do alike: the C one, and Python alone (as built without a C compiler) ---


@pytest.fixture(params=["C", "Python"])
def recording(request: pytest.FixtureRequest) -> Iterator[type[Fold]]:
    """The Fold class to record with, with the C part on, or off (the Python ``add`` and ``split``,
    no C recorder made, as where torchfold was built without its C part)."""
    if request.param == "C":
        if not native.BUILT:
            pytest.skip("the C part was not built")
        yield Fold
        return
    with native.use(False):  # Fold.add and Node.split in Python, no C recorder made
        yield Fold


class Signs(torch.nn.Module):
    """Ops whose results tell -0.0 from 0.0, and a NaN from a NaN of the other sign."""

    def sign(self, x: torch.Tensor) -> torch.Tensor:
        return torch.copysign(torch.ones_like(x), x)

    def leaf(self, ids: torch.Tensor) -> torch.Tensor:
        return ids.float()

    def signed(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x * torch.copysign(torch.ones_like(y), y)


NAN = float("nan")
# 0.0 and -0.0 compare equal, NAN and the second NaN do not (two objects), -NAN has the sign bit
SIGNED = [0.0, -0.0, NAN, float("nan"), -NAN]


def _record_signs(fold: Any) -> list[Any]:
    leaf = fold.add("leaf", 3)
    return [fold.add("sign", value) for value in SIGNED] + [
        fold.add("signed", leaf, value) for value in SIGNED
    ]


def test_calls_are_one_exactly_when_their_floats_bits_are(recording: type[Fold]) -> None:
    # -0.0 == 0.0, yet copysign (1 / x, atan2...) tells them apart: two calls, at depth 0 and above;
    # NaNs of the same bits are one call whether or not they are one object, a NaN's sign is not
    model, fold = Signs(), recording()
    nodes = _record_signs(fold)
    expected = [1.0, -1.0, 1.0, 1.0, -1.0]
    eager = EagerFold(model)
    assert [t.tolist() for t in fold.apply(model, [nodes[:5], nodes[5:]])] == [
        expected,
        [3 * s for s in expected],
    ]
    assert [t.tolist() for t in eager.apply(model, [_record_signs(eager)[:5]])] == [expected]
    assert len(fold) == 1 + 4 + 4 and nodes[2] == nodes[3] and nodes[7] == nodes[8]
    assert len({nodes[0], nodes[1], nodes[2], nodes[4]}) == 4
    for group in fold.groups()[1:]:  # the arguments as given: plain floats, with their signs
        given = [call[-1] for call in fold.arguments(group)]
        assert [type(value) for value in given] == [float] * 4
        assert [math.copysign(1.0, value) for value in given] == [1.0, -1.0, 1.0, -1.0]
    copied = pickle.loads(pickle.dumps(fold))  # the calls stay apart in a copy too
    assert [copied.add("sign", value)._handle for value in SIGNED] == [n._handle for n in nodes[:5]]


def test_the_c_and_the_python_add_store_zeros_nans_ints_and_floats_alike() -> None:
    fast, python = Fold(), PythonFold()
    for fold in (fast, python):
        _record_signs(fold)
        for value in (1, 1.0, 1, -0.0, 0, 0.0):  # ints: the C add once their group exists
            fold.add("leaf", value)
            fold.add("signed", fold.add("leaf", 2), value)
    assert _recorded(fast) == _recorded(python)


def test_ints_floats_and_bools_are_told_apart_alike_by_both_recorders(recording: type[Fold]) -> None:
    # 1 makes a LongTensor and 1.0 a float tensor: never one call; True is refused (not an int)
    fold = recording()
    one, one_float = fold.add("leaf", 1), fold.add("leaf", 1.0)
    assert one != one_float and (fold.add("leaf", 1), fold.add("leaf", 1.0)) == (one, one_float)
    with pytest.raises(FoldError, match=r"argument 1 of 'leaf' is a bool \(True\)"):
        fold.add("leaf", True)
    two = fold.add("leaf", 2)
    above = [fold.add("signed", two, value) for value in (1, 1.0, 1, 1.0)]
    assert above[0] != above[1] and above[2:] == above[:2] and len(fold) == 5
    model = Signs()
    eager, fold = EagerFold(model), recording()  # one group each: two dtypes
    dtypes = [
        [t.dtype for t in f.apply(model, [[f.add(torch.abs, 1)], [f.add(torch.neg, 1.0)]])]
        for f in (fold, eager)
    ]
    assert dtypes == [[torch.int64, torch.float32]] * 2


def test_nodes_of_a_fold_that_is_gone_are_refused_by_apply_and_plan(recording: type[Fold]) -> None:
    gone = recording()
    leaf = gone.add("leaf", 1)
    pair = gone.add("pair", leaf, leaf)
    del gone
    assert repr(pair) == "<node 1 of a Fold that no longer exists>"
    fold = recording()
    own = fold.add("leaf", 2)
    message = (
        r"^request {}, item {}: node {} belongs to a Fold that no longer exists; keep the Fold \(a variable"
    )
    for use in (fold.plan, lambda requests: fold.apply(torch.nn.Module(), requests)):
        with pytest.raises(FoldError, match=message.format(0, 0, 1)):
            use([[pair]])  # all nodes: the check without a loop finds it
        with pytest.raises(FoldError, match=message.format(1, 1, 0)):
            use([[own], [own, leaf]])
        with pytest.raises(FoldError, match=message.format(0, 1, 0)):
            use([[torch.ones(1, 6), leaf]])  # beside a tensor
    with pytest.raises(FoldError, match=r"^node 1 belongs to a Fold that no longer exists"):
        pair.split(2)  # as every use of such a node says


class HoldsFold(torch.nn.Module):
    """A module whose method is an op of the fold it holds (module level: pickled by reference)."""

    def leaf(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


@pytest.mark.parametrize("copy", ["pickle", "deepcopy"])
@pytest.mark.parametrize("order", list(itertools.permutations(range(3))), ids=str)
def test_a_fold_whose_op_holds_it_is_copied_in_any_order(
    recording: type[Fold], copy: str, order: tuple[int, ...]
) -> None:
    # The fold is reached through its own tape's state (tape -> group -> op -> module -> fold), so
    # a copy may build the fold before its tape has its lists.
    import copy as copying

    module, fold = HoldsFold(), recording()
    module.fold = fold
    nodes = [fold.add(module.leaf, i) for i in range(3)]
    items = [(module, fold, nodes[1])[i] for i in order]
    duplicate = pickle.loads(pickle.dumps(items)) if copy == "pickle" else copying.deepcopy(items)
    loaded_module, loaded, node = (duplicate[order.index(i)] for i in range(3))
    assert loaded_module.fold is loaded and node._ref is loaded._tape.ref
    assert repr(node) == "Node('HoldsFold.leaf', depth=0, index=1)"
    again, new = loaded.add(loaded_module.leaf, 1), loaded.add(loaded_module.leaf, 7)
    assert again == node and new._handle == 3 and len(loaded) == 4 and len(fold) == 3
    assert [t.tolist() for t in loaded.apply(loaded_module, [[node, new]])] == [[2, 14]]
    if native.enabled():  # (not in the Python case: no C recorder at all)
        assert type(loaded._recorder).__name__ == "Recorder" and loaded._recorder is not fold._recorder


def test_a_split_into_more_outputs_than_a_call_returns_is_refused_at_once(recording: type[Fold]) -> None:
    fold = recording()
    leaves = [fold.add("leaf", i) for i in range(3)]
    leaves[0].split(2)  # the group's outputs known: a split of another node may be the C one
    tape = fold._tape
    before = (len(tape.source), len(tape.source_group))
    for node in (leaves[1], fold.add("pair", leaves[0], leaves[2])):  # a known group, a new one
        for num in (SPLIT_MAX + 1, 2**40, 10**400):
            shown = re.escape(str(num)) if num.bit_length() <= 128 else "an int of 1329 bits"
            with pytest.raises(
                ValueError, match=rf"^split\(num\) must be an int <= 65536, got {shown}; how many outputs"
            ):
                node.split(num)
    assert (len(tape.source) - 1, len(tape.source_group) - 1) == before  # nothing made (but the pair)
    assert len(fold.add("wide", leaves[0]).split(SPLIT_MAX)) == SPLIT_MAX
