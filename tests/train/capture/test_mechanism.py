"""``StepMechanism`` (torchfold/train/capture/mechanism.py): what a run does around its steps, decided once."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import torchfold
from torchfold.train import AccumulatingOptimizer, StepMechanism
from torchfold.train.capture import EagerRunner, step_runner
from torchfold.train.capture.mechanism import REPLAY_CONTRACT


def _loss(model: Any, outputs: list[torch.Tensor], targets: Any) -> torch.Tensor:
    return outputs[0].sum()


@pytest.mark.parametrize(
    ("device", "choice", "static"),
    [
        ("cpu", "auto", False),
        ("cpu", "off", False),
        ("cpu", "on", True),
        ("cuda", "auto", False),  # every step's Python runs: folds as they come
        ("cuda", "off", False),
        ("cuda", "replay", True),  # a captured step replays one static-shape layout
        ("xla", "auto", True),
        ("xla", "off", True),  # XLA repeats its graphs only with static shapes, captured or not
        ("xla", "on", True),
        ("xla", "replay", True),
    ],
)
def test_static_shapes_follow_the_device_and_the_choice(device: str, choice: str, static: bool) -> None:
    assert StepMechanism(device, compile=choice, world_size=1).needs_static_shapes is static


@pytest.mark.parametrize(
    ("device", "world_size", "defers"),
    [("cpu", 1, False), ("cuda", 1, True), ("xla", 1, True), ("cuda", 2, False), ("xla", 4, False)],
)
def test_losses_are_read_late_in_one_process_on_an_accelerator(
    device: str, world_size: int, defers: bool
) -> None:
    assert StepMechanism(device, world_size=world_size).defers_losses is defers


def test_the_world_size_defaults_to_the_world() -> None:
    assert StepMechanism("cpu").world_size == torchfold.train.world().size == 1


@pytest.mark.parametrize(
    ("device", "options"),
    [("cpu", {"fused": True}), ("cuda", {"fused": True}), ("xla", {"capturable": True}), ("mps", {})],
)
def test_the_optimizer_options_follow_the_device(device: str, options: dict[str, bool]) -> None:
    assert StepMechanism(device).optimizer_options == options


def test_the_optimizer_gets_the_options_its_class_takes_and_the_callers_win() -> None:
    params = [torch.nn.Parameter(torch.zeros(2))]
    adam = StepMechanism("xla").optimizer(torch.optim.Adam, params, lr=0.01)
    assert adam.defaults["capturable"] is True and adam.defaults["lr"] == 0.01
    sgd = StepMechanism("xla").optimizer(torch.optim.SGD, params, lr=0.1)  # SGD has no capturable option
    assert "capturable" not in sgd.defaults
    fused = StepMechanism("cpu").optimizer(torch.optim.SGD, params, lr=0.1, momentum=0.9)
    assert fused.defaults["fused"] is True and fused.defaults["momentum"] == 0.9
    own = StepMechanism("cpu").optimizer(torch.optim.Adam, params, lr=0.1, fused=False)
    assert own.defaults["fused"] is False


def test_an_unknown_compile_choice_is_refused_naming_the_choices() -> None:
    with pytest.raises(
        ValueError, match=r"compile must be one of \('auto', 'off', 'on', 'replay'\), got 'yes'"
    ):
        StepMechanism("cpu", compile="yes")
    assert StepMechanism.compile_choices == ("auto", "off", "on", "replay")


def test_replay_is_an_opt_in_of_xla_and_cuda_that_states_its_contract() -> None:
    with pytest.raises(
        ValueError, match="compile='replay' replays captured steps on XLA and CUDA only, not on cpu"
    ):
        StepMechanism("cpu", compile="replay")
    model = torch.nn.Linear(2, 1)
    optimizer = torchfold.train.AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    # several processes on CUDA: no CUDA graph replay; the contract is said, then why not, and the step runs
    with pytest.warns(UserWarning) as caught:
        runner = StepMechanism("cuda", compile="replay", world_size=2).runner(model, _loss, optimizer)
    said = [str(w.message) for w in caught]
    assert said[0] == REPLAY_CONTRACT and "without running its Python" in said[0]
    assert "steps are not replayed, they run as with compile='auto': 2 processes on CUDA" in said[1]
    assert type(runner).__name__ == "EagerRunner" and runner.compiled is None


@pytest.mark.parametrize("device", ["cpu", "cuda", "xla"])
def test_auto_runs_every_steps_python_on_every_device(device: str) -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torchfold.train.AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for choice in ("auto", "off"):
        runner = StepMechanism(device, compile=choice, world_size=1).runner(model, _loss, optimizer)
        assert type(runner).__name__ == "EagerRunner" and runner.compiled is None


def test_a_world_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="world_size"):
        StepMechanism("cpu", world_size=0)


def test_the_runner_is_the_one_step_runner_chooses() -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    eager = StepMechanism("cpu").runner(model, _loss, optimizer)
    assert type(eager) is EagerRunner and eager.compiled is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a CPU SGD update is captured: a fallback warning fails the test
        captured = StepMechanism("cpu", compile="on", backend="aot_eager").runner(model, _loss, optimizer)
        shorthand = step_runner(
            model, _loss, optimizer, device=torch.device("cpu"), compile="on", backend="aot_eager"
        )
    assert isinstance(captured, EagerRunner) and captured.compiled is not None and captured.strict
    assert type(shorthand) is type(captured) and shorthand.compiled is not None


def test_an_fp16_grad_scaler_keeps_steps_eager_with_a_warning() -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer.grad_scaler = torch.amp.GradScaler("cpu")
    with pytest.warns(UserWarning, match="compile='on': steps run eagerly with a grad_scaler"):
        runner = StepMechanism("cpu", compile="on").runner(model, _loss, optimizer)
    assert type(runner) is EagerRunner and runner.compiled is None


def test_the_trainer_asks_its_mechanism() -> None:
    from torchfold.examples.datasets import Vocab, generate_sst
    from torchfold.examples.models import TreeLSTM, TreeLSTMBuild, tree_lstm_loss

    trees = generate_sst(8, seed=0)
    vocab = Vocab.build(trees)
    model = TreeLSTM(len(vocab), embedding_dim=4, hidden_dim=4)
    optimizer = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    loader = torchfold.train.StepLoader(trees, 4, build=TreeLSTMBuild(vocab), trace=[4, 4])
    trainer = torchfold.train.TraceTrainer(
        model, optimizer, loader, tree_lstm_loss, progress=False, compile="off"
    )
    assert trainer.mechanism.device == trainer.device and trainer.mechanism.compile == "off"
    assert type(trainer.runner) is EagerRunner and not trainer.mechanism.defers_losses
