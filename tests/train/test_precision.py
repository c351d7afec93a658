"""Mixed precision's rules: which precision runs where, and the loss whose gradient is scaled."""

from __future__ import annotations

import pytest
import torch

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
