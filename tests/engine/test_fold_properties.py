"""Property tests: on random graphs, Fold gives the outputs and gradients of eager PyTorch.

Each example is a random program of ``add`` calls over a small model: embedding leaves,
tensor inputs mixed with nodes at one position, a two-output op taken apart with ``split``,
a three-input op, float arguments, an op with a ``nobatch`` shared context, and repeated
identical calls (deduplicated by Fold, recomputed by EagerFold). The same program runs on a
Fold and on the eager EagerFold; outputs and gradients of every parameter and input tensor
must match, whichever way the fold groups its calls (by depth or by readiness). Each also runs through a compiled plan (``Fold.plan``): applied once, applied a
second time, or applied after a pickle round trip (as when built in a DataLoader worker).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torchfold.engine.executor
import torchfold.engine.planner
from torchfold import EagerFold, Fold, FoldPlan
from torchfold.engine import native
from torchfold.engine.readiness import SCHEDULES

HIDDEN = 5
VIA = ("apply", "plan", "plan twice", "pickled plan")
KINDS = ("leaf", "lift", "pair", "combine", "attend", "scale", "repeat", "twin", "pool")


class Zoo(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(11, HIDDEN, generator=generator))
        self.w_lift = torch.nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=generator) / 3)
        self.w_pair = torch.nn.Parameter(torch.randn(2 * HIDDEN, 2 * HIDDEN, generator=generator) / 3)
        self.memory = torch.nn.Parameter(torch.randn(1, HIDDEN, generator=generator))

    def leaf(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed[ids]

    def context(self, ids: torch.Tensor) -> torch.Tensor:
        return self.memory * ids.float().unsqueeze(1)

    def lift(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w_lift)

    def pair(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.cat([a, b], 1) @ self.w_pair
        return torch.tanh(h[:, :HIDDEN]), torch.sigmoid(h[:, HIDDEN:])

    def combine(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return a * b + c

    def attend(self, x: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        assert shared.shape == (1, HIDDEN)
        return x * torch.tanh(shared)

    def scale(self, x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        return x * factor.unsqueeze(1)

    def twin(self, x: torch.Tensor) -> torch.Tensor:
        """Two rows per call: each call owns a block of 2 rows of the batched result."""
        return torch.stack([x, torch.tanh(x @ self.w_lift)], 1).reshape(-1, HIDDEN)

    def pool(self, pair: torch.Tensor) -> torch.Tensor:
        """Reads 2-row blocks (one per call) and gives one row per call back."""
        return pair.reshape(-1, 2, HIDDEN).prod(1)


instruction = st.tuples(
    st.sampled_from(KINDS),
    st.integers(0, 1000),
    st.integers(0, 1000),
    st.integers(0, 1000),
    st.booleans(),
    st.sampled_from([0.5, -1.0, 2.0, 0.0, -0.0]),  # (the signs of zero: two calls)
)


def run_program(fold: Any, program: list[tuple[Any, ...]], inputs: list[torch.Tensor]) -> list[Any]:
    """Interpret ``program`` on ``fold`` (a Fold or an EagerFold); returns the values it made."""
    fold.add("context", 1)  # so the shared value is one row block of a batched call, not all of it
    shared = fold.add("context", 2).nobatch()
    values: list[Any] = []
    twins: list[Any] = []  # values of 2 rows per call, read only by `pool`
    history: list[tuple[str, tuple[Any, ...]]] = []

    def pick(i: int) -> Any:
        return values[i % len(values)]

    for kind, i, j, k, flag, factor in program:
        if not values or kind == "leaf":
            call: tuple[str, tuple[Any, ...]] = ("leaf", (i % 11,))
        elif kind == "repeat":
            call = history[i % len(history)]
        elif kind == "lift":  # a position that mixes given tensors and nodes across the group
            call = ("lift", (inputs[j % len(inputs)] if flag else pick(j),))
        elif kind == "pair":
            call = ("pair", (pick(i), pick(j)))
        elif kind == "combine":
            call = ("combine", (pick(i), pick(j), pick(k)))
        elif kind == "twin":
            call = ("twin", (pick(i),))
        elif kind == "pool":
            call = ("pool", (twins[j % len(twins)],)) if twins else ("twin", (pick(i),))
        elif kind == "attend":
            call = ("attend", (pick(i), shared))
        else:
            call = ("scale", (pick(i), factor))
        history.append(call)
        op, args = call
        node = fold.add(op, *args)
        if op == "twin":
            twins.append(node)
        else:
            values.extend(node.split(2) if op == "pair" else [node])
    return values


def requested(values: list[Any], picks: list[int]) -> list[list[Any]]:
    chosen = [values[p % len(values)] for p in picks] or values
    half = max(1, len(chosen) // 2)
    return [chosen[:half], chosen[half:]] if len(chosen) > 1 else [chosen]


def run_fold(fold: Any, model: torch.nn.Module, requests: list[list[Any]], via: str) -> list[torch.Tensor]:
    """``fold.apply``, or the same through a compiled plan: applied once, twice, or after a pickle round trip."""
    if via == "apply" or isinstance(fold, EagerFold):
        return list(fold.apply(model, requests))
    plan = fold.plan(requests)
    if via == "plan twice":
        plan.apply(model)
    if via == "pickled plan":
        plan = pickle.loads(pickle.dumps(plan))
    return list(plan.apply(model))


def outputs_and_gradients(
    make: Any, program: list[tuple[Any, ...]], picks: list[int], via: str = "apply"
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    model = Zoo()
    generator = torch.Generator().manual_seed(1)
    # A plan shipped to another process holds copies of the tensors given to add: it refuses ones
    # that require grad (no gradient could reach them), so the pickled runs use plain inputs.
    shipped = via == "pickled plan"
    inputs = [torch.randn(1, HIDDEN, generator=generator, requires_grad=not shipped) for _ in range(3)]
    fold = make(model)
    outs = run_fold(fold, model, requested(run_program(fold, program, inputs), picks), via)
    weights = [torch.randn(out.shape, generator=generator) for out in outs]
    loss = sum((out * w).sum() for out, w in zip(outs, weights, strict=True))
    tensors = [*model.parameters(), *([] if shipped else inputs)]
    grads = torch.autograd.grad(loss, tensors, allow_unused=True)
    return outs, [torch.zeros_like(t) if g is None else g for t, g in zip(tensors, grads, strict=True)]


#: how the planner plans a group of nodes: in C (as built), in Python lists (a few calls, as
#: without the C part), or as whole numpy arrays (large groups, without the C part)
PLANNERS = ("C", "lists", "arrays")


@contextmanager
def compaction(always: bool, planner: str = "C") -> Iterator[None]:
    """Force the engine to gather partly used sources on their own (the path big models take),
    and plan groups of nodes the way ``planner`` says (see ``PLANNERS``: but for ``"C"``, the C
    part is off, and the fold records in Python too)."""
    saved, small = torchfold.engine.executor.COMPACT_BYTES, torchfold.engine.planner._SMALL
    torchfold.engine.executor.COMPACT_BYTES = -1 if always else saved
    torchfold.engine.planner._SMALL = 0 if planner == "arrays" else small
    try:
        with native.use(native.enabled() and planner == "C"):
            yield
    finally:
        torchfold.engine.executor.COMPACT_BYTES = saved
        torchfold.engine.planner._SMALL = small


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    program=st.lists(instruction, min_size=1, max_size=30),
    picks=st.lists(st.integers(0, 1000), max_size=12),
    compact=st.booleans(),
    via=st.sampled_from(VIA),
    planner=st.sampled_from(PLANNERS),
    schedule=st.sampled_from(SCHEDULES),
)
def test_fold_equals_eager_on_random_graphs(
    program: list[tuple[Any, ...]], picks: list[int], compact: bool, via: str, planner: str, schedule: str
) -> None:
    with compaction(compact, planner):
        folded, fold_grads = outputs_and_gradients(lambda model: Fold(schedule=schedule), program, picks, via)
    eager, eager_grads = outputs_and_gradients(EagerFold, program, picks)
    assert len(folded) == len(eager)
    for a, b in zip(folded, eager, strict=True):
        torch.testing.assert_close(a, b)
    if via == "pickled plan":  # its inputs do not require grad: compare the parameters' gradients
        eager_grads = eager_grads[: len(fold_grads)]
    for a, b in zip(fold_grads, eager_grads, strict=True):
        torch.testing.assert_close(a, b)


@settings(max_examples=100, deadline=None)
@given(
    program=st.lists(instruction, min_size=1, max_size=40), picks=st.lists(st.integers(0, 1000), max_size=12)
)
def test_readiness_never_makes_more_batched_calls_than_depth(
    program: list[tuple[Any, ...]], picks: list[int]
) -> None:
    # Each wave runs every remaining call of its op's shallowest depth (all ready: shallower calls
    # have run), so each wave ends a distinct (op, depth) group: never more waves than groups.
    inputs = [torch.randn(1, HIDDEN) for _ in range(3)]
    plans = []
    for schedule in SCHEDULES:
        fold = Fold(schedule=schedule)
        plan = fold.plan(requested(run_program(fold, program, inputs), picks))
        assert isinstance(plan, FoldPlan)
        plans.append(plan)
    by_depth, by_readiness = plans
    assert len(by_readiness.groups) <= len(by_depth.groups)


@st.composite
def forests(draw: Any) -> list[Any]:
    """Random binary trees as nested tuples of word ids (leaves are ints)."""

    def tree(depth: int) -> Any:
        if depth == 0 or draw(st.booleans()):
            return draw(st.integers(0, 10))
        return (tree(depth - 1), tree(depth - 1))

    return [tree(draw(st.integers(0, 6))) for _ in range(draw(st.integers(1, 6)))]


def encode(fold: Any, tree: Any, states: list[Any]) -> Any:
    if isinstance(tree, int):
        node = fold.add("leaf", tree)
    else:
        h, c = fold.add("pair", encode(fold, tree[0], states), encode(fold, tree[1], states)).split(2)
        node = fold.add("combine", h, c, h)
    states.append(node)
    return node


def forest_outputs_and_gradients(
    make: Any, trees: list[Any], via: str = "apply"
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor | None, ...]]:
    """Every root's and node's value of ``trees`` recorded on ``make(model)``, and the parameters' gradients."""
    model = Zoo()
    fold = make(model)
    states: list[Any] = []
    roots = [encode(fold, t, states) for t in trees]
    roots_out, states_out = run_fold(fold, model, [roots, states], via)
    loss = roots_out.pow(2).sum() + states_out.sin().sum()
    return roots_out, states_out, torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)


@settings(max_examples=60, deadline=None)
@given(trees=forests(), compact=st.booleans(), via=st.sampled_from(VIA), planner=st.sampled_from(PLANNERS))
def test_fold_equals_eager_on_random_tree_forests(
    trees: list[Any], compact: bool, via: str, planner: str
) -> None:
    with compaction(compact, planner):
        r1, s1, g1 = forest_outputs_and_gradients(lambda model: Fold(), trees, via)
    r2, s2, g2 = forest_outputs_and_gradients(EagerFold, trees)
    torch.testing.assert_close(r1, r2)
    torch.testing.assert_close(s1, s2)
    for a, b in zip(g1, g2, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b)
