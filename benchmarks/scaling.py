"""How torchfold's costs grow with the size of the graph and of the batch (issue 12, part 4).

Two tables, both on the Tree-LSTM of ``torchfold.examples.models`` (CPU, one thread):

* **forest size**: one fold over a forest of generated SST-format trees of about 1k, 10k,
  100k and 1M nodes (``--sizes``). Each size runs in a fresh subprocess, so that its peak RSS is
  its own; the table gives ``add`` (recording, ``encode_trees``), compiling (``Fold.plan``),
  running the plan (``FoldPlan.apply``) and backward, per node and per group, and the peak
  RSS growth over the process before recording, per node;
* **batch size**: training updates (record, compile, apply, loss, backward, Adam) on batches
  of 10 to 500 trees (``--batch-sizes``; SST training trees if found, else generated ones),
  in sentences/s and microseconds per node.

"Per node" is per ``add`` call (what the user records); "per distinct" is per node actually
computed: identical subtrees are computed once, and bigger forests repeat more of them, so
apply, backward and memory, which scale with the distinct nodes, are given per distinct node
too. Costs that are linear in the graph give flat columns; a cost per node or per distinct
node that grows with the size is where scaling stops being linear.

Usage::

    python benchmarks/scaling.py                         # all sizes, hidden 32 for the forest table
    python benchmarks/scaling.py --sizes 1000,10000 --batch-sizes 10,50
    python benchmarks/scaling.py --quick                 # tiny, for the smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import harness
import torch
import torch.nn.functional as F

import torchfold
from torchfold.examples.datasets import Tree, Vocab, generate_sst, read_sst_file
from torchfold.examples.models import TreeLSTM, encode_trees


def current_rss_mb() -> float:
    """The process's resident set size now, in MB (Linux: /proc/self/statm)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def peak_rss_mb() -> float:
    """The process's peak resident set size so far, in MB (``ru_maxrss`` is in KB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def forest(nodes: int, seed: int) -> list[Tree]:
    """Generated SST-format trees (2-40 words) until they hold at least ``nodes`` nodes."""
    trees: list[Tree] = []
    total = 0
    chunk = 0
    while total < nodes:
        batch = generate_sst(max(1, (nodes - total) // 40 + 1), seed=seed + chunk, max_words=40)
        chunk += 1
        for tree in batch:
            trees.append(tree)
            total += len(tree)
            if total >= nodes:
                break
    return trees


def measure_forest(nodes: int, hidden: int, seed: int) -> dict[str, Any]:
    """One fold over a forest of about ``nodes`` nodes: seconds per phase, groups, peak RSS growth."""
    trees = forest(nodes, seed)
    vocab = Vocab.build(trees)
    torch.manual_seed(seed)
    model = TreeLSTM(len(vocab), hidden, hidden)
    # a small fold first: the allocator's and kernels' first-use memory is not the forest's
    warmup = torchfold.Fold()
    small, small_labels, _ = encode_trees(warmup, trees[:3], vocab)
    (small_states,) = warmup.apply(model, [small])
    F.cross_entropy(model.logits(small_states), torch.tensor(small_labels)).backward()
    model.zero_grad(set_to_none=True)
    del warmup, small, small_states
    gc.collect()
    rss_before = current_rss_mb()
    clock = time.process_time
    t0 = clock()
    fold = torchfold.Fold()
    handles, labels, _ = encode_trees(fold, trees, vocab)
    t1 = clock()
    plan = fold.plan([handles])
    t2 = clock()
    (states,) = plan.apply(model)
    t3 = clock()
    loss = F.cross_entropy(model.logits(states), torch.tensor(labels))
    t4 = clock()
    loss.backward()
    t5 = clock()
    peak = peak_rss_mb()
    return {
        "nodes": len(handles),
        "distinct": len(fold),
        "trees": len(trees),
        "groups": len(plan.groups),
        "record": t1 - t0,
        "compile": t2 - t1,
        "apply": t3 - t2,
        "loss": t4 - t3,
        "backward": t5 - t4,
        "rss_growth_mb": peak - rss_before,
    }


def forest_in_subprocess(nodes: int, hidden: int, seed: int) -> dict[str, Any]:
    """``measure_forest`` in a fresh interpreter (its own peak RSS), one thread."""
    code = (
        "import json, sys, torch; torch.set_num_threads(1); "
        f"sys.path.insert(0, {str(Path(__file__).parent)!r}); import scaling; "
        f"print(json.dumps(scaling.measure_forest({nodes}, {hidden}, {seed})))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def training_rate(trees: list[Tree], vocab: Vocab, batch: int, hidden: int, updates: int) -> dict[str, float]:
    """Training updates of ``batch`` trees each (fold built in the loop): sentences/s and us/node."""
    torch.manual_seed(0)
    model = TreeLSTM(len(vocab), hidden, hidden)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    batches = [trees[(i * batch) % len(trees) :][:batch] for i in range(updates + 1)]
    clock = harness.CLOCKS[harness.clock_name()]
    seconds = nodes = 0.0
    for number, chunk in enumerate(batches):
        start = clock()
        fold = torchfold.Fold()
        handles, labels, _ = encode_trees(fold, chunk, vocab)
        (states,) = fold.apply(model, [handles])
        loss = F.cross_entropy(model.logits(states), torch.tensor(labels))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if number:  # the first update warms up
            seconds += clock() - start
            nodes += len(handles)
    return {"sentences/s": updates * batch / seconds, "us/node": seconds / nodes * 1e6}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    harness.add_sst_data_argument(
        parser,
        help="SST-format trees for the batch-size table (default: ../shared/data/sst/train.txt if present)",
    )
    parser.add_argument("--sizes", default="1000,10000,100000,1000000", help="forest sizes in nodes")
    parser.add_argument("--hidden", type=int, default=32, help="embedding and hidden size, forest table")
    parser.add_argument("--batch-sizes", default="10,50,100,200,500", help="trees per training update")
    parser.add_argument(
        "--batch-hidden", type=int, default=128, help="embedding and hidden size, batch table"
    )
    parser.add_argument("--updates", type=int, default=6, help="timed updates per batch size")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the smoke test")
    harness.add_clock_argument(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.hidden, args.batch_sizes, args.batch_hidden, args.updates = (
            "300,1000",
            8,
            "4,8",
            8,
            1,
        )
    args.sizes = [int(size) for size in args.sizes.split(",")]
    args.batch_sizes = [int(size) for size in args.batch_sizes.split(",")]
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    harness.use_clock(args.clock)
    forests = [forest_in_subprocess(size, args.hidden, args.seed) for size in args.sizes]

    if args.data is not None:
        trees, source = (
            read_sst_file(args.data, max_trees=max(args.batch_sizes) * (args.updates + 1)),
            str(args.data),
        )
    else:
        count = max(args.batch_sizes) * (args.updates + 1)
        trees, source = generate_sst(count, seed=args.seed), f"{count} generated SST-format trees"
    vocab = Vocab.build(trees)
    rates = [
        {"trees": batch, **training_rate(trees, vocab, batch, args.batch_hidden, args.updates)}
        for batch in args.batch_sizes
    ]

    print("## Scaling: cost per node and per group, by forest size and by batch size\n")
    print(
        "\n".join(
            harness.machine_lines(
                [
                    f"forest table: generated SST-format trees (2-40 words), TreeLSTM hidden {args.hidden}, one fold "
                    "per forest, each size in a fresh process; process CPU time; RSS growth = peak RSS minus "
                    "RSS before recording",
                    f"batch table: {source}, TreeLSTM hidden {args.batch_hidden}, Adam (fused); per update a new "
                    f"Fold, record, apply, loss, backward, step; {args.updates} timed updates after one warm-up",
                ]
            )
        )
        + "\n"
    )
    rows = []
    for f in forests:
        n, d, g = f["nodes"], f["distinct"], f["groups"]
        rows.append(
            [
                n,
                d,
                f["trees"],
                g,
                f["record"] / n * 1e6,
                f["compile"] / n * 1e6,
                f["apply"] / n * 1e6,
                f["apply"] / d * 1e6,
                f["apply"] / g * 1e3,
                f["backward"] / n * 1e6,
                f["backward"] / d * 1e6,
                (f["record"] + f["compile"] + f["apply"] + f["loss"] + f["backward"]),
                f["rss_growth_mb"] * 2**20 / n / 1024,
                f["rss_growth_mb"] * 2**20 / d / 1024,
            ]
        )
    print(
        harness.markdown_table(
            [
                "nodes",
                "distinct",
                "trees",
                "groups",
                "add us/node",
                "compile us/node",
                "apply us/node",
                "apply us/distinct",
                "apply ms/group",
                "backward us/node",
                "backward us/distinct",
                "total s",
                "peak RSS KB/node",
                "peak RSS KB/distinct",
            ],
            rows,
        )
    )
    print()
    print(
        harness.markdown_table(
            ["trees/batch", "sentences/s", "us/node (whole update)"],
            [[r["trees"], r["sentences/s"], r["us/node"]] for r in rates],
        )
    )
    return {"forests": forests, "batches": rates}


if __name__ == "__main__":
    main(sys.argv[1:])
