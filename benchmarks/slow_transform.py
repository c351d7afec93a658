"""A dataset with a slow per-sample transform feeding a Tree-LSTM: StepLoader synchronous vs asynchronous.

Each sample costs ``--transform-ms`` (default 2 ms) to fetch, like decoding from disk or the
network (a ``time.sleep``: it holds no CPU, as I/O does), and every minibatch of trees is then
recorded and compiled into a fold (``TreeLSTMBuild``). The training step applies the plan, runs
backward and Adam. Timed per optimizer step:

* ``train only``: the step on plans built beforehand (the floor);
* ``data + build``: fetching and building one step's minibatch, alone;
* ``synchronous``: ``StepLoader(num_workers=0)``: fetch, build and train one after the other;
* ``asynchronous``: ``StepLoader(num_workers=N)``: workers fetch and build ahead while the
  training process trains.

The versions alternate in rounds (medians reported). The share of the synchronous step's loading
time that the asynchronous loader hides is ``(synchronous - asynchronous) / (synchronous - train
only)``.

Usage::

    python benchmarks/slow_transform.py --steps 40 --workers 2
    python benchmarks/slow_transform.py --quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

import harness
import torch
from tree_lstm import load_trees

import torchfold
from torchfold.examples.datasets import Tree, Vocab
from torchfold.examples.models import TreeLSTM, TreeLSTMBuild, tree_lstm_loss


class SlowTrees(torch.utils.data.Dataset[Tree]):
    """Trees whose every ``__getitem__`` takes ``seconds`` (a slow transform)."""

    def __init__(self, trees: list[Tree], seconds: float) -> None:
        self.trees = trees
        self.seconds = seconds

    def __len__(self) -> int:
        return len(self.trees)

    def __getitem__(self, i: int) -> Tree:
        time.sleep(self.seconds)
        return self.trees[i]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    harness.add_sst_data_argument(parser)
    parser.add_argument("--batch-size", type=int, default=25, help="trees per step")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--transform-ms", type=float, default=2.0)
    parser.add_argument("--workers", type=int, default=2, help="worker processes of the asynchronous loader")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per version")
    parser.add_argument("--rounds", type=int, default=4, help="rounds alternating the versions")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch_size, args.hidden, args.steps, args.workers, args.rounds = 4, 8, 4, 1, 2
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    trees, source = load_trees(args.data, args.quick)
    trees = trees[: (args.steps + 2) * args.batch_size]
    vocab = Vocab.build(trees)
    dataset = SlowTrees(trees, args.transform_ms / 1000)
    build = TreeLSTMBuild(vocab)
    torch.manual_seed(0)
    model = TreeLSTM(len(vocab), args.hidden, args.hidden)
    optimizer = torchfold.train.AccumulatingOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))

    def train(step: Any) -> None:
        for mb in step:
            plan, targets = mb.data
            with optimizer.minibatch(mb.num_samples):
                tree_lstm_loss(model, plan.apply(model), targets).backward()
        optimizer.step()
        optimizer.zero_grad()

    # The floor: the same steps on plans built beforehand.
    with torchfold.train.StepLoader(trees, args.batch_size, build=build, shuffle=False) as loader:
        ready = list(loader)

    def floor(steps: list[Any]) -> float:
        start = time.perf_counter()
        for step in steps:
            train(step)
        return (time.perf_counter() - start) / len(steps)

    def alone(first: int, count: int) -> float:
        start = time.perf_counter()
        for i in range(first, first + count):
            build([dataset[j] for j in range(i * args.batch_size, (i + 1) * args.batch_size)])
        return (time.perf_counter() - start) / count

    # Rounds alternate the versions, so that the machine's drift hits them alike.
    sync_loader = torchfold.train.StepLoader(dataset, args.batch_size, build=build, shuffle=False)
    async_loader = torchfold.train.StepLoader(
        dataset, args.batch_size, build=build, shuffle=False, num_workers=args.workers
    )
    iterators = {"sync": iter(sync_loader), "async": iter(async_loader)}
    train(next(iterators["sync"]))  # warm-up (and the workers' start-up)
    train(next(iterators["async"]))
    per_round = args.steps // args.rounds
    times: dict[str, list[float]] = {"train": [], "alone": [], "sync": [], "async": []}
    for r in range(args.rounds):
        first = 1 + r * per_round
        times["train"].append(floor(ready[first : first + per_round]))
        times["alone"].append(alone(first, per_round))
        for name, steps in iterators.items():
            start = time.perf_counter()
            for _ in range(per_round):
                train(next(steps))
            times[name].append((time.perf_counter() - start) / per_round)
    sync_loader.close()
    async_loader.close()
    train_only, data_build, sync, asynchronous = (
        statistics.median(times[name]) for name in ("train", "alone", "sync", "async")
    )
    hidden = (sync - asynchronous) / max(sync - train_only, 1e-9)
    result = {
        "train_only_ms": train_only * 1e3,
        "data_build_ms": data_build * 1e3,
        "sync_ms": sync * 1e3,
        "async_ms": asynchronous * 1e3,
        "hidden": hidden,
    }
    rows = [
        ["train only (plans built beforehand)", f"{train_only * 1e3:.1f}"],
        [
            f"data ({args.batch_size} x {args.transform_ms:g} ms) + fold building, alone",
            f"{data_build * 1e3:.1f}",
        ],
        ["StepLoader, synchronous (num_workers=0)", f"{sync * 1e3:.1f}"],
        [f"StepLoader, asynchronous (num_workers={args.workers})", f"{asynchronous * 1e3:.1f}"],
    ]
    print(
        "\n".join(harness.machine_lines([f"data: {source}, {len(trees)} trees, {args.batch_size} per step"]))
    )
    print(harness.markdown_table(["", "ms per step"], rows))
    print(
        f"the asynchronous loader hides {hidden:.0%} of the loading time of the synchronous step (sync - train only)"
    )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
