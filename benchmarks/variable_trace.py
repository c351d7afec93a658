"""The trainer on a variable batch-size trace: per-step time and XLA compilations, XLA against the CPU.

Runs :class:`torchfold.train.TraceTrainer` in this process on SST Tree-LSTM with a trace whose
steps hold 1 to 5 minibatches (default ``steps:25x10,50x5,100x5,75x5,25x5,125x3``, minibatches
of 25 trees), once per ``--devices`` entry, and prints each step's seconds, minibatch count and
(on XLA) the XLA compilations it caused (torch_xla's ``CompileTime`` metric), then a summary:
compilations after step ``--warmup``, the median step time per minibatch count, the slowest
step against the median of its count, the ratio of steps ``--warmup``.. to the CPU's, and the
largest relative loss difference to the CPU run, step by step.

The envelope of static shapes is fitted to a pass over the data and frozen first
(:func:`torchfold.train.fit_static_shapes`, as ``python -m torchfold train`` does): a
minibatch that does not fit it is split, so it never grows in training. It has depth buckets
unless ``--one-layout`` is given; ``python -m torchfold train`` fits one layout for lazily traced
XLA steps (``--compile auto``) and depth buckets for captured ones (``on``, ``replay``)
(:meth:`torchfold.train.StepMechanism.static_shapes`).

Usage::

    PJRT_DEVICE=CPU .venv-xla/bin/python benchmarks/variable_trace.py --data ../shared/data/sst/train.txt
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch
from harness import DATA_DIR, machine_lines

import torchfold
from torchfold.examples.datasets import Vocab, load_sst
from torchfold.examples.models import TreeLSTM, TreeLSTMBuild, tree_lstm_loss
from torchfold.train import AccumulatingOptimizer, StepLoader, StepMechanism, TraceTrainer, fit_static_shapes
from torchfold.train.schedule.trace import BatchSizeTrace


def _compilations() -> int:
    try:
        import torch_xla.debug.metrics as met
    except ImportError:
        return 0
    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


def run(args: argparse.Namespace, device_name: str, trees: list[Any], vocab: Vocab) -> list[dict[str, Any]]:
    if device_name == "xla":
        import torch_xla

        device = torch_xla.device()
    else:
        device = torch.device(device_name)
    # fitted to a pass over the data and frozen: a minibatch that does not fit is split, never grown
    shapes = fit_static_shapes(
        trees,
        TreeLSTMBuild(vocab),
        args.minibatch_size,
        shapes=torchfold.StaticShapes(depth_buckets=not args.one_layout),
    )
    torch.manual_seed(0)
    model = TreeLSTM(len(vocab), args.dims, args.dims).to(device)
    xla = device.type == "xla"
    # the device's options: capturable on XLA (a replayed update), fused on the CPU and CUDA
    base = StepMechanism(device).optimizer(torch.optim.Adam, model.parameters(), lr=0.005)
    optimizer = AccumulatingOptimizer(base)
    trace = BatchSizeTrace.from_schedule(args.trace)
    loader = StepLoader(
        trees,
        args.minibatch_size,
        build=TreeLSTMBuild(vocab, shapes=shapes if xla else None),  # (the CPU: eager, unpadded)
        trace=trace,
        seed=0,
        num_workers=args.workers,
    )
    trainer = TraceTrainer(
        model,
        optimizer,
        loader,
        tree_lstm_loss,
        progress=False,
        compile=args.compile if xla else "off",
        seed=0,
    )
    rows: list[dict[str, Any]] = []
    runner = trainer.runner
    update = runner.update
    clock = {"start": time.perf_counter(), "compiles": _compilations()}

    def timed_update() -> Any:
        result = update()
        if result[0] is not None:
            float(result[0])  # the step has run: time it whole
        now, compiles = time.perf_counter(), _compilations()
        rows.append({"seconds": now - clock["start"], "compiles": compiles - clock["compiles"]})
        clock["start"], clock["compiles"] = time.perf_counter(), compiles
        return result

    runner.update = timed_update  # type: ignore[method-assign]
    with loader:
        clock["start"] = time.perf_counter()
        history = trainer.fit(epochs=1)
    for row, stats in zip(rows, history, strict=True):
        row.update(step=stats.step, minibatches=stats.num_minibatches, loss=stats.loss)
    return rows


def summary(name: str, rows: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    after = [r for r in rows if r["step"] >= warmup]
    by_count: dict[int, list[float]] = {}
    for r in after:
        by_count.setdefault(r["minibatches"], []).append(r["seconds"])
    medians = {k: statistics.median(v) for k, v in sorted(by_count.items())}
    worst = max((r["seconds"] / medians[r["minibatches"]], r["step"]) for r in after) if after else (0, -1)
    return {
        "device": name,
        "compiles_total": sum(r["compiles"] for r in rows),
        "compiles_after_warmup": sum(r["compiles"] for r in after),
        "seconds_after_warmup": sum(r["seconds"] for r in after),
        "median_by_minibatches": medians,
        "worst_over_median": worst,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--data", default=str(DATA_DIR), help="a directory holding sst/train.txt (default: $TORCHFOLD_DATA)"
    )
    parser.add_argument("--trace", default="steps:25x10,50x5,100x5,75x5,25x5,125x3")
    parser.add_argument("--minibatch-size", type=int, default=25)
    parser.add_argument("--max-train", type=int, default=1875)
    parser.add_argument("--dims", type=int, default=128)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=10, help="steps counted as warm-up")
    parser.add_argument("--devices", default="cpu,xla", help="comma-separated: cpu, xla")
    parser.add_argument(
        "--compile",
        default="auto",
        help="the XLA run's compile= (auto: lazy; on: TorchDynamo's guards in front of captured programs; replay)",
    )
    parser.add_argument(
        "--one-layout",
        action="store_true",
        help="StaticShapes(depth_buckets=False): every plan runs all levels, one program per kind",
    )
    parser.add_argument("--json", default=None, help="write every row here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if "xla" in args.devices:
        import torch_xla

        torch_xla.device()  # before any backward: autograd sizes its device queues at the first one
    trees = load_sst(args.data, max_trees=args.max_train)
    vocab = Vocab.build(trees)
    print("\n".join(machine_lines()))
    print(f"command: {' '.join(sys.argv)}")
    results = {name: run(args, name, trees, vocab) for name in args.devices.split(",")}
    for name, rows in results.items():
        print(f"\n{name}: step minibatches seconds compiles loss")
        for r in rows:
            print(
                f"  {r['step']:3d} {r['minibatches']} {r['seconds']:8.3f} {r['compiles']:2d} {r['loss']:.6f}"
            )
        print(f"{name} summary: {json.dumps(summary(name, rows, args.warmup))}")
    if "cpu" in results and "xla" in results:
        cpu, xla = results["cpu"], results["xla"]
        a = sum(r["seconds"] for r in cpu if r["step"] >= args.warmup)
        b = sum(r["seconds"] for r in xla if r["step"] >= args.warmup)
        diff = max(abs(x["loss"] - c["loss"]) / abs(c["loss"]) for x, c in zip(xla, cpu, strict=True))
        print(f"\nsteps {args.warmup}..: cpu {a:.3f} s, xla {b:.3f} s: xla at {a / b:.2f}x the cpu")
        print(f"largest relative loss difference, step by step: {diff:.2e}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
