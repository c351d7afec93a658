"""A per-sample task on real torch_xla (its CPU backend): trained as on the CPU, with one warning
naming the fix for the programs that each new per-op batch size compiles.

Runs only in the XLA environment (``.venv-xla``); the main suite deselects it with ``-m "not xla"``.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.xla
os.environ.setdefault("PJRT_DEVICE", "CPU")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
import _sample_task  # noqa: E402


def test_a_per_sample_task_trains_on_xla_as_on_the_cpu_and_warns_once_naming_the_fix() -> None:
    import torch_xla

    task = _sample_task.make_task(max_train=6, hidden_dim=4)
    torch.manual_seed(0)
    cpu = task.make_model()
    xla = task.make_model().to(torch_xla.device())
    xla.load_state_dict(cpu.state_dict())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        on_xla = [float(task.loss(xla, list(task.train[i : i + 3]), None)) for i in (0, 3)]
    named = [w for w in caught if "per-sample forward on XLA" in str(w.message)]
    assert len(named) == 1 and "StaticShapes" in str(named[0].message)
    on_cpu = [float(task.loss(cpu, list(task.train[i : i + 3]), None)) for i in (0, 3)]
    assert on_xla == pytest.approx(on_cpu, rel=1e-5)
