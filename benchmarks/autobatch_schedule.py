"""autobatch's scheduler: batched calls against Fold's depth grouping, its cost per call, its memory.

Three measurements on random DAGs of several op types (every node an op of three kinds reading one
or two earlier nodes of its sample, ops on a 16-wide state):

* **calls**: how many batched calls ``torchfold.autobatch`` (readiness: the ready calls of one op
  run together, shallowest op first), ``Fold`` (one call per op and depth) and
  ``Fold(schedule="ready")`` (the fold planned by readiness) make on the same samples, and the
  two folds' time per training step (record + plan + apply + backward), median of rounds;
* **cost per call**: a run's time per recorded call (us) from 1,000 to 100,000 calls per run, for
  autobatch and for Fold (``add`` + ``apply``), median of interleaved rounds, one thread;
* **memory**: the Python memory a run allocates per node at its peak (``tracemalloc``), autobatch
  against Fold's ``add`` + ``apply``.

Results: ``benchmarks/results/autobatch.md``.

Usage::

    python benchmarks/autobatch_schedule.py
    python benchmarks/autobatch_schedule.py --quick
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import tracemalloc
from collections.abc import Sequence
from typing import Any

import torch

import torchfold

WIDTH = 16
OPS = ("mix", "gate", "squash")
Dag = list[tuple[str, tuple[int, ...]]]  # per node: its op and the earlier nodes it reads (-1: the input)


class Ops(torch.nn.Module):
    """Three row-wise ops of one or two states."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def mix(self, a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return torch.tanh(self.linear(a if b is None else a + b))

    def gate(self, a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return torch.sigmoid(a) * (a if b is None else b)

    def squash(self, a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return a / (1 + a.abs()) if b is None else (a - b) / (1 + (a - b).abs())


def random_dag(rng: random.Random, nodes: int) -> Dag:
    dag: Dag = []
    for number in range(nodes):
        reads = tuple(rng.randrange(-1, number) for _ in range(rng.choice((1, 2))))
        dag.append((rng.choice(OPS), reads))
    return dag


def run_dag(model: Any, sample: tuple[Dag, torch.Tensor]) -> Any:
    """Plain per-sample code: every node of the DAG in order; the last node's state."""
    dag, start = sample
    values: list[Any] = []
    for op, reads in dag:
        args = [start if read < 0 else values[read] for read in reads]
        values.append(getattr(model, op)(*args))
    return values[-1]


def fold_dag(fold: torchfold.Fold, sample: tuple[Dag, torch.Tensor]) -> torchfold.Node:
    dag, start = sample
    values: list[Any] = []
    for op, reads in dag:
        values.append(fold.add(op, *[start if read < 0 else values[read] for read in reads]))
    return values[-1]


def samples_of(count: int, nodes: int, seed: int) -> list[tuple[Dag, torch.Tensor]]:
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    return [(random_dag(rng, nodes), torch.randn(1, WIDTH, generator=generator)) for _ in range(count)]


def autobatch_run(
    model: Ops, samples: list[tuple[Dag, torch.Tensor]], stats: dict[str, int] | None = None
) -> Any:
    return torchfold.autobatch(run_dag, samples, model, stats=stats)


def fold_run(
    model: Ops, samples: list[tuple[Dag, torch.Tensor]], schedule: str = "depth"
) -> tuple[list[torch.Tensor], int]:
    fold = torchfold.Fold(schedule=schedule)
    roots = [fold_dag(fold, sample) for sample in samples]
    plan = fold.plan([roots])
    assert isinstance(plan, torchfold.FoldPlan)
    return plan.apply(model), len(plan.groups)


def step_ms(model: Ops, samples: list[tuple[Dag, torch.Tensor]], schedule: str) -> tuple[float, float]:
    """One training step's milliseconds on a fold of ``samples``: in all (record, plan, apply,
    backward), and its apply and backward alone (what a step pays when loader workers plan)."""
    start = time.perf_counter()
    fold = torchfold.Fold(schedule=schedule)
    roots = [fold_dag(fold, sample) for sample in samples]
    plan = fold.plan([roots])
    planned = time.perf_counter()
    assert isinstance(plan, torchfold.FoldPlan)
    (out,) = plan.apply(model)
    out.square().sum().backward()
    end = time.perf_counter()
    return (end - start) * 1e3, (end - planned) * 1e3


def calls_table(model: Ops, rows: Sequence[tuple[int, int]], rounds: int) -> None:
    print(
        "| samples | nodes per sample | autobatch batched calls | Fold batched calls (op x depth) "
        "| Fold(schedule='ready') batched calls | step ms, depth | step ms, ready | ready / depth "
        "| apply + backward ms, depth | apply + backward ms, ready | ready / depth |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for count, nodes in rows:
        samples = samples_of(count, nodes, seed=count * 1000 + nodes)
        stats: dict[str, int] = {}
        batched = autobatch_run(model, samples, stats)
        (folded,), groups = fold_run(model, samples)
        (ready,), waves = fold_run(model, samples, "ready")
        torch.testing.assert_close(torch.cat(batched), folded)
        torch.testing.assert_close(ready, folded)
        times: dict[str, list[tuple[float, float]]] = {"depth": [], "ready": []}
        for _ in range(rounds):  # interleaved
            for schedule, spent in times.items():
                spent.append(step_ms(model, samples, schedule))
                gc.collect()
        step = {name: statistics.median(t for t, _ in spent) for name, spent in times.items()}
        run = {name: statistics.median(r for _, r in spent) for name, spent in times.items()}
        print(
            f"| {count} | {nodes} | {stats['batches']} | {groups} | {waves} | {step['depth']:.2f} "
            f"| {step['ready']:.2f} | {step['ready'] / step['depth']:.2f} | {run['depth']:.2f} | {run['ready']:.2f} "
            f"| {run['ready'] / run['depth']:.2f} |"
        )


def cost_table(model: Ops, totals: Sequence[int], rounds: int) -> None:
    print(
        "| calls per run | autobatch us/call | Fold add+apply us/call | autobatch / Fold | rounds (autobatch) |"
    )
    print("| --- | --- | --- | --- | --- |")
    for total in totals:
        samples = samples_of(max(1, total // 50), 50, seed=total)
        times: dict[str, list[float]] = {"autobatch": [], "fold": []}
        with torch.no_grad():
            for _ in range(rounds):
                start = time.perf_counter()
                autobatch_run(model, samples)
                times["autobatch"].append((time.perf_counter() - start) / total * 1e6)
                gc.collect()
                start = time.perf_counter()
                fold_run(model, samples)
                times["fold"].append((time.perf_counter() - start) / total * 1e6)
                gc.collect()
        auto, fold = statistics.median(times["autobatch"]), statistics.median(times["fold"])
        print(
            f"| {total} | {auto:.1f} | {fold:.1f} | {auto / fold:.2f} | {[round(t, 1) for t in times['autobatch']]} |"
        )


def memory_table(model: Ops, totals: Sequence[int]) -> None:
    print("| calls per run | autobatch peak bytes/node | Fold add+apply peak bytes/node | autobatch / Fold |")
    print("| --- | --- | --- | --- |")
    for total in totals:
        samples = samples_of(max(1, total // 50), 50, seed=total)
        peaks = {}
        with torch.no_grad():
            for name, run in (("autobatch", autobatch_run), ("fold", fold_run)):
                gc.collect()
                tracemalloc.start()
                run(model, samples)
                peaks[name] = tracemalloc.get_traced_memory()[1] / total
                tracemalloc.stop()
        print(
            f"| {total} | {peaks['autobatch']:.0f} | {peaks['fold']:.0f} | {peaks['autobatch'] / peaks['fold']:.2f} |"
        )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Ops()
    quick = args.quick
    calls_table(
        model,
        [(4, 10), (16, 20)] if quick else [(4, 10), (16, 20), (64, 20), (32, 60), (128, 30), (200, 50)],
        1 if quick else 2 * args.rounds + 1,
    )
    totals = [1_000, 2_000] if quick else [1_000, 10_000, 100_000]
    cost_table(model, totals, 1 if quick else args.rounds)
    memory_table(model, totals)


if __name__ == "__main__":
    main()
