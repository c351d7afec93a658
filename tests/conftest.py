"""Fixtures shared by several test modules, and where the tests' data lives.

The package assumes no data directory: the tests name theirs (:data:`DATA_DIR`). By default it
is :data:`SAMPLE_DIR`, ``tests/data``: the first few hundred trees of each SST split and the
three traces, committed with the tests, so a clone runs the suite with nothing beside it.
``$TORCHFOLD_DATA`` points the suite (the slow tests and the benchmarks' smoke tests included) at
a full copy instead (``sst/{train,dev,test}.txt``, ``traces/``). :data:`DATA_DIR` is also set as
``$TORCHFOLD_DATA`` for the test session (and the processes it starts, notebooks included), for
the tests that read SST through the variable.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The committed sample (see tests/data/README.md for what it holds and where it comes from).
SAMPLE_DIR = Path(__file__).resolve().parent / "data"
DATA_DIR = Path(os.environ.get("TORCHFOLD_DATA") or SAMPLE_DIR)
os.environ["TORCHFOLD_DATA"] = str(DATA_DIR)
# XLA's CPU compiler without LLVM's optimizations for the test session (and the processes it
# starts): compiling the tests' programs is most of the XLA lane's time, and this halves it
# (about 395 s against 680-870 s for the lane). What the tests assert does not depend on it: the
# same programs and compile counts; results may differ from an optimized build in the last bit
# of a float32 (measured on a trainer's losses), within the tolerances every XLA-against-CPU
# comparison has. Benchmarks run XLA as users do, optimized.
_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")
if "--xla_backend_optimization_level" not in _XLA_FLAGS:
    os.environ["XLA_FLAGS"] = f"{_XLA_FLAGS} --xla_backend_optimization_level=0".strip()
# Trees per SST split in the sample (the first lines of each file) and in the full treebank.
SAMPLE_SST_COUNTS = {"train": 700, "dev": 250, "test": 200}
FULL_SST_COUNTS = {"train": 8544, "dev": 1101, "test": 2210}


def sst_counts() -> dict[str, int]:
    """Trees per split that :data:`DATA_DIR` holds: the sample's by default, the full treebank's otherwise."""
    return SAMPLE_SST_COUNTS if DATA_DIR.resolve() == SAMPLE_DIR else FULL_SST_COUNTS


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The data folder (sst/, traces/); fails (never skips) when it is missing."""
    if not (DATA_DIR / "sst" / "train.txt").is_file():
        pytest.fail(
            f"test data not found at {DATA_DIR} (sst/train.txt): unset TORCHFOLD_DATA to use tests/data"
        )
    return DATA_DIR


@pytest.fixture(scope="module")
def traces_dir() -> Path:
    """The traces folder; fails (never skips) when it is missing."""
    if not (DATA_DIR / "traces" / "step_batchsize_example.csv").is_file():
        pytest.fail(f"traces not found at {DATA_DIR}/traces: unset TORCHFOLD_DATA to use tests/data")
    return DATA_DIR / "traces"
