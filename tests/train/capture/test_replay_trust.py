"""Replays you can trust: a replayed step computes what the eager step computes, or refuses with a warning.

Each case trains a small Tree-LSTM on SST trees with ``TraceTrainer`` on XLA's CPU backend (every
step replayed from the minibatch and update programs) and the same run eagerly on the CPU, and
compares every step's loss and the final parameters. The cases are those that once replayed
silently wrong or crashed: learning rates equal to other scalars of the step (torch_xla shares one
buffer among equal scalars), Python numbers and tensors that the loss reads and that change
between steps, a schedule of the optimizer's options, SGD (which reads a tensor learning rate back to the
host), and a value the guard cannot see (the periodic check raises). ``scripts/fuzz_replay.py``
draws many more such runs at random; a few of its scenarios run here.

The guard itself (what it reads, how it names a change) is tested on the CPU at the end.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.train.capture.fuzzer import load_fuzzer
from torchfold.train.capture.guards import MAX_VALUES, StepGuard, frozen_value

os.environ.setdefault("PJRT_DEVICE", "CPU")
ROOT = Path(__file__).resolve().parents[3]
NUM_TREES = 12
MINIBATCH = 3

#: read by ``_penalized_loss`` (a global a guard follows)
LOSS_SCALE = 1.0


def _train(
    device: torch.device,
    trace: list[int],
    *,
    make_optimizer: Callable[[list[torch.nn.Parameter], bool], torch.optim.Optimizer],
    loss: Callable[..., torch.Tensor] | None = None,
    on_step: Callable[[Any, Any], None] | None = None,
    prepare: Callable[[Any], None] | None = None,
    verify_every: int | None = None,
) -> tuple[list[float], list[torch.Tensor], list[str], Any]:
    """Losses, parameters and warnings of a run of ``trace`` on ``device``; ``on_step(trainer, stats)``.
    A last step completes the last epoch (the trainer runs complete epochs; no step may cross one)."""
    from torchfold.engine.static.shapes import StaticShapes
    from torchfold.examples.datasets import Vocab, load_sst
    from torchfold.examples.models import TreeLSTM, TreeLSTMBuild, tree_lstm_loss
    from torchfold.train import AccumulatingOptimizer, StepLoader, TraceTrainer, fit_static_shapes

    trees = load_sst(split="train", max_trees=NUM_TREES)
    vocab = Vocab.build(trees)
    if sum(trace) % NUM_TREES:
        trace = [*trace, NUM_TREES - sum(trace) % NUM_TREES]
    xla = device.type == "xla"
    shapes = (
        fit_static_shapes(trees, TreeLSTMBuild(vocab), MINIBATCH, shapes=StaticShapes(depth_buckets=False))
        if xla
        else None
    )
    torch.manual_seed(0)
    model = TreeLSTM(len(vocab), 6, 6).to(device=device, dtype=torch.float64)
    if prepare is not None:
        prepare(model)
    optimizer = AccumulatingOptimizer(make_optimizer(list(model.parameters()), xla), lr_rule="constant")
    loader = StepLoader(
        trees, MINIBATCH, build=TreeLSTMBuild(vocab, shapes=shapes), trace=trace, seed=0, num_workers=0
    )
    trainer: Any = None

    def report(stats: Any) -> None:
        if on_step is not None:
            on_step(trainer, stats)

    trainer = TraceTrainer(
        model,
        optimizer,
        loader,
        loss or tree_lstm_loss,
        progress=False,
        on_step=report,
        compile="replay" if xla else "off",
    )
    if verify_every is not None and xla:
        trainer.runner.programs.verify_every = verify_every
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = trainer.fit(max_steps=len(trace))
    return (
        [s.loss for s in history],
        [p.detach().cpu() for p in model.parameters()],
        [str(w.message) for w in caught],
        trainer,
    )


def _adam(lr: float, **options: Any) -> Callable[[list[torch.nn.Parameter], bool], torch.optim.Optimizer]:
    return lambda params, xla: torch.optim.Adam(params, lr=lr, eps=1e-3, capturable=xla, **options)


def _both(trace: list[int], **options: Any) -> tuple[Any, Any]:
    """The same run on XLA and on the CPU (XLA first: autograd counts devices at its first backward)."""
    import torch_xla

    with_xla = _train(torch_xla.device(), trace, **options)
    return with_xla, _train(torch.device("cpu"), trace, **options)


def _assert_equal(xla: Any, cpu: Any) -> None:
    losses, params, _, _ = xla
    expected_losses, expected, _, _ = cpu
    assert len(losses) == len(expected_losses) == xla[3].loader.sampler.trace.num_steps, (
        losses,
        expected_losses,
    )
    assert losses == pytest.approx(expected_losses, rel=1e-6), (losses, expected_losses)
    for p, q in zip(params, expected, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def _refusals(warned: list[str]) -> list[str]:
    return [w for w in warned if "not replayed" in w]


@pytest.fixture(autouse=True)
def _float64() -> Any:
    """float64 throughout (Adam's step counts too: its bias corrections in float32 differ from the
    CPU's Python floats by up to 1e-5, a matter of precision, not of replay)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


@pytest.mark.xla
@pytest.mark.parametrize("minibatches", [1, 2])
@pytest.mark.parametrize("lr", [0.1, 0.2], ids=["lr=1-beta1", "lr=0.2"])
def test_a_learning_rate_equal_to_another_scalar_of_the_step_trains_as_on_the_cpu(
    lr: float, minibatches: int
) -> None:
    # `train --device xla --lr 0.1` died at step 3: Adam's 1 - beta1 (0.1) and the learning rate
    # were one torch_xla buffer, and the program's input of one was bound to the other.
    betas = (0.9, 0.999) if lr == 0.1 else (0.8, 0.999)
    xla, cpu = _both([MINIBATCH * minibatches] * 4, make_optimizer=_adam(lr, betas=betas))
    _assert_equal(xla, cpu)
    assert not _refusals(xla[2]), xla[2]
    assert xla[3].runner.captures >= 2


def _penalized_loss(model: Any, outputs: Any, targets: Any) -> torch.Tensor:
    from torchfold.examples.models import tree_lstm_loss

    return tree_lstm_loss(model, outputs, targets) * LOSS_SCALE + 0.01 * (model.classifier.weight**2).sum()


@pytest.mark.xla
def test_a_loss_weight_equal_to_the_scheduled_learning_rate_stays_a_constant() -> None:
    # 0.01 in the loss was replayed as the current learning rate (Adam lr 0.01, a StepLR in on_step).
    def train(device: torch.device) -> Any:
        def make(params: list[torch.nn.Parameter], xla: bool) -> torch.optim.Optimizer:
            return torch.optim.Adam(params, lr=0.01, eps=1e-3, capturable=xla)

        def schedule_on(trainer: Any, stats: Any) -> None:
            if not hasattr(trainer, "schedule"):
                trainer.schedule = torch.optim.lr_scheduler.StepLR(trainer.optimizer.optimizer, 1, gamma=0.5)
            trainer.schedule.step()

        return _train(
            device,
            [MINIBATCH * 2, MINIBATCH, MINIBATCH] * 2,
            make_optimizer=make,
            loss=_penalized_loss,
            on_step=schedule_on,
        )

    import torch_xla

    xla = train(torch_xla.device())
    cpu = train(torch.device("cpu"))
    _assert_equal(xla, cpu)
    assert not _refusals(xla[2]), xla[2]


class _Weighted:
    """A loss whose weight is a module attribute (``model.weight_of_loss``) and a tensor attribute."""

    def __call__(self, model: Any, outputs: Any, targets: Any) -> torch.Tensor:
        from torchfold.examples.models import tree_lstm_loss

        return tree_lstm_loss(model, outputs, targets) * model.weight_of_loss * model.scale.sum()


@pytest.mark.xla
@pytest.mark.parametrize("minibatches", [1, 2], ids=["one minibatch", "two minibatches"])
def test_python_numbers_and_tensor_attributes_the_loss_reads_are_followed(minibatches: int) -> None:
    # A loss weight changed from 1 to 5 at step 3 was ignored (XLA 1.56 against the CPU's 7.81), and
    # so was model.scale.fill_(3.0); with steps of one minibatch, the weight stayed at its second value.
    def prepare(model: Any) -> None:
        model.weight_of_loss = 1.0
        model.scale = torch.ones(2, dtype=torch.float64, device=next(model.parameters()).device) / 2

    def on_step(trainer: Any, stats: Any) -> None:
        model = trainer.model
        model.weight_of_loss = [1.0, 2.0, 5.0, 5.0, 3.0, 3.0][min(stats.step, 5)]
        if stats.step == 2:
            model.scale.fill_(1.5)

    options = {"make_optimizer": _adam(0.01), "loss": _Weighted(), "on_step": on_step, "prepare": prepare}
    xla, cpu = _both([MINIBATCH * minibatches] * 5, **options)
    _assert_equal(xla, cpu)
    assert not _refusals(xla[2]), xla[2]


@pytest.mark.xla
def test_a_number_that_changes_at_every_step_is_refused_by_name_and_trains_as_on_the_cpu() -> None:
    global LOSS_SCALE

    def on_step(trainer: Any, stats: Any) -> None:
        global LOSS_SCALE
        LOSS_SCALE = 1.0 + stats.step + 1

    try:
        LOSS_SCALE = 1.0
        xla = _train(
            _xla_device(),
            [MINIBATCH] * (MAX_VALUES + 3),
            make_optimizer=_adam(0.01),
            loss=_penalized_loss,
            on_step=on_step,
        )
        LOSS_SCALE = 1.0
        cpu = _train(
            torch.device("cpu"),
            [MINIBATCH] * (MAX_VALUES + 3),
            make_optimizer=_adam(0.01),
            loss=_penalized_loss,
            on_step=on_step,
        )
    finally:
        LOSS_SCALE = 1.0
    _assert_equal(xla, cpu)
    refused = _refusals(xla[2])
    assert len(refused) == 1, xla[2]
    assert "the global LOSS_SCALE named by the loss" in refused[0], refused[0]
    assert "register_buffer" in refused[0]


def _xla_device() -> torch.device:
    import torch_xla

    return torch_xla.device()


@pytest.mark.xla
@pytest.mark.parametrize("momentum", [0.0, 0.9], ids=["sgd", "momentum"])
def test_sgd_replays_on_xla_as_adam_does(momentum: float) -> None:
    # `train --device xla --optimizer sgd` never replayed: SGD read its tensor learning rate back.
    def sgd(params: list[torch.nn.Parameter], xla: bool) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.1, momentum=momentum, weight_decay=0.01)

    xla, cpu = _both([MINIBATCH, MINIBATCH * 2, MINIBATCH] * 2, make_optimizer=sgd)
    _assert_equal(xla, cpu)
    assert not _refusals(xla[2]), xla[2]
    assert xla[3].runner.captures >= 2


#: read by ``_hidden_loss`` through another function's globals only: out of the guard's reach
_HIDDEN = {"weight": 1.0}


def _hidden_weight() -> float:
    return _HIDDEN["weight"]


def _hidden_loss(model: Any, outputs: Any, targets: Any) -> torch.Tensor:
    from torchfold.examples.models import tree_lstm_loss

    return tree_lstm_loss(model, outputs, targets) * _hidden_weight()


@pytest.mark.xla
def test_a_value_out_of_the_guards_reach_is_found_by_the_periodic_check() -> None:
    # The guard reads no dict entries of globals; the programs' periodic second capture finds the change.
    def on_step(trainer: Any, stats: Any) -> None:
        if stats.step == 4:
            _HIDDEN["weight"] = 3.0

    try:
        with pytest.raises(RuntimeError, match="no longer matches its step"):
            _train(
                _xla_device(),
                [MINIBATCH] * 12,
                make_optimizer=_adam(0.01),
                loss=_hidden_loss,
                on_step=on_step,
                verify_every=3,
            )
    finally:
        _HIDDEN["weight"] = 1.0


@pytest.mark.xla
@pytest.mark.parametrize("kind", ["adam", "momentum"])
def test_the_periodic_check_passes_a_run_whose_values_stay_and_the_run_equals_the_cpu(kind: str) -> None:
    # A check captures a step again and puts back what the capture changed: the optimizer's state
    # tensors that the update program reads must be the same objects, with their data, after it
    # (a check once left SGD's momentum buffers pending, and the next replay failed).
    def make(params: list[torch.nn.Parameter], xla: bool) -> torch.optim.Optimizer:
        if kind == "adam":
            return torch.optim.Adam(params, lr=0.01, eps=1e-3, capturable=xla)
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    trace = [MINIBATCH, MINIBATCH * 3] * 4
    xla = _train(_xla_device(), trace, make_optimizer=make, verify_every=2)
    cpu = _train(torch.device("cpu"), trace, make_optimizer=make)
    _assert_equal(xla, cpu)
    assert not _refusals(xla[2]), xla[2]


@pytest.mark.xla
def test_a_schedule_of_the_optimizers_options_is_replayed_with_its_values() -> None:
    # betas changed at every step: read at each step by the one update program, never stale, never refused
    def on_step(trainer: Any, stats: Any) -> None:
        group = trainer.optimizer.optimizer.param_groups[0]
        group["betas"] = (0.9 - 0.05 * (stats.step + 1), 0.999)

    xla, cpu = _both([MINIBATCH * 2] * 7, make_optimizer=_adam(0.01), on_step=on_step)
    _assert_equal(xla, cpu)
    assert not _refusals(xla[2]), xla[2]


@pytest.mark.xla
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5])
def test_random_scenarios_of_the_fuzzer_replay_as_on_the_cpu_or_refuse(seed: int) -> None:
    fuzz = load_fuzzer()
    scenario = fuzz.draw(seed, compile="replay")
    xla = fuzz.run(scenario, _xla_device(), ROOT / "tests" / "data", compile="replay")
    cpu = fuzz.run(scenario, torch.device("cpu"), ROOT / "tests" / "data")
    verdict, details = fuzz.compare(scenario, cpu, xla)
    assert verdict in ("equal", "refused"), f"{verdict}: {details} [{scenario}]"


# -- the guard, on the CPU -------------------------------------------------------------------------


def test_frozen_values_tell_apart_what_eager_code_can() -> None:
    assert frozen_value(0.0) != frozen_value(-0.0)
    assert frozen_value(1) != frozen_value(1.0) != frozen_value(True)
    assert frozen_value(float("nan")) == frozen_value(float("nan"))
    assert frozen_value((1, 2)) != frozen_value([1, 2])
    assert frozen_value({"a": 1}) == frozen_value({"a": 1})
    assert frozen_value(object()) is frozen_value(torch.nn.Linear(1, 1))  # not followed


class _Scaled:
    def __init__(self) -> None:
        self.weight = 2.0

    def loss(self, model: Any, outputs: Any, targets: Any) -> torch.Tensor:
        return outputs[0].sum() * self.weight


def test_the_guard_reads_modules_closures_globals_bound_objects_and_partials() -> None:
    global LOSS_SCALE
    model: Any = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))
    model[0].gain = 0.5
    model.hidden = torch.zeros(2)  # a CPU tensor attribute: guarded by its version
    factor = 3.0

    def loss(m: Any, outputs: Any, targets: Any, *, power: int = 2) -> torch.Tensor:
        return outputs[0].sum() * factor * LOSS_SCALE

    scaled = _Scaled()
    cases: list[tuple[str, Any, Any, str]] = [
        (
            "module attribute",
            loss,
            lambda: setattr(model[0], "gain", 0.25),
            "the attribute gain of the model's 0",
        ),
        ("submodule mode", loss, lambda: model[1].eval(), "the attribute training of the model's 1"),
        ("tensor in place", loss, lambda: model.hidden.add_(1), "the attribute hidden of the model"),
        ("global", loss, lambda: globals().update(LOSS_SCALE=2.0), "the global LOSS_SCALE named by the loss"),
        ("defaults", loss, lambda: setattr(loss, "__kwdefaults__", {"power": 3}), "the defaults of the loss"),
        (
            "bound object",
            scaled.loss,
            lambda: setattr(scaled, "weight", 4.0),
            "the attribute weight of the object",
        ),
        (
            "partial",
            functools.partial(loss, power=2),
            None,
            "the arguments of the loss (a functools.partial)",
        ),
    ]
    for where, function, change, named in cases:
        guard = StepGuard(model, function)
        before = guard.values()
        assert guard.values() == before, where
        if change is None:  # a partial's keywords changed in place
            function.keywords["power"] = 5
        else:
            change()
        changed = guard.changed(before)
        assert changed and changed[0].startswith(named), (where, changed)
        LOSS_SCALE = 1.0
    assert "the variable factor of the loss's closure" in StepGuard(model, loss).describe()


def test_the_guard_admits_a_few_values_per_key_then_names_the_one_that_keeps_changing() -> None:
    model: Any = torch.nn.Linear(1, 1)
    model.alpha = 0.0
    guard = StepGuard(model, lambda m, o, t: o[0].sum() * m.alpha)
    for value in range(MAX_VALUES):
        model.alpha = float(value)
        assert guard.admit("layout", guard.values()) is None
    model.alpha = 0.0  # a value seen before: its program is kept
    assert guard.admit("layout", guard.values()) is None
    model.alpha = 99.0
    why = guard.admit("layout", guard.values())
    assert why is not None and why.startswith("the attribute alpha of the model (3.0 -> 99.0)"), why
    assert guard.admit("another layout", guard.values()) is None  # counted per key


def test_the_guard_costs_microseconds_per_step() -> None:
    # a budget, not a timing assertion: the Tree-LSTM's guard reads a few dozen places
    from torchfold.examples.models import TreeLSTM, tree_lstm_loss

    guard = StepGuard(TreeLSTM(100, 8, 8), tree_lstm_loss)
    assert 5 <= len(guard.describe()) <= 100, guard.describe()


@pytest.mark.xla
@pytest.mark.timeout(900)
def test_a_random_scenario_on_two_replicas_replays_as_one_cpu_process() -> None:
    # two XLA CPU devices (a fresh process: the devices are fixed when torch_xla's runtime starts)
    fuzz = load_fuzzer()
    scenario = fuzz.draw(2, 2, "replay")
    xla = fuzz.run_replicas(2, ROOT / "tests" / "data", 2, "replay")
    assert "error" not in xla, xla.get("error")
    cpu = fuzz.run(scenario, torch.device("cpu"), ROOT / "tests" / "data")
    verdict, details = fuzz.compare(scenario, cpu, xla)
    assert verdict in ("equal", "refused"), f"{verdict}: {details} [{scenario}]"


def test_the_guard_reads_the_autocast_state_of_the_models_device() -> None:
    model = torch.nn.Linear(2, 2)
    guard = StepGuard(model, lambda m, o, t: o[0].sum())
    before = guard.values()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert guard.changed(before) == ["autocast on cpu (off -> on, torch.bfloat16)"]
    assert guard.values() == before
