"""A shift-reduce parser that chooses its transitions from its own predictions, eager vs ``torchfold.autobatch``.

SPINN-style (Bowman et al., 2016) without its tracker LSTM: a sentence's words start on a buffer,
and at every step the model scores SHIFT against REDUCE from the top of the stack and the front
of the buffer and takes the best (``logits.argmax().item()``: the next transition depends on a
value just computed, which a graph recorded ahead of time, such as a Fold's, cannot express);
REDUCE composes the two top states into one. The sentence's label is read from the last state.
The same plain per-sample function runs eagerly, one sentence after another, and under
``torchfold.autobatch`` on the batch (each sentence waits only for its own decision; the others'
calls keep batching). Training with Adam on SST sentences (root labels), batches of 50, one
thread, median of interleaved rounds.

Results: ``benchmarks/results/autobatch.md``.

Usage::

    python benchmarks/autobatch_parser.py --data ../shared/data/sst/train.txt
    python benchmarks/autobatch_parser.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import torchfold
from torchfold.examples.datasets import Tree, Vocab, generate_sst, read_sst_file

SHIFT, REDUCE = 0, 1


class Parser(torch.nn.Module):
    """Row-wise ops of a shift-reduce parser: word states, the transition's scores, composition, labels."""

    def __init__(self, vocab_size: int, dim: int = 128, num_classes: int = 5) -> None:
        super().__init__()
        self.dim = dim
        self.embedding = torch.nn.Embedding(vocab_size, dim)
        self.transition = torch.nn.Linear(2 * dim, 2)
        self.composition = torch.nn.Linear(2 * dim, dim)
        self.classifier = torch.nn.Linear(dim, num_classes)

    def word(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.embedding(ids))

    def decide(self, top: torch.Tensor, front: torch.Tensor) -> torch.Tensor:
        return self.transition(torch.cat([top, front], -1))

    def compose(self, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.composition(torch.cat([left, right], -1)))


def parse(model: Any, sample: tuple[list[int], int]) -> tuple[torch.Tensor, int]:
    """Plain per-sample code: parse one sentence by the model's own transitions; its loss and REDUCE count."""
    words, label = sample
    buffer = [model.word(torch.tensor([word])) for word in reversed(words)]
    stack: list[Any] = []
    reduces = 0
    while buffer or len(stack) > 1:
        if len(stack) < 2:
            action = SHIFT
        elif not buffer:
            action = REDUCE
        else:
            action = int(model.decide(stack[-1], buffer[-1]).argmax().item())
        if action == SHIFT:
            stack.append(buffer.pop())
        else:
            right, left = stack.pop(), stack.pop()
            stack.append(model.compose(left, right))
            reduces += 1
    loss = F.cross_entropy(model.classifier(stack[-1]), torch.tensor([label]))
    return loss, reduces


def eager_loss(model: Parser, batch: list[tuple[list[int], int]]) -> tuple[torch.Tensor, list[int]]:
    outs = [parse(model, sample) for sample in batch]
    return torch.stack([loss for loss, _ in outs]).mean(), [reduces for _, reduces in outs]


def autobatch_loss(model: Parser, batch: list[tuple[list[int], int]]) -> tuple[torch.Tensor, list[int]]:
    outs = torchfold.autobatch(parse, batch, model)
    return torch.stack([loss for loss, _ in outs]).mean(), [reduces for _, reduces in outs]


VERSIONS = {"eager": eager_loss, "autobatch": autobatch_loss}


def sentences(trees: list[Tree], vocab: Vocab) -> list[tuple[list[int], int]]:
    return [
        ([vocab[node.word] for node in tree.nodes() if node.word is not None], tree.label) for tree in trees
    ]


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, help="an SST-format file (default: generated trees)")
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.batch = 2, 1, 8
    torch.set_num_threads(1)
    torch.manual_seed(0)
    trees = read_sst_file(args.data, max_trees=2000) if args.data else generate_sst(200, seed=0)
    vocab = Vocab.build(trees)
    data = sentences(trees, vocab)
    batches = [data[i : i + args.batch] for i in range(0, len(data) - args.batch + 1, args.batch)]
    model = Parser(len(vocab))
    # the same losses, the same transitions taken and the same gradients, before timing
    reference = None
    for name, loss_fn in VERSIONS.items():
        model.zero_grad()
        loss, reduces = loss_fn(model, batches[0])
        loss.backward()
        grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
        if reference is None:
            reference = (loss.detach(), reduces, grads)
            continue
        torch.testing.assert_close(loss.detach(), reference[0], msg=f"{name}: loss differs from eager")
        assert reduces == reference[1], f"{name}: other transitions than eager"
        for a, b in zip(grads, reference[2], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"{name}: gradient differs from eager")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    times: dict[str, list[float]] = {name: [] for name in VERSIONS}
    for round_number in range(args.rounds):
        # every version trains on the same batches in a round (the model's weights differ a little)
        chosen = [batches[(round_number * args.steps + step) % len(batches)] for step in range(args.steps)]
        for name, loss_fn in VERSIONS.items():
            start = time.perf_counter()
            for batch in chosen:
                optimizer.zero_grad()
                loss_fn(model, batch)[0].backward()
                optimizer.step()
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    medians = {name: statistics.median(values) for name, values in times.items()}
    words = sum(len(words) for words, _ in batches[0])
    print(
        f"{args.batch} sentences per batch ({words} words in the first), {args.rounds} rounds x {args.steps} steps"
    )
    for name, values in times.items():
        print(
            f"{name:10s} {medians[name]:8.1f} ms/step  x{medians['eager'] / medians[name]:5.2f} eager  "
            f"rounds {[round(v, 1) for v in values]}"
        )
    return medians


if __name__ == "__main__":
    main()
