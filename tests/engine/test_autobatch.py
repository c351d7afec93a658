"""autobatch: plain per-sample code, batched, equals running it on each sample alone (values and gradients)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torchfold
from tests.engine.test_fold import Chains, chains
from torchfold import FoldError, autobatch

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")),
]


class Model(torch.nn.Module):
    """Methods (batched by rows) and submodules, some shape-polymorphic."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.cell = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(4, 3)
        self.gain = torch.nn.Parameter(torch.tensor(1.5))

    def leaf(self, word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(word)
        return torch.tanh(x), torch.sigmoid(x)

    def node(self, h_left: torch.Tensor, h_right: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.cell(torch.cat([h_left, h_right], -1)))[:, :4]

    def scale(self, x: torch.Tensor) -> torch.Tensor:  # any width: calls of two widths batch apart
        return torch.tanh(x * self.gain)

    def walk(self, tree: Any, reads: list[int]) -> Any:
        """Plain recursion over a nested tuple of word ids, branching on a value it computed."""
        if isinstance(tree, int):
            h, c = self.leaf(torch.tensor([tree]))
            return h * c
        left = self.walk(tree[0], reads)
        right = left if tree[1] == "same" else self.walk(tree[1], reads)  # a DAG: one value read twice
        h = self.node(left, right)
        if tree[2]:  # read an intermediate value and branch on it
            choice = int(self.out(h).argmax().item())
            reads.append(choice)
            h = h + 1.0 if choice == 0 else h.sigmoid() - left
        return h


def program(model: Any, sample: tuple[Any, int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    tree, width = sample
    reads: list[int] = []
    h = model.walk(tree, reads)
    wide = model.scale(torch.linspace(-1.0, 1.0, width).unsqueeze(0))
    loss = torch.nn.functional.cross_entropy(model.out(h), torch.tensor([len(reads) % 3]))
    return loss + wide.sum() * 0.1, h, reads


@st.composite
def trees(draw: st.DrawFn, depth: int = 4) -> Any:
    if depth == 0 or draw(st.booleans()):
        return draw(st.integers(0, 9))
    left = draw(trees(depth - 1))
    right = "same" if draw(st.integers(0, 4)) == 0 else draw(trees(depth - 1))
    return (left, right, draw(st.booleans()))


def gradients(model: torch.nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    samples=st.lists(st.tuples(trees(), st.sampled_from([3, 5])), min_size=1, max_size=6),
    seed=st.integers(0, 9),
)
def test_equals_each_sample_run_alone(device: str, samples: list[Any], seed: int) -> None:
    torch.manual_seed(seed)
    model = Model()
    with torch.device(device):
        model.to(device)
        stats: dict[str, int] = {}
        batched = autobatch(program, samples, model, stats=stats)
        eager = [program(model, sample) for sample in samples]
    for (loss, h, reads), (loss_e, h_e, reads_e) in zip(batched, eager, strict=True):
        assert isinstance(loss, torch.Tensor) and isinstance(h, torch.Tensor)
        assert reads == reads_e  # the same branches taken
        torch.testing.assert_close(loss, loss_e)
        torch.testing.assert_close(h, h_e)
    got = gradients(model, torch.stack([out[0] for out in batched]).sum())
    want = gradients(model, torch.stack([out[0] for out in eager]).sum())
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert stats["alone"] == 0  # every call batched
    if len(samples) > 1:
        assert stats["batches"] < stats["calls"]


def test_independent_calls_of_one_sample_batch_together() -> None:
    # a balanced tree of 8 leaves: its leaves in one call, then 4 + 2 + 1 nodes: 4 op calls, not 15
    model = Model()
    tree = (((1, 2, False), (3, 4, False), False), ((5, 6, False), (7, 8, False), False), False)
    autobatch(
        lambda m, t: m.walk(t, []), [1], model
    )  # learns that leaf returns a pair (else unpacking waits once)
    stats: dict[str, int] = {}
    [h] = autobatch(lambda m, t: m.walk(t, []), [tree], model, stats=stats)
    torch.testing.assert_close(h, model.walk(tree, []))
    leaves = 1 + 1  # the leaf call, then h * c
    assert stats == {"calls": 8 + 8 + 7, "batches": leaves + 3, "alone": 0}


def test_shapes_that_differ_within_an_op_run_as_separate_batches() -> None:
    model = Model()
    samples = [1, 2, 3, 2, 1]
    stats: dict[str, int] = {}
    out = autobatch(lambda m, n: m.scale(torch.ones(1, n) * n), samples, model, stats=stats)
    for got, n in zip(out, samples, strict=True):
        torch.testing.assert_close(got, model.scale(torch.ones(1, n) * n))
    assert stats["batches"] == 3


def test_an_exception_in_a_sample_names_the_sample_and_its_last_op() -> None:
    def fn(model: Any, n: int) -> Any:
        h = model.scale(torch.ones(1, 2))
        if n == 2:
            raise ValueError("bad sample")
        return h

    with pytest.raises(ValueError, match="bad sample") as caught:
        autobatch(fn, [0, 1, 2, 3], Model())
    assert any("sample 2 of autobatch" in note and "Model.scale" in note for note in caught.value.__notes__)


def test_an_op_failing_for_one_sample_raises_its_own_error_naming_it() -> None:
    model = Model()

    def fn(model: Any, width: int) -> Any:
        return model.cell(torch.ones(1, width))  # Linear(8, 8): width 5 fails, alone too

    with pytest.raises(RuntimeError) as caught:
        autobatch(fn, [8, 8, 5, 8], model)
    assert any(
        "sample 2 of autobatch" in note and "Linear.forward" in note for note in caught.value.__notes__
    )


def test_a_method_that_does_not_keep_rows_runs_alone_with_one_warning() -> None:
    class Pool(torch.nn.Module):
        def pool(self, x: torch.Tensor) -> torch.Tensor:
            return x.sum(0, keepdim=True)  # mixes the rows of the calls batched together

    samples = [torch.randn(3, 2) for _ in range(4)]
    with pytest.warns(UserWarning, match=r"'Pool.pool' failed batched") as caught:
        out = autobatch(lambda m, x: m.pool(x) * 2, samples, Pool())
    assert len([w for w in caught if "Pool.pool" in str(w.message)]) == 1
    for got, x in zip(out, samples, strict=True):
        torch.testing.assert_close(got, x.sum(0, keepdim=True) * 2)


def test_an_argument_it_cannot_compare_runs_the_call_alone_with_one_warning() -> None:
    class Options(torch.nn.Module):
        def shift(self, x: torch.Tensor, options: set[str]) -> torch.Tensor:
            return x + len(options)

    stats: dict[str, int] = {}
    with pytest.warns(UserWarning, match=r"'Options.shift' with an argument of type set") as caught:
        out = autobatch(lambda m, n: m.shift(torch.ones(1, 2) * n, {"a"}), [1, 2, 3], Options(), stats=stats)
    assert len(caught) == 1
    assert stats["alone"] == 3
    for got, n in zip(out, [1, 2, 3], strict=True):
        torch.testing.assert_close(got, torch.ones(1, 2) * n + 1)


def test_in_place_changes_of_a_pending_value_are_refused() -> None:
    with pytest.raises(
        FoldError, match=r"'add_' changes a pending value in place .* use the out-of-place form \('add'\)"
    ):
        autobatch(lambda m, n: m.scale(torch.ones(1, 2)).add_(1), [1, 2], Model())


def test_state_set_on_the_model_is_refused() -> None:
    def fn(model: Any, n: int) -> Any:
        model.last = n

    with pytest.raises(FoldError, match="setting 'last' on the model inside autobatch"):
        autobatch(fn, [1], Model())


def test_a_pending_value_kept_past_the_run_says_so() -> None:
    kept: list[Any] = []

    def fn(model: Any, n: int) -> Any:
        h = model.scale(torch.ones(1, 2))
        kept.append(h)
        return h

    autobatch(fn, [1], Model())
    with pytest.raises(FoldError, match="used outside autobatch"):
        kept[0] + 1


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ((1, [1], torch.nn.Linear(1, 1)), "autobatch\\(fn=...\\) must be callable, got 1"),
        ((len, [1], "model"), "autobatch\\(model=...\\) must be a torch.nn.Module, got str"),
    ],
)
def test_bad_arguments(args: tuple[Any, ...], error: str) -> None:
    with pytest.raises(TypeError, match=error):
        autobatch(*args)


def test_root_exports_it() -> None:
    assert torchfold.autobatch is autobatch
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert autobatch(lambda m, x: x, [], torch.nn.Module()) == []


@pytest.mark.parametrize("schedule", ["depth", "ready"])
def test_readiness_batches_an_op_across_depths_as_a_ready_fold_does(schedule: str) -> None:
    # sample 0: a -> b -> a; sample 1: b -> a. Fold groups by (depth, op): a@0, b@0, b@1, a@1, a@2 = 5
    # calls. Readiness: a (sample 0), then b of both (depths 0 and 1), then a of both: 3.
    programs = ["aba", "ba"]
    model = Chains()

    def run(model: Any, program: str) -> Any:
        x = torch.ones(1, 2)
        for op in program:
            x = getattr(model, op)(x)
        return x

    fold = torchfold.Fold(schedule=schedule)
    roots = chains(fold, programs)
    plan = fold.plan([roots])
    assert isinstance(plan, torchfold.FoldPlan)
    stats: dict[str, int] = {}
    out = autobatch(run, programs, model, stats=stats)
    torch.testing.assert_close(torch.cat(out), plan.apply(model)[0])
    assert (stats["batches"], len(plan.groups)) == (3, 5 if schedule == "depth" else 3)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(1, 3), min_size=1, max_size=4),  # the rows of each value the sample makes
            st.lists(st.integers(0, 5), min_size=1, max_size=6),  # which of them it concatenates, in order
            st.booleans(),  # and a tensor of its own code among them
            st.sampled_from([(), (0,)]),  # torch.cat(values) or torch.cat(values, 0)
            st.booleans(),  # (or dim=0 by name)
        ),
        min_size=1,
        max_size=5,
    )
)
def test_concatenating_any_number_of_values_batches_across_samples(samples: list[Any]) -> None:
    # torch.cat(values) along dim 0 (named or not): one batched call for all samples, whatever their
    # counts, rows and order (a value read twice, out of order, or a tensor the sample made);
    # gradients equal eager's
    model = Model()

    def fn(model: Any, sample: Any) -> Any:
        rows, picks, own, dim, by_name = sample
        # (every row of every value distinct: a row read from the wrong place shows)
        values = [
            model.scale(torch.arange(2.0 * n).reshape(n, 2) * 0.1 + 0.01 * k) for k, n in enumerate(rows)
        ]
        chosen = [values[p % len(values)] for p in picks]
        if own:
            chosen.insert(len(chosen) // 2, torch.linspace(0.0, 1.0, 2).unsqueeze(0))
        return torch.cat(chosen, dim=0) if by_name else torch.cat(chosen, *dim)

    stats: dict[str, int] = {}
    out = autobatch(fn, samples, model, stats=stats)
    eager = [fn(model, sample) for sample in samples]
    for got, want in zip(out, eager, strict=True):
        torch.testing.assert_close(got, want)
    weights = [torch.arange(float(w.numel())).reshape(w.shape) for w in eager]  # every row weighed apart
    got = gradients(model, sum((o * w).sum() for o, w in zip(out, weights, strict=True)))
    want = gradients(model, sum((e * w).sum() for e, w in zip(eager, weights, strict=True)))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    widths = len({n for rows, *_ in samples for n in rows})
    assert stats["batches"] == widths + 1  # scale once per number of rows; then every cat at once


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 4), st.integers(0, 4)), min_size=2, max_size=6))
def test_arguments_read_from_any_output_of_any_earlier_result_equal_eager(samples: list[Any]) -> None:
    # Each sample passes two of five values: the two outputs of one batched call (h, c), and
    # results of other calls with as many rows (scale(h), scale(scale(h)), tanh(c)). Where the
    # rows read line up with the calls, they must still come from the value each sample chose
    # (and from a value with as many rows as there are calls).
    model = Model()

    def fn(model: Any, sample: Any) -> Any:
        word, first, second = sample
        h, c = model.leaf(torch.tensor([word]))
        g = model.scale(h)
        values = [h, c, g, model.scale(g), torch.tanh(c)]
        if word % 3 == 0:  # (some samples make no node call: fewer calls than the values have rows)
            return values[first] * 2.0
        return model.node(values[first], values[second])

    stats: dict[str, int] = {}
    out = autobatch(fn, samples, model, stats=stats)
    assert stats["alone"] == 0  # every call batched
    eager = [fn(model, sample) for sample in samples]
    for got, want in zip(out, eager, strict=True):
        torch.testing.assert_close(got, want)
    got = gradients(model, torch.stack(out).sum())
    want = gradients(model, torch.stack(eager).sum())
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_a_method_that_changes_its_arguments_in_place_runs_batched() -> None:
    # Arguments of one kind are gathered together: each must still be a tensor the op may change
    # in place (views of one split may not be), as eager's own tensors may.
    class InPlace(Model):
        def pair(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.relu_(a * 1.0 + 0.0) + torch.nn.functional.relu(b, inplace=True) * 0.0 + a.tanh_()

    model = InPlace()

    def fn(model: Any, words: tuple[int, int]) -> Any:
        x = model.scale(torch.full((1, 4), float(words[0])) - 2.0)
        y = model.scale(torch.full((1, 4), float(words[1])) - 2.0)
        return model.pair(x * 1.0, y * 1.0)

    samples = [(0, 1), (3, 2), (4, 4)]
    stats: dict[str, int] = {}
    out = autobatch(fn, samples, model, stats=stats)
    assert stats["alone"] == 0
    for got, sample in zip(out, samples, strict=True):
        torch.testing.assert_close(got, fn(model, sample))
