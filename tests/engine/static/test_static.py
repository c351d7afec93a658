"""Static shapes: plans padded into a StaticShapes envelope equal eager PyTorch, and repeat their graphs.

The property tests run random programs (the zoo of ``test_fold_properties``: split outputs,
``nobatch`` context, floats, blocks of 2 rows per call, repeated calls) and random tree
forests through one envelope shared by several examples, so most plans are padded into an
envelope grown by others; outputs and gradients must equal the eager ``EagerFold``. That a
graph repeats is checked on the CPU by recording every aten op and its shapes: two batches
fitted to one envelope version must run the very same sequence.
"""

from __future__ import annotations

import pickle
import warnings
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import torchfold
from tests.engine.test_fold_properties import (
    Zoo,
    encode,
    forest_outputs_and_gradients,
    forests,
    instruction,
    requested,
    run_program,
)
from torchfold import (
    EagerFold,
    Fold,
    FoldError,
    StaticPlan,
    StaticShapes,
    StaticShapesOverflow,
    StaticShapesWarning,
)
from torchfold.engine.static import envelope_for
from torchfold.examples.datasets import Vocab, load_sst
from torchfold.examples.models import TreeLSTM, encode_trees


def _no_mixed_positions(program: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Static shapes refuse a position mixing given tensors and nodes (tested below): lift nodes only."""
    return [(kind, i, j, k, False if kind == "lift" else flag, f) for kind, i, j, k, flag, f in program]


def _outputs_and_grads(
    make: Any, program: list[tuple[Any, ...]], picks: list[int], via: str
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    model = Zoo()
    fold = make(model)
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(1, 5, generator=generator) for _ in range(3)]
    requests = requested(run_program(fold, program, inputs), picks)
    if isinstance(fold, EagerFold):
        outs = list(fold.apply(model, requests))
    else:
        plan = fold.plan(requests)
        assert isinstance(plan, StaticPlan)
        if via == "pickled":
            plan = pickle.loads(pickle.dumps(plan))
        if via == "layout":  # the pure runner on the plan's inputs is what apply runs
            padded = plan.layout.run(model, plan.inputs())
            for a, b in zip(padded, plan.apply(model, padded=True), strict=True):
                assert a.shape == b.shape
                torch.testing.assert_close(a, b)
            outs = plan.unpad(padded)
        elif via == "padded":
            padded = plan.apply(model, padded=True)
            for out, size, capacity in zip(padded, plan.sizes, plan.capacities, strict=True):
                assert out.shape[0] % capacity == 0 and capacity >= size
            rows = [out.shape[0] // capacity for out, capacity in zip(padded, plan.capacities, strict=True)]
            outs = [out[: size * k] for out, size, k in zip(padded, plan.sizes, rows, strict=True)]
        else:
            outs = plan.apply(model)
    weights = [torch.randn(out.shape, generator=torch.Generator().manual_seed(2)) for out in outs]
    loss = sum((out * w).sum() for out, w in zip(outs, weights, strict=True))
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    return outs, [
        torch.zeros_like(p) if g is None else g for p, g in zip(model.parameters(), grads, strict=True)
    ]


# One envelope for every example: most plans are fitted into an envelope that others grew.
SHARED = StaticShapes(min_rows=2, level_step=3, warmup=10**9)  # growing is what it is for here


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    program=st.lists(instruction, min_size=1, max_size=30),
    picks=st.lists(st.integers(0, 1000), max_size=12),
    via=st.sampled_from(["apply", "pickled", "padded", "layout"]),
    shared=st.booleans(),
)
def test_padded_plans_equal_eager_on_random_graphs(
    program: list[tuple[Any, ...]], picks: list[int], via: str, shared: bool
) -> None:
    program = _no_mixed_positions(program)
    shapes = SHARED if shared else StaticShapes(min_rows=1)
    padded, padded_grads = _outputs_and_grads(lambda model: Fold(shapes=shapes), program, picks, via)
    eager, eager_grads = _outputs_and_grads(EagerFold, program, picks, via)
    for a, b in zip(padded, eager, strict=True):
        torch.testing.assert_close(a, b)
    for a, b in zip(padded_grads, eager_grads, strict=True):
        torch.testing.assert_close(a, b)


@settings(max_examples=60, deadline=None)
@given(trees=forests())
def test_padded_forests_equal_eager_and_a_seen_forest_never_grows_the_envelope(trees: list[Any]) -> None:
    r1, s1, g1 = forest_outputs_and_gradients(lambda model: Fold(shapes=SHARED), trees)
    r2, s2, g2 = forest_outputs_and_gradients(EagerFold, trees)
    torch.testing.assert_close(r1, r2)
    torch.testing.assert_close(s1, s2)
    # An op of the envelope that this forest lacks runs on padding only: its parameters get a
    # zero gradient where the unpadded run leaves None (a static graph cannot skip it).
    for a, b, p in zip(g1, g2, Zoo().parameters(), strict=True):
        torch.testing.assert_close(
            torch.zeros_like(p) if a is None else a, torch.zeros_like(p) if b is None else b
        )
    version = SHARED.version
    fold = Fold(shapes=SHARED)
    states = []
    roots = [encode(fold, t, states) for t in trees]
    fold.plan([roots, states])
    assert SHARED.version == version


class _OpLog(TorchDispatchMode):
    """Every aten op run, with its tensor arguments' shapes: what an XLA trace would hash."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[Any, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        shapes = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args)
        self.ops.append((str(func), shapes))
        return func(*args, **(kwargs or {}))


def _sst_batches(count: int, size: int) -> tuple[list[Any], Vocab]:
    trees = load_sst(split="train", max_trees=count * size)
    return [trees[i * size : (i + 1) * size] for i in range(count)], Vocab.build(trees)


def _tree_lstm_step(model: TreeLSTM, plan: Any, labels: list[int]) -> torch.Tensor:
    [states] = plan.apply(model, padded=True)
    losses = torch.nn.functional.cross_entropy(
        model.logits(states), plan.pad(0, labels, fill=-100), reduction="sum"
    )
    losses.backward()
    return losses


@pytest.mark.parametrize("depth_buckets", [False, True])
def test_two_sst_batches_fitted_to_one_envelope_run_the_same_ops_on_the_same_shapes(
    depth_buckets: bool,
) -> None:
    """One envelope version runs one sequence of ops per depth bucket (with ``depth_buckets=False``:
    one for every batch); a shallower bucket runs fewer."""
    batches, vocab = _sst_batches(8, 10)
    shapes = StaticShapes(depth_buckets=depth_buckets)
    model = TreeLSTM(len(vocab), 8, 8)
    for trees in batches:
        fold = Fold(shapes=shapes)
        nodes, labels, _ = encode_trees(fold, trees, vocab)
        fold.plan([nodes])
    final = shapes.version
    logs: dict[int, list[Any]] = {}  # per depth bucket (levels run), the op logs of its batches
    for trees in batches:  # refit them into the final envelope
        fold = Fold(shapes=shapes)
        nodes, labels, _ = encode_trees(fold, trees, vocab)
        plan = fold.plan([nodes])
        model.zero_grad(set_to_none=True)
        with _OpLog() as log:
            _tree_lstm_step(model, plan, labels)
        logs.setdefault(plan.layout.levels, []).append(log.ops)  # type: ignore[attr-defined]
    assert shapes.version == final  # refitting seen batches never grows it
    if depth_buckets:
        assert len(logs) > 1  # these batches fall in several buckets
    else:
        assert list(logs) == [shapes.levels]
    for levels, runs in logs.items():
        assert all(ops == runs[0] for ops in runs) and len(runs[0]) > 50, levels
    lengths = [len(logs[levels][0]) for levels in sorted(logs)]
    assert lengths == sorted(lengths) and len(set(lengths)) == len(lengths)
    # unpadded plans of the same two batches differ: the check above can fail
    unpadded = []
    for trees in batches[:2]:
        fold = Fold(shapes=None)
        nodes, _, _ = encode_trees(fold, trees, vocab)
        with _OpLog() as log:
            fold.apply(model, [nodes])
        unpadded.append(log.ops)
    assert unpadded[0] != unpadded[1]


@pytest.mark.parametrize("pack_levels", [False, True])
def test_padded_tree_lstm_loss_and_gradients_equal_the_unpadded_run_in_float64(pack_levels: bool) -> None:
    batches, vocab = _sst_batches(3, 6)
    shapes = StaticShapes(min_rows=16, pack_levels=pack_levels)
    for trees in batches:
        grads = []
        for fold in (Fold(shapes=shapes), Fold(shapes=None)):
            torch.manual_seed(0)
            model = TreeLSTM(len(vocab), 8, 8).double()
            nodes, labels, roots = encode_trees(fold, trees, vocab)
            plan = fold.plan([nodes, [nodes[r] for r in roots]])
            states, root_states = plan.apply(model, padded=True)
            weights = plan.pad(0, torch.full((len(nodes),), 1 / len(nodes), dtype=torch.float64))
            losses = torch.nn.functional.cross_entropy(
                model.logits(states), plan.pad(0, labels), reduction="none"
            )
            # a mean over the padded output with the pads weighted 0, and a log that a zero row would make -inf
            loss = (losses * weights).sum() + root_states[: plan.sizes[1]].abs().log().mean()
            loss.backward()
            grads.append([loss.detach()] + [p.grad for p in model.parameters()])
        for a, b in zip(*grads, strict=True):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert shapes.waste > 0  # padding did happen
    assert (shapes.moved_calls > 0) == pack_levels  # and packing moved calls, when on


def test_padded_calls_repeat_a_real_call_so_no_nan_reaches_the_gradients() -> None:
    class Reciprocal(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor([[2.0]]))

        def leaf(self, n: torch.Tensor) -> torch.Tensor:
            return n.to(self.w.dtype).unsqueeze(1) @ self.w  # a padded 0 would make 1/x infinite below

        def inv(self, x: torch.Tensor) -> torch.Tensor:
            return 1 / x

    fold = Fold(shapes=StaticShapes(min_rows=8))
    leaves = [fold.add("leaf", n) for n in (1, 2, 3)]
    [out] = fold.apply(Reciprocal(), [[fold.add("inv", leaf) for leaf in leaves]])
    model = Reciprocal()
    plan = fold.plan([[fold.add("inv", leaf) for leaf in leaves]])
    padded = plan.apply(model, padded=True)[0]
    assert padded.shape == (8, 1) and torch.isfinite(padded).all()
    (padded * plan.pad(0, torch.ones(3, 1))).sum().backward()
    assert model.w.grad is not None
    torch.testing.assert_close(model.w.grad, torch.tensor([[-(1 + 1 / 2 + 1 / 3) / 4]]))
    torch.testing.assert_close(out, torch.tensor([[1 / 2], [1 / 4], [1 / 6]]))


def test_growth_after_warmup_warns_once_per_growth_and_never_truncates() -> None:
    shapes = StaticShapes(min_rows=2, warmup=1)

    class Ops(torch.nn.Module):
        def leaf(self, n: torch.Tensor) -> torch.Tensor:
            return n.float().unsqueeze(1)

    def plan(count: int) -> Any:
        fold = Fold(shapes=shapes)
        return fold.plan([[fold.add("leaf", i) for i in range(count)]])

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan(2)  # the first plan sets the envelope up: no warning
        plan(1)  # fits
    with pytest.warns(StaticShapesWarning, match=r"did not fit .* expect one new compilation"):
        big = plan(5)
    assert big.capacities == [8]
    torch.testing.assert_close(big.apply(Ops()), [torch.arange(5.0).unsqueeze(1)])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"min_rows": 0}, ValueError, r"StaticShapes\(min_rows\) must be a positive int, got 0"),
        ({"min_rows": True}, TypeError, r"StaticShapes\(min_rows\) must be an int, got bool True"),
        ({"growth": 1.0}, ValueError, r"growth=1.0\): growth must be a finite number > 1"),
        ({"growth": float("inf")}, ValueError, r"growth must be a finite number"),
        ({"sizes": ()}, ValueError, r"sizes=\(\)\): sizes must be positive ints"),
        ({"sizes": (8, 8, 16)}, ValueError, r"sizes must increase strictly"),
        ({"sizes": (8, -1)}, ValueError, r"sizes must be positive ints"),
        ({"sizes": 5}, TypeError, r"StaticShapes\(sizes=5\): sizes must be a sequence of positive ints"),
        ({"level_step": 0}, ValueError, r"StaticShapes\(level_step\) must be a positive int, got 0"),
        ({"warmup": -1}, ValueError, r"StaticShapes\(warmup\) must be an int >= 0, got -1"),
    ],
)
def test_invalid_ladders_are_refused_naming_the_value(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        StaticShapes(**kwargs)


@pytest.mark.parametrize("shapes", [None, StaticShapes()], ids=["unpadded", "static"])
@pytest.mark.parametrize("request_number", [1, 3, -1])
def test_pad_names_a_request_the_plan_lacks_and_how_many_it_has(
    shapes: StaticShapes | None, request_number: int
) -> None:
    fold = Fold(shapes=shapes)
    plan = fold.plan([[fold.add("leaf", 1)]])
    with pytest.raises(
        IndexError, match=rf"pad\(request={request_number}\): the plan has 1 request \(numbered 0 to 0\)"
    ):
        plan.pad(request_number, [1.0])
    with pytest.raises(TypeError, match=r"pad\(request='0'\): request must be an int"):
        plan.pad("0", [1.0])  # type: ignore[arg-type]


def test_explicit_ladder_grows_past_its_last_size() -> None:
    shapes = StaticShapes(sizes=(4, 10), growth=3)
    assert [shapes.bucket(n) for n in (1, 4, 5, 10, 11, 31)] == [4, 4, 10, 10, 30, 90]


def test_a_position_mixing_nodes_and_given_tensors_is_refused_with_the_fix() -> None:
    fold = Fold(shapes=StaticShapes())
    a = fold.add("leaf", 1)
    mixed = [fold.add("combine", a, a, a), fold.add("combine", a, a, torch.ones(1, 5))]
    with pytest.raises(
        FoldError, match=r"op 'combine' at depth 1, argument 2: static shapes cannot pad .*fold.add\('input'"
    ):
        fold.plan([mixed])


def test_fold_shapes_argument_is_checked() -> None:
    with pytest.raises(ValueError, match=r"Fold\(shapes='xla'\): shapes must be 'auto'"):
        Fold(shapes="xla")


def test_cpu_folds_are_not_padded_by_default() -> None:
    fold = Fold()
    plan = fold.plan([[fold.add("leaf", 1)]])
    assert not isinstance(plan, StaticPlan)
    assert plan.sizes == plan.capacities == [1]


def test_request_lists_of_ints_and_tensors_work_with_static_shapes_like_the_original_api() -> None:
    shapes = StaticShapes(min_rows=4)
    for count in (3, 2):  # the second fits the envelope the first made
        outs = []
        for fold in (Fold(shapes=shapes), Fold(shapes=None)):
            nodes = [fold.add("leaf", i) for i in range(count)]
            labels = list(range(count))
            targets = [torch.tensor([[float(i)]]) for i in range(count)]
            outs.append(fold.apply(Zoo(), [nodes, labels, targets]))
        for padded, plain in zip(*outs, strict=True):
            torch.testing.assert_close(padded, plain)
    fold = Fold(shapes=shapes)
    node = fold.add("leaf", 1)
    with pytest.raises(
        FoldError, match=r"apply request 0: static shapes cannot pad a request that mixes nodes and tensors"
    ):
        fold.plan([[node, torch.ones(1, 5)]])


class _Rows(torch.nn.Module):
    """Ops whose outputs differ in rows per call and row shape, to be read at one position."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(2.0))

    def one(self, n: torch.Tensor) -> torch.Tensor:  # 1 row of 1 per call
        return n.float().unsqueeze(1) * self.w

    def two(self, n: torch.Tensor) -> torch.Tensor:  # 2 rows of 1 per call
        return (n.float().unsqueeze(1) * self.w).repeat_interleave(2, 0)

    def wide(self, n: torch.Tensor) -> torch.Tensor:  # 1 row of 2 per call
        return (n.float().unsqueeze(1) * self.w).repeat(1, 2)

    def inp(self, x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return x * k.float().view(-1, *([1] * (x.dim() - 1))).repeat_interleave(x.shape[0] // k.shape[0], 0)


@pytest.mark.parametrize("second", ["two", "wide"])
def test_a_position_reading_outputs_of_another_layout_in_a_later_batch_is_refused_not_wrong(
    second: str,
) -> None:
    shapes = StaticShapes(min_rows=2)
    for op in ("one", second):
        fold = Fold(shapes=shapes)
        outs = [fold.add(torch.neg, fold.add(op, i)) for i in (1, 2, 3)]
        plan = fold.plan([outs])
        if op == "one":
            torch.testing.assert_close(plan.apply(_Rows())[0], torch.tensor([[-2.0], [-4.0], [-6.0]]))
        else:
            with pytest.raises(
                FoldError, match=r"reads the outputs of op 'one' \(1 rows of \(1,\).*op '" + second
            ):
                plan.apply(_Rows())


def test_given_tensors_of_another_layout_are_never_padded_into_a_wrong_result() -> None:
    """Each layout of given tensors gets its own slot; a request that reads both layouts over two
    batches cannot be one concatenation, and says so (it used to return the first layout's rows)."""
    shapes = StaticShapes(min_rows=2)
    for rows in (1, 3):
        folds = (Fold(shapes=shapes), Fold(shapes=None))
        outs = [
            [fold.add("inp", torch.full((rows, 1), float(i + 1)), i + 1) for i in range(2)] for fold in folds
        ]
        expected = folds[1].apply(_Rows(), [outs[1]])[0]
        if rows == 1:
            torch.testing.assert_close(folds[0].apply(_Rows(), [outs[0]])[0], expected)
        else:
            with pytest.raises(FoldError, match=r"op 'inp' \(1 rows .* op 'inp' \(3 rows"):
                folds[0].apply(_Rows(), [outs[0]])
    # (the failed fold grew a slot for its layout, and left the envelope as it was: one slot)
    assert len({key for _, key in shapes._capacity if key[0] == "inp"}) == 1
    fold = Fold(shapes=shapes)
    torch.testing.assert_close(
        fold.apply(_Rows(), [[fold.add("inp", torch.full((1, 1), 5.0), 1)]])[0], torch.full((1, 1), 5.0)
    )


def test_switching_between_request_lists_grows_the_envelope_once_per_list() -> None:
    shapes = StaticShapes(min_rows=2, warmup=0)

    def plan(both: bool) -> Any:
        fold = Fold(shapes=shapes)
        nodes = [fold.add("leaf", i) for i in range(5)]
        return fold.plan([nodes, nodes[:1]] if both else [nodes])

    plan(False)
    with pytest.warns(StaticShapesWarning):
        plan(True)  # a second list: the envelope learns it once
    versions = shapes.version
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for both in (False, True, False, True):
            out = plan(both).apply(Zoo())
            assert [o.shape[0] for o in out] == ([5, 1] if both else [5])
    assert shapes.version == versions


def test_calls_passing_the_same_tensor_at_a_position_are_padded() -> None:
    shared = torch.ones(1, 5)
    results = []
    for fold in (Fold(shapes=StaticShapes()), Fold(shapes=None)):
        outs = [fold.add("combine", shared, shared, fold.add("leaf", i)) for i in range(3)]
        results.append(fold.apply(Zoo(), [outs])[0])
    torch.testing.assert_close(results[0], results[1])


def test_sizes_count_the_rows_of_int_float_and_tensor_requests_for_both_plan_kinds() -> None:
    for shapes in (None, StaticShapes()):
        fold = Fold(shapes=shapes)
        nodes = [fold.add("leaf", i) for i in range(3)]
        plan = fold.plan([nodes, [7, 8, 9], [0.5, 1.5], [torch.ones(2, 1), torch.ones(1, 1)]])
        assert plan.sizes == [3, 3, 2, 3]
        assert plan.pad(1, [1, 1, 1]).shape[0] == plan.capacities[1]


def test_a_static_plan_refuses_to_pickle_what_would_lose_gradients() -> None:
    model = Zoo()
    fold = Fold(shapes=StaticShapes())
    plan = fold.plan([[fold.add(model.leaf, 1)]])
    with pytest.raises(FoldError, match=r"is a method bound to a Zoo: .* record the op by name"):
        pickle.dumps(plan)
    fold = Fold(shapes=StaticShapes())
    plan = fold.plan([[fold.add("lift", torch.ones(1, 5, requires_grad=True))]])
    with pytest.raises(FoldError, match=r"argument 0: a tensor given to add requires grad"):
        pickle.dumps(plan)


def test_a_spawned_loader_worker_builds_the_same_static_plans_as_the_training_process() -> None:
    """The envelope travels to a ``spawn`` worker with the build (pickled) and pads there alike."""
    from torchfold.examples.models import TreeLSTMBuild, tree_lstm_loss
    from torchfold.train import StepLoader

    trees = load_sst(split="train", max_trees=40)
    vocab = Vocab.build(trees)
    shapes = StaticShapes()
    for start in range(0, 40, 8):
        shapes.cover(TreeLSTMBuild(vocab)(trees[start : start + 8])[0])  # type: ignore[arg-type]
    model = TreeLSTM(len(vocab), 8, 8)
    losses = []
    for workers, context in ((0, None), (1, "spawn")):
        loader = StepLoader(
            trees, 8, build=TreeLSTMBuild(vocab, shapes=shapes), trace=16, shuffle=False,
            num_workers=workers, multiprocessing_context=context,
        )  # fmt: skip
        with loader, torch.no_grad():
            losses.append(
                [
                    tree_lstm_loss(model, mb.data[0].apply(model, padded=True), mb.data[1]).item()
                    for step in loader
                    for mb in step
                    if isinstance(mb.data[0], StaticPlan)
                ]
            )
    assert len(losses[0]) == 5 and losses[0] == losses[1]


class _Chain(torch.nn.Module):
    """An RNN cell over tokens: ``h_t = tanh(h_{t-1} @ w + embed[x_t])``, a chain as deep as the sequence."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(7, 3, generator=generator))
        self.w = torch.nn.Parameter(torch.randn(3, 3, generator=generator) / 2)

    def token(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed[ids]

    def cell(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h @ self.w + x)


def _chain(fold: Any, length: int) -> list[Any]:
    tokens = [fold.add("token", t % 7) for t in range(length)]
    states = [tokens[0]]
    for token in tokens[1:]:
        states.append(fold.add("cell", states[-1], token))
    return states


class _Work(TorchDispatchMode):
    """Elements written by every aten op run: the tensor work of a run, counted exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.elements += sum(
            t.numel() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
        )
        return out


def _chain_cost(length: int) -> tuple[int, int, int]:
    """Pieces the padded layout gathers, elements its apply writes, and the peak bytes Python allocates to fit it."""
    import tracemalloc

    fold = Fold(shapes=StaticShapes(min_rows=1))
    states = _chain(fold, length)
    tracemalloc.start()
    plan = fold.plan([states[-1:]])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    pieces = sum(len(gather.pieces) for slot in plan.slots for gather in slot.gathers)
    with _Work() as work:
        plan.apply(_Chain())
    return pieces, work.elements, peak


def test_a_deep_chain_costs_linear_work_and_memory_in_its_depth() -> None:
    """An RNN over n tokens: each level reads the level before it, so padding must not gather every
    earlier level at every level (that was quadratic: 4,000 tokens took 4 GB, 20,000 a MemoryError)."""
    small, large = _chain_cost(300), _chain_cost(600)
    for a, b in zip(small, large, strict=True):
        assert 1.6 < b / a < 2.6, (small, large)
    # and the padded chain still equals eager PyTorch, outputs and gradients
    results = []
    for make in (lambda model: Fold(shapes=StaticShapes(min_rows=1)), EagerFold):
        model = _Chain()
        fold = make(model)
        states = _chain(fold, 50)
        [out] = fold.apply(model, [states[::7]])
        out.sum().backward()
        results.append([out.detach()] + [p.grad for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b)


def test_the_padded_runner_compiles_to_one_graph_without_breaks() -> None:
    """torch.compile(fullgraph=True) of a static plan's runner: no graph break (an ``isinstance``
    with a PEP 604 union broke the graph on torch 2.9), no host sync, nothing data-dependent."""
    fold = Fold(shapes=StaticShapes(min_rows=2))
    states: list[Any] = []
    roots = [encode(fold, tree, states) for tree in ((1, (2, 3)), ((4, 5), 6))]
    context = fold.add("context", 3).nobatch()
    plan = fold.plan([roots, [fold.add("attend", s, context) for s in states], [0.5, 1.5]])
    model = Zoo()
    inputs = plan.inputs()
    torch._dynamo.reset()
    compiled = torch.compile(plan.layout.run, backend="eager", fullgraph=True, dynamic=False)
    for a, b in zip(compiled(model, inputs), plan.apply(model, padded=True), strict=True):
        torch.testing.assert_close(a, b)
    # and run eagerly, nothing reads a tensor's value back to Python (.item(), .tolist())
    with _OpLog() as log:
        plan.layout.run(model, inputs)
    assert log.ops and not [op for op, _ in log.ops if "_local_scalar_dense" in op or "nonzero" in op]


def _tree_plan(shapes: StaticShapes, trees: list[Any], record: Any = encode) -> StaticPlan:
    """``trees`` recorded by ``record`` (the zoo's ``encode`` by default), roots and every node requested."""
    fold = Fold(shapes=shapes)
    states: list[Any] = []
    roots = [record(fold, tree, states) for tree in trees]
    plan = fold.plan([roots, states])
    assert isinstance(plan, StaticPlan)
    return plan


@settings(max_examples=40, deadline=None)
@given(first=forests(), second=forests())
def test_plans_of_one_envelope_version_share_a_layout_key_and_input_shapes(first: Any, second: Any) -> None:
    shapes = StaticShapes(min_rows=2, warmup=10**9, depth_buckets=False)
    _tree_plan(shapes, first + second)  # an envelope both batches fit
    version = shapes.version
    a, b = _tree_plan(shapes, first), _tree_plan(shapes, second)
    assert shapes.version == version
    assert a.layout.key == b.layout.key and hash(a.layout.key) == hash(b.layout.key)
    shaped = [[(t.shape, t.dtype) for t in (i.ints, i.floats, *i.given)] for i in (a.inputs(), b.inputs())]
    assert shaped[0] == shaped[1]
    assert shaped[0][0][1] == torch.int64 and shaped[0][1][1] == torch.get_default_dtype()
    # a worker-built plan (pickled) keeps the key; its layout pickles on its own too
    copied = pickle.loads(pickle.dumps(a))
    assert copied.layout.key == a.layout.key
    assert pickle.loads(pickle.dumps(a.layout)).key == a.layout.key
    model = Zoo()
    for x, y in zip(copied.layout.run(model, b.inputs()), b.apply(model, padded=True), strict=True):
        torch.testing.assert_close(x, y)  # one layout runs every plan of it
    # a deeper forest grows the envelope: a new version, a new key
    deep: Any = 1
    for word in range(40):  # deeper than the envelope's levels past the deepest seen
        deep = (deep, word % 11)
    grown = _tree_plan(shapes, [deep, *first])
    assert shapes.version > version and grown.layout.key != a.layout.key
    assert _tree_plan(shapes, first).layout.key == grown.layout.key


def test_a_depth_bucket_runs_the_levels_down_to_its_deepest_node_and_has_a_key_of_its_own() -> None:
    deep: Any = 1
    for word in range(9):  # 9 tree levels, two op levels each (pair, combine): the deepest op at 18
        deep = (deep, word % 11)
    shallow, alike, middle = [(1, (2, 3))], [(4, (5, 6))], [((((1, 2), 3), 4), 5)]  # ops down to 4, 4, 8
    shapes = StaticShapes(min_rows=2, level_step=4, warmup=3)
    plans = [_tree_plan(shapes, trees) for trees in ([deep], shallow, alike)]
    assert shapes.levels == 28  # ceil(19 * 1.3 / 4) * 4
    # the levels down to the deepest op, rounded up to level_step
    assert [plan.layout.levels for plan in plans] == [20, 8, 8]
    assert plans[0].layout.key != plans[1].layout.key == plans[2].layout.key
    with pytest.warns(
        StaticShapesWarning, match=r"runs 12 of the envelope's 28 levels: expect one new compilation"
    ):
        plans.append(_tree_plan(shapes, middle))  # a new bucket after the warm-up: one more graph
    model = Zoo()
    for plan, trees in zip(plans, ([deep], shallow, alike, middle), strict=True):
        fold = Fold(shapes=None)
        states: list[Any] = []
        roots = [encode(fold, tree, states) for tree in trees]
        for got, expected in zip(plan.apply(model), fold.plan([roots, states]).apply(model), strict=True):
            torch.testing.assert_close(got, expected)
    every_level = StaticShapes(min_rows=2, level_step=4, depth_buckets=False)
    assert [_tree_plan(every_level, trees).layout.levels for trees in ([deep], shallow)] == [28, 28]
    with pytest.raises(TypeError, match="depth_buckets must be True or False"):
        StaticShapes(depth_buckets=1)  # type: ignore[arg-type]


def test_layout_keys_differ_between_envelopes_and_request_kinds() -> None:
    trees = [(1, (2, 3))]
    one, two = StaticShapes(), StaticShapes()
    assert _tree_plan(one, trees).layout.key != _tree_plan(two, trees).layout.key
    fold = Fold(shapes=one)
    states: list[Any] = []
    roots = [encode(fold, tree, states) for tree in trees]
    assert fold.plan([roots]).layout.key != _tree_plan(one, trees).layout.key  # type: ignore[attr-defined]


def test_a_layout_refuses_unpadded_runs_and_inputs_of_another_layout() -> None:
    shapes = StaticShapes(min_rows=2)
    plan = _tree_plan(shapes, [(1, 2)])
    other = _tree_plan(StaticShapes(min_rows=8), [(1, 2)])
    with pytest.raises(ValueError, match=r"run\(padded=False\): a layout does not know a batch's sizes"):
        plan.layout.run(Zoo(), plan.inputs(), padded=False)
    with pytest.raises(
        ValueError, match=r"StaticLayout.run: inputs of \(\d+,\) ints.* but this layout takes"
    ):
        plan.layout.run(Zoo(), other.inputs())


def test_static_names_are_exported() -> None:
    import torchfold.engine.static as static

    assert {"StaticInputs", "StaticLayout", "StaticPlan", "StaticShapes", "StaticShapesWarning"} <= set(
        static.__all__
    )
    assert StaticPlan.__module__.startswith("torchfold.engine.static")


class _Faulty(torch.nn.Module):
    def leaf(self, n: torch.Tensor) -> torch.Tensor:
        return n.float().unsqueeze(1)

    def boom(self, x: torch.Tensor) -> torch.Tensor:
        raise ZeroDivisionError("boom")

    def column_sum(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(0, keepdim=True)  # one row for all calls


@pytest.mark.parametrize("op", ["boom", "column_sum"])
def test_both_runners_word_a_failing_op_alike_the_padded_one_saying_so(op: str) -> None:
    """One call of the op, one check of its outputs, for plain and static plans."""
    messages = []
    for shapes in (None, StaticShapes(min_rows=4)):
        fold = Fold(shapes=shapes)
        plan = fold.plan([[fold.add(op, fold.add("leaf", i)) for i in (1, 2)]])
        with pytest.raises((ZeroDivisionError, FoldError)) as info:
            plan.apply(_Faulty())
        messages.append(" ".join([str(info.value), *getattr(info.value, "__notes__", [])]))
    plain, padded = messages
    if op == "boom":
        assert "while applying 'boom' at depth 1 to 2 nodes, first Node('boom', depth=1, index=0)" in plain
        assert (
            "while applying 'boom' at depth 1 to 4 nodes (padded; static shapes), first Node('boom'" in padded
        )
    else:
        assert "op 'column_sum' at depth 1 ran 2 calls batched and returned shape (1, 1)" in plain
        assert (
            "op 'column_sum' at depth 1 ran 4 calls batched (padded; static shapes) and returned shape"
            in padded
        )
    assert padded.replace(" (padded; static shapes)", "").replace("4", "2") == plain


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_one_cuda_graph_per_layout_replays_every_plan_of_it_without_host_syncs() -> None:
    """What compiled steps do: capture ``layout.run`` (forward and backward) once into a CUDA
    graph on fixed input buffers, then refill the buffers with another plan's inputs and replay."""
    shapes = StaticShapes(min_rows=4, warmup=10**9)
    forests = [[(1, (2, 3)), ((4, 5), 6)], [((7, 8), (9, (10, 0)))], [(1, 2), 3, (4, (5, 6))]]
    for trees in forests:
        _tree_plan(shapes, trees)  # grow the envelope over all three
    plans = [_tree_plan(shapes, trees) for trees in forests]
    assert len({plan.layout.key for plan in plans}) == 1
    model = Zoo().cuda()
    buffers = plans[0].inputs("cuda")
    parameters = list(model.parameters())

    def step() -> list[torch.Tensor]:
        roots, states = plans[0].layout.run(model, buffers)
        loss = roots.pow(2).sum() + states.sin().sum()
        return [
            roots,
            states,
            *torch.autograd.grad(loss, parameters, allow_unused=True, materialize_grads=True),
        ]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for plan in plans:
        for buffer, values in zip(buffers[:2], plan.inputs("cuda")[:2], strict=True):
            buffer.copy_(values)
        torch.cuda.set_sync_debug_mode("error")  # a host sync inside the replay would raise
        try:
            graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        roots, states = plan.apply(model, padded=True)
        loss = roots.pow(2).sum() + states.sin().sum()
        expected = [
            roots,
            states,
            *torch.autograd.grad(loss, parameters, allow_unused=True, materialize_grads=True),
        ]
        for a, b in zip(captured, expected, strict=True):
            torch.testing.assert_close(a, b)
    torch.cuda.set_sync_debug_mode("error")  # an eager run of the layout syncs with the host nowhere either
    try:
        plans[1].layout.run(model, buffers)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_sst_batches_stop_growing_the_envelope_after_the_warm_up() -> None:
    """The XLA lane's compile count, counted on the CPU: 40 batches of 8 SST trees grow the default
    envelope only in the first 20. (A reach of 'as far back as read, times headroom' grew it
    again at batch 31: tree nodes read children at any depth, so they read every level.)"""
    trees = load_sst(split="train", max_trees=320)
    vocab = Vocab.build(trees)
    shapes = StaticShapes()
    versions = []
    for start in range(0, 320, 8):
        fold = Fold(shapes=shapes)
        nodes, _, _ = encode_trees(fold, trees[start : start + 8], vocab)
        fold.plan([nodes])
        versions.append(shapes.version)
    assert versions[19] == versions[-1] <= 3, versions


@pytest.mark.parametrize("packed", [False, True])
def test_a_fold_that_fails_leaves_the_envelope_as_it_was(packed: bool) -> None:
    """A typo'd op grew the envelope with slots of its own: every later fold ran them and failed
    naming nodes it did not hold. A failed fold now puts the envelope back."""

    class Sum(torch.nn.Module):
        def leaf(self, x: torch.Tensor) -> torch.Tensor:
            return x.float().unsqueeze(1)

        def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a + b

    def apply(shapes: StaticShapes, op: str) -> list[torch.Tensor]:
        fold = Fold(shapes=shapes)
        a, b, c = fold.add(op, 1), fold.add("leaf", 2), fold.add("leaf", 3)
        return fold.apply(Sum(), [[fold.add("add", fold.add("add", a, b), c)]])

    model = Sum()
    shapes = StaticShapes(min_rows=4, pack_levels=packed)
    fold = Fold(shapes=shapes)
    fold.apply(model, [[fold.add("add", fold.add("leaf", 4), fold.add("leaf", 5))]])  # a layout that works
    before = pickle.dumps((shapes._snapshot()["_capacity"], shapes._snapshot()["_names"], shapes.version))
    with pytest.raises(FoldError, match="unknown op 'lef'"):
        apply(shapes, "lef")
    assert (
        pickle.dumps((shapes._snapshot()["_capacity"], shapes._snapshot()["_names"], shapes.version))
        == before
    )
    assert apply(shapes, "leaf") == [torch.tensor([[6.0]])]  # the corrected fold runs


def test_cover_pads_a_plan_and_fit_is_its_deprecated_alias() -> None:
    # StaticShapes.fit widened the envelope to a plan while TraceTrainer.fit trains: the method is cover.
    f = Fold()
    plan = f.plan([[f.add(torch.neg, 1)]])
    covered = StaticShapes(min_rows=4).cover(plan)
    with pytest.warns(FutureWarning, match=r"StaticShapes.fit is deprecated; use StaticShapes.cover"):
        fitted = StaticShapes(min_rows=4).fit(plan)
    assert isinstance(fitted, StaticPlan) and fitted.capacities == covered.capacities == [4]
    frozen = StaticShapes(min_rows=4)
    frozen.freeze()
    with pytest.warns(FutureWarning), pytest.raises(StaticShapesOverflow):
        frozen.fit(plan)  # its arguments pass through (grow defaults to not frozen)


# envelope_for: the one rule of when a plan is padded (Fold.plan and FoldPlan.apply both ask it).


def test_the_rule_for_each_fold_setting_and_device() -> None:
    model = torch.nn.Linear(2, 2)
    mine = StaticShapes()
    cpu, xla = torch.device("cpu"), torch.device("xla")
    assert envelope_for(mine) is mine and envelope_for(mine, model, cpu) is mine  # given: always
    assert envelope_for("auto") is None  # planning: the device is not known yet
    assert envelope_for("auto", model, cpu) is None
    assert envelope_for("auto", model, xla) is StaticShapes.of(model)  # one envelope per module
    assert envelope_for(None, model, xla) is None  # never


def test_plan_pads_into_a_given_envelope_and_leaves_auto_to_apply() -> None:
    def record(shapes: StaticShapes | str | None) -> object:
        fold = torchfold.Fold(shapes=shapes)
        return fold.plan([[fold.add(torch.neg, 1), fold.add(torch.neg, 2)]])

    mine = StaticShapes(min_rows=4)
    assert isinstance(record(mine), torchfold.StaticPlan) and mine.plans == 1
    auto, never = record("auto"), record(None)
    assert isinstance(auto, torchfold.FoldPlan) and auto.pad_on_xla
    assert isinstance(never, torchfold.FoldPlan) and not never.pad_on_xla
    model = torch.nn.Module()
    assert [t.tolist() for t in auto.apply(model)] == [[-1, -2]]  # on the CPU: not padded
    assert StaticShapes.of(model).plans == 0
