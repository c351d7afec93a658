"""What torchfold itself costs: ``Fold.add`` and ``Fold.apply`` microseconds per node.

The ops are trivial (an int leaf becomes a one-element float row; ``inc`` adds one, ``plus``
adds two rows), so nearly all the time measured is torchfold's own bookkeeping plus the
unavoidable one tensor call per group. Three graph shapes, several sizes:

* ``chain``: ``inc`` applied n-1 times to one leaf: every node is its own group (worst case);
* ``balanced``: a complete binary tree of ``plus`` over n/2 leaves: log2(n) groups;
* ``forest``: random binary trees of 2-20 leaves (SST-like shapes), many per fold.

For each: ``add`` microseconds per node, ``apply`` microseconds per node and per group, the
time the same ops take when called directly once per group on ready batched tensors (the
floor any batching scheme pays), and the time to run the graph eagerly, one call per node.

``--recording``: recording and compiling alone, from 1,000 to 1,000,000 nodes: ``Fold.add``
microseconds per call and ``Fold.plan`` microseconds per node (each as installed, with its C
part where it is built, and in pure Python in turn) on a forest of random binary
trees (2-20 leaves, distinct words, so every node is distinct), best of ``--repeats`` fresh
folds, with Python's cyclic garbage collector on (as users run). The trees are laid out as a
post-order program first; the timed loop only pops children and calls ``add``, and the same
loop calling a method that does nothing is timed too (``loop us/call``, included in ``add``).

Usage::

    python benchmarks/fold_overhead.py
    python benchmarks/fold_overhead.py --recording --repeats 3
    python benchmarks/fold_overhead.py --quick
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import harness
import torch
from torch import Tensor

import torchfold
from torchfold.engine import native


class Trivial(torch.nn.Module):
    """Ops whose compute is negligible, so that timings show the fold's overhead."""

    def leaf(self, ids: Tensor) -> Tensor:
        return ids.to(torch.float32).unsqueeze(1)

    def inc(self, x: Tensor) -> Tensor:
        return x + 1

    def plus(self, a: Tensor, b: Tensor) -> Tensor:
        return a + b


Builder = Callable[[torchfold.Fold, int, random.Random], list[torchfold.Node]]


def build_chain(fold: torchfold.Fold, n: int, rng: random.Random) -> list[torchfold.Node]:
    node = fold.add("leaf", 1)
    for _ in range(n - 1):
        node = fold.add("inc", node)
    return [node]


def build_balanced(fold: torchfold.Fold, n: int, rng: random.Random) -> list[torchfold.Node]:
    # Distinct leaf values, so that deduplication does not shrink the tree.
    level = [fold.add("leaf", i) for i in range(max(1, (n + 1) // 2))]
    while len(level) > 1:
        level = [fold.add("plus", level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)] + (
            [level[-1]] if len(level) % 2 else []
        )
    return level


def _random_tree(fold: torchfold.Fold, leaves: list[int], rng: random.Random) -> torchfold.Node:
    if len(leaves) == 1:
        return fold.add("leaf", leaves[0])
    split = rng.randint(1, len(leaves) - 1)
    return fold.add("plus", _random_tree(fold, leaves[:split], rng), _random_tree(fold, leaves[split:], rng))


def build_forest(fold: torchfold.Fold, n: int, rng: random.Random) -> list[torchfold.Node]:
    roots = []
    made = 0
    while made < n:
        words = rng.randint(2, 20)
        # Leaf values drawn from a big range: few identical subtrees, as in real sentences.
        roots.append(_random_tree(fold, [rng.randrange(1 << 30) for _ in range(words)], rng))
        made += 2 * words - 1
    return roots


BUILDERS: dict[str, Builder] = {"chain": build_chain, "balanced": build_balanced, "forest": build_forest}


def direct_time(fold: torchfold.Fold, model: Trivial, repeats: int) -> float:
    """Seconds to call each group's op once on ready batched tensors of its size."""
    calls: list[tuple[Callable[..., Tensor], tuple[Tensor, ...]]] = []
    for group in fold.groups():
        rows = len(group.calls)
        if group.op == "leaf":
            calls.append((model.leaf, (torch.arange(rows),)))
        elif group.op == "inc":
            calls.append((model.inc, (torch.ones(rows, 1),)))
        else:
            calls.append((model.plus, (torch.ones(rows, 1), torch.ones(rows, 1))))

    def run() -> None:
        for fn, args in calls:
            fn(*args)

    return min(harness.time_calls(run, repeats))


def eager_time(build: Builder, n: int, seed: int, model: Trivial, repeats: int) -> float:
    """Seconds to evaluate the same graph eagerly, one op call per node (``torchfold.EagerFold``)."""

    def run() -> None:
        unfold = torchfold.EagerFold(model)
        build(unfold, n, random.Random(seed))  # type: ignore[arg-type]

    return min(harness.time_calls(run, repeats))


def measure(shape: str, n: int, repeats: int, seed: int = 0) -> list[object]:
    """One table row: sizes and microsecond costs of recording and applying one graph."""
    model = Trivial()
    build = BUILDERS[shape]
    add_times, apply_times = [], []
    fold = torchfold.Fold()
    for _ in range(repeats):
        fold = torchfold.Fold()
        start = time.perf_counter()
        roots = build(fold, n, random.Random(seed))
        middle = time.perf_counter()
        fold.apply(model, [roots])
        end = time.perf_counter()
        add_times.append(middle - start)
        apply_times.append(end - middle)
    nodes = len(fold)
    groups = len(fold.groups())
    add_s = min(add_times)
    apply_s = min(apply_times)
    direct_s = direct_time(fold, model, repeats)
    eager_s = eager_time(build, n, seed, model, max(1, repeats // 2))
    return [
        shape,
        nodes,
        groups,
        add_s / nodes * 1e6,
        apply_s / nodes * 1e6,
        apply_s / groups * 1e6,
        direct_s / groups * 1e6,
        (apply_s - direct_s) / nodes * 1e6,
        eager_s / nodes * 1e6,
    ]


def forest_program(n: int, rng: random.Random) -> list[int]:
    """Random binary trees of 2-20 leaves in post-order, ``n`` nodes in all: a word id (>= 0) per
    leaf, -1 per internal node (whose children are the last two values made)."""
    program: list[int] = []

    def tree(leaves: int) -> None:
        if leaves == 1:
            program.append(rng.randrange(1 << 30))
            return
        split = rng.randint(1, leaves - 1)
        tree(split)
        tree(leaves - split)
        program.append(-1)

    while len(program) < n:
        tree(min(rng.randint(2, 20), (n - len(program) + 1) // 2) or 1)
    return program


class _Nothing:
    """A recorder whose ``add`` does nothing: the cost of the recording loop itself."""

    def add(self, op: str, *args: object) -> object:
        return op  # not args: a tuple of the children's tuples would keep every tree alive


def record_program(fold: torchfold.Fold | _Nothing, program: list[int]) -> list[Any]:
    """Record ``program`` (see :func:`forest_program`) on ``fold``; the roots."""
    add = fold.add
    stack: list[Any] = []
    push, pop = stack.append, stack.pop
    for word in program:
        if word >= 0:
            push(add("leaf", word))
        else:
            right = pop()
            push(add("plus", pop(), right))
    return stack


def measure_recording(n: int, repeats: int, seed: int = 0) -> list[object]:
    """One row of the recording table: add us/call and plan us/node (C, where built, and Python),
    the loop's own us/call; each repeat times them in turn on fresh folds."""
    program = forest_program(n, random.Random(seed))
    clock = harness.CLOCKS[harness.clock_name()]
    add_s, python_add_s, plan_s, python_plan_s, loop_s = [], [], [], [], []
    nodes = 0
    for _ in range(repeats):
        for on, times, plan_times in (
            (native.enabled(), add_s, plan_s),
            (False, python_add_s, python_plan_s),
        ):
            with native.use(on):  # (the second turn: the Python add and planner alone)
                fold = torchfold.Fold()
                gc.collect()  # each fold starts from the same heap
                start = clock()
                roots = record_program(fold, program)
                middle = clock()
                times.append(middle - start)
                fold.plan([roots])
                plan_times.append(clock() - middle)
                nodes = len(fold)
                del fold, roots
        start = clock()
        record_program(_Nothing(), program)
        loop_s.append(clock() - start)
    return [
        n,
        nodes,
        min(add_s) / len(program) * 1e6,
        min(python_add_s) / len(program) * 1e6,
        min(plan_s) / nodes * 1e6,
        min(python_plan_s) / nodes * 1e6,
        min(loop_s) / len(program) * 1e6,
    ]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 10000], help="nodes per graph")
    parser.add_argument("--shapes", nargs="+", default=list(BUILDERS), choices=list(BUILDERS))
    parser.add_argument("--repeats", type=int, default=7, help="best of this many runs")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument(
        "--recording",
        action="store_true",
        help="time Fold.add and Fold.plan alone on binary forests of --recording-sizes nodes instead",
    )
    parser.add_argument(
        "--recording-sizes", type=int, nargs="+", default=[1000, 10000, 65535, 250000, 1000000]
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the smoke test")
    harness.add_clock_argument(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.repeats, args.recording_sizes = [20], 2, [100]
    return args


def main(argv: Sequence[str] | None = None) -> list[list[object]]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    harness.use_clock(args.clock)
    if args.recording:
        return recording_table(args)
    rows = [measure(shape, n, args.repeats) for shape in args.shapes for n in args.sizes]
    print("## Fold overhead: microseconds per node (trivial ops)\n")
    print("\n".join(harness.machine_lines([f"best of {args.repeats} runs per cell"])) + "\n")
    header = [
        "graph",
        "nodes",
        "groups",
        "add us/node",
        "apply us/node",
        "apply us/group",
        "op call us/group",
        "apply overhead us/node",
        "eager us/node",
    ]
    print(harness.markdown_table(header, rows))
    print(
        "\n`op call`: the same ops called directly once per group on ready tensors; `apply overhead` = "
        "(apply - op calls) / nodes; `eager`: torchfold.EagerFold, one op call per node."
    )
    return rows


def recording_table(args: argparse.Namespace) -> list[list[object]]:
    rows = [measure_recording(n, args.repeats) for n in args.recording_sizes]
    print("## Recording and compiling: Fold.add us per call, Fold.plan us per node (binary forests)\n")
    extra = [f"best of {args.repeats} fresh folds per size; cyclic GC {'on' if gc.isenabled() else 'off'}"]
    print("\n".join(harness.machine_lines(extra)) + "\n")
    header = [
        "nodes asked",
        "distinct nodes",
        "add us/call",
        "Python add us/call",
        "plan us/node",
        "Python plan us/node",
        "loop us/call",
    ]
    print(harness.markdown_table(header, rows))
    print(
        f"\n`add`, `plan`: `Fold.add` and `Fold.plan` as installed ({'C' if native.BUILT else 'Python'}); "
        "`Python add`, `Python plan`: the pure-Python `Fold.add` and planner (what runs without a C "
        "compiler), timed in turn with them.\n"
        "`loop`: the same recording loop calling an `add` that does nothing (part of both `add` columns)."
    )
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
