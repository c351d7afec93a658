"""Where torchfold's time goes on the Tree-LSTM benchmark: phases, GC, and a cProfile.

Prints, in CPU milliseconds per batch (mean over the batches):

* torchfold's phases (record with ``encode_trees``, compile with ``Fold.plan``, run with
  ``FoldPlan.apply``, logits + loss, backward) next to the hand-batched version's forward and
  backward, which do the same tensor work;
* recording alone with Python's cyclic GC on, after ``gc.freeze()``, and off;
* self CPU time of the worker-fed path's ops by kind (matrix products, gathers, element-wise,
  Adam), from ``torch.profiler`` over 10 batches;
* a cProfile of torchfold training updates (Adam included), sorted by self time.

Usage::

    python benchmarks/profile_tree_lstm.py                # SST from ../shared/data if present
    python benchmarks/profile_tree_lstm.py --quick        # tiny, for the smoke test
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import gc
import io
import pstats
import sys
import time
from collections.abc import Callable, Sequence

import harness
import torch
import torch.nn.functional as F
import tree_lstm

import torchfold
from torchfold.examples.datasets import Vocab
from torchfold.examples.models import TreeLSTM, encode_trees

clock = time.process_time


def mean_ms(fn: Callable[[tree_lstm.Batch], object], batches: list[tree_lstm.Batch]) -> float:
    start = clock()
    for batch in batches:
        fn(batch)
    return (clock() - start) / len(batches) * 1000


def phases(model: TreeLSTM, batches: list[tree_lstm.Batch]) -> dict[str, float]:
    """Mean CPU ms per batch of each phase of a torchfold and a hand-batched forward/backward."""
    total = dict.fromkeys(
        ("record", "compile", "apply", "loss", "backward", "hand forward", "hand backward"), 0.0
    )
    for batch in batches:
        t0 = clock()
        fold = torchfold.Fold()
        nodes, labels, _ = encode_trees(fold, batch.trees, batch.vocab)
        t1 = clock()
        plan = fold.plan([nodes])
        t2 = clock()
        (states,) = plan.apply(model)
        t3 = clock()
        loss = F.cross_entropy(model.logits(states), torch.tensor(labels))
        t4 = clock()
        loss.backward()
        t5 = clock()
        hand = tree_lstm.hand_loss(model, batch)
        t6 = clock()
        hand.backward()
        t7 = clock()
        stamps = (t0, t1, t2, t3, t4, t5, t6, t7)
        for key, start, end in zip(total, stamps[:-1], stamps[1:], strict=True):
            total[key] += end - start
    return {key: seconds / len(batches) * 1000 for key, seconds in total.items()}


# torch.profiler op names by what they do (self CPU time; everything else is "other")
OP_KINDS = {
    "matrix products": ("aten::mm", "aten::addmm"),
    # (index_select and fill_ also count the embedding lookup and its dense gradient's zero-fill)
    "concatenations and row gathers, forward and backward": (
        "aten::cat",
        "aten::index_select",
        "aten::index_add_",
        "aten::fill_",
        "aten::zero_",
        "aten::split_with_sizes",
        "aten::narrow",
        "aten::slice",
        "aten::as_strided",
    ),
    "element-wise": (
        "aten::mul",
        "aten::add",
        "aten::add_",
        "aten::tanh",
        "aten::sigmoid",
        "aten::tanh_backward",
        "aten::sigmoid_backward",
        "aten::sum",
    ),
    "Adam (fused)": ("aten::_fused_adam_",),
}


def op_shares(model: TreeLSTM, batches: list[tree_lstm.Batch]) -> list[list[object]]:
    """Self CPU time by kind of op over updates of the worker-fed path: plans compiled before,
    then apply, loss, backward and a fused Adam step per batch, under ``torch.profiler``."""
    plans = [tree_lstm.fold_plan(batch) for batch in batches]
    trainer = tree_lstm.Trainer(copy.deepcopy(model), tree_lstm.fold_loss, batches, 1e-3)
    trainer.update(tree_lstm.plan_loss(trainer.model, *plans[0]))  # warm-up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        for plan, labels in plans:
            trainer.update(tree_lstm.plan_loss(trainer.model, plan, labels))
    self_us = {event.key: event.self_cpu_time_total for event in profiler.key_averages()}
    total = sum(self_us.values())
    rows: list[list[object]] = []
    for kind, names in OP_KINDS.items():
        us = sum(self_us.pop(name, 0.0) for name in names)
        rows.append([kind, f"{100 * us / total:.0f}%", us / 1000 / len(plans)])
    other = sum(self_us.values())
    rows.append(
        [
            "other (autograd engine, embedding, loss, Python ops)",
            f"{100 * other / total:.0f}%",
            other / 1000 / len(plans),
        ]
    )
    return rows


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    harness.add_sst_data_argument(parser, help="SST-format trees, one per line")
    parser.add_argument("--batches", type=int, default=30, help="batches of 50 trees to average over")
    parser.add_argument("--updates", type=int, default=20, help="torchfold training updates to cProfile")
    parser.add_argument("--top", type=int, default=20, help="cProfile rows to print")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the smoke test")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    size = 4 if args.quick else 50
    count = 2 if args.quick else args.batches
    trees, source = tree_lstm.load_trees(args.data, args.quick)
    vocab = Vocab.build(trees)
    batches = []
    for i in range(0, min(len(trees), count * size) - size + 1, size):
        chunk = trees[i : i + size]
        flat = [tree_lstm.flatten(t, vocab) for t in chunk]
        batches.append(tree_lstm.Batch(chunk, flat, tree_lstm.make_plan(flat), vocab))
    hidden = 8 if args.quick else 128
    model = TreeLSTM(len(vocab), hidden, hidden)

    print("## Where torchfold's time goes: Tree-LSTM, CPU ms per batch (mean)\n")
    extra = [
        f"data: {source}; {len(batches)} batches of {size} trees; hidden {hidden}; clock: process CPU time"
    ]
    print("\n".join(line for line in harness.machine_lines(extra) if not line.startswith("clock:")) + "\n")
    phases(model, batches[:1])  # warm-up
    times = phases(model, batches)
    fold_total = times["record"] + times["compile"] + times["apply"] + times["loss"] + times["backward"]
    hand_total = times["hand forward"] + times["hand backward"]
    print(
        harness.markdown_table(
            [
                "version",
                "record",
                "compile (Fold.plan)",
                "apply / forward",
                "logits+loss",
                "backward",
                "total",
            ],
            [
                [
                    "torchfold",
                    times["record"],
                    times["compile"],
                    times["apply"],
                    times["loss"],
                    times["backward"],
                    fold_total,
                ],
                [
                    "hand-batched",
                    "-",
                    "-",
                    times["hand forward"],
                    "(in forward)",
                    times["hand backward"],
                    hand_total,
                ],
            ],
        )
    )

    def record(batch: tree_lstm.Batch) -> None:
        encode_trees(torchfold.Fold(), batch.trees, batch.vocab)

    gc_rows = [["on (default)", mean_ms(record, batches)]]
    gc.collect()
    gc.freeze()
    gc_rows.append(["after gc.freeze()", mean_ms(record, batches)])
    gc.unfreeze()
    gc.disable()
    try:
        gc_rows.append(["off", mean_ms(record, batches)])
    finally:
        gc.enable()
    print(f"\nrecording alone (encode_trees), {len(gc.get_objects())} GC-tracked objects in the process:\n")
    print(harness.markdown_table(["cyclic GC", "record ms/batch"], gc_rows))

    shares = op_shares(model, batches[: 2 if args.quick else 10])
    print("\ntorch.profiler, worker-fed path (plans compiled before; apply, loss, backward, fused Adam):\n")
    print(harness.markdown_table(["ops", "share of self CPU time", "ms per batch"], shares))

    trainer = tree_lstm.Trainer(copy.deepcopy(model), tree_lstm.fold_loss, batches, 1e-3)
    trainer.step()
    profile = cProfile.Profile(timer=time.process_time)
    profile.enable()
    for _ in range(1 if args.quick else args.updates):
        trainer.step()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.top)
    print(
        f"\ncProfile of {1 if args.quick else args.updates} torchfold training updates (process-time timer):"
    )
    print("```text\n" + text.getvalue().strip() + "\n```")
    return {**times, "torchfold total": fold_total, "hand total": hand_total}


if __name__ == "__main__":
    main(sys.argv[1:])
