"""Packing levels: calls that can wait run at a later level where the envelope has room.

A fold runs each call at its *depth*: one level after the deepest call it reads. A tree's node
can run later than that, as long as its readers run later still; only the results' order
changes, never a value. :class:`~torchfold.engine.static.shapes.StaticShapes` uses that freedom
to give the ops that read nodes one capacity per level instead of the widest level any batch had:
the levels near the leaves are full of calls with time to spare, the deep levels are nearly
empty, and packing moves the first onto the second. On SST minibatches of 25 trees, the node
op's padded calls fell from about 2.0 per real one to about 1.3 (``benchmarks/results/xla.md``).

The schedule is list scheduling by deadline: every call's deadline is the last level at which
the calls that read it (and theirs, up to the roots) still fit into the levels the plan runs;
each level takes the ready calls with the earliest deadlines, up to its capacity. For a forest of
trees and one capacity per level, this is Hu's algorithm, which needs the fewest levels.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from torchfold.engine.static.columns import Batch, Column, OpKey, Stream

__all__ = ["Packer"]

_NODE_KINDS = ("nodes", "shared")
Known = Mapping[tuple[OpKey, int], Mapping[Stream, float]]


def _movable_keys(batch: Batch, known: Known) -> set[OpKey]:
    """The ops of ``batch`` whose calls may run later than their depth.

    Those that read nodes like a tree's: each of their positions reads each stream some node
    more than one level back, in this batch or in one before it (``known``: the reach an
    envelope holds per position and stream, ``inf`` for every level). A chain (an RNN step
    reading the step before it, or an op reading the one just before it in a cell) reads
    exactly one level back: moving either end would make it read further, and a chain that
    reads every earlier level costs quadratic work, so both ends keep their depths. A
    ``nobatch`` node passed whole stays with the calls recorded with it, so ops reading one
    keep theirs too.
    """
    depth_of = np.asarray(batch.depths, dtype=np.int64)
    numbers: dict[Stream, int] = {}
    stream_of = np.asarray([numbers.setdefault(s, len(numbers)) for s in batch.streams], dtype=np.int64)
    streams = list(numbers)
    candidates: set[OpKey] = set()
    furthest: dict[tuple[OpKey, int], np.ndarray] = {}  # per position, how far back it reads each stream
    for (depth, key), columns in zip(batch.slots, batch.columns, strict=True):
        if "nodes" not in key[3] or "shared" in key[3]:
            continue
        candidates.add(key)
        for position, column in enumerate(columns):
            if column.kind == "nodes":
                assert column.sources is not None
                back = furthest.setdefault((key, position), np.zeros(len(streams), dtype=np.int64))
                np.maximum.at(back, stream_of[column.sources], depth - depth_of[column.sources])
    chained: set[OpKey] = set()
    for (key, position), back in furthest.items():
        reach = known.get((key, position), {})
        for number in np.flatnonzero(back == 1).tolist():
            if reach.get(streams[number], 0) != math.inf:  # never read further back: a chain
                chained.add(key)
                chained.add(streams[number][0])
    return candidates - chained


class Packer:
    """One batch's calls (numbered group after group), which call reads which, and schedules of them.

    Args:
        batch: the decoded plan.
        known: the reach an envelope holds per (op, position) and stream (which ops may move).

    Example: two roots at depth 4, one node per level at most: one of them waits a level.

        >>> import torchfold
        >>> from torchfold.engine.static.columns import decode
        >>> f = torchfold.Fold()
        >>> x = f.add("node", f.add("leaf", 1), f.add("leaf", 2))
        >>> y = f.add("node", x, f.add("leaf", 3))
        >>> z = f.add("node", f.add("leaf", 4), y)
        >>> packer = Packer(decode(f.plan([[f.add("node", x, z), f.add("node", z, x)]])), {})
        >>> packer.depth.tolist()
        [0, 0, 0, 0, 1, 2, 3, 4, 4]
        >>> one = {(level, key): 1 for level in range(6) for key in packer.movable_keys}
        >>> packer.schedule(6, one).tolist(), packer.schedule(5, one)
        ([0, 0, 0, 0, 1, 2, 3, 4, 5], None)
    """

    def __init__(self, batch: Batch, known: Known) -> None:
        self.batch = batch
        calls = np.asarray(batch.calls, dtype=np.int64)
        self.start = np.concatenate([[0], np.cumsum(calls)]).astype(np.int64)
        self.total = int(self.start[-1])
        self.group = np.repeat(np.arange(len(calls), dtype=np.int64), calls)
        self.depth = np.repeat(np.asarray([depth for depth, _ in batch.slots], dtype=np.int64), calls)
        numbers: dict[OpKey, int] = {}
        group_key = np.asarray(
            [numbers.setdefault(key, len(numbers)) for _, key in batch.slots], dtype=np.int64
        )
        self.keys = list(numbers)
        self.key = group_key[self.group]
        #: the ops whose calls may move
        self.movable_keys = _movable_keys(batch, known)
        self.movable = np.isin(self.key, [numbers[k] for k in self.movable_keys])
        self.source_group = np.asarray([group for group, _ in batch.owner], dtype=np.int64)
        readers: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
        read: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
        for number, columns in enumerate(batch.columns):
            first, count = int(self.start[number]), batch.calls[number]
            for column in columns:
                if column.kind not in _NODE_KINDS:
                    continue
                assert column.sources is not None and column.calls is not None
                produced = self.start[self.source_group[column.sources]] + column.calls
                if column.kind == "shared":  # one node, read by every call
                    produced = np.repeat(produced, count)
                readers.append(np.arange(first, first + count, dtype=np.int64))
                read.append(produced)
        self.reader = np.concatenate(readers)
        self.read = np.concatenate(read)

    def packable(self) -> bool:
        """Whether some op's calls may move."""
        return bool(self.movable.any())

    def schedule(self, levels: int, capacity: Mapping[tuple[int, OpKey], int]) -> np.ndarray | None:
        """Per call, the level it runs at so that each level's calls of a movable op fit
        ``capacity[(level, op)]`` and every call runs after what it reads, within ``levels``
        levels; None where this list schedule finds none. Other ops' calls keep their depth."""
        total = self.total
        if total and int(self.depth.max()) >= levels:
            return None
        # deadlines: the last level each call may run at (one before its readers' deadlines)
        fixed = ~self.movable
        deadline = np.where(fixed, self.depth, levels - 1)
        order = np.argsort(-self.depth[self.reader], kind="stable")
        reader, read = self.reader[order], self.read[order]
        cuts = np.flatnonzero(np.diff(self.depth[reader])) + 1
        for part_reader, part_read in zip(np.split(reader, cuts), np.split(read, cuts), strict=True):
            np.minimum.at(deadline, part_read, deadline[part_reader] - 1)
        if (deadline < self.depth).any():
            return None
        level = np.where(fixed, self.depth, -1)
        pending = np.bincount(self.reader, minlength=total)
        waiting = self.movable.copy()
        for at in range(1, levels):
            released = level[self.read] == at - 1
            pending = pending - np.bincount(self.reader[released], minlength=total)
            ready = np.flatnonzero(waiting & (pending == 0))
            for k in np.unique(self.key[ready]).tolist():
                mine = ready[self.key[ready] == k]
                room = capacity.get((at, self.keys[k]), 0)
                if len(mine) > room:
                    mine = mine[np.lexsort((mine, deadline[mine]))]
                    if deadline[mine[room]] <= at:  # a call that cannot wait finds no room
                        return None
                    mine = mine[:room]
                level[mine] = at
                waiting[mine] = False
        if waiting.any():
            return None
        return level

    def pack(self, level: np.ndarray) -> Batch:
        """The batch with its calls moved to ``level`` (per call): one group per (level, op), its
        calls in their original order; columns, sources and requests renumbered."""
        batch, keys = self.batch, len(self.keys)
        codes, new_group = np.unique(level * keys + self.key, return_inverse=True)  # level * keys + op
        new_group = new_group.reshape(-1)
        order = np.argsort(new_group, kind="stable")  # calls new group after new group, in their order
        counts = np.bincount(new_group, minlength=len(codes))
        starts = np.concatenate([[0], np.cumsum(counts)])
        position = np.empty(self.total, dtype=np.int64)
        position[order] = np.arange(self.total) - starts[new_group[order]]
        first_group = self.group[order[starts[:-1]]].tolist()
        # each new group's outputs are the new sources
        widest = max(max(key[2], 1) for _, key in batch.slots)
        source_of = np.full((len(codes), widest), -1, dtype=np.int64)
        owner: list[tuple[int, int | None]] = []
        streams: list[Stream] = []
        depths: list[int] = []
        for number, group in enumerate(first_group):
            key = batch.slots[group][1]
            for output in range(key[2]) if key[2] else [None]:
                source_of[number, output or 0] = len(owner)
                owner.append((number, output))
                streams.append((key, output))
                depths.append(int(codes[number]) // keys)
        old_output = np.asarray([output or 0 for _, output in batch.owner], dtype=np.int64)

        def renumber(column: Column) -> Column:
            if column.kind not in _NODE_KINDS:
                return column
            assert column.sources is not None and column.calls is not None
            call = self.start[self.source_group[column.sources]] + column.calls
            return Column(column.kind, source_of[new_group[call], old_output[column.sources]], position[call])

        # per movable op, each position's calls over all its groups (in call order), to cut new groups from
        by_key: dict[int, tuple[np.ndarray, list[Column]]] = {}
        for k in np.unique(self.key[self.movable]).tolist():
            key = self.keys[k]
            groups = [number for number, (_, other) in enumerate(batch.slots) if other == key]
            row = np.full(self.total, -1, dtype=np.int64)
            mine = np.flatnonzero(self.key == k)
            row[mine] = np.arange(len(mine))
            parts = [[renumber(column) for column in batch.columns[number]] for number in groups]
            by_key[k] = (row, [_merge(list(columns)) for columns in zip(*parts, strict=True)])
        columns: list[list[Column]] = []
        for number, group in enumerate(first_group):
            k = int(self.key[self.start[group]])
            if k in by_key:
                row, merged = by_key[k]
                columns.append(_take(merged, row[order[starts[number] : starts[number + 1]]]))
            else:  # an op whose calls keep their depth: its group, renumbered
                columns.append([renumber(column) for column in batch.columns[group]])
        return Batch(
            slots=[
                (int(g) // keys, batch.slots[s][1]) for g, s in zip(codes.tolist(), first_group, strict=True)
            ],
            names=[batch.names[s] for s in first_group],
            calls=counts.tolist(),
            columns=columns,
            requests=[renumber(column) for column in batch.requests],
            streams=streams,
            depths=depths,
            owner=owner,
        )


def _take(columns: list[Column], calls: np.ndarray) -> list[Column]:
    """The columns of one group of a movable op (no ``shared`` position) cut down to ``calls``."""
    taken = []
    for column in columns:
        if column.kind == "nodes":
            assert column.sources is not None and column.calls is not None
            taken.append(Column("nodes", column.sources[calls], column.calls[calls]))
        elif column.kind == "given":
            taken.append(Column("given", values=[column.values[c] for c in calls.tolist()]))
        else:
            taken.append(Column(column.kind, values=np.asarray(column.values)[calls]))
    return taken


def _merge(parts: list[Column]) -> Column:
    """One column of the calls of several groups of one op (in group order)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if first.kind == "nodes":
        return Column(
            "nodes",
            np.concatenate([p.sources for p in parts if p.sources is not None]),
            np.concatenate([p.calls for p in parts if p.calls is not None]),
        )
    if first.kind == "given":
        return Column("given", values=[v for p in parts for v in p.values])
    return Column(first.kind, values=np.concatenate([np.asarray(p.values) for p in parts]))
