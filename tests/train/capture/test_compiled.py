"""Captured steps (torchfold.train.capture.compiled): equal to the eager step, captured once per layout, clear refusals.

The captures here use torch.compile's ``aot_eager`` backend: dynamo and AOTAutograd capture the
forward and backward graphs exactly as on XLA or CUDA, without generating code (fast on a CPU).
The XLA lane (tests/train/test_xla.py, tests/train/capture/test_sound_steps.py) runs the real XLA backends.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchfold import Fold, StaticPlan, StaticShapes, StaticShapesWarning
from torchfold.examples.datasets import Vocab, load_sst
from torchfold.examples.models import TreeLSTM, TreeLSTMBuild, tree_lstm_loss
from torchfold.train import AccumulatingOptimizer, StepLoader, TraceTrainer
from torchfold.train.capture.compiled import (
    CompiledLoss,
    CompiledUpdate,
    compile_backend,
    uncapturable_update,
    wants_compile,
)
from torchfold.train.capture.runner import EagerRunner

BACKEND = "aot_eager"


class Chain(torch.nn.Module):
    """Leaves from ints, a binary op, a unary op: enough for random forests of any shape."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.mix = torch.nn.Linear(8, 4)
        self.out = torch.nn.Linear(4, 1)

    def leaf(self, word: torch.Tensor) -> torch.Tensor:
        return self.embed(word)

    def pair(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mix(torch.cat([a, b], 1)))

    def score(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x)


def _forest(fold: Fold, shapes: list[int], seed: int) -> list[object]:
    rng = np.random.default_rng(seed)
    roots = []
    for leaves in shapes:
        nodes = [fold.add("leaf", int(rng.integers(10))) for _ in range(leaves)]
        while len(nodes) > 1:
            i = int(rng.integers(len(nodes) - 1))
            nodes[i : i + 2] = [fold.add("pair", nodes[i], nodes[i + 1])]
        roots.append(fold.add("score", nodes[0]))
    return roots


def _loss(model: torch.nn.Module, outputs: list[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    return (outputs[0].squeeze(1) * targets).pow(2).sum()


def _eager_and_captured(
    plan: StaticPlan, targets: torch.Tensor, captured: CompiledLoss, model: Chain
) -> None:
    reference = copy.deepcopy(model)
    expected = _loss(reference, plan.apply(reference, padded=True), targets)
    expected.backward()
    got = captured(plan, targets)  # forward, loss and backward
    assert not got.requires_grad
    torch.testing.assert_close(got, expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name  # an op no plan of the envelope ran has none
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=name)


# (8 examples of up to 3 batches: each batch that grows the envelope is a capture of seconds; 15 of
# up to 4 took 3 minutes of the unit lane on a shared 2-core machine, for the same claim)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=4), min_size=1, max_size=3), st.integers(0, 99)
)
def test_captured_loss_and_gradients_equal_the_eager_step(batches: list[list[int]], seed: int) -> None:
    torch.manual_seed(seed)
    model = Chain()
    shapes = StaticShapes(min_rows=4)
    captured = CompiledLoss(model, _loss, backend=BACKEND)
    for number, trees in enumerate(batches):
        fold = Fold(shapes=shapes)
        plan = fold.plan([_forest(fold, trees, seed + number)])
        assert isinstance(plan, StaticPlan)
        weights = plan.pad(0, np.linspace(0.5, 1.5, len(trees)).astype(np.float32))
        model.zero_grad(set_to_none=True)
        _eager_and_captured(plan, weights, captured, model)
    assert 1 <= captured.captures <= shapes.version * 2


def test_one_capture_per_layout_and_a_new_one_after_growth() -> None:
    torch.manual_seed(0)
    model, shapes = Chain(), StaticShapes(min_rows=4, warmup=12, headroom=1.0, level_step=1)
    captured = CompiledLoss(model, _loss, backend=BACKEND)
    unpadded = []
    for seed in range(6):
        fold = Fold(shapes=None)
        unpadded.append(fold.plan([_forest(fold, [2, 3], seed)]))
    for plan in unpadded:  # the warm-up: the envelope grows to fit them all, silently
        shapes.cover(plan)
    plans = [shapes.cover(plan) for plan in unpadded]
    keys = {plan.layout.key for plan in plans}
    assert len(keys) == 1
    for plan in plans:
        captured(plan, plan.pad(0, [1.0, 1.0]))
    assert captured.captures == 1
    fold = Fold(shapes=shapes)
    with pytest.warns(StaticShapesWarning):  # the envelope grows: one warning, one new capture
        bigger = fold.plan([_forest(fold, [6, 6, 6, 6, 6], 9)])
    assert bigger.layout.key not in keys
    reference = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    _eager_and_captured(bigger, bigger.pad(0, [1.0] * 5), captured, model)
    assert captured.captures == 2
    del reference


def test_layouts_past_max_captures_run_eagerly_with_one_warning() -> None:
    """A growing envelope (not fitted before training) makes a layout at each growth: past
    ``max_captures`` (8 by default on the CPU, where a capture is minutes of inductor compile)
    they run eagerly, equal to the eager step, and nothing more is compiled."""
    torch.manual_seed(0)
    model, shapes = Chain(), StaticShapes(min_rows=4, warmup=100, headroom=1.0, level_step=1)
    assert CompiledLoss(model, _loss, backend=BACKEND).max_captures == 8  # the CPU's default
    with pytest.raises(ValueError, match=r"CompiledLoss\(max_captures\)"):
        CompiledLoss(model, _loss, backend=BACKEND, max_captures=0)
    captured = CompiledLoss(model, _loss, backend=BACKEND, max_captures=2)
    forests = ([1, 2], [3, 3], [6, 6, 6], [2, 5, 5, 6])  # each grows the envelope: a new layout
    plans = []
    for trees in forests:
        fold = Fold(shapes=shapes)
        plans.append(fold.plan([_forest(fold, trees, len(trees))]))
    assert len({plan.layout.key for plan in plans}) == 4
    for number, (plan, trees) in enumerate(zip(plans, forests, strict=True)):
        model.zero_grad(set_to_none=True)
        targets = plan.pad(0, [1.0] * len(trees))
        if number == 2:
            with pytest.warns(UserWarning, match=r"2 layouts captured \(max_captures=2, .* run eagerly"):
                _eager_and_captured(plan, targets, captured, model)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                _eager_and_captured(plan, targets, captured, model)
    assert captured.captures == 2 and captured.compile_seconds > 0


def test_a_replaced_parameter_is_captured_anew_never_run_stale() -> None:
    torch.manual_seed(0)
    model, shapes = Chain(), StaticShapes(min_rows=4)
    captured = CompiledLoss(model, _loss, backend=BACKEND)
    fold = Fold(shapes=shapes)
    plan = fold.plan([_forest(fold, [3, 2], 0)])
    targets = plan.pad(0, [1.0, 1.0])
    captured(plan, targets)
    model.out.weight = torch.nn.Parameter(torch.full_like(model.out.weight, 3.0))
    model.zero_grad(set_to_none=True)
    _eager_and_captured(plan, targets, captured, model)


def test_an_unpadded_plan_is_refused_with_the_fix() -> None:
    model = Chain()
    fold = Fold(shapes=None)
    plan = fold.plan([_forest(fold, [2], 0)])
    with pytest.raises(TypeError, match=r"static-shape plan .*compile='off'"):
        CompiledLoss(model, _loss, backend=BACKEND)(plan, torch.ones(1))  # type: ignore[arg-type]


def test_a_loss_that_reads_a_value_on_the_host_names_the_op() -> None:
    model = Chain()

    def syncing(model: torch.nn.Module, outputs: list[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        values = outputs[0].tolist()  # a device-to-host read: cannot be part of a captured graph
        return outputs[0].sum() * len(values)

    fold = Fold(shapes=StaticShapes(min_rows=4))
    plan = fold.plan([_forest(fold, [2], 0)])
    captured = CompiledLoss(model, syncing, backend=BACKEND)
    with pytest.raises(Exception, match="tolist") as info:
        captured(plan, torch.ones(4))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "cannot be captured as one graph" in notes and "compile='off'" in notes
    assert "test_compiled.py:" in notes and "outputs[0].tolist()" in notes  # the user's line that read
    assert captured.captures == 0  # nothing half-captured is kept


def test_compile_choices() -> None:
    cpu, cuda, xla = torch.device("cpu"), torch.device("cuda"), torch.device("xla")
    # auto runs every step's Python everywhere; replay (captured, Python not run) is an opt-in of XLA and CUDA
    assert [wants_compile("auto", d) for d in (cpu, cuda, xla)] == [False, False, False]
    assert [wants_compile("off", d) for d in (cpu, cuda, xla)] == [False, False, False]
    assert [wants_compile("replay", d) for d in (cuda, xla)] == [True, True]
    assert wants_compile("on", cpu)
    with pytest.raises(
        ValueError, match=r"compile='replay' replays captured steps on XLA and CUDA only, not on cpu"
    ):
        wants_compile("replay", cpu)
    with pytest.raises(
        ValueError, match=r"compile must be one of \('auto', 'off', 'on', 'replay'\), got 'yes'"
    ):
        wants_compile("yes", cpu)
    assert compile_backend(xla) == ("torchfold_xla", None)
    assert compile_backend(cuda) == ("inductor", None)  # CUDA graphs: CudaStepReplay's


def _sst_trainer(
    compile: str, trees: list[object], vocab: Vocab, shapes: StaticShapes, log: list[str] | None = None
) -> TraceTrainer:
    torch.manual_seed(0)
    model = TreeLSTM(len(vocab), 8, 8)
    # capturable: the captured trainer captures the update too (the eager one's Adam is the default)
    adam = torch.optim.Adam(model.parameters(), lr=0.01, capturable=compile == "on")
    optimizer = AccumulatingOptimizer(adam, lr_rule="linear", ref_batch_size=8)
    loader = StepLoader(
        trees, 4, build=TreeLSTMBuild(vocab, shapes=copy.deepcopy(shapes)), trace=[8, 4, 12, 16, 4], seed=1
    )
    return TraceTrainer(
        model,
        optimizer,
        loader,
        tree_lstm_loss,
        progress=False,
        log_every=0 if log is None else 100,
        log=None if log is None else log.append,
        compile=compile,
        compile_backend=BACKEND,
    )


def test_the_trainer_with_captured_steps_equals_the_eager_trainer_on_sst(data_dir: Path) -> None:
    trees = load_sst(data_dir / "sst", split="train", max_trees=44)
    vocab = Vocab.build(trees)
    shapes = StaticShapes()
    for start in range(0, len(trees), 4):  # fitted on the host first: the envelope does not grow in training
        shapes.cover(TreeLSTMBuild(vocab)(trees[start : start + 4])[0])  # type: ignore[arg-type]
    logs: dict[str, list[str]] = {"off": [], "on": []}
    eager, captured = (_sst_trainer(kind, trees, vocab, shapes, logs[kind]) for kind in ("off", "on"))
    assert eager.compiled is None and captured.compiled is not None
    # the runner holds the captured update; the user's optimizer is left as it was made
    for trainer in (captured, eager):
        assert not any(isinstance(value, CompiledUpdate) for value in vars(trainer.optimizer).values())
    assert isinstance(captured.runner, EagerRunner) and isinstance(
        captured.runner.compiled_update, CompiledUpdate
    )
    assert getattr(eager.runner, "compiled_update", None) is None
    compiled, layouts = captured.compiled, set()

    def recording(plan: Any, targets: Any) -> torch.Tensor:
        layouts.add(plan.layout.key)
        return compiled(plan, targets)

    captured.runner.compiled = recording  # type: ignore[attr-defined]
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaticShapesWarning)
        expected, got = eager.fit(), captured.fit()
    assert [s.num_minibatches for s in got] == [2, 1, 3, 4, 1]  # a varying number of minibatches per step
    assert [s.loss for s in got] == pytest.approx([s.loss for s in expected], rel=1e-5)
    for p, q in zip(captured.model.parameters(), eager.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    for a, b in zip(
        captured.optimizer.state_dict()["state"].values(),
        eager.optimizer.state_dict()["state"].values(),
        strict=True,
    ):
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-7)
    # one capture per layout (here two depth buckets), none per minibatch
    assert compiled.captures == len(layouts) == 2
    # and the run says what it compiled, by dynamo's own count: a graph per layout (its backward
    # compiled with it) and the update's, whatever the batch size and the minibatches of the step
    assert captured.compiled_graphs == compiled.captures + 1, captured.compiled_graphs
    assert (
        f"compiled: {captured.compiled_graphs} graphs by torch.compile in this run (this process)"
        in logs["on"]
    )
    assert eager.compiled_graphs == 0 and not any("compiled" in line for line in logs["off"])


def _graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_a_compiled_update_equals_the_plain_step_whatever_the_learning_rate(kind: str) -> None:
    """A learning rate changed at every step (LR rules do) is an input of the update's graph:
    the update is compiled at the first step and once more when the optimizer makes its state,
    never again; parameters and state equal the plain step's."""

    def make(params: list[torch.nn.Parameter], captured: bool) -> torch.optim.Optimizer:
        if kind == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        # capturable: its step count on the device (the CPU's plain step refuses it; compiled, it runs)
        return torch.optim.Adam(params, lr=0.1, capturable=captured)

    torch.manual_seed(3)
    # float64, so that equal updates agree to rounding; capturable Adam keeps its step count in
    # a float32 tensor, so its bias corrections round to ~1e-7. torch.compile's Adam (any backend,
    # capturable or not) also differs from eager Adam by ~1e-6 of the update: Adam's reference is
    # torch.compile'd too (with a float lr: a new graph per value, as ours must not make).
    tolerance = {"rtol": 1e-12, "atol": 1e-14} if kind == "sgd" else {"rtol": 1e-6, "atol": 1e-8}
    ours = [
        torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64)),
        torch.nn.Parameter(torch.randn(5, dtype=torch.float64)),
    ]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    compiled, plain = CompiledUpdate(make(ours, True), backend=BACKEND), make(theirs, False)
    reference = plain.step if kind == "sgd" else torch.compile(plain.step, backend=BACKEND)
    graphs = [0]
    for step in range(6):
        grads = [torch.randn_like(p) for p in ours]
        for optimizer, params in ((compiled.optimizer, ours), (plain, theirs)):
            optimizer.param_groups[0]["lr"] = 0.05 * (step + 1)
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
        before = _graphs()
        compiled()
        graphs.append(graphs[-1] + _graphs() - before)
        reference()
        for p, q in zip(ours, theirs, strict=True):
            torch.testing.assert_close(p, q, **tolerance)
    assert graphs[-1] == graphs[2] <= 2, graphs  # nothing compiled after the second step
    for a, b in zip(compiled.optimizer.state.values(), plain.state.values(), strict=True):
        for name, value in a.items():
            torch.testing.assert_close(value, b[name], **tolerance, check_dtype=False)


def test_an_update_that_cannot_be_captured_is_named_with_its_fix() -> None:
    params = [torch.nn.Parameter(torch.ones(2))]
    adam = torch.optim.Adam(params, lr=0.1)
    reason = uncapturable_update(adam)
    assert reason is not None and "Adam param group 0 has capturable=False" in reason
    assert "capturable=True" in reason
    with pytest.raises(ValueError, match=r"the optimizer's update cannot be captured: Adam param group 0"):
        CompiledUpdate(adam, backend=BACKEND)
    # the trainer captures the rest and says why the update is not
    model = Chain()
    loader = StepLoader(list(range(8)), 4, build=lambda items: (None, None), trace=[8])
    with pytest.warns(UserWarning, match=r"the optimizer's update runs op by op: Adam .*capturable=True"):
        trainer = TraceTrainer(
            model,
            AccumulatingOptimizer(torch.optim.Adam(model.parameters(), lr=0.1)),
            loader,
            lambda m, outputs, targets: outputs[0].sum(),
            progress=False,
            compile="on",
            compile_backend=BACKEND,
        )
    assert trainer.runner.compiled_update is None  # type: ignore[attr-defined]
    # a state dict turning capturable off after the capture: the update runs plainly, with a warning
    update = CompiledUpdate(torch.optim.Adam(params, lr=0.1, capturable=True), backend=BACKEND)
    update.optimizer.load_state_dict(adam.state_dict())
    params[0].grad = torch.ones(2)
    with pytest.warns(UserWarning, match=r"the optimizer's update now runs uncaptured: Adam param group 0"):
        update()
    assert params[0].detach().tolist() == pytest.approx([0.9, 0.9])


def test_a_compiled_update_of_sgd_with_momentum_weight_decay_and_two_groups_equals_the_plain_step() -> None:
    """The optimizer the differential fuzzer found silently wrong when TorchDynamo compiled its
    update on XLA (SGD with momentum, weight decay 0.1, two param groups, a rate changed by a rule):
    on the CPU the compiled update equals the plain one step by step; where torch.compile fails on
    it (torch 2.14's Dynamo: a speculation-log divergence at the momentum buffers' store), the
    update runs uncompiled from then on, with one warning saying why, never a crash."""
    torch.manual_seed(5)
    ours = [torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64)) for _ in range(3)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]

    def make(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        groups = [{"params": params[:2]}, {"params": params[2:], "lr": 0.01}]
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=0.1)

    compiled, plain = CompiledUpdate(make(ours), backend=BACKEND), make(theirs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(6):
            grads = [torch.randn_like(p) for p in ours]
            for optimizer, params in ((compiled.optimizer, ours), (plain, theirs)):
                optimizer.param_groups[0]["lr"] = 0.05 * 0.5 ** (step // 2)  # (a StepLR's rates)
                for p, g in zip(params, grads, strict=True):
                    p.grad = g.clone()
            compiled()
            plain.step()
            for p, q in zip(ours, theirs, strict=True):
                torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
    said = [str(w.message) for w in caught if "runs uncompiled" in str(w.message)]
    assert len(said) <= 1 and all("torch.compile failed on SGD.step" in text for text in said), said


def test_with_fallback_a_step_dynamo_cannot_capture_runs_its_python_with_one_warning() -> None:
    """``fallback=True`` (what ``compile="on"`` uses on XLA): a loss that reads a value back to the
    host breaks Dynamo's graph before anything runs; the step then runs its Python, equal to the
    eager step, and so does every later one, with one warning naming the line."""
    model = Chain()

    def syncing(model: torch.nn.Module, outputs: list[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        values = outputs[0].tolist()  # a host read: Dynamo cannot trace it into a graph
        return _loss(model, outputs, targets) * len(values) / len(values)

    fold = Fold(shapes=StaticShapes(min_rows=4))
    plan = fold.plan([_forest(fold, [2], 0)])
    captured = CompiledLoss(model, syncing, backend=BACKEND, fallback=True)
    with pytest.warns(UserWarning, match=r"not through torch.compile .*test_compiled.py:") as caught:
        _eager_and_captured(plan, torch.ones(4), captured, model)
    assert len([w for w in caught if "not through torch.compile" in str(w.message)]) == 1
    assert captured.captures == 0 and captured.refused is not None and "tolist" in captured.refused
    model.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        _eager_and_captured(plan, torch.ones(4), captured, model)
