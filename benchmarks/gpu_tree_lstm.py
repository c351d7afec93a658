"""Tree-LSTM training on a CUDA GPU: hand-batched vs torchfold vs static-shape plans in a CUDA graph.

The same model, batches and Adam as ``tree_lstm.py`` (dense configuration), on ``--device``
(default ``cuda``). Versions, timed side by side (interleaved), one update = loss, backward
and Adam step, synchronised at the end:

* ``hand-batched``: ``tree_lstm.hand_loss`` with its precomputed indices on the GPU;
* ``torchfold``: a ``Fold`` recorded, compiled and applied per batch in the training process;
* ``torchfold, plans built ahead``: the same plans compiled before timing (what a
  ``DataLoader`` worker ships), applied in the loop;
* ``static plans``: the plans padded into one ``StaticShapes`` envelope (fitted to all batches
  first, so that every plan runs the same operations on the same shapes), applied eagerly,
  padded rows weighing 0 in the loss;
* ``static plans, captured``: the same padded step's forward, loss and backward compiled once per
  envelope layout by the library (``torchfold.train.capture.compiled.CompiledLoss``: torch.compile's
  inductor, default mode: no CUDA graphs) and run with each plan's index tensors; fused Adam after;
* ``static plans, one CUDA graph``: the whole padded step (forward, loss, backward and the fused
  Adam update) captured once per layout in one CUDA graph by the library
  (``torchfold.train.capture.cuda_replay.CudaStepReplay``) and replayed with each plan's inputs;
* ``TraceTrainer, captured``: the library's training loop (``TraceTrainer(compile="auto")``) over
  a ``StepLoader`` whose worker processes build the static plans, one step per batch (steps of
  one minibatch: replayed whole, as the version above).

Before timing, the first batch's loss must agree between every version (the graph's replay
too; the trainer's loss weighs trees, not nodes, equally, so it is left out of that check).
``--device cpu`` runs the eager versions on the CPU (no capture), for the smoke test.

Usage::

    python benchmarks/gpu_tree_lstm.py --data ../shared/data/sst/train.txt
    python benchmarks/gpu_tree_lstm.py --quick --device cpu
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

import harness
import numpy as np
import torch
import torch.nn.functional as F
import tree_lstm
from torch import Tensor

import torchfold
from torchfold.engine.static import StaticPlan
from torchfold.examples.datasets import Vocab
from torchfold.examples.models import TreeLSTM, TreeLSTMBuild, encode_trees, tree_lstm_loss
from torchfold.train.capture.compiled import CompiledLoss
from torchfold.train.capture.cuda_replay import CudaStepReplay


def hand_plan_to(plan: tree_lstm.Plan, device: torch.device) -> tree_lstm.Plan:
    """The hand-batched plan with its index tensors on ``device``."""
    levels = [tree_lstm.Level(level.sources, level.children.to(device), level.size) for level in plan.levels]
    return tree_lstm.Plan(
        plan.leaf_words.to(device),
        levels,
        plan.node_rows.to(device),
        plan.labels.to(device),
        plan.num_nodes,
        plan.num_unique,
    )


def weighted_targets(batch: tree_lstm.Batch) -> tuple[np.ndarray, np.ndarray]:
    """Labels of every node and weights that make the weighted sum the mean over the batch's nodes."""
    labels = np.asarray([label for flat in batch.flat for label in flat.labels], dtype=np.int64)
    return labels, np.full(len(labels), 1 / len(labels))


class Version:
    """One way of training: a model copy, its Adam, and ``step(i)`` for batch ``i``."""

    def __init__(self, model: TreeLSTM, capturable: bool = False) -> None:
        self.model = model
        self.optimizer = torch.optim.Adam(
            model.parameters(), lr=1e-3, **({"capturable": True} if capturable else {"fused": True})
        )
        self.losses: list[float] = []

    def loss(self, i: int) -> Tensor:
        raise NotImplementedError

    def step(self, i: int) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(i)
        loss.backward()
        self.optimizer.step()
        self.losses.append(loss.item())  # synchronises


class Hand(Version):
    def __init__(self, model: TreeLSTM, batches: list[tree_lstm.Batch], device: torch.device) -> None:
        super().__init__(model)
        self.batches = [
            tree_lstm.Batch(b.trees, b.flat, hand_plan_to(b.plan, device), b.vocab) for b in batches
        ]

    def loss(self, i: int) -> Tensor:
        return tree_lstm.hand_loss(self.model, self.batches[i])


class InLoop(Version):
    def __init__(self, model: TreeLSTM, batches: list[tree_lstm.Batch], device: torch.device) -> None:
        super().__init__(model)
        self.batches = batches
        self.device = device

    def loss(self, i: int) -> Tensor:
        batch = self.batches[i]
        fold = torchfold.Fold()
        nodes, labels, _ = encode_trees(fold, batch.trees, batch.vocab)
        (states,) = fold.apply(self.model, [nodes])
        return F.cross_entropy(self.model.logits(states), torch.tensor(labels, device=self.device))


class Planned(Version):
    def __init__(
        self, model: TreeLSTM, plans: list[Any], targets: list[tuple[np.ndarray, np.ndarray]]
    ) -> None:
        super().__init__(model)
        self.plans = plans
        self.targets = targets

    def loss(self, i: int) -> Tensor:
        plan = self.plans[i]
        return tree_lstm_loss(self.model, plan.apply(self.model, padded=True), self.targets[i])


class OnDevice(Version):
    """Static plans and their padded targets, the targets moved to the device once."""

    def __init__(
        self,
        model: TreeLSTM,
        plans: list[StaticPlan],
        targets: list[tuple[Tensor, Tensor]],
        device: torch.device,
    ) -> None:
        super().__init__(model)
        self.plans = plans
        self.targets = [(labels.to(device), weights.to(device)) for labels, weights in targets]


class Captured(OnDevice):
    """Static plans, forward + loss + backward compiled once per layout by the library
    (``torchfold.train.capture.compiled.CompiledLoss``: inductor's default mode), fused Adam after."""

    def __init__(
        self,
        model: TreeLSTM,
        plans: list[StaticPlan],
        targets: list[tuple[Tensor, Tensor]],
        device: torch.device,
    ) -> None:
        super().__init__(model, plans, targets, device)
        self.captured = CompiledLoss(model, tree_lstm_loss, device=device)

    def step(self, i: int) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.captured(self.plans[i], self.targets[i])  # forward, loss and backward
        self.optimizer.step()
        self.losses.append(loss.item())  # synchronises


class Replayed(OnDevice):
    """Static plans, the whole step (forward, loss, backward and fused Adam) as one CUDA graph per
    layout, replayed by the library (``torchfold.train.capture.cuda_replay.CudaStepReplay``)."""

    def __init__(
        self,
        model: TreeLSTM,
        plans: list[StaticPlan],
        targets: list[tuple[Tensor, Tensor]],
        device: torch.device,
    ) -> None:
        super().__init__(model, plans, targets, device)
        self.replay = CudaStepReplay(model, tree_lstm_loss, self.optimizer)

    def step(self, i: int) -> None:
        loss = self.replay(
            self.plans[i], self.targets[i], [group["lr"] for group in self.optimizer.param_groups]
        )
        self.losses.append(loss.item())  # synchronises


class Trainer(Version):
    """``TraceTrainer(compile="auto")`` over a ``StepLoader`` whose worker builds the static plans:
    the library's whole training loop (its own loss weighs each tree equally, so its losses are
    not compared with the others')."""

    def __init__(
        self, model: TreeLSTM, trees: list[Any], vocab: Vocab, shapes: Any, batch_size: int, workers: int
    ) -> None:
        from torchfold.train import AccumulatingOptimizer, StepLoader, TraceTrainer

        self.model = model
        self.losses = []
        optimizer = AccumulatingOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3, fused=True))
        build = TreeLSTMBuild(vocab, shapes=copy.deepcopy(shapes))
        loader = StepLoader(
            trees, batch_size, build=build, trace=batch_size, shuffle=False, num_workers=workers
        )
        self.trainer = TraceTrainer(model, optimizer, loader, tree_lstm_loss, progress=False, compile="auto")
        self.loader = loader
        self.steps = iter(loader)

    def step(self, i: int) -> None:
        step = next(self.steps, None)
        if step is None:  # the epoch is over: every iter() is the next one
            self.steps = iter(self.loader)
            step = next(self.steps)
        self.losses.append(self.trainer.train_step(step).loss)  # reads the step's loss: synchronises


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    harness.add_sst_data_argument(
        parser,
        help="SST-format trees (default: sst/train.txt under $TORCHFOLD_DATA or ../shared/data, if present)",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--batches", type=int, default=20, help="distinct batches, cycled")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--updates", type=int, default=10, help="timed updates per version per round")
    parser.add_argument(
        "--workers",
        type=int,
        default=4,
        help="worker processes building the TraceTrainer's plans (default 4)",
    )
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch_size, args.hidden, args.batches, args.rounds, args.updates = 4, 8, 3, 1, 2
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    trees, source = tree_lstm.load_trees(args.data, args.quick)
    vocab = Vocab.build(trees)
    batches = []
    for i in range(0, args.batches * args.batch_size, args.batch_size):
        chunk = trees[i : i + args.batch_size]
        flat = [tree_lstm.flatten(t, vocab) for t in chunk]
        batches.append(tree_lstm.Batch(chunk, flat, tree_lstm.make_plan(flat), vocab))
    targets = [weighted_targets(b) for b in batches]
    plans = [tree_lstm.fold_plan(b)[0] for b in batches]
    shapes = torchfold.StaticShapes()
    for plan in plans:  # grow the envelope over every batch first, then pad all into its last version
        shapes.cover(plan)
    static = [shapes.cover(plan) for plan in plans]
    static_targets = [
        (s.pad(0, labels), s.pad(0, weights)) for s, (labels, weights) in zip(static, targets, strict=True)
    ]
    layouts = len({s.layout.key for s in static})

    model = TreeLSTM(len(vocab), args.hidden, args.hidden).to(device)
    versions: dict[str, Version] = {
        "hand-batched": Hand(copy.deepcopy(model), batches, device),
        "torchfold": InLoop(copy.deepcopy(model), batches, device),
        "torchfold, plans built ahead": Planned(copy.deepcopy(model), plans, targets),
        "static plans": Planned(copy.deepcopy(model), static, static_targets),
    }
    if device.type == "cuda":
        versions["static plans, captured"] = Captured(copy.deepcopy(model), static, static_targets, device)
        versions["static plans, one CUDA graph"] = Replayed(
            copy.deepcopy(model), static, static_targets, device
        )
    compared = dict(versions)  # the versions whose losses and weights must agree
    if device.type == "cuda":
        versions["TraceTrainer, captured"] = Trainer(
            copy.deepcopy(model),
            [t for b in batches for t in b.trees],
            vocab,
            shapes,
            args.batch_size,
            args.workers,
        )

    # Equivalence: the first three updates' losses, and the weights after them, agree across
    # versions (the graph's replays too: the weights also show that Adam's state is right).
    checked = 3
    for version in versions.values():
        for i in range(checked):
            version.step(i % len(batches))
    reference = versions["hand-batched"]
    for name, version in compared.items():
        torch.testing.assert_close(
            torch.tensor(version.losses), torch.tensor(reference.losses), rtol=1e-4, atol=1e-5,
            msg=lambda m, name=name: f"{name}: losses differ from hand-batched: {m}",
        )  # fmt: skip
        for (key, value), expected in zip(
            version.model.state_dict().items(), reference.model.state_dict().values(), strict=True
        ):
            torch.testing.assert_close(
                value, expected, rtol=1e-4, atol=1e-5,
                msg=lambda m, name=name, key=key: f"{name}: {key} after {checked} updates differs from hand-batched: {m}",
            )  # fmt: skip
    first_loss = reference.losses[0]

    def synced(version: Version) -> Callable[[], None]:
        position = [checked]

        def run() -> None:
            version.step(position[0] % len(batches))
            position[0] += 1
            if device.type == "cuda":
                torch.cuda.synchronize()

        return run

    times = harness.interleaved(
        {name: synced(v) for name, v in versions.items()}, args.rounds, dict.fromkeys(versions, args.updates)
    )
    seconds = {name: statistics.mean(t) for name, t in times.items()}
    rate = {name: args.batch_size / s for name, s in seconds.items()}
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (CPU run)"
    print("## Tree-LSTM on a GPU: training sentences/s\n")
    print(
        "\n".join(
            harness.machine_lines(
                [
                    f"device: {device} ({gpu}); torch {torch.__version__}",
                    f"data: {source}; {len(batches)} batches of {args.batch_size} trees, cycled; hidden {args.hidden}",
                    f"static plans: one StaticShapes envelope fitted to all batches, {layouts} layout(s), padding waste "
                    f"{shapes.waste:.0%} of real calls",
                    f"first-batch loss {first_loss:.6f}; the first {checked} updates' losses and the weights after them agree "
                    "across versions",
                    f"timed: {args.rounds} interleaved rounds of {args.updates} updates each, synchronised per update",
                ]
            )
        )
        + "\n"
    )
    hand = rate["hand-batched"]
    print(
        harness.markdown_table(
            ["version", "sentences/s", "ms/update", "vs hand-batched"],
            [[name, r, seconds[name] * 1000, f"{r / hand:.2f}x"] for name, r in rate.items()],
        )
    )
    return rate


if __name__ == "__main__":
    main(sys.argv[1:])
