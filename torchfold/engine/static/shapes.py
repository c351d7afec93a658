"""Static shapes: pad plans so that the graphs XLA compiles repeat from batch to batch.

XLA (TPUs, and ``torch_xla`` on the CPU) compiles one program per distinct sequence of tensor
operations and shapes. An unpadded plan has a different sequence of (depth, op, calls) for every
batch of trees, so every batch compiles anew (seconds each). :class:`StaticShapes` is a
grow-only *envelope* learned over the batches it sees:

* one **slot** per (depth, op signature), holding a capacity taken from a bucket ladder
  (powers of two from ``min_rows`` by default) that only grows;
* the number of depth levels is the deepest level seen times ``headroom``, rounded up to a
  multiple of ``level_step``; the levels past the deepest one seen repeat its ops at the
  smallest bucket, so a somewhat deeper batch still fits;
* a plan runs the levels down to its own deepest node, rounded up to a multiple of
  ``level_step`` (its *depth bucket*): a shallow batch does not pay for the deepest batch's
  levels, and each depth bucket is one more graph (``depth_buckets=False``: one graph of all
  levels);
* with ``pack_levels=True``, the ops that read nodes like a tree's (at several depths)
  get one capacity per level instead of one per depth: a node may run at any level after its
  children's, so the calls with time to spare move from the crowded levels near the leaves to
  the nearly empty deep ones (:mod:`torchfold.engine.static.pack`), and a batch that does not
  fit its own depth bucket runs in a deeper one before the envelope grows;
* each argument position of an op reads the concatenation of the earlier slots' outputs of the
  op outputs ("streams") it has ever read, so which tensors a gather concatenates depends on the
  envelope (and the plan's depth bucket) only, never on the batch's nodes: of a stream it has only ever read one level back (a chain:
  an RNN step reading the step before), the slots one level back; of the others (a tree's
  children, at any depth), every earlier slot. So a chain of n calls costs O(n), not O(n²),
  and trees keep the envelope they always had (reading every level back grows it no more).

:meth:`StaticShapes.cover` pads a :class:`~torchfold.FoldPlan` into the envelope, growing it when
the plan does not fit, and returns a :class:`StaticPlan`. Every plan fitted to one version of
the envelope runs the same tensor operations on the same shapes; only the index data differs.
So after a warm-up the number of compiled graphs stays fixed.

Padding never shows: a padded call repeats the arguments of a real call of its column (a real
row, an int or float the column holds, a given tensor's rows), so padded rows are finite and
computed like real ones, and no real row and no request reads them. ``apply`` returns exactly the
requested rows; ``apply(model, padded=True)`` returns them padded to the envelope's capacity, for
a loss whose shape must not vary either (weight the padded rows with 0, see :meth:`StaticPlan.pad`).
"""

from __future__ import annotations

import itertools
import math
import uuid
import warnings
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from torchfold._validate import check_int
from torchfold.engine.devices import needs_static_shapes
from torchfold.engine.ir import PlanData
from torchfold.engine.static.columns import Batch, Column, OpKey, Stream, count_items, decode, request_kinds
from torchfold.engine.static.layout import StaticLayout
from torchfold.engine.static.pack import Packer
from torchfold.engine.static.padded import StaticPlan

__all__ = ["StaticShapes", "StaticShapesOverflow", "StaticShapesWarning", "envelope_for"]

_Tensor = torch.Tensor
_BY_MODULE: weakref.WeakKeyDictionary[Any, StaticShapes] = weakref.WeakKeyDictionary()


class StaticShapesWarning(UserWarning):
    """A plan did not fit a warmed-up envelope: it grows, and the next run compiles a new graph."""


class StaticShapesOverflow(ValueError):
    """A plan does not fit a frozen envelope (:meth:`StaticShapes.freeze`), or one fitted with ``grow=False``.

    :class:`~torchfold.train.StepLoader` catches it in its build and splits the minibatch into
    smaller ones that fit (the step stays exactly the same); :attr:`shapes` is the envelope.
    """

    def __init__(self, message: str, shapes: StaticShapes) -> None:
        super().__init__(message)
        self.shapes = shapes

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.shapes))


class StaticShapes:
    """A grow-only envelope of padded shapes: plans fitted to it repeat the same XLA graphs.

    The default for folds applied on an XLA device (one envelope per module); pass one to
    :class:`~torchfold.Fold` (``Fold(shapes=StaticShapes())``) to choose the ladder, to share it,
    or to pad on a CPU or GPU too (static shapes are what CUDA graphs need as well).

    Args:
        min_rows: the smallest bucket, in calls (default 16).
        growth: each bucket of the ladder is this factor times the previous one (default 1.5).
        sizes: an explicit ladder instead (increasing ints); a group larger than its last size
            gets a bucket grown from it by ``growth``, with a warning, never an error.
        level_step: the number of depth levels is rounded up to a multiple of this (default 8).
        headroom: a group that outgrows its slot gets the bucket of this many times its calls
            (default 1.3): more room against later growth, for more padding.
        warmup: plans fitted before growing the envelope warns (default 20); growth during the
            warm-up is expected and silent.
        depth_buckets: a plan runs only the levels down to its deepest node, rounded up to a
            multiple of ``level_step``, instead of every level of the envelope (default True):
            shallow batches skip the deep levels' padding, for one graph per depth bucket
            (at most ``levels / level_step`` of them).
        pack_levels: run tree nodes later than their depth where the envelope has room (default
            False): the ops that read nodes at several depths get one capacity per level, the
            smallest their batches needed, for much less padding (on SST, 0.25 padded calls per
            real one instead of 0.72), for more host time per fit. Only the level a
            call runs at changes, never a value; chains (a position that only ever read one
            level back) keep their depths. On XLA's CPU backend the replayed step was not
            clearly faster for it (``benchmarks/results/xla.md``).

    Example:
        >>> import torch, torchfold
        >>> class Sum(torch.nn.Module):
        ...     def leaf(self, x):
        ...         return x.float().unsqueeze(1)
        ...     def add(self, a, b):
        ...         return a + b
        >>> shapes = torchfold.StaticShapes(min_rows=4)
        >>> f = torchfold.Fold(shapes=shapes)
        >>> a, b, c = f.add("leaf", 1), f.add("leaf", 2), f.add("leaf", 3)
        >>> plan = f.plan([[f.add("add", f.add("add", a, b), c)]])
        >>> plan.apply(Sum())
        [tensor([[6.]])]
        >>> plan.apply(Sum(), padded=True)[0].shape, plan.sizes, plan.capacities
        (torch.Size([4, 1]), [1], [4])
    """

    def __init__(
        self,
        *,
        min_rows: int = 16,
        growth: float = 1.5,
        sizes: Sequence[int] | None = None,
        level_step: int = 8,
        headroom: float = 1.3,
        warmup: int = 20,
        depth_buckets: bool = True,
        pack_levels: bool = False,
    ) -> None:
        self.min_rows = check_int("StaticShapes(min_rows)", min_rows, 1)
        if (
            isinstance(growth, bool)
            or not isinstance(growth, int | float)
            or not growth > 1
            or math.isinf(growth)
        ):
            raise ValueError(f"StaticShapes(growth={growth!r}): growth must be a finite number > 1, like 2.0")
        self.growth = float(growth)
        self.sizes: tuple[int, ...] | None = None
        if sizes is not None:
            if not isinstance(sizes, Iterable):
                raise TypeError(
                    f"StaticShapes(sizes={sizes!r}): sizes must be a sequence of positive ints, like (8, 32, 128)"
                )
            ladder = tuple(sizes)
            if not ladder or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in ladder):
                raise ValueError(
                    f"StaticShapes(sizes={sizes!r}): sizes must be positive ints, like (8, 32, 128)"
                )
            if any(b <= a for a, b in itertools.pairwise(ladder)):
                raise ValueError(
                    f"StaticShapes(sizes={sizes!r}): sizes must increase strictly, like (8, 32, 128)"
                )
            self.sizes = ladder
        self.level_step = check_int("StaticShapes(level_step)", level_step, 1)
        if (
            isinstance(headroom, bool)
            or not isinstance(headroom, int | float)
            or not 1 <= headroom < math.inf
        ):
            raise ValueError(
                f"StaticShapes(headroom={headroom!r}): headroom must be a finite number >= 1, like 1.25"
            )
        self.headroom = float(headroom)
        self.warmup = check_int("StaticShapes(warmup)", warmup, 0)
        if not isinstance(pack_levels, bool):
            raise TypeError(f"StaticShapes(pack_levels={pack_levels!r}): pack_levels must be True or False")
        if not isinstance(depth_buckets, bool):
            raise TypeError(
                f"StaticShapes(depth_buckets={depth_buckets!r}): depth_buckets must be True or False"
            )
        self.depth_buckets = depth_buckets
        self._buckets: set[int] = set()  # the level counts plans have run so far
        self._capacity: dict[tuple[int, OpKey], int] = {}
        self._order: dict[OpKey, int] = {}  # ops in first-seen order: the order of slots at a depth
        self._names: dict[OpKey, str] = {}
        # what each position of an op reads: per stream, its reach (levels back: 1, or inf for all)
        self._streams: dict[tuple[OpKey, int], dict[Stream, float]] = {}
        self._fills: dict[tuple[OpKey, int], Any] = {}  # a value that pads an ints/floats/given position
        # per request signature (the kinds of the requests, in order): each request's kind, capacity
        # and streams; training ([nodes]) and evaluation ([roots]) then keep an envelope each
        self._requests: dict[tuple[str, ...], list[tuple[str, int, set[Stream]]]] = {}
        self._deepest = -1
        self._levels = 0
        self.pack_levels = pack_levels
        # per movable op (one that reads nodes), its capacity at every level but the first
        self._per_level: dict[OpKey, int] = {}
        self._first: dict[OpKey, int] = {}  # per op, the least depth it ran at
        self._layouts: dict[tuple[tuple[str, ...], int], StaticLayout] = {}  # per (signature, levels)
        #: how many times the envelope grew: the number of distinct graphs it has asked for
        self.version = 0
        # who this envelope is, in layout keys: travels with its pickles (to loader workers)
        self._token = uuid.uuid4().hex
        #: plans fitted so far
        self.plans = 0
        #: calls that plans held, and calls run after padding (``padded_calls / real_calls - 1`` is the waste)
        self.real_calls = 0
        self.padded_calls = 0
        #: calls that plans ran later than their depth (``pack_levels``), over all plans fitted
        self.moved_calls = 0
        #: a frozen envelope never grows: :meth:`cover` raises :class:`StaticShapesOverflow` instead
        self.frozen = False

    def __repr__(self) -> str:
        return (
            f"StaticShapes(version={self.version}, plans={self.plans}, slots={len(self._capacity)}, "
            f"levels={self._levels}, waste={self.waste:.2f})"
        )

    @classmethod
    def of(cls, module: object) -> StaticShapes:
        """The envelope that folds applied on an XLA device use for ``module`` (made on first use).

        >>> import torch
        >>> model = torch.nn.Linear(2, 2)
        >>> StaticShapes.of(model) is StaticShapes.of(model)
        True
        """
        shapes = _BY_MODULE.get(module)
        if shapes is None:
            shapes = _BY_MODULE[module] = cls()
        return shapes

    @property
    def waste(self) -> float:
        """Padded calls per real call over all plans fitted (0.0: no padding)."""
        return self.padded_calls / self.real_calls - 1 if self.real_calls else 0.0

    def bucket(self, calls: int) -> int:
        """The capacity the ladder gives a group of ``calls`` calls.

        >>> StaticShapes().bucket(9), StaticShapes().bucket(17), StaticShapes(sizes=(10, 100)).bucket(101)
        (16, 24, 150)
        """
        if self.sizes is not None:
            for size in self.sizes:
                if size >= calls:
                    return size
            size = self.sizes[-1]
        else:
            size = self.min_rows
        while size < calls:
            size = max(size + 1, math.ceil(size * self.growth))
        return size

    # -- what the envelope holds (what a StaticLayout is made of) ------------------------------

    @property
    def levels(self) -> int:
        """The levels (depths) the envelope runs: its deepest plan's, or more with ``pack_levels``."""
        return self._levels

    @property
    def token(self) -> str:
        """Who this envelope is, in layout keys (with :attr:`version`): copies of it, such as its
        pickles in ``DataLoader`` workers, keep it."""
        return self._token

    @property
    def fills(self) -> Mapping[tuple[OpKey, int], Any]:
        """Per (op key, position) of ints, floats or given tensors, the value its padding holds."""
        return self._fills

    def slots(self, levels: int | None = None) -> list[tuple[int, OpKey, str, int]]:
        """The envelope's slots in run order (by depth, then ops in the order first seen), each as
        (depth, op key, op name, capacity); with ``levels``, those below it only."""
        order = self._order
        keys = sorted(
            (slot for slot in self._capacity if levels is None or slot[0] < levels),
            key=lambda slot: (slot[0], order[slot[1]]),
        )
        return [(depth, key, self._names[key], self._capacity[(depth, key)]) for depth, key in keys]

    def reach(self, key: OpKey, position: int) -> Mapping[Stream, float]:
        """What position ``position`` of op ``key`` reads: per stream, its reach (levels back: 1, or
        inf for all)."""
        return self._streams[(key, position)]

    def requests(self, signature: tuple[str, ...]) -> list[tuple[str, int, set[Stream]]]:
        """Per request of the request kinds ``signature``: its kind, capacity and streams."""
        return self._requests[signature]

    # -- warming up, freezing -----------------------------------------------------------------

    def freeze(self, frozen: bool = True) -> StaticShapes:
        """Stop growing: from now on a plan that does not fit raises :class:`StaticShapesOverflow`
        (no new layout, so no new compilation); ``freeze(False)`` grows again. Returns the envelope.

        Freeze after fitting the envelope to the data (e.g.
        :func:`torchfold.train.fit_static_shapes`); a :class:`~torchfold.train.StepLoader` then
        splits a minibatch that does not fit into smaller ones that do, and grows the envelope
        only for a sample that does not fit alone (with a :class:`StaticShapesWarning`).

        >>> shapes = StaticShapes().freeze()
        >>> shapes.frozen
        True
        """
        if not isinstance(frozen, bool):
            raise TypeError(f"freeze({frozen!r}): pass True (stop growing) or False (grow again)")
        self.frozen = frozen
        return self

    def reset_counters(self) -> None:
        """Zero the waste counters (:attr:`real_calls`, :attr:`padded_calls`, :attr:`moved_calls`),
        e.g. after fitting the envelope, so that :attr:`waste` is the training run's own.
        """
        self.real_calls = self.padded_calls = self.moved_calls = 0

    def fits(self, plan: PlanData) -> bool:
        """Whether ``plan`` fits the envelope as it is: no growth and no new layout, so no new graph
        (what ``cover(plan, grow=False)`` pads; nothing is changed).

        >>> import torch, torchfold
        >>> shapes = StaticShapes(min_rows=4)
        >>> f = torchfold.Fold()
        >>> plan = f.plan([[f.add(torch.neg, 1)]])
        >>> shapes.fits(plan), shapes.cover(plan).capacities, shapes.fits(plan)
        (False, [4], True)
        """
        plan = _unpadded(plan, "fits")
        batch = decode(plan)
        packer = Packer(batch, self._streams) if self.pack_levels else None
        if packer is not None and packer.packable():
            return self._packed_place(packer) is not None
        return self._fits(batch) and self._existing_levels(batch) is not None

    # -- fitting ----------------------------------------------------------------------------

    def fit(self, plan: PlanData, *, grow: bool | None = None) -> StaticPlan:
        """Deprecated: :meth:`cover` (``fit`` is also :meth:`TraceTrainer.fit <torchfold.train.TraceTrainer.fit>`, which trains)."""
        warnings.warn(
            "StaticShapes.fit is deprecated; use StaticShapes.cover (pads a plan into the envelope, widening it to "
            "cover the plan)",
            FutureWarning,
            stacklevel=2,
        )
        return self.cover(plan, grow=grow)

    def cover(self, plan: PlanData, *, grow: bool | None = None) -> StaticPlan:
        """Pad ``plan`` into the envelope, widening the envelope first to cover it if it does not fit.

        Args:
            plan: an unpadded :class:`~torchfold.FoldPlan`.
            grow: ``False``: raise :class:`StaticShapesOverflow` instead of growing, or of making
                a layout the envelope has not made since it last grew (either is one more graph to
                compile); ``True``: grow even a frozen envelope; default: grow unless
                :meth:`freeze` was called.
        """
        plan = _unpadded(plan, "cover")
        if grow is not None and not isinstance(grow, bool):
            raise TypeError(f"cover(grow={grow!r}): grow must be True, False or None (grow unless frozen)")
        if grow is None:
            grow = not self.frozen
        batch = decode(plan)
        packer = Packer(batch, self._streams) if self.pack_levels else None
        packable = packer is not None and packer.packable()
        undo = None
        if not grow:
            if packer is not None and packable:
                place = self._packed_place(packer)
                if place is None:
                    raise self._overflow(batch, "more room")
                batch, levels, moved = place
                self.moved_calls += moved
            else:
                if not self._fits(batch):
                    raise self._overflow(batch, "more room")
                found = self._existing_levels(batch)
                if found is None:
                    raise self._overflow(
                        batch, "a layout of its own (a depth bucket not run since the envelope last grew)"
                    )
                levels = found
        else:
            undo = self._snapshot()  # put back if the fold fails to run (StaticPlan.apply)
            if packer is not None and packable:
                batch, levels, grows = self._fit_packed(packer)
            else:
                grows = not self._fits(batch)
                if grows:
                    self._learn(batch)
                    self._grew()
                levels = self._levels_for(batch, warn=not grows)  # (growing warned already)
            if not grows and self._buckets == undo["_buckets"]:
                undo = None  # nothing changed
        self.plans += 1
        signature = request_kinds(batch)
        layout = self._layouts.get((signature, levels))
        if layout is None:
            layout = self._layouts[(signature, levels)] = StaticLayout(self, signature, levels)
        padded = layout.pad(plan, batch)
        self.real_calls += sum(batch.calls)
        self.padded_calls += layout.total_calls
        if undo is not None:
            padded._undo = (weakref.ref(self), (self.version, len(self._buckets), undo))
        return padded

    def _overflow(self, batch: Batch, needs: str) -> StaticShapesOverflow:
        deepest = max((depth for depth, _ in batch.slots), default=0)
        return StaticShapesOverflow(
            f"a fold of {sum(batch.calls)} calls, {deepest + 1} levels deep, does not fit the "
            f"{'frozen ' if self.frozen else ''}static shapes (version {self.version}, {self._levels} levels): it "
            f"needs {needs}; fit it in smaller folds (StepLoader splits its minibatches so), or call "
            "cover(plan, grow=True) to grow the envelope (one more compilation)",
            self,
        )

    def _existing_levels(self, batch: Batch) -> int | None:
        """The levels a plan that fits the envelope runs without a new layout (so without a new
        graph): the fewest, from its own depth bucket up, whose layout exists; ``None`` if none does."""
        signature = request_kinds(batch)
        if not self.depth_buckets:
            return self._levels if (signature, self._levels) in self._layouts else None
        own = min(self._levels, self._own_levels(batch))
        for levels in sorted(self._buckets):
            if own <= levels and (signature, levels) in self._layouts:
                return levels
        return None

    def _packed_place(self, packer: Packer) -> tuple[Batch, int, int] | None:
        """Where a packable plan fits without growing and without a new layout: the packed batch,
        its levels and the calls moved later, or ``None`` (nothing in the envelope changes)."""
        signature = request_kinds(packer.batch)
        own = self._own_levels(packer.batch)
        if self.depth_buckets:
            tries = [levels for levels in sorted(self._buckets) if own <= levels <= self._levels]
        else:
            tries = [self._levels] if own <= self._levels else []
        for levels in tries:
            if (signature, levels) not in self._layouts:
                continue
            level = packer.schedule(levels, self._capacity)
            if level is not None:
                packed = packer.pack(level)
                if self._fits(packed):
                    return packed, levels, int((level != packer.depth).sum())
        return None

    # -- undoing a fit whose fold failed ------------------------------------------------------

    _STATE = (
        "_buckets", "_capacity", "_order", "_names", "_streams", "_fills", "_requests", "_deepest",
        "_levels", "_per_level", "_first", "_layouts", "version",
    )  # fmt: skip

    def _snapshot(self) -> dict[str, Any]:
        """The envelope's shape state, copied deep enough that growing leaves the copy as it was."""
        return {
            "_buckets": set(self._buckets),
            "_capacity": dict(self._capacity),
            "_order": dict(self._order),
            "_names": dict(self._names),
            "_streams": {where: dict(reach) for where, reach in self._streams.items()},
            "_fills": dict(self._fills),
            "_requests": {
                sig: [(k, room, set(st)) for k, room, st in reqs] for sig, reqs in self._requests.items()
            },
            "_deepest": self._deepest,
            "_levels": self._levels,
            "_per_level": dict(self._per_level),
            "_first": dict(self._first),
            "_layouts": dict(self._layouts),
            "version": self.version,
        }

    def undo_fit(self, undo: tuple[int, int, dict[str, Any] | None]) -> bool:
        """A plan whose fit grew the envelope failed to run (an unknown op, say): put the envelope
        back as it was before that fit, if nothing grew it since. Returns whether it did."""
        version, buckets, state = undo
        if state is None or self.version != version or len(self._buckets) != buckets:
            return False
        for name in self._STATE:
            setattr(self, name, state[name])
        return True

    def _own_levels(self, batch: Batch) -> int:
        """A plan's depth bucket: the levels down to its deepest node, rounded up to ``level_step``."""
        deepest = max((depth for depth, _ in batch.slots), default=0)
        return -(-(deepest + 1) // self.level_step) * self.level_step

    def _levels_for(self, batch: Batch, warn: bool) -> int:
        """The levels a plan of ``batch`` runs: its depth bucket (with ``depth_buckets``), else all."""
        if not self.depth_buckets:
            return self._levels
        return self._enter_bucket(min(self._levels, self._own_levels(batch)), batch, warn)

    def _enter_bucket(self, levels: int, batch: Batch, warn: bool) -> int:
        """Note that a plan runs ``levels`` levels; the first plan of a new depth bucket after the
        warm-up warns (``warn``) that it compiles."""
        if self.depth_buckets and levels not in self._buckets:
            if warn and self._buckets and self.plans >= self.warmup:
                deepest = max((depth for depth, _ in batch.slots), default=0)
                warnings.warn(
                    f"the first fold of depth {deepest} after {self.plans} plans runs {levels} of the "
                    f"envelope's {self._levels} levels: expect one new compilation for this depth bucket; "
                    "warm up on deeper folds, or pass depth_buckets=False for one graph of every level",
                    StaticShapesWarning,
                    stacklevel=5,
                )
            self._buckets.add(levels)
        return levels

    def _fit_packed(self, packer: Packer) -> tuple[Batch, int, bool]:
        """Fit a plan whose calls may move to later levels: into the smallest depth bucket, from
        its own up, where a schedule fits the envelope; else grow the envelope for its own bucket.
        Returns the packed batch, the levels it runs and whether the envelope grew."""
        batch = packer.batch
        own = self._own_levels(batch)
        if self.depth_buckets:
            tries = [levels for levels in sorted(self._buckets) if own <= levels <= self._levels]
            if own <= self._levels and own not in tries:
                # a new depth bucket is a new graph: in the warm-up, the cheapest place to run;
                # after it, the place of last resort (an existing deeper bucket compiles nothing)
                tries.insert(0 if self.plans < self.warmup else len(tries), own)
        else:
            tries = [self._levels] if own <= self._levels else []
        for levels in tries:
            level = packer.schedule(levels, self._capacity)
            if level is not None:
                packed = packer.pack(level)
                if self._fits(packed):
                    self.moved_calls += int((level != packer.depth).sum())
                    return packed, self._enter_bucket(levels, batch, warn=True), False
        movable = packer.movable_keys
        self._learn(batch, movable)
        levels = min(own, self._levels) if self.depth_buckets else self._levels
        for key, need in self._packed_capacity(packer, levels, movable).items():
            self._per_level[key] = max(self._per_level.get(key, 0), need)
        self._fill_levels()
        level = packer.schedule(levels, self._capacity)
        assert level is not None, "a schedule at the capacities just learned"
        self.moved_calls += int((level != packer.depth).sum())
        packed = packer.pack(level)
        self._learn(packed, movable, depths=False)  # what the packed calls read, levels further back
        self._grew(stacklevel=5)
        return packed, self._enter_bucket(levels, batch, warn=False), True

    def _packed_capacity(self, packer: Packer, levels: int, movable: set[OpKey]) -> dict[OpKey, int]:
        """Per movable op, the smallest capacity per level (one scale for all ops) at which the
        plan's calls fit ``levels`` levels: found by bisection between nothing and the plan's widest level."""
        widest: dict[OpKey, int] = {}
        for (_depth, key), calls in zip(packer.batch.slots, packer.batch.calls, strict=True):
            if key in movable:
                widest[key] = max(widest.get(key, 0), calls)

        def capacities(scale: int) -> dict[OpKey, int]:
            return {
                key: max(self._per_level.get(key, 0), -(-calls * scale // 64))
                for key, calls in widest.items()
            }

        def fits(scale: int) -> bool:
            trial = dict(self._capacity)
            self._fill_levels(trial, capacities(scale))
            return packer.schedule(levels, trial) is not None

        low, high = 0, 64  # at the widest level's calls everywhere, each call runs at its own depth
        while high - low > 1:
            middle = (low + high) // 2
            if fits(middle):
                high = middle
            else:
                low = middle
        return capacities(high)

    def _fill_levels(
        self, capacity: dict[tuple[int, OpKey], int] | None = None, per_level: dict[OpKey, int] | None = None
    ) -> None:
        """Give each movable op its capacity per level (``per_level``, default the envelope's) at
        every level from the first it ran at, in ``capacity`` (default the envelope's): packing
        only ever moves calls later, and there its positions find earlier outputs."""
        capacity = self._capacity if capacity is None else capacity
        for key, calls in (self._per_level if per_level is None else per_level).items():
            for depth in range(self._first[key], self._levels):
                capacity[(depth, key)] = max(capacity.get((depth, key), 0), calls)

    def _streams_of(self, batch: Batch, column: Column) -> set[Stream]:
        assert column.sources is not None
        return {batch.streams[s] for s in column.unique_sources()[0].tolist()}

    def _reach_of(self, batch: Batch, column: Column, depth: int) -> dict[Stream, int]:
        """Per stream a position at ``depth`` reads, how many levels back it reads it at most."""
        assert column.sources is not None
        reach: dict[Stream, int] = {}
        for source in column.unique_sources()[0].tolist():
            stream, back = batch.streams[source], depth - batch.depths[source]
            if reach.get(stream, 0) < back:
                reach[stream] = back
        return reach

    def _fits(self, batch: Batch) -> bool:
        requests = self._requests.get(request_kinds(batch))
        if requests is None:
            return False
        capacity = self._capacity
        for slot, calls, columns in zip(batch.slots, batch.calls, batch.columns, strict=True):
            if capacity.get(slot, 0) < calls:
                return False
            depth, key = slot
            for position, column in enumerate(columns):
                if column.kind in ("nodes", "shared"):
                    known = self._streams[(key, position)]
                    for stream, back in self._reach_of(batch, column, depth).items():
                        if known.get(stream, 0) < back:
                            return False
        for (kind, room, streams), column in zip(requests, batch.requests, strict=True):
            if kind != "given" and count_items(column) > room:
                return False
            if kind == "nodes" and not self._streams_of(batch, column) <= streams:
                return False
        return True

    def _learn(
        self, batch: Batch, movable: set[OpKey] | frozenset[OpKey] = frozenset(), depths: bool = True
    ) -> None:
        """Grow the envelope to hold ``batch``: its slots' capacities (but the ``movable`` ops',
        whose capacity is one per level), what each position reads, its requests and, with
        ``depths``, the levels its depth needs."""
        for slot, name, calls, columns in zip(
            batch.slots, batch.names, batch.calls, batch.columns, strict=True
        ):
            depth, key = slot
            have = self._capacity.get(slot, 0)
            if calls > have and key not in movable:
                self._capacity[slot] = self.bucket(math.ceil(calls * self.headroom))
            self._order.setdefault(key, len(self._order))
            self._names.setdefault(key, name)
            for position, column in enumerate(columns):
                where = (key, position)
                if column.kind in ("nodes", "shared"):
                    known = self._streams.setdefault(where, {})
                    for stream, back in self._reach_of(batch, column, depth).items():
                        if known.get(stream, 0) < back:
                            # One level back (a chain) stays exact; further back means every level:
                            # reads of trees reach back at any depth, and each new reach would
                            # grow the envelope again (a new graph after the warm-up). A movable
                            # op's calls may run any number of levels after what they read.
                            known[stream] = 1 if back == 1 and key not in movable else math.inf
                elif where not in self._fills:
                    first = column.values[0]
                    self._fills[where] = first.detach().clone() if isinstance(first, _Tensor) else first
            if depths:
                self._deepest = max(self._deepest, depth)
                self._first[key] = min(self._first.get(key, depth), depth)
        # Levels past the deepest seen repeat its ops at the smallest bucket: a batch a little
        # deeper than all before it then fits without a new graph.
        wanted = math.ceil((self._deepest + 1) * self.headroom)
        self._levels = max(self._levels, -(-wanted // self.level_step) * self.level_step)
        # (only ops that read nodes: one without node arguments always runs at depth 0)
        deepest_ops = [
            key
            for depth, key in self._capacity
            if depth == self._deepest
            and key not in self._per_level
            and any(kind in ("nodes", "shared") for kind in key[3])
        ]
        for depth in range(self._deepest + 1, self._levels):
            for key in deepest_ops:
                self._capacity.setdefault((depth, key), self.bucket(1))
        self._fill_levels()
        signature = request_kinds(batch)
        requests = self._requests.get(signature) or [(column.kind, 0, set()) for column in batch.requests]
        self._requests[signature] = [
            (
                kind,
                room
                if count_items(column) <= room
                else self.bucket(math.ceil(count_items(column) * self.headroom)),
                streams | self._streams_of(batch, column) if kind == "nodes" else streams,
            )
            for (kind, room, streams), column in zip(requests, batch.requests, strict=True)
        ]

    def _grew(self, stacklevel: int = 4) -> None:
        """The envelope grew: its layouts are new (warned about after the warm-up)."""
        grown = bool(self._layouts)
        self._layouts.clear()
        self.version += 1
        if grown and self.plans >= self.warmup:
            warnings.warn(
                f"a fold did not fit the static shapes learned over {self.plans} plans, so they grow "
                f"(version {self.version}): expect one new compilation; a larger min_rows, growth or level_step "
                "leaves more room",
                StaticShapesWarning,
                stacklevel=stacklevel,
            )


def envelope_for(
    shapes: StaticShapes | str | None, module: object = None, device: torch.device | None = None
) -> StaticShapes | None:
    """When to pad: the envelope a plan is padded into, or ``None`` to run it unpadded.

    The one rule, which :meth:`Fold.plan <torchfold.Fold.plan>` asks with the fold's ``shapes``
    (no module or device yet) and :meth:`FoldPlan.apply <torchfold.FoldPlan.apply>` asks again
    with the module and its device:

    * a :class:`StaticShapes` (``Fold(shapes=envelope)``): always that envelope;
    * ``"auto"`` (the default): on an XLA device, the module's own envelope
      (:meth:`StaticShapes.of`), so that the graphs XLA compiles repeat; elsewhere none;
    * ``None``: never pad.

    >>> import torch
    >>> model = torch.nn.Linear(2, 2)
    >>> envelope_for("auto", model, torch.device("cpu")) is None
    True
    >>> envelope_for("auto", model, torch.device("xla")) is StaticShapes.of(model)
    True
    """
    if isinstance(shapes, StaticShapes):
        return shapes
    if shapes == "auto" and device is not None and needs_static_shapes(device):
        return StaticShapes.of(module)
    return None


def _unpadded(plan: PlanData, method: str) -> PlanData:
    if isinstance(plan, StaticPlan):
        raise TypeError(f"{method} expects an unpadded FoldPlan; this plan is already padded")
    if not isinstance(plan, PlanData):
        raise TypeError(f"{method} expects a FoldPlan (from Fold.plan), got {type(plan).__name__}")
    return plan
