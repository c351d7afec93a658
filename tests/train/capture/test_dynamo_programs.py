"""``compile="on"``'s backend on XLA (``XlaGraphPrograms``): where a program would not repeat the
eager step, the graph runs lazily, and every call equals ``loss.backward()`` on the CPU.

The XLA tests run in the XLA lane (``make test-xla``); the others need no torch_xla.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch

import torchfold
from torchfold.train.capture.dynamo_programs import XlaGraphPrograms
from torchfold.train.capture.xla_capture import Computed, restored_afterwards


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
        self.lin = torch.nn.Linear(2, 2)

    def leaf(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.float().unsqueeze(1) * self.w)


def _batches() -> list[tuple[Any, Any]]:
    shapes = torchfold.StaticShapes(min_rows=4)
    out = []
    for values in ([1, 2], [3, 4, 5], [2, 6]):
        fold = torchfold.Fold(shapes=shapes)
        plan = fold.plan([[fold.add("leaf", v) for v in values]])
        out.append((plan, plan.pad(request=0, values=[1.0 / len(values)] * len(values))))
    return out


def _loss(m: Any, outputs: Any, weights: torch.Tensor) -> torch.Tensor:
    return (outputs[0].sum(1) * weights).sum()


def _grads(model: torch.nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().cpu() for p in model.parameters()]


def _same(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> None:
    assert [g is None for g in a] == [g is None for g in b]
    for x, y in zip(a, b, strict=True):
        if x is not None and y is not None:
            torch.testing.assert_close(x, y)


def _run_both(
    prepare: Any, loss: Any = _loss, between: Any = None
) -> tuple[list[list[torch.Tensor | None]], list[list[torch.Tensor | None]], list[str], Any]:
    """Each batch through ``CompiledLoss`` on XLA and through ``loss.backward()`` on the CPU, from
    the same model (``prepare(model, device)`` adds hooks or extra tensors; ``between(model, i)``
    changes it before batch ``i``); the gradients after each, and the XLA run's warnings."""
    import torch_xla

    from torchfold.train.capture.compiled import CompiledLoss

    device = torch_xla.device()
    torch.manual_seed(0)
    cpu_model = _Tiny()
    xla_model = copy.deepcopy(cpu_model).to(device)
    cpu_extra, xla_extra = prepare(cpu_model, torch.device("cpu")), prepare(xla_model, device)
    step = CompiledLoss(xla_model, lambda m, o, t: loss(m, o, t, xla_extra), device=device, fallback=True)
    xla_grads, cpu_grads = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for number, (plan, weights) in enumerate(_batches()):
            if between is not None:
                between(cpu_model, number)
                between(xla_model, number)
            for model in (cpu_model, xla_model):
                model.zero_grad()
            step(plan, weights.to(device))
            torch_xla.sync()
            xla_grads.append(_grads(xla_model))
            loss(cpu_model, plan.apply(cpu_model, padded=True), weights, cpu_extra).backward()
            cpu_grads.append(_grads(cpu_model))
    return xla_grads, cpu_grads, [str(w.message) for w in caught], (step, xla_extra, cpu_extra)


@pytest.mark.xla
def test_a_parameter_with_a_tensor_hook_runs_lazily_and_its_hook_runs_once() -> None:
    def prepare(model: _Tiny, device: torch.device) -> None:
        model.w.register_hook(lambda grad: grad * 0.5)

    xla, cpu, caught, (step, _, _) = _run_both(prepare, loss=lambda m, o, t, extra: _loss(m, o, t))
    for a, b in zip(xla, cpu, strict=True):
        _same(a, b)
    assert any("tensor hook" in w for w in caught), caught
    assert step.programs is not None and step.programs.programs == 0


@pytest.mark.xla
def test_a_tensor_needing_gradients_outside_the_model_gets_its_gradient() -> None:
    def prepare(model: _Tiny, device: torch.device) -> torch.Tensor:
        return torch.tensor(3.0, device=device, requires_grad=True)  # (a loss's own weight)

    def loss(m: Any, outputs: Any, weights: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        return _loss(m, outputs, weights) * extra

    xla, cpu, caught, (_, xla_extra, cpu_extra) = _run_both(prepare, loss=loss)
    for a, b in zip(xla, cpu, strict=True):
        _same(a, b)
    torch.testing.assert_close(xla_extra.grad.cpu(), cpu_extra.grad)
    assert any("not one of the model's parameters" in w for w in caught), caught


@pytest.mark.xla
def test_a_program_is_captured_again_when_a_parameter_is_frozen() -> None:
    def between(model: _Tiny, number: int) -> None:
        model.w.requires_grad_(number < 2)  # (frozen for the last batch)

    xla, cpu, caught, (step, _, _) = _run_both(
        lambda model, device: None, loss=lambda m, o, t, extra: _loss(m, o, t), between=between
    )
    for a, b in zip(xla, cpu, strict=True):
        _same(a, b)
    assert xla[-1][0] is None  # (w frozen: no gradient, as on the CPU)
    assert step.programs is not None and step.programs.programs >= 1, caught


@pytest.mark.xla
def test_a_step_under_no_grad_raises_as_the_eager_one_does() -> None:
    import torch_xla

    from torchfold.train.capture.compiled import CompiledLoss

    device = torch_xla.device()
    model = _Tiny().to(device)
    step = CompiledLoss(model, _loss, device=device, fallback=True)
    plan, weights = _batches()[0]
    with torch.no_grad(), pytest.raises(RuntimeError, match="does not require grad"):
        step(plan, weights.to(device))


def test_a_warm_up_that_runs_the_step_says_so() -> None:
    programs = XlaGraphPrograms(lambda: [])
    with pytest.raises(RuntimeError, match="ran the step instead of compiling it"):
        programs.warm_up(lambda: None)  # (a call TorchDynamo did not compile: the step ran)


def test_tensors_put_back_after_a_capture_are_forgotten_as_computed() -> None:
    """A warm-up's capture gives tensors buffers of their own and marks them; putting their old
    buffers back must drop the mark, or the next capture would not give them one of their own."""
    computed = Computed()
    tensor = torch.zeros(())
    with restored_afterwards([tensor], computed=computed):
        computed.add(tensor)
        tensor.add_(1.0)
    assert not computed.holds(tensor) and float(tensor) == 0.0
