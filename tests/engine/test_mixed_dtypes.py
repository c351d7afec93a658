"""Groups whose rows differ in dtype: under autocast, Fold gives what eager PyTorch gives.

Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` an ``nn.Embedding`` leaf returns float32
rows while an op through a ``Linear`` returns bfloat16 ones, so one group of a fold reads both at
one position. The fold joins them the way ``torch.cat`` does (promoted, float32 here); eager
PyTorch runs each call on its own rows, so an output of a group that promoted may be float32
where the eager call alone gives bfloat16 (never less precise). Property tests run random boolean-formula DAGs (shared
subexpressions, leaves and ops at every depth) through a Fold, its plan and a padded plan, and
compare outputs and gradients with the model's methods called one by one under the same
autocast. Rows that truly cannot be joined (ints and floats) are refused with a FoldError that
says dtype.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

import torchfold
from torchfold import EagerFold, Fold, FoldError, StaticShapes

DIM = 8
OPS = ("and_", "or_", "xor_", "not_")
VIA = ("apply", "plan", "padded plan", "padded apply")


class Formula(nn.Module):
    """Boolean-formula cells: embedding leaves (float32 under autocast), Linear ops (bfloat16) and
    elementwise ops (whatever their inputs promote to)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(6, DIM)
        self.w_and = nn.Linear(2 * DIM, DIM)
        self.w_xor = nn.Linear(2 * DIM, DIM)

    def leaf(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)

    def and_(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.w_and(torch.cat([a, b], 1)))

    def or_(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b - a * b

    def xor_(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.w_xor(torch.cat([a, b], 1)))

    def not_(self, a: torch.Tensor) -> torch.Tensor:
        return 1 - a


Program = list[tuple[str, int, int]]


def run_program(add: Any, program: Program) -> list[Any]:
    """The values of ``program``: ``add(op, *args)`` per instruction, args earlier values or new leaves."""
    values: list[Any] = [add("leaf", 0), add("leaf", 1)]
    for op, i, j in program:
        if op == "leaf":
            values.append(add("leaf", i % 6))
            continue
        a = values[i % len(values)]
        args = (a,) if op == "not_" else (a, values[j % len(values)])
        values.append(add(op, *args))
    return values


def eager(model: Formula, program: Program, picks: list[int]) -> torch.Tensor:
    """Plain eager PyTorch: the model's methods called one by one, the picked values concatenated."""

    def add(op: str, *args: Any) -> torch.Tensor:
        if op == "leaf":
            return model.leaf(torch.tensor([args[0]]))
        return getattr(model, op)(*args)

    values = run_program(add, program)
    return torch.cat([values[p % len(values)] for p in picks], 0)


def folded(model: Formula, program: Program, picks: list[int], via: str) -> torch.Tensor:
    fold = Fold(shapes=StaticShapes(min_rows=4) if via.startswith("padded") else None)
    values = run_program(fold.add, program)
    request = [[values[p % len(values)] for p in picks]]
    if via == "apply":
        return fold.apply(model, request)[0]
    plan = fold.plan(request)
    if via == "padded apply":
        return plan.apply(model, padded=True)[0][: len(picks)]
    return plan.apply(model)[0]


def outputs_and_gradients(run: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model = Formula()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = run(model)
        loss = (out.float() * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum()
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    return out, [
        torch.zeros_like(p) if g is None else g for p, g in zip(model.parameters(), grads, strict=True)
    ]


# bfloat16 keeps 8 bits of mantissa: a few roundings apart is 1e-2 relative. A group that promotes
# computes an elementwise op in float32 where an eager call of bfloat16 rows rounds to bfloat16.
def assert_bf16_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=3e-2, atol=3e-2, check_dtype=False)


instruction = st.tuples(st.sampled_from((*OPS, "leaf")), st.integers(0, 100), st.integers(0, 100))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    program=st.lists(instruction, min_size=1, max_size=14),
    picks=st.lists(st.integers(0, 100), min_size=1, max_size=5),
    via=st.sampled_from(VIA),
)
# (found by the property: the padded plan's or_ at depth 2 reads and_ rows through a stream that
# also holds depth 0's float32 leaves, and computes in float32 where eager's call gives bfloat16)
@example(program=[("and_", 0, 0), ("or_", 0, 0), ("or_", 2, 2)], picks=[4], via="padded plan")
def test_fold_equals_eager_under_bf16_autocast(program: Program, picks: list[int], via: str) -> None:
    expected, expected_grads = outputs_and_gradients(lambda model: eager(model, program, picks))
    out, grads = outputs_and_gradients(lambda model: folded(model, program, picks, via))
    # the dtype torch.cat gives the eager values (promoted over the picked rows), or float32: a
    # group that reads both precisions at one position computes in float32 (a padded plan
    # promotes over every level its envelope joins at that position, the same in every batch),
    # where an eager call that read only bfloat16 rows gives bfloat16
    assert out.dtype in (expected.dtype, torch.float32), (out.dtype, expected.dtype)
    assert_bf16_close(out, expected)
    for grad, want in zip(grads, expected_grads, strict=True):
        scale = max(1.0, float(want.abs().max()))
        assert_bf16_close(grad / scale, want / scale)


def test_a_group_of_float32_and_bfloat16_rows_reads_them_promoted() -> None:
    """Depth 2's xor_ reads an op's bfloat16 rows and a leaf's float32 rows at one position: the op
    gets them as float32 (what torch.cat gives), and the result is eager's."""
    seen: list[torch.dtype] = []

    class Watched(Formula):
        def xor_(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            seen.append(a.dtype)
            return super().xor_(a, b)

    program: Program = [
        ("and_", 0, 1),
        ("xor_", 2, 0),
        ("xor_", 0, 2),
    ]  # values: leaf, leaf, and_, xor_, xor_
    for via in VIA:
        seen.clear()
        model = Watched()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = folded(model, program, [3, 4], via)
            want = eager(model, program, [3, 4])
        assert seen[-1] == torch.float32, via
        assert out.dtype == want.dtype == torch.bfloat16
        assert_bf16_close(out, want)


def test_the_eager_twin_and_the_fold_agree_under_autocast() -> None:
    """The eager twin and the fold agree on the issue's case: a leaf and an op batched at depth 2."""
    model = Formula()
    program: Program = [("xor_", 0, 1), ("xor_", 2, 0), ("xor_", 0, 2)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        unfold = EagerFold(model)
        want = unfold.apply(model, [run_program(unfold.add, program)[3:]])[0]
        got = folded(model, program, [3, 4], "apply")
    assert_bf16_close(got, want)


class Mixed(nn.Module):
    """An op whose calls read ints (an ``ids`` op's rows) and floats (a leaf's) at one position."""

    def ids(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, 1).expand(-1, 2)

    def leaf(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().reshape(-1, 1).expand(-1, 2)

    def use(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


@pytest.mark.parametrize("shapes", [None, "static"], ids=["plain", "padded"])
def test_rows_of_ints_and_floats_at_one_position_are_refused_naming_the_dtypes(shapes: str | None) -> None:
    fold = Fold(shapes=StaticShapes(min_rows=4) if shapes else None)
    nodes = [fold.add("use", fold.add("ids", 1)), fold.add("use", fold.add("leaf", 2))]
    with pytest.raises(
        FoldError, match=r"disagree in dtype.*torch\.int64.*torch\.float32.*integer vs floating point"
    ):
        fold.plan([nodes]).apply(Mixed())


def test_rows_of_ints_and_floats_given_to_add_are_refused_naming_the_dtypes() -> None:
    fold = Fold()
    nodes = [fold.add("use", torch.ones(1, 2, dtype=torch.long)), fold.add("use", torch.ones(1, 2))]
    with pytest.raises(FoldError, match=r"argument 0: rows disagree in dtype") as caught:
        fold.apply(Mixed(), [nodes])
    assert "disagree in shape" not in str(caught.value)


def test_rows_of_two_float_dtypes_given_to_add_are_promoted() -> None:
    fold = Fold()
    rows = [torch.full((1, 2), 0.5, dtype=torch.bfloat16), torch.full((1, 2), 0.25, dtype=torch.float64)]
    (out,) = fold.apply(Mixed(), [[fold.add("use", row) for row in rows]])
    assert out.dtype == torch.float64
    assert out.tolist() == [[1.0, 1.0], [0.5, 0.5]]


def test_promotion_rule() -> None:
    gathered = torchfold.engine.ops.gathered_dtype
    assert gathered([torch.bfloat16, torch.float32, torch.bfloat16]) == torch.float32
    assert gathered([torch.float16, torch.bfloat16]) == torch.float32  # as torch.promote_types
    assert gathered([torch.int32, torch.int64]) == torch.int64
    assert gathered([torch.int64, torch.bfloat16]) is None
    assert gathered([torch.bool, torch.uint8]) is None
