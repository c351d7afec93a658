"""`python -m torchfold train --task` on XLA's CPU backend: a task written outside the package, and the pyast task.

Runs only in the XLA environment (``.venv-xla``, the Makefile's ``test-xla``); the main suite
deselects it with ``-m "not xla"``.
"""

from __future__ import annotations

import json
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


EVALUATE_ON_XLA = """
import json, sys, warnings
import torch
import torch_xla
import torchfold.examples.tasks as tasks
from torchfold.examples.datasets import Vocab, load_sst
from torchfold.examples.models import TreeLSTM

tasks._EVAL_BATCH = 40  # 5 batches of differing node counts, as 1000 dev trees make in batches of 256
trees = load_sst(sys.argv[1], "dev", max_trees=200)
vocab = Vocab.build(load_sst(sys.argv[1], "train", max_trees=100))
torch.manual_seed(0)
model = TreeLSTM(len(vocab), 4, 4)
on_cpu = tasks.evaluate_sst(model, trees, vocab)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    on_xla = tasks.evaluate_sst(model.to(torch_xla.device()), trees, vocab)
print(json.dumps({"cpu": on_cpu, "xla": on_xla, "warnings": [str(w.message) for w in caught]}))
"""


def test_the_sst_evaluation_on_xla_runs_padded_and_equals_the_cpu_s(data_dir: Path, tmp_path: Path) -> None:
    """``train --device xla`` once warned at its end that ``apply`` returned exact outputs of 4 sizes:
    the evaluation's batches ran padded but were cut to their own rows, a program per node count."""
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", EVALUATE_ON_XLA, str(data_dir)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert not [w for w in found["warnings"] if "exact outputs" in w], found["warnings"]
    assert found["xla"].keys() == found["cpu"].keys()
    for name, value in found["cpu"].items():
        assert found["xla"][name] == pytest.approx(value, abs=1e-6), name
