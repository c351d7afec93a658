"""Packing levels: a static envelope runs tree calls later than their depth where it has room.

Packing only changes the level a call runs at, so every padded plan must still equal eager
PyTorch (outputs and gradients). The schedule must keep every call after what it reads, inside
the levels the plan runs and the envelope's capacities; chains (an RNN, an op reading the one
just before it in a cell) keep their depths; and on SST it must cut the padding.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine.static.test_static import _tree_plan
from tests.engine.test_fold_properties import Zoo, encode, forests
from torchfold import EagerFold, Fold, FoldPlan, StaticShapes, StaticShapesWarning
from torchfold.engine.static.columns import decode
from torchfold.engine.static.pack import Packer
from torchfold.examples.datasets import Vocab, load_sst
from torchfold.examples.models import encode_trees

HIDDEN = 4


class Cell(torch.nn.Module):
    """A tree cell of one op per node (like the Tree-LSTM): ``node`` reads its children at any depth."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(11, HIDDEN, generator=generator))
        self.w = torch.nn.Parameter(torch.randn(2 * HIDDEN, HIDDEN, generator=generator) / 2)

    def leaf(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed[ids]

    def node(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.cat([a, b], 1) @ self.w)


def _record(fold: Any, tree: Any, nodes: list[Any]) -> Any:
    node = (
        fold.add("leaf", tree)
        if isinstance(tree, int)
        else fold.add("node", _record(fold, tree[0], nodes), _record(fold, tree[1], nodes))
    )
    nodes.append(node)
    return node


def _run(make: Any, trees: list[Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    # float64: a level's rows sum their gradients in another order once packed, and float32's
    # rounding of that order would blur a real difference
    model = Cell().double()
    fold = make(model)
    nodes: list[Any] = []
    roots = [_record(fold, tree, nodes) for tree in trees]
    outs = list(fold.apply(model, [roots, nodes]))
    loss = outs[0].pow(2).sum() + outs[1].sin().sum()
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    # a padded plan runs every op of its envelope, so a parameter unused by the forest gets zeros
    return outs, [
        torch.zeros_like(p) if g is None else g for p, g in zip(model.parameters(), grads, strict=True)
    ]


SHARED = StaticShapes(
    min_rows=1, level_step=3, warmup=10**9, pack_levels=True
)  # plans packed into an envelope others grew
_SPINE = (((1, 2), 3), 4)
# each position reads each stream more than one level back somewhere: the node op may move
MIXED = [((1, 2), _SPINE), (_SPINE, (3, 4)), (1, (2, 3)), ((4, 5), 6), (7, 8)]


@settings(max_examples=80, deadline=None)
@given(trees=forests(), shared=st.booleans())
def test_packed_forests_equal_eager(trees: list[Any], shared: bool) -> None:
    shapes = SHARED if shared else StaticShapes(min_rows=1, level_step=2, pack_levels=True)
    packed, packed_grads = _run(lambda model: Fold(shapes=shapes), trees)
    eager, eager_grads = _run(EagerFold, trees)
    for a, b in zip(packed + packed_grads, eager + eager_grads, strict=True):
        torch.testing.assert_close(a, b)


def test_a_forest_whose_calls_moved_equals_eager() -> None:
    """The property test above checks packing where the envelope makes calls move; this forest
    surely does (a fresh envelope: each level's capacity is the least this forest needs)."""
    shapes = StaticShapes(min_rows=1, level_step=4, pack_levels=True)
    packed, packed_grads = _run(lambda model: Fold(shapes=shapes), MIXED)
    assert shapes.moved_calls > 0
    eager, eager_grads = _run(EagerFold, MIXED)
    for a, b in zip(packed + packed_grads, eager + eager_grads, strict=True):
        torch.testing.assert_close(a, b)


def _decoded(fold: Fold, requests: list[list[Any]]) -> Any:
    plan = fold.plan(requests)
    assert isinstance(plan, FoldPlan)
    return decode(plan)


def _levels_ok(packer: Packer, level: np.ndarray, levels: int, capacity: dict[Any, int]) -> None:
    assert (level >= packer.depth).all() and (level < levels).all()
    assert (level[~packer.movable] == packer.depth[~packer.movable]).all()
    assert (level[packer.reader] > level[packer.read]).all()  # every call after what it reads
    pairs, counts = np.unique(np.stack([level, packer.key], 1), axis=0, return_counts=True)
    for (at, k), count in zip(pairs.tolist(), counts.tolist(), strict=True):
        key = packer.keys[k]
        if key in packer.movable_keys:
            assert count <= capacity.get((at, key), 0)


@settings(max_examples=150, deadline=None)
@given(trees=forests(), extra=st.integers(0, 6), room=st.integers(1, 8))
def test_a_schedule_runs_each_call_after_what_it_reads_within_the_levels_and_capacities(
    trees: list[Any], extra: int, room: int
) -> None:
    fold = Fold(shapes=None)
    nodes: list[Any] = []
    roots = [_record(fold, tree, nodes) for tree in trees]
    batch = _decoded(fold, [roots, nodes])
    packer = Packer(batch, {})
    deepest = max(depth for depth, _ in batch.slots)
    levels = deepest + 1 + extra
    widest: dict[Any, int] = {}
    for (_, key), calls in zip(batch.slots, batch.calls, strict=True):
        widest[key] = max(widest.get(key, 0), calls)
    # at the widest level's calls everywhere, a schedule always exists (each call at its depth fits)
    full = {(at, key): calls for key, calls in widest.items() for at in range(levels)}
    level = packer.schedule(levels, full)
    assert level is not None
    _levels_ok(packer, level, levels, full)
    # at less room, a schedule found keeps every rule, and the packed batch keeps every call
    tight = {(at, key): room if key in packer.movable_keys else calls for (at, key), calls in full.items()}
    level = packer.schedule(levels, tight)
    if level is not None:
        _levels_ok(packer, level, levels, tight)
        packed = packer.pack(level)
        assert sum(packed.calls) == sum(batch.calls)
        assert all(
            calls <= room
            for (_, key), calls in zip(packed.slots, packed.calls, strict=True)
            if key in packer.movable_keys
        )
    # too few levels: no schedule
    assert packer.schedule(deepest, full) is None


def test_chains_keep_their_depths() -> None:
    """An RNN reads the step before it, and the zoo's ``combine`` the ``pair`` just before it:
    moving them would make those positions read every earlier level (quadratic for a chain)."""
    fold = Fold(shapes=None)
    state = fold.add("leaf", 0)
    for t in range(1, 12):
        state = fold.add("node", state, fold.add("leaf", t % 11))
    assert not Packer(_decoded(fold, [[state]]), {}).packable()
    fold = Fold(shapes=None)
    states: list[Any] = []
    roots = [encode(fold, tree, states) for tree in [((1, 2), (3, (4, 5))), (6, 7)]]
    packer = Packer(_decoded(fold, [roots, states]), {})
    assert {key[0] for key in packer.movable_keys} == set()  # pair and combine are chained
    # the zoo's forests through an envelope still equal eager (nothing moved)
    shapes = StaticShapes(min_rows=1, pack_levels=True)
    fold = Fold(shapes=shapes)
    states = []
    roots = [encode(fold, tree, states) for tree in [((1, 2), (3, (4, 5))), (6, 7)]]
    fold.apply(Zoo(), [roots, states])
    assert shapes.moved_calls == 0


def _sst_envelope(pack: bool, trees: list[Any], vocab: Vocab) -> tuple[StaticShapes, list[int]]:
    shapes = StaticShapes(pack_levels=pack)
    versions = []
    for start in range(0, len(trees), 25):
        fold = Fold(shapes=shapes)
        nodes, _, _ = encode_trees(fold, trees[start : start + 25], vocab)
        fold.plan([nodes])
        versions.append(shapes.version)
        if len(versions) == 20:
            shapes.real_calls = shapes.padded_calls = 0  # the waste after the warm-up
    return shapes, versions


def test_packing_cuts_the_padding_of_sst_batches_and_stops_growing_after_the_warm_up() -> None:
    trees = load_sst(split="train", max_trees=60 * 25)  # 60 batches of the full set, 24 of tests/data
    assert len(trees) >= 24 * 25, f"{len(trees)} trees: too few for a warm-up of 20 batches and 4 after it"
    vocab = Vocab.build(trees)
    packed, versions = _sst_envelope(True, trees, vocab)
    plain, _ = _sst_envelope(False, trees, vocab)
    assert versions[19] == versions[-1], versions
    assert packed.moved_calls > 0
    # padded calls per real one: about 1.7 without packing, about 1.3 with it
    assert packed.waste < 0.6 * plain.waste, (packed.waste, plain.waste)


def test_after_the_warm_up_a_batch_runs_in_a_deeper_bucket_it_fits_instead_of_compiling_its_own() -> None:
    deep: Any = _SPINE
    for word in range(11):  # a node at depth 14, reading children at several depths
        deep = ((word, 1), deep) if word % 2 else (deep, (word, 2))
    shallow = [(1, (2, 3)), ((4, 5), 6)]  # depth 2
    shapes = StaticShapes(min_rows=2, level_step=4, warmup=1, pack_levels=True)
    first = _tree_plan(shapes, [deep, *shallow], _record)
    assert shapes.moved_calls > 0
    assert first.layout.levels == 16
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaticShapesWarning)
        later = _tree_plan(
            shapes, shallow, _record
        )  # its own bucket (4 levels) is new: it runs in the 16 there is
    assert later.layout.levels == 16 and later.layout.key == first.layout.key
    warming = StaticShapes(min_rows=2, level_step=4, warmup=5, pack_levels=True)
    _tree_plan(warming, [deep, *shallow], _record)
    assert _tree_plan(warming, shallow, _record).layout.levels == 4  # in the warm-up, a bucket of its own


def test_pack_levels_is_checked() -> None:
    assert not StaticShapes().pack_levels  # opt-in: not clearly faster on XLA's CPU backend
    with pytest.raises(TypeError, match="pack_levels must be True or False"):
        StaticShapes(pack_levels=1)  # type: ignore[arg-type]
