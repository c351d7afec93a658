"""Batching by readiness: the order DyNet's agenda runs calls in, for both front ends.

A :class:`~torchfold.Fold` groups its calls by op and depth: every call of an op at one depth
runs as one batched call, and depth ``d`` waits for all of depth ``d - 1``. Readiness is looser:
a call is ready once the calls it reads have run, and the ready calls of one op run together,
the op whose shallowest ready call is shallowest first (:func:`shallowest`). On graphs that mix
several ops, calls of one op at different depths then share a batch, and the graph runs in
fewer batched calls (``benchmarks/results/autobatch.md``). On a tree of one op (a Tree-LSTM's
cell) the two orders are the same.

``autobatch`` schedules by readiness as its samples run; ``Fold(schedule="ready")`` plans a
recorded graph the same way: :func:`by_readiness` regroups it into *waves* (a wave is one
batched call, its number the new "depth"), and the planner and executor run the waves as they
run depth groups. Unlike ``autobatch``, a plan does not know the shapes its nodes will have: a
wave may join an op's calls whose rows differ in shape or dtype by depth, which the executor
then refuses (``PlanData.merges_depths``) instead of promoting.
"""

from __future__ import annotations

import gc
from collections.abc import Hashable, Iterable
from typing import Any, Generic, TypeVar

from torchfold._errors import FoldError
from torchfold.engine.node import Group, Recording, Tape

__all__ = [
    "SCHEDULES",
    "Agenda",
    "Waves",
    "by_readiness",
    "check_schedule",
    "refused_by_readiness",
    "shallowest",
]

#: the ways a :class:`~torchfold.Fold` may group its calls into batched calls
SCHEDULES = ("depth", "ready")

_Key = TypeVar("_Key", bound=Hashable)
_Item = TypeVar("_Item")


def check_schedule(schedule: object) -> str:
    """``schedule`` if it is one of :data:`SCHEDULES`, else a ``ValueError`` naming them.

    >>> check_schedule("wave")
    Traceback (most recent call last):
    ...
    ValueError: Fold(schedule='wave'): schedule must be 'depth' (one batched call per op and depth) or 'ready' (ready calls of one op together, fewer calls on graphs of several ops)
    """
    if schedule not in SCHEDULES:
        raise ValueError(
            f"Fold(schedule={schedule!r}): schedule must be 'depth' (one batched call per op and depth) "
            "or 'ready' (ready calls of one op together, fewer calls on graphs of several ops)"
        )
    return str(schedule)


def refused_by_readiness(error: Exception, why: str) -> FoldError:
    """``error`` of a plan made by readiness, with why readiness caused it and the fix."""
    return FoldError(
        f"{error}; this fold is planned with schedule='ready', {why}: plan it with Fold(schedule='depth') "
        "(the default)"
    )


def shallowest(depths: dict[_Key, int], among: Iterable[_Key] | None = None) -> _Key:
    """The batch to run next: the key (an op and what else must agree) whose shallowest ready
    call is shallowest, among ``among`` when given (else all of ``depths``); the first such key
    on a tie (dicts keep their order, so ties go to the key that became ready first).

    >>> shallowest({"cell": 2, "leaf": 0, "gate": 0})
    'leaf'
    """
    return min(depths if among is None else among, key=depths.__getitem__)


class Agenda(Generic[_Key, _Item]):
    """The ready calls by batching key, and each key's shallowest ready depth: what both front
    ends schedule from (``autobatch`` as its samples run, :class:`Waves` on a recorded fold).

    >>> agenda = Agenda()
    >>> agenda.add("cell", "c1", 2)
    >>> agenda.add("leaf", "l1", 0)
    >>> agenda.add("cell", "c2", 1)
    >>> agenda.pop(), agenda.pop(), bool(agenda)
    (('leaf', ['l1']), ('cell', ['c1', 'c2']), False)
    """

    __slots__ = ("depths", "items")

    def __init__(self) -> None:
        self.items: dict[_Key, list[_Item]] = {}
        self.depths: dict[_Key, int] = {}

    def __bool__(self) -> bool:
        return bool(self.items)

    def add(self, key: _Key, item: _Item, depth: int) -> None:
        """``item``, a call at ``depth`` whose inputs have all run, waits under ``key``."""
        items = self.items.get(key)
        if items is None:
            self.items[key] = [item]
            self.depths[key] = depth
        else:
            items.append(item)
            if depth < self.depths[key]:
                self.depths[key] = depth

    def pop(self, among: Iterable[_Key] | None = None) -> tuple[_Key, list[_Item]]:
        """The next batch (see :func:`shallowest`): its key and its calls, taken off the agenda."""
        key = shallowest(self.depths, among)
        del self.depths[key]
        return key, self.items.pop(key)


def _signature(call: tuple[Any, ...], nodes: bool, source: list[int], padded: bool) -> tuple[Any, ...]:
    """What calls of one op must share to be batched together, beyond the op and the arity:
    the kind of each argument position (rows, of a node or of a tensor given to ``add``; an int;
    a float), and at a ``nobatch`` position the very handle (a group passes one ``nobatch`` node
    per position). ``nodes``: the call is stored above depth 0, where a bare int is a node's
    handle (see ``Group``). ``padded``: nodes and tensors apart, as static shapes pad a position
    of nodes only or of tensors only."""
    kinds: list[Any] = []
    for arg in call:
        cls = arg.__class__
        if cls is int:
            kinds.append(("nobatch", arg) if nodes and source[arg] < 0 else _NODE[padded] if nodes else "int")
        elif cls is tuple:  # ("int", value) or ("float", value)
            kinds.append(arg[0])
        else:
            kinds.append(_TENSOR[padded])
    return tuple(kinds)


_NODE = {False: "rows", True: "node rows"}
_TENSOR = {False: "rows", True: "tensor rows"}


def _stored_above_depth_0(call: tuple[Any, ...]) -> tuple[Any, ...]:
    """A call stored at depth 0 as it is stored above: its ints tagged (there a bare int is a handle)."""
    return tuple([("int", arg) if arg.__class__ is int else arg for arg in call])


class Waves:
    """A recorded fold regrouped by readiness: one :class:`~torchfold.engine.node.Group` per
    wave, read by the planner as it reads the fold (a :class:`~torchfold.engine.node.Recording`).

    Handles keep their numbers (a node of the fold is the same handle here, and its tape's
    ``ref`` is the fold's, so the fold's nodes are this recording's): only which batched call
    each handle is a row of changes. A wave's depth is 0 when none of its calls reads a node,
    else one more than the wave before it that reads one: a wave reads only waves of lower depth.
    """

    def __init__(self, fold: Recording, padded: bool = False) -> None:
        self.device = fold.device
        self.volatile = fold.volatile
        self.shapes = fold.shapes
        self._length = len(fold)
        old = fold.tape
        tape = self._tape = Tape()
        tape.ref = old.ref
        tape.outputs_of = old.outputs_of
        tape.nobatch_of = old.nobatch_of
        self._groups: list[Group] = []
        groups = fold.groups()
        stored = [list(group.nodes) for group in groups]  # each group's calls, in order
        number_of = {id(group): number for number, group in enumerate(groups)}
        # where each call of the fold now runs: per group of the fold, per call, (group here, call)
        moved: list[list[Any]] = [[None] * len(calls) for calls in stored]
        depth = 0
        for members in self._schedule(groups, number_of, old, padded):
            first = groups[members[0][0]]
            reads = any(groups[member].depth for member, _ in members)
            depth += reads
            group = Group(first.op, depth if reads else 0, len(self._groups))
            group.source = tape.new_sources(group, 1, output=False)[0]
            if first.num_outputs:
                group.output_sources = tape.new_sources(group, first.num_outputs, output=True)
                group.num_outputs = first.num_outputs
            nodes = group.nodes
            for member, index in members:
                call = stored[member][index]
                handle = groups[member].nodes[call]
                if reads and not groups[member].depth:
                    call = _stored_above_depth_0(call)
                    group.plain = group.plain and all(arg.__class__ is int for arg in call)
                else:
                    group.plain = group.plain and groups[member].plain
                moved[member][index] = (group, len(nodes))
                nodes[call] = handle
            self._groups.append(group)
        # each handle: the same output of the same call, in its new group
        for handle, source in enumerate(old.source):
            batch = source >= 0
            number = source if batch else ~source
            group, index = moved[number_of[id(old.source_group[number])]][old.index[handle]]
            output = old.source_output[number]
            new = group.source if output is None else group.output_sources[output]
            tape.depth.append(group.depth)
            tape.source.append(new if batch else ~new)
            tape.index.append(index)

    @staticmethod
    def _schedule(
        groups: list[Group], number_of: dict[int, int], tape: Tape, padded: bool
    ) -> list[list[tuple[int, int]]]:
        """The waves, in the order they run: per wave its calls as (group number, call);
        ``number_of``: each group's number, by its id."""
        source, index_of, group_of = tape.source, tape.index, tape.source_group
        # The fold's calls as numbers: group g's call i is first[g] + i.
        first: list[int] = []
        owner: list[int] = []  # per call number, its group's number
        for number, group in enumerate(groups):
            first.append(len(owner))
            owner.extend([number] * len(group.nodes))
        pending = [0] * len(owner)  # per call, how many calls it reads have not run
        dependents: list[list[int] | None] = [None] * len(owner)
        keys: list[Any] = []  # per group, the batching key of its calls
        ready: Agenda[Any, int] = Agenda()

        def make_ready(call: int) -> None:
            number = owner[call]
            ready.add(keys[number], call, groups[number].depth)

        signed = bool(tape.nobatch_of)  # (a nobatch handle makes a call's signature its own)
        for number, group in enumerate(groups):
            nodes = group.depth > 0
            arity = len(next(iter(group.nodes)))
            kind = (group.op, arity, group.num_outputs)
            # One key for the group: its calls agree on each position's kind (the planner refuses
            # a group whose calls do not, whichever way it is scheduled).
            if group.plain and not (nodes and signed):  # every argument a node (an int, at depth 0)
                keys.append((*kind, (_NODE[padded] if nodes else "int",) * arity))
            else:
                keys.append((*kind, _signature(next(iter(group.nodes)), nodes, source, padded)))
            for call_number, call in enumerate(group.nodes, first[number]):
                reads = 0
                for arg in call if nodes else ():
                    if arg.__class__ is int:  # a node's handle (see Group)
                        at = source[arg]
                        read = first[number_of[id(group_of[at if at >= 0 else ~at])]] + index_of[arg]
                        below = dependents[read]
                        if below is None:
                            dependents[read] = [call_number]
                        elif below[-1] == call_number:  # (read twice by one call)
                            continue
                        else:
                            below.append(call_number)
                        reads += 1
                pending[call_number] = reads
                if not reads:
                    make_ready(call_number)
        waves: list[list[tuple[int, int]]] = []
        while ready:
            _, calls = ready.pop()
            waves.append([(owner[call], call - first[owner[call]]) for call in calls])
            for done in calls:
                for dependent in dependents[done] or ():
                    pending[dependent] -= 1
                    if not pending[dependent]:
                        make_ready(dependent)
        return waves

    @property
    def tape(self) -> Tape:
        return self._tape

    def groups(self) -> list[Group]:
        """The waves in the order they run."""
        return self._groups

    def __len__(self) -> int:
        return self._length


def by_readiness(fold: Recording, padded: bool = False) -> Waves:
    """``fold`` regrouped into waves by readiness (see :class:`Waves`). ``padded``: its plans are
    padded into static shapes, which pad a position of nodes only or of tensors only, so nodes
    and tensors given to ``add`` at one position stay in different waves."""
    collecting = gc.isenabled()
    gc.disable()  # (a few objects per call, none cyclic: the collector's passes would cost more than all)
    try:
        return Waves(fold, padded)
    finally:
        if collecting:
            gc.enable()
