"""Fixtures shared by several test modules, and where the tests' data lives.

The package assumes no data directory: the tests name theirs (:data:`DATA_DIR`):
``$TORCHFOLD_DATA`` if set, else ``../shared/data`` relative to the repository. It is also set as
``$TORCHFOLD_DATA`` for the test session (and the processes it starts), for the tests that read
SST through the variable.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# $TORCHFOLD_DATA when set (a worktree elsewhere), else ../shared/data next to the repository.
DATA_DIR = Path(
    os.environ.get("TORCHFOLD_DATA") or Path(__file__).resolve().parents[1].parent / "shared" / "data"
)
os.environ["TORCHFOLD_DATA"] = str(DATA_DIR)


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The shared data folder (sst/, traces/); fails (never skips) when it is missing."""
    if not (DATA_DIR / "sst" / "train.txt").is_file():
        pytest.fail(f"shared data not found at {DATA_DIR} (sst/train.txt); put the data there")
    return DATA_DIR


@pytest.fixture(scope="module")
def traces_dir() -> Path:
    """The shared traces folder; fails (never skips) when it is missing."""
    if not (DATA_DIR / "traces" / "step_batchsize_example.csv").is_file():
        pytest.fail(f"shared data not found at {DATA_DIR}: put the folder holding traces/ there")
    return DATA_DIR / "traces"
