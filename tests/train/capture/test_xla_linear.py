"""``transposed_weights``: ``F.linear`` against a transposed copy of its weight equals ``F.linear``.

Run on the CPU (the mode takes any device type); the XLA lane checks the same on XLA, with the
optimization barrier that keeps XLA from folding the copy back.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from torchfold.train.capture.xla_linear import transposed_weights


@settings(max_examples=60, deadline=None)
@given(
    leading=st.lists(st.integers(1, 4), min_size=0, max_size=2),
    sizes=st.tuples(st.integers(1, 6), st.integers(1, 6)),
    bias=st.booleans(),
    by_name=st.booleans(),
    needs=st.tuples(st.booleans(), st.booleans(), st.booleans()).filter(any),
    seed=st.integers(0, 2**16),
)
def test_outputs_and_gradients_equal_f_linear(
    leading: list[int],
    sizes: tuple[int, int],
    bias: bool,
    by_name: bool,
    needs: tuple[bool, bool, bool],
    seed: int,
) -> None:
    """Any input rank (1-D, 2-D, batched), with and without a bias, arguments by position or name,
    gradients wanted for any of input, weight and bias (a frozen weight, a fixed input)."""
    into, out = sizes
    generator = torch.Generator().manual_seed(seed)

    def leaf(wanted: bool, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_(wanted)

    x, weight = leaf(needs[0], *leading, into), leaf(needs[1], out, into)
    b = leaf(needs[2], out) if bias else None
    if not any(t is not None and t.requires_grad for t in (x, weight, b)):
        b = None
        x.requires_grad_()
    upstream = torch.randn(*leading, out, generator=generator, dtype=torch.float64)
    results = []
    for transposed in (False, True):
        for t in (x, weight, b):
            if t is not None:
                t.grad = None
        with transposed_weights("cpu") if transposed else torch.autograd.set_grad_enabled(True):
            y = F.linear(input=x, weight=weight, bias=b) if by_name else F.linear(x, weight, b)
        (y * upstream).sum().backward()
        results.append([y.detach(), x.grad, weight.grad, None if b is None else b.grad])
    for plain, transposed in zip(*results, strict=True):
        if plain is None:
            assert transposed is None
        else:
            torch.testing.assert_close(transposed, plain, rtol=1e-12, atol=1e-12)


def test_one_copy_per_weight_and_only_the_chosen_device() -> None:
    layer, other = torch.nn.Linear(3, 2), torch.nn.Linear(2, 4)
    x = torch.randn(5, 3)
    with transposed_weights("cpu") as mode:
        other(layer(layer(x)[:, :3].repeat(1, 2)[:, :3]))
    assert mode.calls == 3 and len(mode.copies) == 2  # three products, two weights
    with transposed_weights("xla") as mode:  # CPU tensors: F.linear as it is
        layer(x)
    assert mode.calls == 0
    with transposed_weights("cpu") as mode:  # a bias that broadcasts: F.linear as it is
        y = F.linear(x, layer.weight, layer.bias.detach().reshape(1, 2).requires_grad_())
    assert mode.calls == 0 and y.shape == (5, 2)


def test_gradients_of_gradients_equal_f_linear() -> None:
    # a gradient penalty differentiates the backward pass: it is made of differentiable operations
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2).double()
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    results = []
    for transposed in (False, True):
        layer.zero_grad()
        with transposed_weights("cpu") if transposed else torch.autograd.set_grad_enabled(True):
            y = torch.tanh(layer(x))
        (grad,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        (y.sum() + grad.pow(2).sum()).backward()
        results.append([layer.weight.grad.clone(), layer.bias.grad.clone()])  # type: ignore[union-attr]
    for plain, transposed_result in zip(*results, strict=True):
        torch.testing.assert_close(transposed_result, plain, rtol=1e-12, atol=1e-12)


def test_a_weight_changed_in_place_is_copied_again() -> None:
    # two optimizer steps inside one mode: the second forward reads the updated weight
    results = []
    for transposed in (False, True):
        torch.manual_seed(0)
        layer, x = torch.nn.Linear(3, 2).double(), torch.randn(4, 3, dtype=torch.float64)
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
        losses = []
        with transposed_weights("cpu") if transposed else contextlib.nullcontext():
            for _ in range(3):
                optimizer.zero_grad()
                loss = layer(x).pow(2).sum()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
        results.append((losses, layer.weight.detach().clone()))
    (plain, plain_weight), (transposed_losses, transposed_weight) = results
    assert transposed_losses == pytest.approx(plain, rel=1e-12)
    torch.testing.assert_close(transposed_weight, plain_weight, rtol=1e-12, atol=1e-12)


def test_no_grad_and_autocast_give_f_linears_values() -> None:
    layer, x = torch.nn.Linear(3, 2), torch.randn(4, 3)
    with transposed_weights("cpu") as mode, torch.no_grad():
        y = layer(x)
    assert mode.calls == 1 and not y.requires_grad
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias))
    with transposed_weights("cpu") as mode, torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
        expected = F.linear(x, layer.weight, layer.bias)
    assert mode.calls == 0 and y.dtype == torch.bfloat16  # autocast's linear, as it is
    torch.testing.assert_close(y, expected)
