"""The default step on XLA runs the step's Python at every step, so it reads what eager code reads.

Each case trains a small Tree-LSTM on SST trees with ``TraceTrainer`` on XLA's CPU backend with
the default ``compile="auto"`` and the same run eagerly on the CPU, and compares every step's
loss, the final parameters and the optimizer state (``scripts/fuzz_replay.py``'s comparison).
The scenarios hold, at once, every kind of read that a replay which skips the step's Python
got wrong without a word: a numpy scalar, a class attribute, a global and an attribute first
set after the trainer was made, an activation function swapped in an attribute, an attribute
two objects down, a loss that is an ``nn.Module`` whose weight changes, a tensor attribute
rebound at every call (a running statistic), a term switched on by Python's ``random``, a tensor
attribute replaced anew; and the two settings a replay refused: an attribute that no step reads
set at every step (``model.global_step``) and ``OneCycleLR``, which cycles the momentum (SGD) or
Adam's first beta.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.train.capture.fuzzer import load_fuzzer

os.environ.setdefault("PJRT_DEVICE", "CPU")
ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "tests" / "data"

#: every change kind of the fuzzer, at steps 0-3 of a 5-step epoch: (after step, kind, value)
EVERY_READ = [
    (0, "numpy scalar", 2.0),
    (0, "class attribute", 3.0),
    (1, "late global", 0.5),
    (1, "late attribute", 2.0),
    (2, "swapped function", 0.0),
    (2, "deep attribute", 0.5),
    (3, "module loss weight", 2.0),
    (3, "tensor replaced", 0.5),
    (3, "global", 2.0),
]


def _scenario(fuzz: Any, **fields: Any) -> Any:
    """A fuzzer scenario of ``fields``, the rest plain: no frozen parameter, no dropout, no changes,
    no module loss, running statistic or random term."""
    plain = dict(
        frozen=False, dropout=False, changes=[], module_loss=False, running_stat=False, random_term=False
    )
    return fuzz.Scenario(**{**plain, **fields})


@pytest.fixture(autouse=True)
def _float64() -> Any:
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


@pytest.mark.xla
@pytest.mark.timeout(900)
@pytest.mark.parametrize("optimizer", ["adam", "momentum"])
def test_every_kind_of_read_trains_on_xla_as_on_the_cpu(optimizer: str) -> None:
    import torch_xla

    fuzz = load_fuzzer()
    device = torch_xla.device()  # (before any backward on the CPU: autograd counts devices at its first)
    scenario = _scenario(
        fuzz,
        seed=7,
        optimizer=optimizer,
        lr=0.1,
        weight_decay=0.01,
        groups=2,
        schedule="onecycle",
        trace=[3, 6, 9, 3, 9],  # one epoch of the 30 trees, steps of 1-3 minibatches
        changes=EVERY_READ,
        module_loss=True,
        running_stat=True,
        random_term=True,
    )
    xla = fuzz.run(scenario, device, DATA)
    cpu = fuzz.run(scenario, torch.device("cpu"), DATA)
    verdict, details = fuzz.compare(scenario, cpu, xla)
    assert verdict == "equal", details
    assert not [w for w in xla["warnings"] if "not replayed" in w or "took more than" in w], xla["warnings"]
    # the changes did change the run: the same scenario without them trains to other losses
    unchanged = fuzz.run(fuzz.Scenario(**{**vars(scenario), "changes": []}), torch.device("cpu"), DATA)
    assert unchanged["losses"][:1] == pytest.approx(cpu["losses"][:1], rel=1e-9)
    assert unchanged["losses"][1:] != pytest.approx(cpu["losses"][1:], rel=1e-3)


@pytest.mark.xla
@pytest.mark.timeout(900)
@pytest.mark.parametrize("numpy_scalar", [False, True])
def test_every_kind_of_read_trains_under_torch_compile_on_xla_as_on_the_cpu(numpy_scalar: bool) -> None:
    """``compile="on"``: TorchDynamo's guards and side effects, torchfold's programs behind them,
    against every kind of change the fuzzer makes (a tensor attribute made or changed in place
    between steps is a pending computation, run before it is a program's input), equal to the
    eager CPU run. A loss that reads a numpy scalar (TorchDynamo makes it a host tensor read with
    ``.item()``, which a program would keep) runs lazily, with one warning saying so."""
    import torch_xla

    fuzz = load_fuzzer()
    device = torch_xla.device()
    changes = [change for change in EVERY_READ if numpy_scalar or change[1] != "numpy scalar"]
    scenario = _scenario(
        fuzz,
        seed=7,
        optimizer="adam",
        lr=0.1,
        weight_decay=0.01,
        groups=2,
        schedule="onecycle",
        trace=[3, 6, 9, 3, 9],
        changes=[*changes, (2, "tensor attribute", 0.5)],
        module_loss=True,
        running_stat=True,
    )
    xla = fuzz.run(scenario, device, DATA, compile="on")
    cpu = fuzz.run(scenario, torch.device("cpu"), DATA)
    verdict, details = fuzz.compare(scenario, cpu, xla)
    assert verdict == "equal", details
    assert not [w for w in xla["warnings"] if "not through torch.compile" in w], xla["warnings"]
    lazily = [w for w in xla["warnings"] if "runs a step's graph lazily" in w]
    if numpy_scalar:
        assert len(lazily) == 1 and "on the host" in lazily[0], xla["warnings"]
    else:
        assert not lazily and xla["captures"] >= 1, xla["warnings"]


@pytest.mark.xla
def test_the_opt_in_replay_says_its_contract_once_when_made() -> None:
    import torch_xla

    from torchfold.train import AccumulatingOptimizer, StepMechanism
    from torchfold.train.capture import XlaRunner
    from torchfold.train.capture.mechanism import REPLAY_CONTRACT

    model = torch.nn.Linear(2, 1).to(torch_xla.device())
    optimizer = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    mechanism = StepMechanism(torch_xla.device(), compile="replay", world_size=1)
    with pytest.warns(UserWarning) as caught:
        runner = mechanism.runner(model, lambda m, outputs, targets: outputs[0].sum(), optimizer)
    assert isinstance(runner, XlaRunner)
    assert [str(w.message) for w in caught] == [REPLAY_CONTRACT]
    assert "without running its Python" in REPLAY_CONTRACT and "compile='auto'" in REPLAY_CONTRACT


@pytest.mark.xla
@pytest.mark.timeout(900)
@pytest.mark.parametrize("optimizer", ["adam", "momentum"])
def test_the_replay_runs_a_onecycle_schedule_on_one_update_program(optimizer: str) -> None:
    """``OneCycleLR`` cycles Adam's first beta (SGD's momentum) at every step: the opt-in replay
    reads them at each step on the same update program (no refusal), equal to the CPU's steps."""
    import torch_xla

    fuzz = load_fuzzer()
    device = torch_xla.device()
    scenario = _scenario(
        fuzz,
        seed=3,
        optimizer=optimizer,
        lr=0.1,
        weight_decay=0.01,
        groups=1,
        schedule="onecycle",
        trace=[3, 3, 3, 3, 3, 3, 3, 3, 3, 3],  # one minibatch a step: one minibatch program
    )
    with pytest.warns(UserWarning, match="compile='replay'"):
        xla = fuzz.run(scenario, device, DATA, compile="replay")
    cpu = fuzz.run(scenario, torch.device("cpu"), DATA)
    verdict, details = fuzz.compare(scenario, cpu, xla)
    assert verdict == "equal", details
    refusals = [w for w in xla["warnings"] if "not replayed" in w or "took" in w]
    assert not refusals, refusals
    # the minibatch and update programs (captured, verified), the all-reduce's, the first update's
    # (which makes the optimizer's state), the loss read back: never one per step of the schedule
    assert xla["compilations"] <= 6, xla["compilations"]


@pytest.mark.xla
@pytest.mark.timeout(900)
def test_the_default_compiles_a_layout_once_whatever_its_place_in_a_step() -> None:
    """A step's later minibatch adds to the gradients the first left, and a step's sample count
    divides them: with the buffers, the weights and the divisor as the graphs' inputs, a later
    minibatch is the first one's graph and a step of several the update of one. One layout here:
    steps of 1, 2 and 3 minibatches compile nothing after the first two steps."""
    import torch_xla

    fuzz = load_fuzzer()
    device = torch_xla.device()
    scenario = _scenario(
        fuzz,
        seed=11,
        optimizer="adam",
        lr=0.01,
        weight_decay=0.0,
        groups=1,
        schedule="none",
        trace=[3, 3, 6, 9, 3],  # (24 trees: none is split)
    )
    xla = fuzz.run(scenario, device, DATA)
    cpu = fuzz.run(scenario, torch.device("cpu"), DATA)
    verdict, details = fuzz.compare(scenario, cpu, xla)
    assert verdict == "equal", details
    # step 0: its minibatch and the update that makes the optimizer's state; step 1: the steady
    # update; then steps of 2, 3 and 1 minibatches reuse them (before: 2 more at the first of two)
    assert xla["compiled_by_step"][2:] == [0, 0, 0], xla["compiled_by_step"]


class _Scaled(torch.nn.Module):
    """The example Tree-LSTM (its fold ops), and a class attribute its loss reads."""

    scale = 1.0

    def __init__(self, vocab: int) -> None:
        super().__init__()
        from torchfold.examples.models import TreeLSTM

        self.tree = TreeLSTM(vocab, 8, 8)
        self.center = torch.zeros(8)  # a running statistic the loss rebinds at every call

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.tree, name)


_FACTOR = 1.0  # a global the loss reads


def _compiled_run(
    device: torch.device, compile: str, *, changes: bool, random_term: bool, one_layout: bool = True
) -> dict[str, Any]:
    """Train ``_Scaled`` on 60 SST trees, four steps; ``changes``: the class attribute and the global
    change after step 0; ``one_layout``: one static-shape layout (else the mechanism's, depth
    buckets for ``"on"``). Its losses, final parameters, captures and warnings."""
    import random
    import warnings

    from torchfold.examples.datasets import Vocab, load_sst
    from torchfold.examples.models import TreeLSTMBuild, tree_lstm_loss
    from torchfold.train import (
        AccumulatingOptimizer,
        StepLoader,
        StepMechanism,
        TraceTrainer,
        fit_static_shapes,
    )
    from torchfold.train.schedule.trace import BatchSizeTrace

    global _FACTOR
    _FACTOR, _Scaled.scale = 1.0, 1.0
    fuzz_compilations = load_fuzzer()._compilations  # (torch_xla's count of compilations so far)
    trees = load_sst(DATA, max_trees=60)
    vocab = Vocab.build(trees)
    mechanism = StepMechanism(device, compile=compile)
    shapes = mechanism.static_shapes(**({"depth_buckets": False} if one_layout else {}))
    build = TreeLSTMBuild(vocab, shapes=fit_static_shapes(trees, TreeLSTMBuild(vocab), 10, shapes=shapes))
    torch.manual_seed(0)
    random.seed(0)
    model = _Scaled(len(vocab)).to(device)
    model.center = model.center.to(device)
    optimizer = AccumulatingOptimizer(mechanism.optimizer(torch.optim.Adam, model.parameters(), lr=0.01))
    trace = BatchSizeTrace.from_schedule("steps:10x2,20x2")

    def loss(m: Any, outputs: Any, targets: Any) -> torch.Tensor:
        base = tree_lstm_loss(m.tree, outputs, targets)
        head = m.tree.classifier.weight
        m.center = 0.5 * m.center + 0.5 * head.detach().mean(0)
        total = base * m.scale * _FACTOR + ((head - m.center) ** 2).sum()
        if random_term and random.random() < 0.5:
            total = total + (head**2).sum()
        return total

    compiled_by_step: list[int] = []

    def on_step(stats: Any) -> None:
        global _FACTOR
        if device.type == "xla":
            compiled_by_step.append(fuzz_compilations())
        if changes and stats.step == 0:
            _Scaled.scale = 3.0
            _FACTOR = 0.5

    loader = StepLoader(trees, 10, build=build, trace=trace, seed=0, num_workers=0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = TraceTrainer(
                model, optimizer, loader, loss, progress=False, on_step=on_step, compile=compile, seed=0
            )
            with loader:
                history = trainer.fit(epochs=1)
    finally:
        _FACTOR, _Scaled.scale = 1.0, 1.0
    return {
        "update": getattr(trainer.runner, "compiled_update", None),
        "losses": [stats.loss for stats in history],
        "params": [p.detach().cpu() for p in model.parameters()],
        "center": model.center.cpu(),
        "captures": trainer.runner.captures,
        "layouts": len(loader.layout_examples()),
        "warnings": [str(w.message) for w in caught],
        "compiled_by_step": [b - a for a, b in zip([0, *compiled_by_step], compiled_by_step, strict=False)],
    }


@pytest.mark.xla
@pytest.mark.timeout(900)
def test_torch_compile_on_xla_compiles_every_layout_in_the_warm_up_and_changes_nothing() -> None:
    """``compile="on"`` on XLA with depth buckets: the trainer's warm-up has TorchDynamo trace
    every layout and compiles its program without running it (the running statistic the loss
    rebinds is not rebound by it), so no step after the second compiles, and the run equals the
    eager CPU run."""
    import torch_xla

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        xla = _compiled_run(torch_xla.device(), "on", changes=False, random_term=False, one_layout=False)
        cpu = _compiled_run(torch.device("cpu"), "off", changes=False, random_term=False, one_layout=False)
    finally:
        torch.set_default_dtype(before)
    assert xla["layouts"] >= 2 and xla["captures"] == xla["layouts"], (xla["layouts"], xla["captures"])
    assert xla["losses"] == pytest.approx(cpu["losses"], rel=1e-4)
    for a, b in zip(xla["params"], cpu["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(xla["center"], cpu["center"], rtol=1e-4, atol=1e-5)
    # step 0 (its layout, the update that makes the optimizer's state), the warm-up and the steady
    # update at step 1; then steps of two minibatches of other layouts compile nothing
    assert xla["compiled_by_step"][2:] == [0, 0], xla["compiled_by_step"]


@pytest.mark.xla
@pytest.mark.timeout(900)
@pytest.mark.parametrize("random_term", [False, True])
def test_torch_compile_on_xla_reads_what_eager_code_reads_or_runs_the_python(random_term: bool) -> None:
    """``compile="on"`` on XLA: TorchDynamo's guards follow a class attribute and a global changed
    mid-run, and its side effects rebind the running statistic, as the eager CPU run does; a step it
    cannot trace whole (Python's ``random``) runs its Python instead, with one warning naming it."""
    import torch_xla

    device = torch_xla.device()
    before = torch.get_default_dtype()
    torch.set_default_dtype(
        torch.float32
    )  # (the openxla backend's float64 graphs: see docs/design/capture.md)
    try:
        xla = _compiled_run(device, "on", changes=True, random_term=random_term)
        cpu = _compiled_run(torch.device("cpu"), "off", changes=True, random_term=random_term)
        unchanged = _compiled_run(torch.device("cpu"), "off", changes=False, random_term=random_term)
    finally:
        torch.set_default_dtype(before)
    fell_back = [w for w in xla["warnings"] if "not through torch.compile" in w]
    if random_term:
        assert xla["captures"] == 0 and len(fell_back) == 1 and "random" in fell_back[0], xla["warnings"]
    else:
        assert xla["captures"] == 1 and not fell_back, xla["warnings"]
        assert xla["update"] is None  # (the update stays lazy on XLA: see CompiledUpdate's module)
        # step 1 compiles again (the guards saw the changes); the steps of 2 minibatches after it
        # compile nothing: the gradients go through the buffers the lazy step uses, so a later
        # minibatch is the first one's graph
        assert xla["compiled_by_step"][1] > 0 and xla["compiled_by_step"][2:] == [0, 0], xla[
            "compiled_by_step"
        ]
    assert xla["losses"] == pytest.approx(cpu["losses"], rel=1e-4)
    for a, b in zip(xla["params"], cpu["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(xla["center"], cpu["center"], rtol=1e-4, atol=1e-5)
    # the changes did change the run
    assert unchanged["losses"][0] == pytest.approx(cpu["losses"][0], rel=1e-6)
    assert unchanged["losses"][1:] != pytest.approx(cpu["losses"][1:], rel=1e-3)
