"""The capture seam on real torch_xla (CPU backend): every step replayed, whatever its minibatch count.

Steps of 1-5 minibatches on one XLA device (:class:`torchfold.train.capture.XlaRunner`: a
minibatch program per layout, replayed once per minibatch, and an update program per step)
equal eager steps on the CPU (``AccumulatingOptimizer``'s ``minibatch()`` and ``step()``), and
the number of XLA compilations stays flat after the warm-up while new minibatch counts appear.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.xla
os.environ.setdefault("PJRT_DEVICE", "CPU")


def _compilations() -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


def _sst(count: int) -> tuple[list[Any], Any]:
    from torchfold.examples.datasets import Vocab, load_sst

    trees = load_sst(split="train", max_trees=count)
    return trees, Vocab.build(trees)


def _trainer(
    device: torch.device, trees: list[Any], vocab: Any, shapes: Any, kind: str, trace: list[int]
) -> Any:
    from torchfold.examples.models import TreeLSTM, TreeLSTMBuild, tree_lstm_loss
    from torchfold.train import AccumulatingOptimizer, StepLoader, TraceTrainer

    torch.manual_seed(0)
    model = TreeLSTM(len(vocab), 8, 8).to(device=device, dtype=torch.float64)
    xla = device.type == "xla"
    base: torch.optim.Optimizer = (
        # eps 1e-3: Adam's division by the root of tiny second moments would blow XLA's and the CPU's
        # rounding differences up to 1e-4 (a wrong gradient, rate or update moves parameters by ~lr)
        torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-3, capturable=xla)
        if kind == "adam"
        else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    )
    optimizer = AccumulatingOptimizer(base, lr_rule="linear", ref_batch_size=8)
    loader = StepLoader(
        trees, 4, build=TreeLSTMBuild(vocab, shapes=shapes if xla else None), trace=trace, seed=0
    )
    return TraceTrainer(
        model, optimizer, loader, tree_lstm_loss, progress=False, compile="replay" if xla else "off"
    )


@pytest.mark.timeout(1200)  # five XLA compilations of a Tree-LSTM step, on a loaded machine
@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_steps_of_any_minibatch_count_replay_and_equal_eager_steps_on_the_cpu(kind: str) -> None:
    import torch_xla

    from torchfold import StaticShapes
    from torchfold.examples.models import TreeLSTMBuild
    from torchfold.train.capture import XlaRunner

    # steps of 1, 2, 3 minibatches of 4 trees first (the warm-up), then of 4 and 5, new counts
    warmup = [4, 8, 12, 4, 8, 12, 8, 4]
    later = [16, 20, 4, 20, 12, 16, 8, 20]
    trees, vocab = _sst(sum(warmup + later))
    shapes = StaticShapes(depth_buckets=False)  # one layout: the envelope fitted on every minibatch first
    for start in range(0, len(trees), 4):
        shapes.cover(TreeLSTMBuild(vocab)(trees[start : start + 4])[0])  # type: ignore[arg-type]
    device = torch_xla.device()
    trace = warmup + later
    xla = _trainer(device, trees, vocab, shapes, kind, trace)
    cpu = _trainer(torch.device("cpu"), trees, vocab, shapes, kind, trace)
    assert isinstance(xla.runner, XlaRunner)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = xla.fit(max_steps=len(warmup))
        compiled = _compilations()
        second = xla.fit(max_steps=len(trace))
    got = first + second
    expected = cpu.fit(max_steps=len(trace))
    assert [s.num_minibatches for s in got] == [b // 4 for b in trace]
    assert [s.lr for s in got] == pytest.approx([s.lr for s in expected])
    assert [s.loss for s in got] == pytest.approx([s.loss for s in expected], rel=1e-5)
    for p, q in zip(xla.model.parameters(), cpu.model.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-5)
    # Adam and SGD (its learning-rate tensor requires grad inside the capture: multiplied by, never
    # read back to the host) both replay, none refused
    messages = [str(w.message) for w in caught if "not replayed" in str(w.message)]
    assert not messages, messages
    assert xla.runner.programs.refused is None, xla.runner.programs.refused
    # steps of 4 and 5 minibatches, never seen in the warm-up, compiled nothing
    assert _compilations() == compiled
    # one layout: its minibatch program, and the update program (the first update, which made the
    # optimizer's state, is not kept)
    assert xla.runner.captures == 2, xla.runner.captures


@pytest.mark.timeout(1200)  # the warm-up compiles a program per layout, on a loaded machine
def test_the_warm_up_compiles_every_layout_so_that_no_later_step_compiles() -> None:
    import torch_xla

    from torchfold.examples.models import TreeLSTMBuild
    from torchfold.train import fit_static_shapes

    # steps of 1-4 minibatches of 4 trees; depth buckets: several layouts, met in any order
    trace = [4, 4, 8, 4, 12, 16, 4, 8, 12, 4, 16, 8]
    trees, vocab = _sst(sum(trace))
    shapes = fit_static_shapes(
        trees, TreeLSTMBuild(vocab), 4
    )  # frozen: a minibatch that does not fit is split
    xla = _trainer(torch_xla.device(), trees, vocab, shapes, "adam", trace)
    cpu = _trainer(torch.device("cpu"), trees, vocab, shapes, "adam", trace)
    layouts = len(xla.loader.layout_examples())
    assert layouts >= 2, "the test needs several layouts"
    counts: list[int] = []
    xla.on_step = lambda stats: counts.append(_compilations())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = xla.fit(max_steps=len(trace))
    expected = cpu.fit(max_steps=len(trace))
    assert not [str(w.message) for w in caught if "not replayed" in str(w.message)]
    # the warm-up ran before step 1 (step 0 made Adam's state): from step 2 on, nothing compiles
    assert counts[2:] == [counts[1]] * (len(trace) - 2), counts
    # per layout, its minibatch program; and the update program (compiled by the warm-up: the
    # update of step 0, which made Adam's state, is not kept)
    assert xla.runner.programs.captures == layouts + 1, (xla.runner.programs.captures, layouts)
    # compiled ahead, nothing changed: the steps equal eager steps on the CPU
    assert [s.loss for s in got] == pytest.approx([s.loss for s in expected], rel=1e-5)
    for p, q in zip(xla.model.parameters(), cpu.model.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-5)


def test_a_python_number_the_loss_reads_is_followed_or_refused() -> None:
    """A loss that multiplies by a Python number changing between steps: the step guard reads it
    (a variable of the loss's closure), each value is a program of its own, and a value that keeps
    changing is refused (with a warning naming it) rather than replayed at its first value; every
    step equals eager on the CPU."""
    import torch_xla

    from torchfold import StaticShapes
    from torchfold.examples.models import TreeLSTM, TreeLSTMBuild, tree_lstm_loss
    from torchfold.train import to_device
    from torchfold.train.capture import XlaPrograms

    trees, vocab = _sst(16)
    shapes = StaticShapes(depth_buckets=False)
    for start in range(0, 16, 4):
        shapes.cover(TreeLSTMBuild(vocab)(trees[start : start + 4])[0])  # type: ignore[arg-type]
    device = torch_xla.device()
    scale = {"value": 1.0}

    def loss(model: Any, outputs: Any, targets: Any) -> torch.Tensor:
        return tree_lstm_loss(model, outputs, targets) * scale["value"]

    def make(on: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = TreeLSTM(len(vocab), 8, 8).to(on)
        return model, torch.optim.Adam(model.parameters(), lr=0.01, capturable=on.type == "xla")

    (model, optimizer), (reference, plain) = make(device), make(torch.device("cpu"))
    programs = XlaPrograms(model, loss, optimizer)
    build = TreeLSTMBuild(vocab, shapes=shapes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for number in range(6):
            scale["value"] = 0.5 + number * 0.37
            batches = [trees[4 * (number % 4) : 4 * (number % 4) + 4], trees[4 * ((number + 1) % 4) :][:4]]
            for part in batches:
                plan, targets = build(part)
                programs.run_minibatch(plan, to_device(targets, device), 4)
            programs.update([0.01], 8)
            plain.zero_grad()
            for part in batches:
                plan, targets = TreeLSTMBuild(vocab)(part)
                (
                    loss(reference, plan.apply(reference), to_device(targets, torch.device("cpu"))) * 0.5
                ).backward()
            plain.step()
    why = "the variable scale of the loss's closure"
    assert programs.refused is not None and why in programs.refused and "took more than" in programs.refused
    assert any(why in str(w.message) for w in caught)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-3, atol=1e-4)


def test_a_parameter_outside_the_optimizer_is_an_input_and_cpu_targets_are_moved() -> None:
    """A module parameter the optimizer does not hold, changed between steps, is read anew by
    every replay (an input, not a constant of the capture); targets given on the CPU are moved."""
    import torch_xla

    from torchfold import StaticShapes
    from torchfold.examples.models import TreeLSTM, TreeLSTMBuild, tree_lstm_loss
    from torchfold.train.capture import XlaPrograms

    trees, vocab = _sst(8)
    shapes = StaticShapes(depth_buckets=False)
    for start in range(0, 8, 4):
        shapes.cover(TreeLSTMBuild(vocab)(trees[start : start + 4])[0])  # type: ignore[arg-type]
    device = torch_xla.device()

    def make(on: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = TreeLSTM(len(vocab), 8, 8).to(on)
        model.temperature = torch.nn.Parameter(torch.ones((), device=on), requires_grad=False)
        params = [p for name, p in model.named_parameters() if name != "temperature"]
        return model, torch.optim.Adam(params, lr=0.01, capturable=on.type == "xla")

    def loss(model: Any, outputs: Any, targets: Any) -> torch.Tensor:
        return tree_lstm_loss(model, outputs, targets) * model.temperature

    (model, optimizer), (reference, plain) = make(device), make(torch.device("cpu"))
    programs = XlaPrograms(model, loss, optimizer)
    build = TreeLSTMBuild(vocab, shapes=shapes)
    for number in range(5):
        with torch.no_grad():
            model.temperature.fill_(1.0 + number)
            reference.temperature.fill_(1.0 + number)
        for part in (trees[:4], trees[4:8]):
            plan, targets = build(part)  # numpy targets: the runner moves them
            programs.run_minibatch(plan, tuple(torch.as_tensor(t) for t in targets), 4)
        programs.update([0.01], 8)
        plain.zero_grad()
        for part in (trees[:4], trees[4:8]):
            plan, targets = TreeLSTMBuild(vocab)(part)
            (
                loss(reference, plan.apply(reference), tuple(torch.as_tensor(t) for t in targets)) * 0.5
            ).backward()
        plain.step()
    assert programs.refused is None
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-3, atol=1e-4)


class _Leaves(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1, dtype=torch.float64))

    def leaf(self, x: torch.Tensor) -> torch.Tensor:  # two logits per call
        return torch.stack([x.double() * self.w, -x.double() * self.w], dim=1)


class _LockedBuild:
    """Leaves into a frozen envelope, behind a lock (a cache's, a tokenizer's) when ``locked``."""

    def __init__(self, shapes: Any, locked: bool) -> None:
        import threading

        self.shapes = shapes
        self.lock = threading.Lock() if locked else None
        self.cache: dict[int, int] = {}

    def __call__(self, items: list[int]) -> Any:
        import torchfold

        if self.lock is not None:
            with self.lock:
                self.cache[len(items)] = len(items)
        fold = torchfold.Fold(shapes=self.shapes)
        plan = fold.plan([[fold.add("leaf", v) for v in items]])
        return plan, plan.pad(0, [v % 2 for v in items], fill=-100).numpy()


def _leaves_loss(model: Any, outputs: list[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(outputs[0], targets, ignore_index=-100)


@pytest.mark.timeout(300)
def test_a_build_holding_a_lock_warms_up_and_trains_past_the_first_step() -> None:
    """The warm-up (after step 0) copies the build to build its layout examples; a build holding a
    lock once stopped training there (``TypeError: cannot pickle '_thread.lock' object``). It now
    trains, warmed up as a build without the lock: the same steps, the same programs."""
    import torch_xla

    from torchfold.train import AccumulatingOptimizer, StepLoader, TraceTrainer, fit_static_shapes

    items = list(range(1, 41))
    shapes = fit_static_shapes(items, _LockedBuild(None, locked=False), 4)
    results = []
    for locked in (True, False):
        model = _Leaves().to(torch_xla.device())
        optimizer = AccumulatingOptimizer(torch.optim.Adam(model.parameters(), lr=0.1, capturable=True))
        build = _LockedBuild(shapes, locked)
        loader = StepLoader(items, 4, build=build, trace=[8, 4, 12, 8, 4], seed=0)
        trainer = TraceTrainer(model, optimizer, loader, _leaves_loss, progress=False, compile="replay")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stats = trainer.fit(max_steps=5)
        assert not [str(w.message) for w in caught if "layout_examples" in str(w.message)]
        results.append(([s.loss for s in stats], model.w.item(), trainer.runner.captures))
    assert len(results[0][0]) == 5
    assert results[0] == results[1]
