"""`python -m torchfold train --task` on XLA's CPU backend: a task written outside the package, and the pyast task.

Runs only in the XLA environment (``.venv-xla``, the Makefile's ``test-xla``); the main suite
deselects it with ``-m "not xla"``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from _external_task import MODULE, write_task

pytestmark = pytest.mark.xla
REPO = Path(__file__).resolve().parents[2]
QUICK = ["--device", "xla", "--trace", "8", "--minibatch-size", "4", "--no-progress", "--workers", "0"]


def _train(args: list[str], cwd: Path, *path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, path), str(REPO), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "torchfold", "train", *args, *QUICK],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=500,
    )


def test_a_task_outside_the_package_trains_on_xla_with_static_shapes(tmp_path: Path) -> None:
    write_task(tmp_path)
    done = _train(
        ["--task", f"{MODULE}:make_task", "--max-steps", "3", "--log-every", "1"], tmp_path, tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "device xla:0" in done.stdout and "done: 3 steps (24 samples" in done.stdout, done.stdout
    assert "eval: accuracy " in done.stdout
    assert "unpadded plan" not in done.stderr  # the run passed the envelope to the task's build


def test_the_pyast_task_trains_on_xla_with_static_shapes(tmp_path: Path) -> None:
    root = Path(sysconfig.get_paths()["stdlib"]) / "email"
    args = ["--task", "pyast", "--task-arg", f"root={root}", "--task-arg", "train_size=40"]
    args += ["--task-arg", "eval_size=8", "--task-arg", "hidden_dim=8", "--task-arg", "embedding_dim=4"]
    done = _train([*args, "--max-steps", "3", "--log-every", "1"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "device xla:0" in done.stdout and "done: 3 steps (24 samples" in done.stdout, done.stdout
    assert "eval: accuracy " in done.stdout
