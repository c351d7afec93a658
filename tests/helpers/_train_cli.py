"""``python -m torchfold train`` inside the test process: the data folder it reads, and runs that leave torch as it was.

The command sets torch's thread count for its run (``--threads``); the test process keeps its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _loop_worker import NUM_TREES, sst_trees

from torchfold.cli.train import main


def write_sst(tmp_path: Path, num_trees: int = NUM_TREES) -> Path:
    """``tmp_path / "data"``, for ``--data``: its ``train.txt`` holds the first ``num_trees`` of ``sst_trees()``."""
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / "train.txt").write_text("".join(f"{tree}\n" for tree in sst_trees()[:num_trees]))
    return data


def small_run(tmp_path: Path, *extra: str) -> list[str]:
    """The arguments of a quick run: 24 trees, steps of 12 in minibatches of 6, a 4-wide Tree-LSTM, quiet."""
    return [
        *("--trace", "12", "--data", str(write_sst(tmp_path, 24)), "--minibatch-size", "6"),
        *("--hidden-dim", "4", "--embedding-dim", "4", "--no-progress", "--log-every", "0"),
        *extra,
    ]


def train(args: list[str]) -> int:
    """``python -m torchfold train ARGS`` in this process: its exit code (torch's thread count restored)."""
    threads = torch.get_num_threads()
    try:
        return main(args)
    finally:
        torch.set_num_threads(threads)


def run_train(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """:func:`train`, and what it wrote to stdout and stderr."""
    code = train(args)
    out, err = capsys.readouterr()
    return code, out, err
