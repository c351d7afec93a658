"""Could another schedule than depth batching cut the batched calls on SST? Counted, not timed.

A fold runs one batched call per (depth, op) group: its depth-batching schedule. Fewer calls
mean less per-call overhead (Python, dispatch, gathers), so a schedule with fewer calls would
be faster. For each batch size this script records SST batches with
``torchfold.examples.models.encode_trees`` and counts, per batch:

* ``depth batching``: the fold's groups (``len(fold.groups())``), what ``apply`` runs;
* ``lower bound``: the longest chain of dependent calls. Every schedule that runs dependent
  calls one after another needs at least that many batched calls, however it groups them;
* ``agenda``: agenda scheduling in the style of DyNet's autobatching, simulated on the same
  graph of torchfold calls: at each step, batch every ready node of the op whose ready nodes
  have the lowest mean depth, then release the nodes that became ready. This is the agenda
  rule applied to torchfold's ops (one per Tree-LSTM cell), not a count of the calls DyNet
  makes on its own finer graph (lookups, affine transforms, logistic, ... per cell).

When depth batching meets the lower bound, no schedule (agenda, level merging, or any other)
can batch the graph into fewer calls, so the time per call is what is left to cut. For a
Tree-LSTM this holds by construction: it has one leaf op at depth 0 and one internal op above,
each level of internal nodes depending on the one below, so depth batching and any greedy
ready-set schedule make one call per level. The counts confirm it on real batches; graphs with
several ops at mixed depths can differ (see the tests).

Usage::

    python benchmarks/schedules.py --data ../shared/data/sst/train.txt
    python benchmarks/schedules.py --quick      # tiny smoke run on generated trees
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import harness

import torchfold
from torchfold.examples.datasets import Tree, Vocab, generate_sst, read_sst_file
from torchfold.examples.models import encode_trees

Call = tuple[int, int]  # (group number, call index): one distinct node of a fold


def dependency_graph(fold: torchfold.Fold) -> tuple[dict[Call, list[Call]], dict[Call, str], dict[Call, int]]:
    """Each distinct call's inputs (the calls it reads), its op name and its depth."""
    groups = fold.groups()
    number = {id(group): n for n, group in enumerate(groups)}
    inputs: dict[Call, list[Call]] = {}
    ops: dict[Call, str] = {}
    depths: dict[Call, int] = {}
    for n, group in enumerate(groups):
        for index, args in enumerate(fold.arguments(group)):
            call = (n, index)
            inputs[call] = [
                (number[id(arg.group)], arg.index) for arg in args if isinstance(arg, torchfold.Node)
            ]
            ops[call] = str(group.op)
            depths[call] = group.depth
    return inputs, ops, depths


def longest_chain(inputs: dict[Call, list[Call]]) -> int:
    """Calls on the longest path of dependent calls (calls are listed inputs-first)."""
    length: dict[Call, int] = {}
    for call, reads in inputs.items():  # groups come in depth order, so inputs are seen first
        length[call] = 1 + max((length[r] for r in reads), default=0)
    return max(length.values())


def agenda_calls(inputs: dict[Call, list[Call]], ops: dict[Call, str], depths: dict[Call, int]) -> int:
    """Batched calls of DyNet-style agenda scheduling (lowest mean depth first) on this graph."""
    waiting = {call: len(set(reads)) for call, reads in inputs.items()}
    users: dict[Call, list[Call]] = defaultdict(list)
    for call, reads in inputs.items():
        for read in set(reads):
            users[read].append(call)
    ready: dict[str, list[Call]] = defaultdict(list)
    for call, count in waiting.items():
        if count == 0:
            ready[ops[call]].append(call)
    calls = 0
    while ready:
        op = min(ready, key=lambda name: statistics.fmean(depths[c] for c in ready[name]))
        batch = ready.pop(op)
        calls += 1
        for done in batch:
            for user in users[done]:
                waiting[user] -= 1
                if waiting[user] == 0:
                    ready[ops[user]].append(user)
    return calls


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, default=None, help="SST-format trees, one per line")
    parser.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[10, 25, 50, 100, 250, 500], help="trees per batch"
    )
    parser.add_argument("--trees", type=int, default=2000, help="trees to cut into batches")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the smoke test")
    args = parser.parse_args(argv)
    if args.quick:
        args.trees, args.batch_sizes = 40, [5, 20]
    return args


def main(argv: Sequence[str] | None = None) -> dict[int, dict[str, float]]:
    args = parse_args(argv)
    trees: list[Tree]
    if args.data is not None:
        trees, source = read_sst_file(args.data, max_trees=args.trees), str(args.data)
    else:
        trees, source = generate_sst(args.trees, seed=0), f"{args.trees} generated SST-like trees"
    vocab = Vocab.build(trees)
    results: dict[int, dict[str, float]] = {}
    rows = []
    for size in args.batch_sizes:
        counts: dict[str, list[int]] = defaultdict(list)
        for start in range(0, len(trees) - size + 1, size):
            fold = torchfold.Fold()
            encode_trees(fold, trees[start : start + size], vocab)
            inputs, ops, depths = dependency_graph(fold)
            counts["nodes"].append(len(inputs))
            counts["depth batching"].append(len(fold.groups()))
            counts["lower bound"].append(longest_chain(inputs))
            counts["agenda"].append(agenda_calls(inputs, ops, depths))
        means = {name: statistics.fmean(values) for name, values in counts.items()}
        means["batches"] = len(counts["nodes"])
        means["batches at the bound"] = sum(
            d == b for d, b in zip(counts["depth batching"], counts["lower bound"], strict=True)
        )
        results[size] = means
        rows.append(
            [
                size,
                int(means["batches"]),
                f"{means['nodes']:.0f}",
                f"{means['depth batching']:.1f}",
                f"{means['lower bound']:.1f}",
                f"{means['agenda']:.1f}",
                f"{int(means['batches at the bound'])}/{int(means['batches'])}",
                f"{means['nodes'] / means['depth batching']:.0f}",
            ]
        )
    print("## Batched calls per batch: depth batching vs the lower bound vs agenda scheduling\n")
    extra = [
        f"data: {source}; Tree-LSTM graphs recorded with torchfold.examples.models.encode_trees (means per batch)"
    ]
    print("\n".join(harness.machine_lines(extra)) + "\n")
    print(
        harness.markdown_table(
            [
                "trees per batch",
                "batches",
                "distinct nodes",
                "depth batching calls",
                "lower bound (longest chain)",
                "agenda calls",
                "batches with depth batching at the bound",
                "nodes per call",
            ],
            rows,
        )
    )
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
