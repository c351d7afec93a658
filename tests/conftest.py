"""Fixtures shared by several test modules."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchfold.examples.datasets import data_root


@pytest.fixture(scope="module")
def traces_dir() -> Path:
    """The shared traces folder; fails (never skips) when it is missing."""
    root = data_root()
    if root is None or not (root / "traces" / "step_batchsize_example.csv").is_file():
        pytest.fail(
            f"shared data not found (data_root()={root}); set TORCHFOLD_DATA to the folder holding traces/"
        )
    return root / "traces"
