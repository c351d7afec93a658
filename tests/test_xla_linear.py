"""``transposed_weights``: ``F.linear`` against a transposed copy of its weight equals ``F.linear``.

Run on the CPU (the mode takes any device type); the XLA lane checks the same on XLA, with the
optimization barrier that keeps XLA from folding the copy back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from torchfold.train.xla_linear import transposed_weights


@settings(max_examples=60, deadline=None)
@given(
    leading=st.lists(st.integers(1, 4), min_size=0, max_size=2),
    sizes=st.tuples(st.integers(1, 6), st.integers(1, 6)),
    bias=st.booleans(),
    by_name=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_outputs_and_gradients_equal_f_linear(
    leading: list[int], sizes: tuple[int, int], bias: bool, by_name: bool, seed: int
) -> None:
    """Any input rank (1-D, 2-D, batched), with and without a bias, arguments by position or name."""
    into, out = sizes
    generator = torch.Generator().manual_seed(seed)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_()

    x, weight = leaf(*leading, into), leaf(out, into)
    b = leaf(out) if bias else None
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
