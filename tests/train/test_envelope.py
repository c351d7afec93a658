"""The envelope fitted before training (torchfold.train.data.envelope) and the loader's split of a minibatch
that does not fit it: the step stays exactly the same, and the envelope never grows after the warm-up."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import torchfold
from torchfold import FoldPlan, StaticShapes, StaticShapesOverflow, StaticShapesWarning
from torchfold.examples.datasets import Tree, Vocab, load_sst
from torchfold.examples.models import TreeLSTM, TreeLSTMBuild, tree_lstm_loss, tree_lstm_shapes
from torchfold.train import AccumulatingOptimizer, StepLoader, fit_static_shapes


@pytest.fixture(scope="module")
def sst(data_dir: Any) -> tuple[list[Tree], Vocab]:
    trees = load_sst(split="train", max_trees=400)
    return trees, Vocab.build(trees)


def _train(loader: StepLoader[Any, Any], vocab: Vocab, steps: int) -> dict[str, list[Any]]:
    """Steps of SGD (momentum) on float64, recording every step's loss, gradients and parameters."""
    torch.manual_seed(0)
    model = TreeLSTM(len(vocab), 8, 8).double()
    optimizer = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    seen: dict[str, list[Any]] = {"loss": [], "grads": [], "params": [], "minibatches": [], "positions": []}
    for step in loader:
        total = torch.zeros((), dtype=torch.float64)
        for minibatch in step:
            plan, targets = minibatch.data
            with optimizer.minibatch(minibatch.num_samples):
                loss = tree_lstm_loss(model, plan.apply(model, padded=True), targets)
                loss.backward()
            total += loss.detach() * minibatch.num_samples
        optimizer.step()
        seen["loss"].append(total / step.batch_size)
        seen["grads"].append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        seen["params"].append([p.detach().clone() for p in model.parameters()])
        seen["minibatches"].append((len(step), step.split.local_minibatches, step.split.num_minibatches))
        seen["positions"].append([(m.position, m.indices) for m in step])
        optimizer.zero_grad()
        if step.step + 1 == steps:
            break
    return seen


@pytest.mark.filterwarnings("ignore:sample 251 of the dataset:torchfold.StaticShapesWarning")
def test_a_split_minibatch_trains_exactly_as_the_unsplit_one(sst: tuple[list[Tree], Vocab]) -> None:
    trees, vocab = sst
    # An envelope fitted to minibatches of 2 trees: most minibatches of 8 overflow it and are split.
    shapes = fit_static_shapes(trees[:40], TreeLSTMBuild(vocab), 2)
    version = shapes.version
    trace = [8, 16, 24, 8, 32, 16]
    split = StepLoader(trees, 8, build=TreeLSTMBuild(vocab, shapes=shapes), trace=trace, seed=3)
    whole = StepLoader(trees, 8, build=TreeLSTMBuild(vocab), trace=trace, seed=3)
    got, want = _train(split, vocab, len(trace)), _train(whole, vocab, len(trace))
    assert shapes.version == version  # split, never grown
    ran = [count for count, _local, _total in got["minibatches"]]
    assert sum(ran) > sum(size // 8 for size in trace)  # minibatches were split
    # the counts say what ran: this rank's, and (one process) the step's
    assert all(count == local == total for count, local, total in got["minibatches"])
    assert all(
        count == local == total == size // 8
        for (count, local, total), size in zip(want["minibatches"], trace, strict=False)
    )
    for step in range(len(trace)):
        torch.testing.assert_close(got["loss"][step], want["loss"][step], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(got["grads"][step], want["grads"][step], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(got["params"][step], want["params"][step], rtol=1e-12, atol=1e-14)
    # the parts of a split minibatch hold its samples, in order, at positions of their own
    for parts, whole_step in zip(got["positions"], want["positions"], strict=False):
        positions = [position for position, _ in parts]
        assert len(set(positions)) == len(positions)
        assert sorted(i for _, indices in parts for i in indices) == sorted(
            i for _, ix in whole_step for i in ix
        )
        for position, indices in whole_step:
            assert [i for p, ix in parts if p % len(whole_step) == position for i in ix] == indices


@pytest.mark.filterwarnings("ignore:sample 251 of the dataset:torchfold.StaticShapesWarning")
def test_split_positions_are_the_same_on_any_number_of_ranks(sst: tuple[list[Tree], Vocab]) -> None:
    trees, vocab = sst
    shapes = fit_static_shapes(trees[:40], TreeLSTMBuild(vocab), 2)
    trace = [16, 32, 24]

    def positions(replicas: int, rank: int, workers: int = 0) -> list[set[tuple[int, tuple[int, ...]]]]:
        with StepLoader(
            trees,
            8,
            build=TreeLSTMBuild(vocab, shapes=shapes),
            trace=trace,
            seed=5,
            num_replicas=replicas,
            rank=rank,
            num_workers=workers,
            multiprocessing_context="fork",
        ) as loader:
            return [{(m.position, tuple(m.indices)) for m in step} for step in loader]

    one = positions(1, 0)
    two = [a | b for a, b in zip(positions(2, 0), positions(2, 1), strict=True)]
    assert one == two
    assert positions(1, 0, workers=2) == one  # split in worker processes, the parts sent back
    assert sum(len(step) for step in one) > sum(size // 8 for size in trace)  # there were splits


def test_the_envelope_stays_flat_after_the_warm_up_over_a_variable_trace(
    sst: tuple[list[Tree], Vocab],
) -> None:
    trees, vocab = sst
    shapes = tree_lstm_shapes(
        trees, vocab, 10, seed=1
    )  # the CLI's fitting: a pass over the data, then frozen
    assert shapes.frozen and shapes.real_calls == 0
    version, layouts = shapes.version, {layout.key for layout in shapes._layouts.values()}
    trace = [10, 30, 50, 20, 40, 10, 50, 30] * 4  # two epochs of 400 trees, other permutations than the fit's
    loader = StepLoader(trees, 10, build=TreeLSTMBuild(vocab, shapes=shapes), trace=trace, seed=7)
    keys, ran, planned = set(), 0, 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaticShapesWarning)
        for _epoch in range(2):
            for step in loader:
                keys |= {minibatch.data[0].layout.key for minibatch in step}
                ran += len(step)
                planned += -(-step.batch_size // 10)
    assert ran > planned  # some minibatch did not fit the fitted envelope: it was split
    assert shapes.version == version
    assert keys <= layouts  # no new graph after the warm-up, whatever the step's size


def test_a_sample_that_does_not_fit_alone_grows_the_envelope_with_one_warning_naming_it(
    sst: tuple[list[Tree], Vocab],
) -> None:
    trees, vocab = sst
    by_size = sorted(trees, key=lambda tree: str(tree).count("("))  # nodes per tree
    small, deep = by_size[:20], by_size[-1]
    dataset = [*small[:7], deep]
    shapes = fit_static_shapes(small, TreeLSTMBuild(vocab), 2)
    version = shapes.version
    loader = StepLoader(dataset, 4, build=TreeLSTMBuild(vocab, shapes=shapes), trace=8, shuffle=False)
    with pytest.warns(StaticShapesWarning) as record:
        [step] = list(loader)
    named = [str(w.message) for w in record if issubclass(w.category, StaticShapesWarning)]
    assert len(named) == 1 and named[0].startswith("sample 7 of the dataset does not fit"), named
    assert shapes.version == version + 1 and shapes.frozen  # grown once, frozen again
    assert [m.indices for m in step][-1] == [7]  # the deep tree ran alone
    assert sum(m.num_samples for m in step) == 8


def test_a_frozen_envelope_refuses_to_grow_and_fits_says_so_without_changing_it() -> None:
    class Neg(torch.nn.Module):
        def leaf(self, x: torch.Tensor) -> torch.Tensor:
            return x.float().unsqueeze(1)

    def plan(n: int) -> Any:
        f = torchfold.Fold()
        return f.plan([[f.add("leaf", i) for i in range(n)]])

    shapes = StaticShapes(min_rows=4)
    shapes.cover(plan(3))
    shapes.freeze()
    state = pickle.dumps(shapes._snapshot())
    assert shapes.fits(plan(4)) and not shapes.fits(plan(9))
    with pytest.raises(StaticShapesOverflow, match="does not fit the frozen static shapes") as caught:
        shapes.cover(plan(9))
    assert caught.value.shapes is shapes
    assert pickle.dumps(shapes._snapshot()) == state  # nothing learned
    assert shapes.cover(plan(9), grow=True).capacities[0] >= 9  # asked for: grows
    assert shapes.frozen and shapes.version == 2


def test_fit_static_shapes_refuses_a_build_that_pads_already(sst: tuple[list[Tree], Vocab]) -> None:
    trees, vocab = sst
    with pytest.raises(
        TypeError, match=r"fit_static_shapes: build returned StaticPlan .* TreeLSTMBuild\(vocab\)"
    ):
        fit_static_shapes(trees[:4], TreeLSTMBuild(vocab, shapes=StaticShapes()), 2)
    with pytest.raises(ValueError, match="minibatch_size"):
        fit_static_shapes(trees[:4], TreeLSTMBuild(vocab), 0)


# fit_static_shapes leaves an envelope that every minibatch of its pass fits, frozen.


@pytest.mark.parametrize(("minibatch_size", "seed"), [(16, 0), (25, 0), (16, 1)])
def test_every_minibatch_of_the_fitting_pass_fits_the_frozen_envelope(
    data_dir: Path, minibatch_size: int, seed: int
) -> None:
    # Growing drops the layouts made before it: after a single pass, a minibatch fitted before
    # the last growth needs a layout the frozen envelope no longer has (on these trees, with
    # seed 0, two minibatches did), and training would split it for nothing.
    trees = load_sst(data_dir, "train", max_trees=400)
    build = TreeLSTMBuild(Vocab.build(trees))
    shapes = fit_static_shapes(trees, build, minibatch_size, seed=seed)
    order = np.random.default_rng(seed).permutation(len(trees))
    minibatches = [order[start : start + minibatch_size] for start in range(0, len(trees), minibatch_size)]
    plans = [build([trees[i] for i in m])[0] for m in minibatches]
    assert all(isinstance(plan, FoldPlan) for plan in plans)
    misfits = [i for i, plan in enumerate(plans) if not shapes.fits(plan)]  # type: ignore[arg-type]
    assert shapes.frozen and misfits == []
