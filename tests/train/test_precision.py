"""Mixed precision's rules: which precision runs where, the loss whose gradient is scaled, and bf16 on a
model whose leaves are an embedding (rows of two dtypes in one group)."""

from __future__ import annotations

import pytest
import torch
from _formula_task import make_task

from torchfold.train.data.loader import StepLoader
from torchfold.train.loop.trainer import TraceTrainer
from torchfold.train.optim.optimizer import AccumulatingOptimizer
from torchfold.train.optim.precision import ScaledLoss, autocast, check_precision, grad_scaler


def test_fp16_is_for_cuda_only_and_bf16_autocasts_anywhere() -> None:
    cpu = torch.device("cpu")
    assert check_precision("bf16", cpu) == "bf16" and check_precision("fp16", torch.device("cuda")) == "fp16"
    with pytest.raises(ValueError, match="precision='fp16' needs a CUDA device"):
        check_precision("fp16", cpu)
    with pytest.raises(ValueError, match=r"precision must be one of \['fp32', 'bf16', 'fp16'\], got 'fp8'"):
        check_precision("fp8", cpu)
    with autocast("bf16", cpu):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with autocast("fp32", cpu):
        assert not torch.is_autocast_enabled("cpu")
    assert grad_scaler("bf16", cpu) is None


def test_a_scaled_loss_keeps_its_value_and_scales_its_gradient() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    weight = torch.tensor([2.0], requires_grad=True)
    loss = ScaledLoss(lambda model, outputs, targets: (weight * outputs[0]).sum(), scaler)
    value = loss(torch.nn.Identity(), [torch.tensor([3.0])], None)
    value.backward()
    assert value.item() == 6.0 and weight.grad is not None and weight.grad.item() == 3.0 * 1024


def _formula_trainer(precision: str) -> TraceTrainer:
    task = make_task(size=32)
    torch.manual_seed(0)
    model = task.make_model()
    optimizer = AccumulatingOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    loader = StepLoader(task.train, 8, build=task.build, trace=[16, 8, 16])
    return TraceTrainer(model, optimizer, loader, task.loss, progress=False, precision=precision)


def test_bf16_trains_a_model_whose_leaves_are_an_embedding() -> None:
    """Under bf16 autocast the embedding leaves stay float32 and the Linear ops give bfloat16, and
    one group reads both at one position: the run trains (the fold promotes them, as torch.cat
    would) and stays close to the fp32 run."""
    task = make_task(size=32)
    plan, _ = task.build(task.train[:8])
    model = task.make_model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.leaf(torch.tensor([0])).dtype == torch.float32
        assert model.and_(torch.zeros(1, 8), torch.zeros(1, 8)).dtype == torch.bfloat16
        plan.apply(model)  # a group reads a leaf's rows and an op's at one position
    bf16 = _formula_trainer("bf16")
    history = bf16.fit(max_steps=6)
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    expected = _formula_trainer("fp32").fit(max_steps=6)
    losses, fp32 = [s.loss for s in history], [s.loss for s in expected]
    torch.testing.assert_close(losses, fp32, rtol=0.03, atol=0.03)
    assert losses != fp32  # it did run in bfloat16
