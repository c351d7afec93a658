"""TraceTrainer on a StepLoader vs the hand-batched Tree-LSTM, sentences/s in one run.

The same binary Tree-LSTM as ``tree_lstm.py`` (embedding = hidden = 128, softmax loss at every
node averaged over the batch's nodes, Adam) on batches of 50 SST trees, timed two ways,
alternating in rounds:

* ``hand-batched``: ``tree_lstm.py``'s depth batching written by hand, every index precomputed
  outside the timed loop (the practical limit of batching by depth), a plain ``torch.optim.Adam``;
* ``TraceTrainer``: ``torchfold.train.TraceTrainer`` on a ``torchfold.train.StepLoader`` whose worker process
  records and compiles every batch's fold (``TreeLSTMBuild``), the optimizer an
  ``AccumulatingOptimizer`` around the same Adam; a constant trace of 50 (one minibatch a step).

Both start from the same weights and take the same batches in the same order; the script checks
that their first losses agree. A trainer round is timed from the end of its third step to the
end of its last, so that minibatches the worker built while the hand-batched round ran do not
count. Optionally (``--cli``) ``python -m torchfold train`` runs afterwards on the same data and
its own ``samples/s`` line is reported (one run, not interleaved).

Usage::

    python benchmarks/trainer_tree_lstm.py --data ../shared/data/sst/train.txt --rounds 6 --updates 20 --cli
    python benchmarks/trainer_tree_lstm.py --quick
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import harness
import torch
import torch.nn.functional as F
from tree_lstm import Batch, flatten, hand_loss, load_trees, make_plan

import torchfold
from torchfold.examples.datasets import Vocab
from torchfold.examples.models import TreeLSTM, TreeLSTMBuild


def node_mean_loss(model: torch.nn.Module, outputs: list[torch.Tensor], targets: Any) -> torch.Tensor:
    """Mean cross-entropy over all nodes of the minibatch: the loss ``hand_loss`` computes."""
    labels, _ = targets
    return F.cross_entropy(model.logits(outputs[0]), labels)  # type: ignore[operator]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    harness.add_sst_data_argument(parser)
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--hidden", type=int, default=128, help="embedding and hidden size")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workers", type=int, default=1, help="StepLoader worker processes")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per version first")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--updates", type=int, default=20, help="steps per round and version")
    parser.add_argument("--cli", action="store_true", help="also time python -m torchfold train")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the smoke test")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch_size, args.hidden, args.warmup, args.rounds, args.updates = 4, 8, 1, 1, 5
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    trees, source = load_trees(args.data, args.quick)
    needed = args.warmup + args.rounds * args.updates
    trees = trees[: needed * args.batch_size]
    if len(trees) < needed * args.batch_size:
        raise SystemExit(
            f"need {needed * args.batch_size} trees, have {len(trees)}: fewer --rounds/--updates"
        )
    vocab = Vocab.build(trees)
    batches = []
    for i in range(0, len(trees), args.batch_size):
        chunk = trees[i : i + args.batch_size]
        flat = [flatten(t, vocab) for t in chunk]
        batches.append(Batch(chunk, flat, make_plan(flat), vocab))
    model = TreeLSTM(len(vocab), args.hidden, args.hidden)

    hand_model = copy.deepcopy(model)
    hand_opt = torch.optim.Adam(hand_model.parameters(), lr=args.lr, fused=True)
    hand_losses: list[float] = []
    position = 0

    def hand_steps(n: int) -> float:
        nonlocal position
        start = time.perf_counter()
        for _ in range(n):
            hand_opt.zero_grad(set_to_none=True)
            loss = hand_loss(hand_model, batches[position])
            loss.backward()
            hand_opt.step()
            hand_losses.append(loss.item())
            position += 1
        return time.perf_counter() - start

    trainer_model = copy.deepcopy(model)
    optimizer = torchfold.train.AccumulatingOptimizer(
        torch.optim.Adam(trainer_model.parameters(), lr=args.lr, fused=True)
    )
    loader = torchfold.train.StepLoader(
        trees,
        args.batch_size,
        build=TreeLSTMBuild(vocab),
        shuffle=False,
        num_workers=args.workers,
        worker_init_fn=_freeze_gc,
    )
    ends: list[float] = []
    trainer = torchfold.train.TraceTrainer(
        trainer_model,
        optimizer,
        loader,
        node_mean_loss,
        progress=False,
        on_step=lambda stats: ends.append(time.perf_counter()),
    )
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.collect()
        gc.freeze()
    try:
        return _measure(args, trainer, hand_steps, hand_losses, ends, loader, source, trees)
    finally:
        loader.close()
        if freeze:
            gc.unfreeze()  # main() may run inside a bigger process (the smoke test)


def _measure(
    args: argparse.Namespace,
    trainer: torchfold.train.TraceTrainer,
    hand_steps: Any,
    hand_losses: list[float],
    ends: list[float],
    loader: torchfold.train.StepLoader[Any, Any],
    source: str,
    trees: list[Any],
) -> dict[str, float]:
    history = trainer.fit(max_steps=args.warmup)
    hand_steps(args.warmup)
    torch.testing.assert_close(
        torch.tensor([s.loss for s in history]), torch.tensor(hand_losses), rtol=1e-4, atol=1e-5
    )
    rates: dict[str, list[float]] = {"hand-batched": [], "TraceTrainer": []}
    skip = min(2, args.updates - 1)
    for _ in range(args.rounds):
        seconds = hand_steps(args.updates)
        rates["hand-batched"].append(args.updates * args.batch_size / seconds)
        ends.clear()
        trainer.fit(max_steps=trainer.next_step + args.updates)
        timed = len(ends) - 1 - skip
        rates["TraceTrainer"].append(timed * args.batch_size / (ends[-1] - ends[skip]))
    result = {name: statistics.median(values) for name, values in rates.items()}
    rows = [
        [
            name,
            f"{result[name]:,.0f}",
            f"{min(v):,.0f}..{max(v):,.0f}",
            f"{result[name] / result['hand-batched']:.2f}x",
        ]
        for name, v in rates.items()
    ]
    if args.cli:
        result["cli"] = _cli(args, trees)
        rows.append(
            [
                "python -m torchfold train (one run)",
                f"{result['cli']:,.0f}",
                "",
                f"{result['cli'] / result['hand-batched']:.2f}x",
            ]
        )
    print(
        "\n".join(
            harness.machine_lines([f"data: {source}, {len(trees)} trees, batches of {args.batch_size}"])
        )
    )
    print(
        harness.markdown_table(
            ["version", "sentences/s (median)", "range over rounds", "vs hand-batched"], rows
        )
    )
    print(json.dumps(result))
    return result


def _freeze_gc(worker_id: int) -> None:
    gc.freeze()  # the forked dataset copy leaves the cyclic GC (see tree_lstm.py)


def _cli(args: argparse.Namespace, trees: list[Any]) -> float:
    """``python -m torchfold train`` on the same trees, a constant batch; its own samples/s."""
    with tempfile.TemporaryDirectory() as directory:
        data = Path(directory) / "train.txt"
        data.write_text("".join(f"{tree}\n" for tree in trees))
        steps = args.warmup + args.rounds * args.updates
        command = [sys.executable, "-m", "torchfold", "train", "--trace", str(args.batch_size)]
        command += ["--data", directory, "--minibatch-size", str(args.batch_size), "--max-steps", str(steps)]
        command += ["--embedding-dim", str(args.hidden), "--hidden-dim", str(args.hidden), "--no-progress"]
        command += ["--workers", str(args.workers), "--threads", str(args.threads), "--no-resume"]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
    match = re.search(r"([\d.]+) samples/s", done.stdout)
    if match is None:
        raise RuntimeError(f"no samples/s in the CLI's output:\n{done.stdout}{done.stderr}")
    return float(match.group(1))


if __name__ == "__main__":
    main()
