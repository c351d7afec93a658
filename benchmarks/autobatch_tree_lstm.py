"""Tree-LSTM training on SST: plain per-sample PyTorch under ``torchfold.autobatch`` vs eager vs a Fold.

The model and trees of ``benchmarks/tree_lstm.py`` (``torchfold.examples.models.TreeLSTM``,
embedding and hidden size 128, batches of 50 SST trees, a softmax loss at every node, Adam).
Three versions of one training step, timed interleaved (median of the rounds), one thread:

* ``eager``: ``forward_tree`` (plain recursion, one call per node) on each tree in turn;
* ``autobatch``: the same ``forward_tree``, unchanged, run by ``torchfold.autobatch`` on the batch;
* ``fold``: ``encode_trees`` recorded on a ``torchfold.Fold`` inside the step, applied once.

It first checks that the three compute the same loss and gradients on the first batch.
Results: ``benchmarks/results/autobatch.md``.

Usage::

    python benchmarks/autobatch_tree_lstm.py --data ../shared/data/sst/train.txt
    python benchmarks/autobatch_tree_lstm.py --quick     # generated trees, a few rounds
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

import torchfold
from torchfold.examples.datasets import Tree, Vocab, generate_sst, read_sst_file
from torchfold.examples.models import TreeLSTM, encode_trees, forward_tree

Loss = Callable[[TreeLSTM, list[Tree], Vocab], torch.Tensor]


def eager_loss(model: TreeLSTM, trees: list[Tree], vocab: Vocab) -> torch.Tensor:
    outs = [forward_tree(model, tree, vocab) for tree in trees]
    labels = [label for _, tree_labels in outs for label in tree_labels]
    return F.cross_entropy(model.logits(torch.cat([h for h, _ in outs])), torch.tensor(labels))


def autobatch_loss(model: TreeLSTM, trees: list[Tree], vocab: Vocab) -> torch.Tensor:
    outs = torchfold.autobatch(lambda m, tree: forward_tree(m, tree, vocab), trees, model)
    labels = [label for _, tree_labels in outs for label in tree_labels]
    return F.cross_entropy(model.logits(torch.cat([h for h, _ in outs])), torch.tensor(labels))


def fold_loss(model: TreeLSTM, trees: list[Tree], vocab: Vocab) -> torch.Tensor:
    fold = torchfold.Fold()
    nodes, labels, _ = encode_trees(fold, trees, vocab)
    (states,) = fold.apply(model, [nodes])
    return F.cross_entropy(model.logits(states), torch.tensor(labels))


VERSIONS: dict[str, Loss] = {"eager": eager_loss, "autobatch": autobatch_loss, "fold": fold_loss}


def check_same(model: TreeLSTM, trees: list[Tree], vocab: Vocab) -> None:
    reference = None
    for name, loss_fn in VERSIONS.items():
        model.zero_grad()
        loss = loss_fn(model, trees, vocab)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        if reference is None:
            reference = (loss.detach(), grads)
            continue
        torch.testing.assert_close(loss.detach(), reference[0], msg=f"{name}: loss differs from eager")
        for a, b in zip(grads, reference[1], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"{name}: gradient differs from eager")


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, help="an SST-format file (default: generated trees)")
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=4, help="training steps per version per round")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.batch = 2, 1, 8
    torch.set_num_threads(1)
    torch.manual_seed(0)
    trees = read_sst_file(args.data, max_trees=2000) if args.data else generate_sst(200, seed=0)
    vocab = Vocab.build(trees)
    batches = [trees[i : i + args.batch] for i in range(0, len(trees) - args.batch + 1, args.batch)]
    model = TreeLSTM(len(vocab))
    check_same(model, batches[0], vocab)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    times: dict[str, list[float]] = {name: [] for name in VERSIONS}
    nodes = sum(len(list(tree.nodes())) for tree in batches[0])
    for round_number in range(args.rounds):
        # every version trains on the same batches in a round (the model's weights differ a little)
        chosen = [batches[(round_number * args.steps + step) % len(batches)] for step in range(args.steps)]
        for name, loss_fn in VERSIONS.items():
            start = time.perf_counter()
            for batch in chosen:
                optimizer.zero_grad()
                loss_fn(model, batch, vocab).backward()
                optimizer.step()
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(
        f"{args.batch} trees per batch ({nodes} nodes in the first), {args.rounds} rounds x {args.steps} steps"
    )
    for name, values in times.items():
        print(
            f"{name:10s} {medians[name]:8.1f} ms/step  x{medians['eager'] / medians[name]:5.2f} eager  "
            f"rounds {[round(v, 1) for v in values]}"
        )
    print(f"autobatch / fold speed: {medians['fold'] / medians['autobatch']:.2f}")
    return medians


if __name__ == "__main__":
    main()
