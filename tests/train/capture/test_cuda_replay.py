"""CudaStepReplay: a training step of one minibatch (forward, loss, backward, update) as one CUDA graph.

The replay's own tests need a GPU (they are skipped without one, and counted as skipped); what
decides whether a step can be replayed, and where the trainer uses it, is tested everywhere.
"""

from __future__ import annotations

import copy
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch

from torchfold import StaticShapes
from torchfold.examples.datasets import Vocab, load_sst
from torchfold.examples.models import TreeLSTM, TreeLSTMBuild, tree_lstm_loss
from torchfold.train import AccumulatingOptimizer, StepLoader, TraceTrainer, to_device
from torchfold.train.capture._replay import target_tensors
from torchfold.train.capture.cuda_replay import CudaStepReplay, _rebuilt, uncapturable_step

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _model(vocab: Vocab) -> TreeLSTM:
    torch.manual_seed(0)
    return TreeLSTM(len(vocab), 16, 16)


def test_an_optimizer_whose_update_cannot_be_captured_is_refused_naming_the_fix() -> None:
    model = TreeLSTM(10, 4, 4)
    with pytest.raises(
        ValueError, match=r"Adam param group 0 has neither.*Adam\(params, \.\.\., capturable=True\)"
    ):
        CudaStepReplay(model, tree_lstm_loss, torch.optim.Adam(model.parameters()))
    with pytest.raises(ValueError, match=r"SGD\(params, \.\.\., fused=True\)"):
        CudaStepReplay(model, tree_lstm_loss, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for optimizer in (
        torch.optim.Adam(model.parameters(), capturable=True),
        torch.optim.Adam(model.parameters(), fused=True),
        torch.optim.AdamW(model.parameters(), fused=True),
    ):
        assert uncapturable_step(optimizer) is None
        CudaStepReplay(model, tree_lstm_loss, optimizer)
    assert "LBFGS has neither a capturable nor a fused option" in str(
        uncapturable_step(torch.optim.LBFGS(model.parameters()))
    )
    second = torch.optim.Adam([{"params": [model.embedding.weight]}], fused=True)
    second.add_param_group({"params": [model.classifier.weight], "fused": False})
    assert "param group 1 has neither" in str(uncapturable_step(second))


def test_targets_come_back_in_their_own_structure_from_their_tensors() -> None:
    Pair = namedtuple("Pair", "labels weights")
    targets = {"b": Pair(torch.zeros(2), [torch.ones(1)]), "a": torch.full((3,), 2.0)}
    tensors, why = target_tensors(targets)
    assert why is None
    copies = [t.clone() for t in tensors]
    rebuilt = _rebuilt(targets, iter(copies))
    assert list(rebuilt) == ["b", "a"] and isinstance(rebuilt["b"], Pair)
    assert (
        rebuilt["a"] is copies[0]
        and rebuilt["b"].labels is copies[1]
        and rebuilt["b"].weights[0] is copies[2]
    )


def test_the_trainer_replays_whole_steps_on_gpus_only(data_dir: Path) -> None:
    """On the CPU (compile='on') steps are captured by torch.compile, never by a CUDA graph."""
    trees = load_sst(data_dir / "sst", split="train", max_trees=8)
    vocab = Vocab.build(trees)
    model = _model(vocab)
    optimizer = AccumulatingOptimizer(torch.optim.Adam(model.parameters(), fused=True))
    loader = StepLoader(trees, 4, build=TreeLSTMBuild(vocab, shapes=StaticShapes()), trace=[4])
    trainer = TraceTrainer(model, optimizer, loader, tree_lstm_loss, progress=False, compile="on")
    assert trainer.compiled is not None and trainer.replay is None  # nothing is compiled until a step
    with pytest.raises(ValueError, match="compile='replay' replays captured steps on XLA and CUDA only"):
        TraceTrainer(model, optimizer, loader, tree_lstm_loss, progress=False, compile="replay")


def _batches(data_dir: Path, count: int, size: int) -> tuple[Vocab, list[tuple[Any, Any]]]:
    """``count`` SST batches of ``size`` trees as static plans of one envelope, targets on the GPU."""
    trees = load_sst(data_dir / "sst", split="train", max_trees=count * size)
    vocab = Vocab.build(trees)
    shapes = StaticShapes()
    build = TreeLSTMBuild(vocab, shapes=shapes)
    chunks = [trees[i : i + size] for i in range(0, count * size, size)]
    for chunk in chunks:  # grow the envelope first: then every plan has its last layout
        build(chunk)
    batches = []
    for chunk in chunks:
        plan, (labels, weights) = build(chunk)
        batches.append((plan, (torch.from_numpy(labels).cuda(), torch.from_numpy(weights).cuda())))
    return vocab, batches


def _eager_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, plan: Any, targets: Any, lr: float
) -> torch.Tensor:
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    loss = tree_lstm_loss(model, plan.apply(model, padded=True), targets)
    loss.backward()
    optimizer.step()
    return loss.detach()


def _same(model: torch.nn.Module, other: torch.nn.Module, optimizer: Any, reference: Any, what: str) -> None:
    for (name, p), q in zip(model.named_parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(
            p, q, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{what}: {name}: {m}"
        )
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        for key, value in optimizer.state[p].items():
            torch.testing.assert_close(value, reference.state[q][key], rtol=1e-5, atol=1e-6)


@gpu
@pytest.mark.parametrize("kind", ["fused", "capturable"])
def test_replayed_steps_equal_eager_steps_with_changing_learning_rates(data_dir: Path, kind: str) -> None:
    vocab, batches = _batches(data_dir, 6, 8)
    model = _model(vocab).cuda()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, **{kind: True})
    eager = torch.optim.Adam(reference.parameters(), lr=1e-3, **{kind: True})
    replay = CudaStepReplay(model, tree_lstm_loss, optimizer)
    layouts = {plan.layout.key for plan, _ in batches}
    for number in range(3 * len(batches)):
        plan, targets = batches[number % len(batches)]
        lr = 1e-3 * (1 + number % 3)
        loss = replay(plan, targets, [lr])
        expected = _eager_step(reference, eager, plan, targets, lr)
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        assert all(p.grad is None for p in model.parameters())
        assert [group["lr"] for group in optimizer.param_groups] == [1e-3]  # its own rate is back
        _same(model, reference, optimizer, eager, f"step {number}")
    assert replay.refused is None
    assert replay.captures == len(layouts)


@gpu
def test_new_optimizer_state_or_moved_parameters_capture_anew_never_replay_a_stale_graph(
    data_dir: Path,
) -> None:
    vocab, batches = _batches(data_dir, 3, 8)
    model = _model(vocab).cuda()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    eager = torch.optim.Adam(reference.parameters(), lr=1e-3, fused=True)
    replay = CudaStepReplay(model, tree_lstm_loss, optimizer)

    def steps(count: int) -> None:
        for number in range(count):
            plan, targets = batches[number % len(batches)]
            torch.testing.assert_close(
                replay(plan, targets, [1e-3]), _eager_step(reference, eager, plan, targets, 1e-3)
            )

    layouts = len({plan.layout.key for plan, _ in batches})
    steps(4)
    captures = replay.captures
    assert captures == layouts
    optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # new state tensors, the same values
    steps(3)
    assert replay.captures == captures + layouts
    with torch.no_grad():  # a parameter's data moved elsewhere (e.g. assigned), its values kept
        model.classifier.weight.data = model.classifier.weight.data.clone()
    steps(3)
    assert replay.captures == captures + 2 * layouts
    optimizer.param_groups[0]["betas"] = (0.8, 0.99)  # a setting is a constant of the graph
    eager.param_groups[0]["betas"] = (0.8, 0.99)
    steps(3)
    assert replay.captures == captures + 3 * layouts
    assert len(replay._graphs) == 2 * layouts  # on earlier memory: dropped; of the earlier betas: kept
    _same(model, reference, optimizer, eager, "after the changes")


@gpu
def test_a_loss_that_reads_back_to_the_host_is_refused_naming_its_line(data_dir: Path) -> None:
    vocab, batches = _batches(data_dir, 2, 8)
    model = _model(vocab).cuda()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)
    eager = torch.optim.Adam(reference.parameters(), lr=1e-3, capturable=True)

    def loss(m: torch.nn.Module, outputs: Any, targets: Any) -> torch.Tensor:
        scale = 1.0 if float(outputs[0].sum()) == float(outputs[0].sum()) else 0.0  # a host read
        return tree_lstm_loss(m, outputs, targets) * scale

    replay = CudaStepReplay(model, loss, optimizer)
    plan, targets = batches[0]
    with pytest.warns(
        UserWarning,
        match=r"not replayed whole: the step reads a value back to the host .* at .*test_cuda_replay.py:\d+ \(scale = ",
    ):
        first = replay(plan, targets, [1e-3])
    torch.testing.assert_close(first, _eager_step(reference, eager, plan, targets, 1e-3))
    assert replay.refused is not None and replay.captures == 0
    _same(model, reference, optimizer, eager, "the refused step ran eagerly")


@gpu
def test_the_trainer_replays_steps_of_one_minibatch_and_ends_where_eager_training_ends(
    data_dir: Path,
) -> None:
    """Steps of one minibatch replayed whole, steps of several captured by torch.compile with an
    eager update, mixed along one trace: the parameters end where eager training ends."""
    trees = load_sst(data_dir / "sst", split="train", max_trees=48)
    vocab = Vocab.build(trees)
    shapes = StaticShapes()
    build = TreeLSTMBuild(vocab, shapes=shapes)
    for start in range(0, len(trees), 4):
        build(trees[start : start + 4])
    trace = [4, 8, 4, 4, 12, 4, 4, 8]
    results = []
    for compile in ("replay", "off"):
        model = _model(vocab).cuda()
        optimizer = AccumulatingOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2, fused=True))
        loader = StepLoader(
            trees, 4, build=TreeLSTMBuild(vocab, shapes=copy.deepcopy(shapes)), trace=trace, shuffle=False
        )
        trainer = TraceTrainer(model, optimizer, loader, tree_lstm_loss, progress=False, compile=compile)
        stats = trainer.fit()
        results.append(([s.loss for s in stats], [p.detach().cpu() for p in model.parameters()]))
        if compile == "replay":
            assert isinstance(trainer.replay, CudaStepReplay)
            assert trainer.replay.refused is None and trainer.replay.captures >= 1
    (losses, params), (eager_losses, eager_params) = results
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=1e-4, atol=1e-5)
    for p, q in zip(params, eager_params, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_accumulators_let_go_by_a_computed_step_are_hooked_again_afterwards() -> None:
    """A step computed by its runner (computed_step with counts) runs with the gradient accumulators
    released: gradients come from torch.autograd.grad with no weighting; afterwards a step of two
    minibatches is weighted by their sample counts again."""
    p = torch.nn.Parameter(torch.tensor([1.0]))
    optimizer = AccumulatingOptimizer(torch.optim.SGD([p], lr=1.0))

    def accumulator() -> Any:
        return p.view_as(p).grad_fn.next_functions[0][0]  # type: ignore[union-attr]

    accumulator().metadata["made"] = "before"
    assert accumulator().metadata == {"made": "before"}  # the optimizer holds it

    def run(lrs: list[float]) -> float:
        assert accumulator().metadata == {}  # autograd made a new one: nothing held the old one
        grad = torch.autograd.grad((p * 3).sum(), [p])[0]
        with torch.no_grad():
            p.sub_(lrs[0] * grad)
        return lrs[0]

    assert optimizer.computed_step(run, num_samples=2, num_minibatches=1) == 1.0
    assert p.item() == -2.0 and p.grad is None and optimizer.last_batch_size == 2
    with torch.no_grad():
        p.fill_(1.0)
    with optimizer.minibatch(1):
        (p * 2).sum().backward()
    with optimizer.minibatch(3):
        (p * 6).sum().backward()
    optimizer.step()
    assert p.item() == 1.0 - (2 * 1 + 6 * 3) / 4


@gpu
def test_a_loss_weight_in_a_module_attribute_is_followed_by_the_cuda_replay_as_by_eager_steps() -> None:
    """The step guard keys the CUDA graphs too: a Python number the loss reads, changed between
    steps (a new graph per value), and a tensor kept as a plain attribute changed in place (the
    graph reads it where it lives) give the eager steps' losses and parameters."""
    trees = load_sst(split="train", max_trees=8)
    vocab = Vocab.build(trees)
    shapes = StaticShapes()
    shapes.cover(TreeLSTMBuild(vocab)(trees)[0])  # type: ignore[arg-type]

    def weighted(model: Any, outputs: Any, targets: Any) -> torch.Tensor:
        return tree_lstm_loss(model, outputs, targets) * model.weight_of_loss * model.scale.sum()

    results = []
    for device in (torch.device("cuda"), torch.device("cpu")):
        model: Any = _model(vocab).to(device)
        model.weight_of_loss = 1.0
        model.scale = torch.ones(2, device=device) / 2
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01, capturable=device.type == "cuda")
        replay = CudaStepReplay(model, weighted, optimizer) if device.type == "cuda" else None
        build = TreeLSTMBuild(vocab, shapes=shapes)
        losses = []
        for step, weight in enumerate([1.0, 1.0, 2.0, 2.0, 5.0]):
            model.weight_of_loss = weight
            if step == 3:
                model.scale.fill_(1.5)
            plan, targets = build(trees)
            targets = to_device(targets, device)
            if replay is not None:
                losses.append(float(replay(plan, targets, [0.01])))
            else:
                optimizer.zero_grad()
                loss = weighted(model, plan.apply(model, padded=True), targets)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
        results.append((losses, [p.detach().cpu() for p in model.parameters()]))
    (gpu_losses, gpu_params), (cpu_losses, cpu_params) = results
    assert gpu_losses == pytest.approx(cpu_losses, rel=1e-4)
    for p, q in zip(gpu_params, cpu_params, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)
