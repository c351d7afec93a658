"""docs/guide/lightning-accelerate.md, run with the real Lightning and accelerate: over the two
epochs of the page's trace, each recipe's gradients, step by step, its parameters and its number
of optimizer steps equal ``TraceTrainer``'s with the same trace, seed and optimizer, and the first
step's gradient equals that of one fold over the step's trees. The epoch reaches the
``TraceBatchSampler`` by the ways Lightning and accelerate set it.

The ``integrations`` lane (``make test-integrations`` installs the extra and runs it, part of
``make test``): there a missing package fails; elsewhere these tests skip, saying what to install.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

pytestmark = pytest.mark.integrations

PAGE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "lightning-accelerate.md"


def _needs(name: str) -> ModuleType:
    if os.environ.get("TORCHFOLD_INTEGRATIONS") == "require":  # make test-integrations: no skip
        return importlib.import_module(name)
    return pytest.importorskip(
        name, reason=f"needs {name}: pip install 'pytorch-fold[integrations]' (make test-integrations)"
    )


def _blocks() -> list[str]:
    """The page's blocks: the shared part, the Lightning recipe, the accelerate recipe."""
    blocks = re.findall(r"^```python\n(.*?)^```$", PAGE.read_text(encoding="utf-8"), flags=re.S | re.M)
    assert len(blocks) == 3, len(blocks)
    return blocks


@pytest.fixture(autouse=True)
def _keep_threads() -> Iterator[None]:
    """The page sets one intra-op thread, as a reader's process does; the test process gets its count back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@contextlib.contextmanager
def _adam_gradients() -> Iterator[list[list[torch.Tensor]]]:
    """The gradients every Adam update starts from (after the AccumulatingOptimizer's weighing,
    all-reduce and division: the step's mean gradient), whoever steps it."""
    seen: list[list[torch.Tensor]] = []

    def record(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if isinstance(optimizer, torch.optim.Adam):
            seen.append([p.grad.clone() for g in optimizer.param_groups for p in g["params"]])

    handle = register_optimizer_step_pre_hook(record)
    try:
        yield seen
    finally:
        handle.remove()


def _run(block: int) -> tuple[dict[str, Any], list[list[torch.Tensor]], str]:
    """The shared block and one recipe, as a reader runs them: their names, Adam's gradients, the output."""
    scope: dict[str, Any] = {}
    out = io.StringIO()
    blocks = _blocks()
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[0], str(PAGE), "exec"), scope)
        assert torch.get_num_threads() == 1  # the page's advice: one intra-op thread per process
        with _adam_gradients() as grads:
            exec(compile(blocks[block], str(PAGE), "exec"), scope)
    return scope, grads, out.getvalue()


def _trainer_run(scope: dict[str, Any]) -> tuple[torch.nn.Module, list[list[torch.Tensor]]]:
    """``TraceTrainer`` on the page's trees, trace, seed and optimizer."""
    from torchfold.examples.models import TreeLSTM, tree_lstm_loss
    from torchfold.train import StepLoader, TraceTrainer

    torch.manual_seed(0)
    model = TreeLSTM(len(scope["vocab"]), embedding_dim=8, hidden_dim=8)
    loader = StepLoader(scope["trees"], 4, build=scope["build"], trace=scope["TRACE"], seed=0)
    trainer = TraceTrainer(model, scope["accumulating"](model), loader, tree_lstm_loss, progress=False)
    with _adam_gradients() as grads:
        stats = trainer.fit()
    assert [s.batch_size for s in stats] == scope["TRACE"]
    return model, grads


def _one_fold_gradient(scope: dict[str, Any]) -> list[torch.Tensor]:
    """The first step's gradient as one fold over all its trees: the mean loss over the step."""
    from torchfold.examples.models import TreeLSTM, tree_lstm_loss
    from torchfold.train import TraceBatchSampler

    sampler = TraceBatchSampler(scope["trees"], scope["TRACE"], minibatch_size=4, seed=0)
    minibatches = iter(sampler)
    first = [i for _ in range(sampler.steps()[0].local_minibatches) for i in next(minibatches)]
    torch.manual_seed(0)
    model = TreeLSTM(len(scope["vocab"]), embedding_dim=8, hidden_dim=8)
    plan, targets = scope["build"]([scope["trees"][i] for i in first])
    tree_lstm_loss(model, plan.apply(model), targets).backward()
    return [p.grad for p in model.parameters()]


def _check(scope: dict[str, Any], grads: list[list[torch.Tensor]]) -> None:
    assert scope["sampler"].num_epochs == 2  # the page's trace: two epochs, so the second is checked
    reference, expected = _trainer_run(scope)
    assert len(grads) == len(expected) == len(scope["TRACE"])
    for step, (got, want) in enumerate(zip(grads, expected, strict=True)):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6, msg=lambda m, step=step: f"step {step}: {m}")
    for g, w in zip(grads[0], _one_fold_gradient(scope), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    outputs = {}
    for name, model in (("recipe", scope["model"]), ("trainer", reference)):
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
        plan, _ = scope["build"](scope["trees"][:4])
        outputs[name] = plan.apply(model)[0]
    torch.testing.assert_close(outputs["recipe"], outputs["trainer"])


@pytest.mark.timeout(300)
def test_the_lightning_recipe_steps_as_the_trace_trainer() -> None:
    _needs("lightning")
    scope, grads, out = _run(1)
    assert out.strip().splitlines()[-1] == str(len(scope["TRACE"])) == "7", out  # global_step: one per step
    assert scope["trainer"].current_epoch == 2 and scope["sampler"].epoch == 1
    _check(scope, grads)


@pytest.mark.timeout(300)
def test_the_accelerate_recipe_steps_as_the_trace_trainer() -> None:
    _needs("accelerate")
    scope, grads, out = _run(2)
    assert out.strip().splitlines()[-1] == str(scope["TRACE"][-1]) == "20", out  # the last step's batch
    assert scope["sampler"].epoch == 1
    _check(scope, grads)


@pytest.mark.timeout(300)
def test_the_epoch_reaches_the_trace_sampler_through_accelerates_loaders() -> None:
    """A loader accelerate prepared sets the epoch on ``batch_sampler`` and ``batch_sampler.sampler``
    (``DataLoaderShard``, one process: the loader is kept whole), or on ``batch_sampler.sampler``
    only (``DataLoaderDispatcher``); either way the trace sampler moves to the epoch's steps."""
    _needs("accelerate")
    from accelerate import Accelerator
    from accelerate.data_loader import DataLoaderDispatcher

    from torchfold.train import TraceBatchSampler

    trace = [8, 16, 4, 12, 12, 8, 20]  # two epochs of 40

    dataset = torch.utils.data.TensorDataset(torch.arange(40))

    def sampler_and_loader() -> tuple[TraceBatchSampler, torch.utils.data.DataLoader[Any]]:
        sampler = TraceBatchSampler(dataset, trace, minibatch_size=4, seed=0)
        return sampler, torch.utils.data.DataLoader(dataset, batch_sampler=sampler)

    def batches(loader: Any) -> list[list[int]]:
        return [x.tolist() for (x,) in loader]

    reference, _ = sampler_and_loader()
    reference.set_epoch(1)
    sampler, loader = sampler_and_loader()
    prepared = Accelerator(cpu=True).prepare(loader)
    assert prepared.batch_sampler is sampler  # one process: accelerate keeps the batch sampler
    first = batches(prepared)
    assert sampler.epoch == 0 and first == list(sampler) != list(reference)
    assert batches(prepared) == list(reference) and sampler.epoch == 1  # its next pass: the next epoch
    prepared.set_epoch(0)
    assert sampler.epoch == 0 and list(sampler) == first

    sampler, _ = sampler_and_loader()
    dispatcher = DataLoaderDispatcher(dataset, batch_sampler=sampler)
    dispatcher.set_epoch(1)
    assert sampler.epoch == 1 and [s.step for s in sampler.steps()] == [4, 5, 6]
    assert list(sampler) == list(reference)


@pytest.mark.timeout(300)
def test_the_threads_benchmark_runs_the_lightning_recipe_with_the_count_it_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """benchmarks/recipe_threads.py at its smallest: one run of the page's Lightning recipe."""
    _needs("lightning")
    monkeypatch.syspath_prepend(str(PAGE.parents[2] / "benchmarks"))
    recipe_threads = importlib.import_module("recipe_threads")
    result = recipe_threads.run_once(2)  # not the page's 1: the benchmark's count reaches the recipe
    assert result["threads"] == 2 and result["global_step"] == 7
    assert result["wall"] > 0 and result["cpu"] > 0
