"""One run context: the device, the process-group backend, the accumulation dtype and where checkpoints are read.

Each has one rule (:func:`torchfold.engine.resolve.device_for`, :func:`default_device`,
:func:`process_group_backend`, :func:`accumulation_dtype`, :data:`CHECKPOINT_MAP_LOCATION`), and the
trainer, the CLI, the step mechanisms and the engine all ask it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _loop_worker import MINIBATCH, make_model, make_trainer, sst_trees
from _train_cli import run_train, small_run

import torchfold.cli.train as cli_train
from torchfold.engine.fold import Fold
from torchfold.engine.resolve import device_for
from torchfold.engine.static.shapes import StaticShapes
from torchfold.examples.datasets import Vocab
from torchfold.examples.models import TreeLSTMBuild, tree_lstm_loss
from torchfold.train import RunContext, TraceTrainer, captured_step, run_context, world
from torchfold.train.capture.compiled import CompiledLoss, CompiledUpdate
from torchfold.train.capture.mechanism import step_runner
from torchfold.train.capture.runner import EagerRunner
from torchfold.train.data.loader import StepLoader
from torchfold.train.distributed import devices
from torchfold.train.distributed.world import (
    CHECKPOINT_MAP_LOCATION,
    accumulation_dtype,
    default_device,
    process_group_backend,
)
from torchfold.train.optim.optimizer import AccumulatingOptimizer

META = torch.device("meta")


def test_each_answer_comes_from_one_rule() -> None:
    ctx = run_context("cpu")
    assert ctx == RunContext(torch.device("cpu"))
    assert (ctx.device, ctx.backend, ctx.accumulation_dtype, ctx.map_location) == (
        torch.device("cpu"),
        "gloo",
        torch.float64,
        CHECKPOINT_MAP_LOCATION,
    )
    assert ctx.world == world() and ctx.map_location == torch.device("cpu")
    assert run_context().device == default_device()
    assert [process_group_backend(d) for d in ("cuda:1", "cpu", "xla:0")] == ["nccl", "gloo", "gloo"]
    assert run_context("cuda:1").backend == "nccl"  # a CUDA run's context, made without touching CUDA
    assert [accumulation_dtype(d) for d in ("cpu", "cuda", "xla", "mps")] == [
        torch.float64,
        torch.float64,
        torch.float32,
        torch.float32,
    ]
    # The model's device: its first parameter's, else its first buffer's (the engine's rule).
    only_buffers = torch.nn.BatchNorm1d(2, affine=False).to(META)
    assert run_context(model=only_buffers).device == device_for(only_buffers) == META
    assert run_context("cpu", model=only_buffers).device == torch.device("cpu")  # explicit wins


def _parts(model: torch.nn.Module, device: str | None) -> dict[str, torch.device]:
    """Where each part of torchfold computes for ``model`` with ``device`` (None: left out)."""
    trees = sst_trees(24)
    vocab = Vocab.build(trees)
    loader = StepLoader(trees, MINIBATCH, build=TreeLSTMBuild(vocab), trace=12)
    optimizer = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    trainer = TraceTrainer(model, optimizer, loader, tree_lstm_loss, device=device)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    f = Fold(shapes=StaticShapes())
    plan = f.plan([[f.add("leaf", 1)]])
    return {
        "TraceTrainer": trainer.device,
        "TraceTrainer.context": trainer.context.device,
        "captured_step": captured_step(model, tree_lstm_loss, sgd, device=device).device,
        "CompiledLoss": CompiledLoss(model, tree_lstm_loss, device=device).device,
        "CompiledUpdate": CompiledUpdate(sgd, device=device).device,
        "device_for": device_for(model, device),
        "StaticPlan.inputs": plan.inputs(device if device is not None else device_for(model)).ints.device,
    }


def test_an_explicit_device_is_honoured_everywhere() -> None:
    parts = _parts(make_model(Vocab.build(sst_trees(24))), "meta")  # the model is on the CPU
    assert parts == dict.fromkeys(parts, META)


def test_left_out_the_device_is_the_models_everywhere() -> None:
    parts = _parts(make_model(Vocab.build(sst_trees(24))).to(META), None)
    assert parts == dict.fromkeys(parts, META)


def test_the_cli_and_the_trainer_read_checkpoints_where_the_run_context_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    read_to: list[Any] = []
    real_load = torch.load

    def load(*args: Any, **kwargs: Any) -> Any:  # torch.load itself, noting where it put the tensors
        read_to.append(kwargs.get("map_location"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", load)
    ck = tmp_path / "cli"
    args = small_run(tmp_path, "--workers", "0", "--checkpoint-dir", str(ck), "--checkpoint-every", "1")
    assert run_train([*args, "--max-steps", "1"], capsys)[0] == 0
    read_to.clear()
    code, out, err = run_train([*args, "--max-steps", "2"], capsys)
    assert code == 0 and "resumed from" in out, err
    cli = list(read_to)

    read_to.clear()
    trees = sst_trees()
    make_trainer(trees, checkpoint_dir=str(tmp_path / "lib"), checkpoint_every=1).fit(max_steps=1)
    # resume=True (the default): the trainer resumes as it is made, reading the checkpoint once
    assert make_trainer(trees, checkpoint_dir=str(tmp_path / "lib")).resumed_from is not None
    assert (cli, read_to) == ([CHECKPOINT_MAP_LOCATION], [CHECKPOINT_MAP_LOCATION])


def test_the_cli_process_group_backend_follows_the_device_not_the_machine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # `--device cpu` under torchrun on a machine with CUDA: gloo, as the run's tensors are on the
    # CPU (nccl cannot reduce them). The CLI used to pick nccl whenever CUDA was present.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA machine, as far as the choice goes
    monkeypatch.setenv("WORLD_SIZE", "2")
    chosen: list[str] = []

    def init_distributed(backend: str, **kwargs: Any) -> None:  # stop before joining a group
        chosen.append(backend)
        raise ValueError("stopped before joining the group")

    monkeypatch.setattr(cli_train, "init_distributed", init_distributed)
    code, _, err = run_train(
        small_run(tmp_path, "--workers", "0", "--device", "cpu", "--max-steps", "1"), capsys
    )
    assert code == 2 and "stopped before joining the group" in err, err
    assert chosen == [run_context("cpu").backend] == ["gloo"]


def test_the_device_policy_answers_each_question_per_kind() -> None:
    kinds = ("cpu", "cuda:1", "xla:0")  # (made as torch.device values: no CUDA, no torch_xla needed)
    answers = {
        "needs_static_shapes": [devices.needs_static_shapes(k) for k in kinds],
        "replays_steps": [devices.replays_steps(k) for k in kinds],
        "runner_kind": [devices.runner_kind(k) for k in kinds],
        "process_group_backend": [devices.process_group_backend(k) for k in kinds],
        "accumulation_dtype": [devices.accumulation_dtype(k) for k in kinds],
        "fused_optimizer": [devices.fused_optimizer(k) for k in kinds],
        "capturable_optimizer": [devices.capturable_optimizer(k) for k in kinds],
        "checkpoint_map_location": [devices.checkpoint_map_location(k) for k in kinds],
        "on_host": [devices.on_host(torch.device(k)) for k in kinds],
    }
    assert answers == {
        "needs_static_shapes": [False, False, True],
        "replays_steps": [False, True, True],
        "runner_kind": ["compiled", "cuda", "xla"],
        "process_group_backend": ["gloo", "nccl", "gloo"],
        "accumulation_dtype": [torch.float64, torch.float64, torch.float32],
        "fused_optimizer": [True, True, None],
        "capturable_optimizer": [False, False, True],
        "checkpoint_map_location": [CHECKPOINT_MAP_LOCATION] * 3,
        "on_host": [True, False, False],
    }
    # the run context gives the same answers for its device (whether to pad and which runner depend on
    # compile= too: StepMechanism answers those)
    xla = run_context("xla:0")
    assert (xla.is_xla, xla.backend, xla.map_location) == (True, "gloo", torch.device("cpu"))
    cpu = run_context("cpu")
    assert (cpu.is_xla, cpu.backend) == (False, "gloo")


def test_a_run_context_is_its_own_device_so_the_cli_works_it_out_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx = run_context("cpu")
    assert run_context(ctx) is ctx and run_context(ctx, model=torch.nn.Linear(2, 2).to(META)) is ctx
    made: list[RunContext] = []
    real = cli_train.run_context

    def noting(*args: Any, **kwargs: Any) -> RunContext:
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(cli_train, "run_context", noting)
    contexts: list[RunContext] = []
    real_init = TraceTrainer.__init__

    def init(self: TraceTrainer, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        contexts.append(self.context)

    monkeypatch.setattr(TraceTrainer, "__init__", init)
    assert run_train(small_run(tmp_path, "--workers", "0", "--max-steps", "1"), capsys)[0] == 0
    assert len(made) == 1 and contexts == made and contexts[0] is made[0]


def test_a_step_runner_runs_on_the_device_it_was_chosen_for() -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    chosen = step_runner(model, lambda m, o, t: o[0].sum(), optimizer, device=META, compile="off")
    assert chosen.device == META  # the run's device, not the parameters' (the CPU)
    assert EagerRunner(model, lambda m, o, t: o[0].sum(), optimizer).device == torch.device("cpu")
