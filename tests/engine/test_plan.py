"""Plans (``Fold.plan``): built in DataLoader worker processes, applied in the trainer."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import torchfold
import torchfold._deprecation
import torchfold.engine.executor
import torchfold.engine.planner
from torchfold import Fold, FoldError, FoldPlan
from torchfold.examples.datasets import Tree, Vocab, generate_sst
from torchfold.examples.models import TreeLSTM, encode_trees

TREES = generate_sst(24, seed=3)
VOCAB = Vocab.build(TREES)


def build_plan(trees: list[Tree]) -> tuple[FoldPlan, torch.Tensor]:
    """A DataLoader ``collate_fn``: record the batch on a fold and ship its plan and labels."""
    fold = Fold()
    nodes, labels, _ = encode_trees(fold, trees, VOCAB)
    return fold.plan([nodes]), torch.tensor(labels)


def loss_and_grads(
    model: TreeLSTM, states: torch.Tensor, labels: torch.Tensor
) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model.logits(states), labels)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_plans_built_in_dataloader_workers_equal_inline_apply() -> None:
    torch.manual_seed(0)
    model = TreeLSTM(len(VOCAB), 8, 12)
    loader = DataLoader(TREES, batch_size=5, collate_fn=build_plan, num_workers=2)
    batches = 0
    for (plan, labels), start in zip(loader, range(0, len(TREES), 5), strict=True):
        (states,) = plan.apply(model)
        shipped = loss_and_grads(model, states, labels)
        fold = Fold()
        nodes, inline_labels, _ = encode_trees(fold, TREES[start : start + 5], VOCAB)
        (inline_states,) = fold.apply(model, [nodes])
        inline = loss_and_grads(model, inline_states, torch.tensor(inline_labels))
        torch.testing.assert_close(states, inline_states)
        assert shipped[0] == pytest.approx(inline[0], rel=1e-6)
        for a, b in zip(shipped[1], inline[1], strict=True):
            torch.testing.assert_close(a, b)
        batches += 1
    assert batches == 5


def test_a_plan_reapplied_follows_the_current_weights() -> None:
    model = TreeLSTM(len(VOCAB), 4, 6)
    plan, _ = build_plan(TREES[:3])
    (before,) = plan.apply(model)
    with torch.no_grad():
        model.node_gates.weight.mul_(2)
    (after,) = plan.apply(model)
    fold = Fold()
    nodes, _, _ = encode_trees(fold, TREES[:3], VOCAB)
    torch.testing.assert_close(after, fold.apply(model, [nodes])[0])
    assert not torch.allclose(before, after)


def test_plan_checks_the_graph_before_any_op_runs() -> None:
    fold = Fold()
    a = fold.add("merge", fold.add("leaf", 1), 2)
    b = fold.add("merge", 3, fold.add("leaf", 2))
    with pytest.raises(
        FoldError, match=r"op 'merge' at depth \d, argument 0: ints and nodes/tensors are mixed"
    ):
        fold.plan([[a, b]])
    with pytest.raises(FoldError, match="empty request"):
        fold.plan([])


def test_plan_runs_on_the_module_given_at_apply_and_names_unknown_ops() -> None:
    fold = Fold()
    plan = fold.plan([[fold.add("lef", 1)]])
    with pytest.raises(FoldError, match=r"unknown op 'lef' at depth 0 .*Node\('lef', depth=0, index=0\)"):
        plan.apply(TreeLSTM(5, 4, 4))


def test_plan_repr_len_and_pickle_size() -> None:
    plan, _ = build_plan(TREES[:4])
    fold = Fold()
    encode_trees(fold, TREES[:4], VOCAB)
    assert len(plan) == len(fold)
    assert repr(plan) == f"FoldPlan({len(fold.groups())} groups, {len(fold)} nodes, 1 request)"
    # no nodes inside: the pickle is index arrays, a few hundred bytes per group
    assert len(pickle.dumps(plan)) < 2000 * len(fold.groups())


def test_volatile_fold_plans_run_without_autograd() -> None:
    with pytest.warns(DeprecationWarning):
        fold = torchfold.Fold(volatile=True)
    nodes, _, _ = encode_trees(fold, TREES[:2], VOCAB)
    (states,) = fold.plan([nodes]).apply(TreeLSTM(len(VOCAB), 4, 4))
    assert not states.requires_grad


class Lookup(torch.nn.Module):
    """Ops reading ints: one clamps them, one returns them (its output is the plan's ints, unless copied)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.arange(24.0).reshape(8, 3))

    def clamped(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids.clamp(max=5)]

    def ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    def scale(self, rows: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        return rows * factor


def test_a_plan_is_not_changed_by_changing_its_outputs() -> None:
    """(An op changing its own arguments in place is refused: see test_fold.)"""
    model, fold = Lookup(), Fold()
    plan = fold.plan(
        [[fold.add("clamped", 7), fold.add("clamped", 1)], [fold.add("ids", 7), fold.add("ids", 2)]]
    )
    first_rows, first_ids = plan.apply(model)
    first_ids[0] = 99
    again_rows, again_ids = plan.apply(model)
    torch.testing.assert_close(again_rows, first_rows)
    assert again_ids.tolist() == [7, 2]


def test_pickling_refuses_what_would_cut_gradients_off() -> None:
    model = Lookup()
    fold = Fold()
    bound = fold.plan([[fold.add(model.ids, 1), fold.add(model.ids, 2)]])
    bound.apply(model)  # fine in this process
    with pytest.raises(
        FoldError, match=r"op 'Lookup.ids' at depth 0 is a method bound to a Lookup: .*fold.add\('ids'"
    ):
        pickle.dumps(bound)
    weight = torch.ones(1, 3, requires_grad=True)
    fold = Fold()
    rows = [fold.add("clamped", i) for i in (1, 2)]
    plan = fold.plan([[fold.add("scale", row, weight) for row in rows]])
    with pytest.raises(
        FoldError, match=r"op 'scale' at depth 1, argument 1: a tensor given to add requires grad"
    ):
        pickle.dumps(plan)


def test_a_pickled_plan_carries_only_the_rows_given_to_add() -> None:
    images = torch.randn(10_000, 784)  # 31 MB; the fold reads 4 rows of it
    fold = Fold()
    nodes = [fold.add("classify", images[i : i + 1]) for i in range(4)]
    plan = fold.plan([nodes])
    shipped = pickle.loads(pickle.dumps(plan))
    assert len(pickle.dumps(plan)) < 100_000
    model = torchfold.examples.models.MLP()
    torch.testing.assert_close(shipped.apply(model)[0], model(images[:4]))
    assert plan.groups[0].fixed[0][1].value[0].untyped_storage().nbytes() == images.untyped_storage().nbytes()


class Empty(torch.nn.Module):
    """Ops whose calls own no rows at all."""

    def none(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(0, 3)


def test_calls_owning_no_rows_are_refused() -> None:
    """0 rows for 3 calls would be read as 0 rows per call: requests would silently come back empty."""
    fold = Fold()
    nodes = [fold.add("none", i) for i in (1, 2, 3)]
    with pytest.raises(
        FoldError, match=r"op 'none' at depth 0 ran 3 calls batched and returned shape \(0, 3\)"
    ):
        fold.apply(Empty(), [nodes])


def test_applying_a_plan_leaves_it_unchanged_even_from_two_threads() -> None:
    """A compiled plan is a value: workers ship it, several threads may apply it at once."""
    model = TreeLSTM(len(VOCAB), 4, 6)
    plan, _ = build_plan(TREES[:6])
    before = pickle.dumps(plan)
    (expected,) = plan.apply(model)
    results: list[torch.Tensor] = []
    threads = [threading.Thread(target=lambda: results.extend(plan.apply(model))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 2
    for got in results:
        torch.testing.assert_close(got, expected)
    assert pickle.dumps(plan) == before


# -- deprecated names: a plan's groups were its "steps", planning was "compiling" -----------------


def test_plan_steps_is_a_deprecated_alias_of_groups() -> None:
    plan, _ = build_plan(TREES[:3])
    assert isinstance(plan, FoldPlan) and plan.groups
    with pytest.warns(FutureWarning, match=r"PlanData\.steps .* use \.groups"):
        steps = plan.steps
    assert steps is plan.groups


class _PickledBeforeTheRename:
    """Pickles as a FoldPlan written when ``PlanData`` held ``steps``: the same reduce, the old state."""

    def __init__(self, plan: FoldPlan) -> None:
        state = plan.__getstate__()
        self.state = {("steps" if key == "groups" else key): value for key, value in state.items()}

    def __reduce__(self) -> tuple[object, ...]:
        return (object.__new__, (FoldPlan,), self.state)


def test_a_plan_pickled_with_its_groups_named_steps_still_loads_and_runs() -> None:
    torch.manual_seed(0)
    model = TreeLSTM(len(VOCAB), 8, 8)
    plan, _ = build_plan(TREES[:4])
    old = pickle.dumps(_PickledBeforeTheRename(plan))
    assert b"steps" in old and b"groups" not in old
    loaded = pickle.loads(old)
    assert isinstance(loaded, FoldPlan) and "steps" not in vars(loaded)
    assert [(g.op, g.depth, g.num_calls) for g in loaded.groups] == [
        (g.op, g.depth, g.num_calls) for g in plan.groups
    ]
    torch.testing.assert_close(loaded.apply(model)[0], plan.apply(model)[0])
