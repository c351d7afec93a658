"""``captured_step`` in a loop of the user's own, on real torch_xla (CPU backend): notebook 06's loop.

Each step records its minibatches of SST trees on a ``Fold(shapes=...)`` (an envelope fitted
before training and frozen), ``fold.plan`` asks for the roots, and ``captured_step`` runs the
step, over a trace whose steps hold 1 to 5 minibatches. Once a step's programs have been seen
(the minibatch program of each of its layouts, whatever its minibatch count), the step compiles
nothing; the programs captured are exactly one per layout plus the update; the losses and
parameters equal a plain eager loop on the CPU.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.xla
os.environ.setdefault("PJRT_DEVICE", "CPU")

MINIBATCH = 4
# minibatches per step: 1-5, a step of several first (Adam's state is made by the update program)
TRACE = [MINIBATCH * k for k in (2, 2, 1, 3, 2, 4, 1, 3, 5, 2, 1, 4, 3, 1, 2, 5)]


def _compilations() -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


def _record(trees: list[Any], vocab: Any, shapes: Any = None) -> tuple[Any, torch.Tensor]:
    import torchfold
    from torchfold.examples.models import encode_trees

    fold = torchfold.Fold(shapes=shapes)
    nodes, labels, roots = encode_trees(fold, trees, vocab)
    plan = fold.plan([[nodes[r] for r in roots]])
    return plan, plan.pad(0, [labels[r] for r in roots], fill=-100)


def _root_loss(model: Any, outputs: list[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    [states] = outputs
    return F.cross_entropy(model.logits(states), targets, ignore_index=-100)


def _envelope(minibatches: list[list[Any]], vocab: Any) -> Any:
    """Fitted until a pass over the minibatches grows it no more (every depth bucket then has its
    layout at the final size), then frozen."""
    from torchfold import StaticShapes

    shapes = StaticShapes(warmup=10 * len(minibatches))
    before = -1
    while shapes.version != before:
        before = shapes.version
        for trees in minibatches:
            shapes.cover(_record(trees, vocab)[0])
    return shapes.freeze()


def _eager_steps(model: torch.nn.Module, minibatches: list[list[Any]], vocab: Any) -> list[float]:
    """The plainest loop on the CPU: an unpadded fold per minibatch, weighed by its share of the step."""
    import torchfold
    from torchfold.examples.models import encode_trees

    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-3)
    feed, losses = iter(minibatches), []
    for batch_size in TRACE:
        optimizer.zero_grad()
        total = 0.0
        for _ in range(batch_size // MINIBATCH):
            trees = next(feed)
            fold = torchfold.Fold()
            nodes, labels, roots = encode_trees(fold, trees, vocab)
            [states] = fold.apply(model, [[nodes[r] for r in roots]])
            loss = F.cross_entropy(model.logits(states), torch.tensor([labels[r] for r in roots]))
            (loss * len(trees) / batch_size).backward()
            total += loss.item() * len(trees) / batch_size
        optimizer.step()
        losses.append(total)
    return losses


@pytest.mark.timeout(900)  # about six XLA compilations of a small Tree-LSTM step, on a loaded machine
def test_the_users_loop_replays_one_program_per_layout_and_equals_an_eager_loop(data_dir: Path) -> None:
    import torch_xla

    import torchfold
    from torchfold.examples.datasets import Vocab, load_sst
    from torchfold.examples.models import TreeLSTM
    from torchfold.train.capture import XlaRunner

    trees = load_sst(data_dir, "train", max_trees=sum(TRACE))
    vocab = Vocab.build(trees)
    minibatches = [trees[i : i + MINIBATCH] for i in range(0, len(trees), MINIBATCH)]
    shapes = _envelope(minibatches, vocab)
    device = torch_xla.device()
    torch.manual_seed(0)
    # float64: XLA's and the CPU's rounding differences stay far below the tolerance (eps 1e-3:
    # Adam's division by the root of tiny second moments would blow them up)
    reference = TreeLSTM(len(vocab), 8, 8).double()
    model = TreeLSTM(len(vocab), 8, 8).double()
    model.load_state_dict(reference.state_dict())
    model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-3, capturable=True)
    step = torchfold.train.captured_step(model, _root_loss, optimizer, compile="replay")
    assert isinstance(step.runner, XlaRunner)

    feed = iter(minibatches)
    layouts: dict[Any, int] = {}
    seen: set[int] = set()  # the layouts of steps 1.. (steady: Adam's state exists)
    every: set[int] = set()
    losses, compiles, repeats = [], [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for number, batch_size in enumerate(TRACE):
            before = _compilations()
            items = []
            for _ in range(batch_size // MINIBATCH):
                part = next(feed)
                plan, targets = _record(part, vocab, shapes)
                items.append((plan, targets, len(part)))
            losses.append(float(step(items)))
            compiles.append(_compilations() - before)
            # a step of one minibatch too: the minibatch program of its layout, then the update
            used = {layouts.setdefault(item[0].layout.key, len(layouts)) for item in items}
            every |= used
            if number > 0 and used <= seen:
                repeats.append(number)
            if number > 0:  # step 0 also made Adam's state (in the update, which is not kept)
                seen |= used
    assert not [str(w.message) for w in caught if "not replayed" in str(w.message)]
    assert step.runner.programs.refused is None
    assert len(layouts) >= 2, layouts  # the trace changes layout, not only the minibatch count
    # steps whose programs were all seen before compile nothing, whatever their minibatch count
    assert len(repeats) >= len(TRACE) // 2, repeats
    assert [compiles[i] for i in repeats] == [0] * len(repeats), (compiles, repeats)
    # one minibatch program per layout, and one update program
    assert step.captures == len(every) + 1, (step.captures, every)

    expected = _eager_steps(reference, minibatches, vocab)
    assert losses == pytest.approx(expected, rel=1e-5)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-5)


class _Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def leaf(self, x: torch.Tensor) -> torch.Tensor:  # two logits per call
        return torch.stack([x.float() * self.w, -x.float() * self.w], dim=1)


@pytest.mark.timeout(300)
def test_compile_off_on_xla_takes_targets_from_the_host() -> None:
    """``captured_step(..., compile="off")`` on XLA (the eager runner, run op by op) is given
    ``plan.pad``'s CPU targets, as with ``compile="replay"``: they are moved, not handed to XLA ops
    ("Expected XLA tensor"); the steps equal the same steps on the CPU."""
    import torch_xla

    import torchfold
    from torchfold.train.capture import EagerRunner

    def loss(model: Any, outputs: list[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs[0], targets, ignore_index=-100)

    results = []
    for device in (torch_xla.device(), torch.device("cpu")):
        model = _Scale().to(device)
        step = torchfold.train.captured_step(
            model, loss, torch.optim.SGD(model.parameters(), lr=0.1), compile="off"
        )
        assert isinstance(step.runner, EagerRunner)
        losses = []
        for values in ([1, 2], [3, 1, 2]):
            fold = torchfold.Fold(shapes=torchfold.StaticShapes())
            plan = fold.plan([[fold.add("leaf", v) for v in values]])
            targets = plan.pad(0, [v % 2 for v in values], fill=-100)  # int64, on the CPU
            losses.append(float(step([(plan, targets, len(values))])))
        results.append([*losses, model.w.item()])
    assert results[0] == pytest.approx(results[1], rel=1e-6)


class _Moded(torch.nn.Module):
    """Two logits per leaf, through a dropout (``drop``) or doubled in train() (``double``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.w = torch.nn.Parameter(torch.ones(1, dtype=torch.float64))
        self.drop = torch.nn.Dropout(0.5)

    def leaf(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.stack([x.double() * self.w, -x.double() * self.w], dim=1)
        if self.kind == "drop":
            return self.drop(logits)
        return logits * 2 if self.training else logits


def _moded_steps(model: _Moded, modes: list[bool]) -> tuple[list[float], Any]:
    """Steps of one minibatch and of two, in the mode ``modes`` gives each; the model's mode is
    checked after every step."""
    import torchfold

    def loss(model: Any, outputs: list[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs[0], targets, ignore_index=-100)

    on_xla = model.w.device.type == "xla"
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1, capturable=on_xla)
    step = torchfold.train.captured_step(model, loss, optimizer, compile="replay" if on_xla else "off")
    results = []
    for number, training in enumerate(modes):
        model.train(training)
        items = []
        for values in ([1, 2], [3, 1, 2])[: 1 + number % 2]:
            fold = torchfold.Fold(shapes=torchfold.StaticShapes())
            plan = fold.plan([[fold.add("leaf", v) for v in values]])
            items.append((plan, plan.pad(0, [v % 2 for v in values], fill=-100), len(values)))
        results.append(float(step(items)))
        assert model.training is training and model.drop.training is training
    return [*results, model.w.item()], step


@pytest.mark.timeout(300)
def test_a_model_in_eval_stays_in_eval_and_its_steps_replay() -> None:
    """A model in eval() with a dropout: ``captured_step`` keeps it in eval() (it once called
    ``model.train()`` on every step, so the dropout drew random numbers and no step replayed); its
    steps, of one minibatch and of several, replay and equal the same steps on the CPU."""
    import torch_xla

    modes = [False] * 6
    model = _Moded("drop").to(torch_xla.device())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        on_xla, step = _moded_steps(model, modes)
    assert not [str(w.message) for w in caught if "not replayed" in str(w.message)]
    assert step.captures >= 3  # steps of one minibatch and of two, and the update
    on_cpu, _ = _moded_steps(_Moded("drop"), modes)
    assert on_xla == pytest.approx(on_cpu, rel=1e-4)  # (capturable Adam counts its steps in float32)


@pytest.mark.timeout(300)
def test_the_captured_programs_follow_the_models_mode() -> None:
    """A model whose ops read ``self.training``: switching it between train() and eval() between
    steps gives each mode programs of its own (never a replay of the other mode's), and the steps
    equal the same steps on the CPU."""
    import torch_xla

    modes = [True, True, False, False, True, False, True, False]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        on_xla, _ = _moded_steps(_Moded("double").to(torch_xla.device()), modes)
    assert not [str(w.message) for w in caught if "not replayed" in str(w.message)]
    on_cpu, _ = _moded_steps(_Moded("double"), modes)
    assert on_xla == pytest.approx(on_cpu, rel=1e-4)  # (capturable Adam counts its steps in float32)
