"""Fitting a static-shape envelope to a dataset before training, so that it never grows during it.

:func:`fit_static_shapes` fits a :class:`~torchfold.StaticShapes` envelope to the plans of a
seeded pass of minibatches over the dataset (what training will see: random minibatches of the
same size), refitted until a pass no longer grows it, then resets its counters and freezes it. Give it to the loader's ``build``: a
:class:`~torchfold.train.StepLoader` splits a minibatch whose plan still does not fit into
smaller minibatches that do, and the optimizer weighs each by its samples, so the step is
exactly the same and the set of compiled programs stays the one of the warm-up. Only a sample
that does not fit alone grows the envelope, with one :class:`~torchfold.StaticShapesWarning`
naming it (see ``docs/design/envelope.md``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from torchfold._validate import check_int
from torchfold.engine.ir import PlanData
from torchfold.engine.static.shapes import StaticPlan, StaticShapes, StaticShapesWarning

__all__ = ["fit_static_shapes", "seeded_pass"]

T = TypeVar("T")


def seeded_pass(
    length: int, minibatch_size: int, seed: int, max_minibatches: int | None = None
) -> list[list[int]]:
    """The minibatches (dataset indices) of a pass over a dataset of ``length`` samples: a seeded
    permutation cut into ``minibatch_size`` samples (the last one short), at most
    ``max_minibatches`` of them; what :func:`fit_static_shapes` fits the envelope to, and what
    ``StepLoader.layout_examples`` builds its examples from.

    >>> seeded_pass(5, 2, seed=0)
    [[2, 4], [3, 0], [1]]
    """
    order = np.random.default_rng(seed).permutation(length).tolist()
    starts = range(0, length, minibatch_size)
    if max_minibatches is not None:
        starts = starts[:max_minibatches]
    return [order[start : start + minibatch_size] for start in starts]


def fit_static_shapes(
    dataset: Sequence[T],
    build: Callable[[list[T]], Any],
    minibatch_size: int,
    *,
    shapes: StaticShapes | None = None,
    max_minibatches: int | None = None,
    seed: int = 0,
    freeze: bool = True,
) -> StaticShapes:
    """Fit an envelope to the plans of a pass of minibatches over ``dataset``, then freeze it.

    The pass is a seeded permutation of the dataset cut into minibatches of ``minibatch_size``
    samples (the last one short), as training draws them. Their plans are fitted again until a
    pass no longer grows the envelope, so that every one of them fits the frozen envelope (growth
    drops the layouts made before it). Fitting runs on the host (no tensor operation), a few
    milliseconds per minibatch and pass.

    Args:
        dataset: the samples (indexable, with ``len()``), e.g. a list of trees.
        build: ``build(items)`` returning an unpadded :class:`~torchfold.FoldPlan` (or a tuple
            whose first element is one), e.g. the loader's build made without ``shapes``.
        minibatch_size: samples per minibatch: the loader's ``batch_size`` (or its
            ``max_device_batch_size``, the largest minibatch it makes).
        shapes: the envelope to fit (default: a new ``StaticShapes()``).
        max_minibatches: fit at most this many minibatches of the pass (default: all of them).
        seed: the permutation's seed.
        freeze: freeze the envelope after fitting (default ``True``): it then never grows by
            itself; :class:`~torchfold.train.StepLoader` splits what does not fit.

    Returns:
        ``shapes``, fitted, with its counters reset (its :attr:`~torchfold.StaticShapes.waste`
        is then the training run's).

    Example:
        >>> import torchfold
        >>> from torchfold.examples.datasets import Vocab, generate_sst
        >>> from torchfold.examples.models import TreeLSTMBuild
        >>> trees = generate_sst(40, seed=0)
        >>> vocab = Vocab.build(trees)
        >>> shapes = fit_static_shapes(trees, TreeLSTMBuild(vocab), 8)
        >>> shapes.frozen, shapes.plans, shapes.real_calls  # 5 minibatches, 2 passes (the second grew nothing)
        (True, 10, 0)
        >>> loader_build = TreeLSTMBuild(vocab, shapes=shapes)  # plans padded into it, never growing
    """
    if len(dataset) == 0:
        raise ValueError("fit_static_shapes: the dataset is empty; give it the samples training will see")
    check_int("fit_static_shapes(minibatch_size)", minibatch_size)
    if max_minibatches is not None:
        check_int("fit_static_shapes(max_minibatches)", max_minibatches)
    if shapes is None:
        shapes = StaticShapes()
    elif not isinstance(shapes, StaticShapes):
        raise TypeError(
            f"fit_static_shapes(shapes=...) must be a torchfold.StaticShapes, got {type(shapes).__name__}"
        )
    plans = []
    for indices in seeded_pass(len(dataset), minibatch_size, seed, max_minibatches):
        built = build([dataset[i] for i in indices])
        plan = built[0] if isinstance(built, tuple) and built else built
        if isinstance(plan, StaticPlan) or not isinstance(plan, PlanData):
            raise TypeError(
                f"fit_static_shapes: build returned {type(plan).__name__} for dataset indices {indices[:8]}; it "
                "must return an unpadded FoldPlan (or a tuple starting with one): make it without shapes, e.g. "
                "TreeLSTMBuild(vocab), not TreeLSTMBuild(vocab, shapes=...)"
            )
        plans.append(plan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StaticShapesWarning)  # all of this is the warm-up: growing is its job
        # Until a pass no longer grows the envelope: growing drops the layouts made before it, so
        # after one pass a minibatch fitted before the last growth may need a layout the frozen
        # envelope no longer has (and be split in training). A pass that grows nothing has made the
        # layout of every minibatch at the final size. The envelope only grows, so this ends.
        grew = True
        while grew:
            version = shapes.version
            for plan in plans:
                shapes.cover(plan, grow=True)
            grew = shapes.version != version
    shapes.reset_counters()
    if freeze:
        shapes.freeze()
    return shapes
