"""A per-sample task (``Task(forward=...)``): trained by TraceTrainer, captured_step and the CLI
as plain eager per-sample PyTorch would train it (mean loss over a step's samples)."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchfold.train import AccumulatingOptimizer, StepLoader, Task, TraceTrainer, captured_step
from torchfold.train.loop.checkpoint import list_checkpoints, load_checkpoint
from torchfold.train.persample import SampleLoss, SampleMinibatch, build_samples

REPO = Path(__file__).resolve().parents[2]
HELPERS = REPO / "tests" / "helpers"
sys.path.insert(0, str(HELPERS))
import _sample_task  # noqa: E402


def _model(task: Task) -> torch.nn.Module:
    torch.manual_seed(0)
    return task.make_model().double()


def _eager(task: Task, steps: list[list[object]], lr: float) -> torch.nn.Module:
    """Plain per-sample PyTorch: for each step, the mean of its samples' losses, backward, SGD."""
    model = _model(task)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    assert task.forward is not None
    for samples in steps:
        opt.zero_grad()
        torch.stack([task.forward(model, s) for s in samples]).mean().backward()
        opt.step()
    return model


def test_trace_trainer_trains_a_per_sample_task_as_eager_pytorch_does() -> None:
    torch.set_default_dtype(torch.float64)  # the per-sample code makes its own tensors
    try:
        task = _sample_task.make_task(max_train=12, hidden_dim=6)
        model = _model(task)
        opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
        # steps of 6, 3 and 3 samples in minibatches of 3: a step's minibatches combine into its mean
        loader = StepLoader(task.train, 3, build=task.build, trace=[6, 3, 3], seed=1)
        TraceTrainer(model, opt, loader, task.loss, log_every=0).fit(max_steps=3)
        same = StepLoader(task.train, 3, trace=[6, 3, 3], seed=1)  # the same steps, the items as they are
        steps = [[s for mb in step for s in mb.data] for step in itertools.islice(same, 3)]
        assert [len(s) for s in steps] == [6, 3, 3]
        eager = _eager(task, steps, lr=0.5)
        for (name, got), want in zip(model.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=name)
        assert any(
            (p - q).abs().max() > 1e-3
            for p, q in zip(model.parameters(), _model(task).parameters(), strict=True)
        )
    finally:
        torch.set_default_dtype(torch.float32)


def test_captured_step_trains_a_per_sample_task() -> None:
    task = _sample_task.make_task(max_train=6, hidden_dim=4)
    model = _model(task).float()
    step = captured_step(model, task.loss, torch.optim.SGD(model.parameters(), lr=0.5), compile="off")
    first, second = task.build(task.train[:4]), task.build(task.train[4:])
    loss = step([(first[0], first[1], 4), (second[0], second[1], 2)])
    eager = _eager(task, [list(task.train)], lr=0.5).float()
    want = torch.stack([task.forward(_model(task).float(), s) for s in task.train]).mean()  # type: ignore[misc]
    torch.testing.assert_close(torch.as_tensor(float(loss)), want.detach(), rtol=1e-5, atol=1e-6)
    for got, wanted in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(got, wanted, rtol=1e-5, atol=1e-6)


def test_the_cli_trains_a_per_sample_task(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "torchfold", "train", "--task", "_sample_task:make_task", "--task-arg", "max_train=8",
         "--trace", "4", "--minibatch-size", "2", "--max-steps", "2", "--no-progress", "--log-every", "1",
         "--workers", "0"],
        env={**os.environ, "PYTHONPATH": f"{HELPERS}:{REPO}"},
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "sst-per-sample" in done.stdout + done.stderr


@pytest.mark.parametrize("flag", ["on", "replay"])
def test_the_cli_refuses_to_capture_a_per_sample_task_naming_the_fix(tmp_path: Path, flag: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "torchfold", "train", "--task", "_sample_task:make_task", "--task-arg", "max_train=8",
         "--trace", "4", "--minibatch-size", "2", "--max-steps", "2", "--no-progress", "--workers", "0",
         "--compile", flag],
        env={**os.environ, "PYTHONPATH": f"{HELPERS}:{REPO}"},
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"--compile {flag} captures" in done.stderr and "drop --compile" in done.stderr, done.stderr[
        -2000:
    ]


def test_loader_workers_build_a_per_sample_task_s_minibatches() -> None:
    # SampleMinibatch crosses the worker's pipe: the same steps as built in the training process
    task = _sample_task.make_task(max_train=12, hidden_dim=4)
    built = {}
    for workers in (0, 2):
        loader = StepLoader(task.train, 3, build=task.build, trace=[6, 6], seed=1, num_workers=workers)
        built[workers] = [[list(mb.data[0].samples) for mb in step] for step in itertools.islice(loader, 2)]
    assert built[2] == built[0] and len(built[0][0]) == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_two_torchrun_processes_train_a_per_sample_task_as_one_process_does(tmp_path: Path) -> None:
    # each rank batches its share of a step with autobatch; the all-reduced step equals one process's
    train = ["-m", "torchfold", "train", "--task", "_sample_task:make_task", "--task-arg", "max_train=16",
             "--trace", "8,4,8", "--minibatch-size", "2", "--max-steps", "3", "--no-progress", "--log-every", "0",
             "--workers", "0", "--backend", "gloo", "--checkpoint-every", "3"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{HELPERS}:{REPO}", "OMP_NUM_THREADS": "1"}
    runs = {
        "one": [sys.executable, *train],
        "two": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--nnodes=1",
                "--max-restarts=0", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{_free_port()}", *train],
    }  # fmt: skip
    models = {}
    for name, command in runs.items():
        folder = tmp_path / name
        folder.mkdir()
        command = [*command, "--checkpoint-dir", str(folder / "ckpt")]
        done = subprocess.run(command, env=env, cwd=folder, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert f"{1 if name == 'one' else 2} process(es)" in done.stdout, done.stdout[-2000:]
        [(step, path)] = list_checkpoints(folder / "ckpt")
        assert step == 3
        models[name] = load_checkpoint(path)["model"]
    torch.testing.assert_close(models["two"], models["one"], rtol=1e-5, atol=1e-6)


def test_a_forward_returning_no_scalar_is_refused_naming_the_sample() -> None:
    loss = SampleLoss(lambda model, x: model(torch.ones(1, 1) * x))  # (1, 2): not a loss
    with pytest.raises(
        ValueError, match=r"Task forward returned shape \(1, 2\) for sample 0 .*scalar tensor"
    ):
        loss(torch.nn.Linear(1, 2), [1.0, 2.0])


def test_a_task_gives_forward_or_build_and_loss() -> None:
    model = torch.nn.Linear(1, 1)
    with pytest.raises(TypeError, match="forward is given with build and loss; give either"):
        Task("t", train=[1], build=build_samples, model=lambda: model, loss=SampleLoss(len), forward=len)
    with pytest.raises(TypeError, match="neither forward nor build and loss are given"):
        Task("t", train=[1], model=lambda: model)
    task = Task("t", train=[1], model=lambda: model, forward=lambda m, x: m(torch.ones(1, 1) * x).sum())
    plan, targets = task.build([1, 2])
    assert isinstance(plan, SampleMinibatch) and len(plan) == 2 and targets is None
