"""The three matrix products of an ``nn.Linear`` on XLA's CPU backend, by rows, beside eager PyTorch.

A linear layer ``y = x Wᵀ`` on ``n`` rows (the calls of one level of a fold) runs three products
of the same size in a training step: the forward ``x·Wᵀ``, the input's gradient ``g·W`` and the
weight's gradient ``gᵀ·x``. This script times each of them alone, with the weight of the
Tree-LSTM's node op (``W`` of 640 x 256), at several row counts:

* ``xla``: one compiled program of ``--products`` products of one kind, run under torch_xla's
  profiler; the median time of its ``dot`` operations (the device's own time: no host work, no
  transfer). As in a fold's levels, the products of ``W`` share one weight, each product's rows
  made from the one before (so XLA cannot merge them into one product), and the weight
  gradients each read their own rows;
* ``eager``: the same program in eager PyTorch on the CPU (``--threads``), its time per product
  (the few copies between the products included).

The fourth kind is the forward product as :mod:`torchfold.train.capture.xla_linear` captures it: against
a copy of ``Wᵀ`` made once per program, behind an optimization barrier. XLA's CPU backend runs
its products on its own thread pool (all cores), whatever ``--threads`` says.

Usage::

    PJRT_DEVICE=CPU .venv-xla/bin/python benchmarks/xla_dots.py
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import machine_lines, markdown_table

_DOT = re.compile(r"^dot(\.\d+)+$")

KINDS = ("x·Wᵀ (forward)", "g·W (input gradient)", "gᵀ·x (weight gradient)", "x·T (forward, T a copy of Wᵀ)")


def program(kind: str, rows: int, args: argparse.Namespace, device: Any) -> Callable[[], Any]:
    """``--products`` products of ``kind`` on ``rows`` rows (inputs made on ``device``); their sum."""
    import torch
    import torch.nn.functional as F

    from torchfold.train.capture.xla_linear import transposed_weights

    out, into, count = args.out_features, args.in_features, args.products
    torch.manual_seed(0)
    weight = (torch.randn(out, into) / into**0.5).to(device)
    if kind in (KINDS[0], KINDS[3]):
        start = torch.randn(rows, into).to(device)

        def forward() -> Any:
            # nn.Linear's product; the fourth kind as replayed steps capture it (one copy per program)
            linear = transposed_weights(weight.device.type) if kind == KINDS[3] else contextlib.nullcontext()
            x, total = start, 0
            with linear:
                for _ in range(count):  # the next rows from this product: a chain, as levels are
                    y = F.linear(x, weight)
                    x, total = y[:, :into], total + y.sum()
            return total

        return forward
    if kind == KINDS[1]:
        start = torch.randn(rows, out).to(device)

        def input_gradient() -> Any:
            g, total = start, 0
            for _ in range(count):
                y = g @ weight
                g, total = torch.cat([y] * -(-out // into), 1)[:, :out], total + y.sum()
            return total

        return input_gradient
    grads = [torch.randn(rows, out).to(device) for _ in range(count)]
    inputs = [torch.randn(rows, into).to(device) for _ in range(count)]

    def weight_gradient() -> Any:
        return sum((g.t() @ x).sum() for g, x in zip(grads, inputs, strict=True))

    return weight_gradient


def xla_dot_us(kind: str, rows: int, args: argparse.Namespace) -> float:
    """Microseconds per product of ``kind`` in a compiled XLA program, from the profiler's dot times."""
    import torch
    import torch_xla
    import torch_xla.debug.profiler as xp

    step = program(kind, rows, args, torch_xla.device())

    def run() -> None:
        torch.as_tensor(step()).item()

    for _ in range(3):  # compile, then warm
        run()
    with tempfile.TemporaryDirectory() as trace_dir:
        xp.start_trace(trace_dir)
        for _ in range(args.repeats):
            run()
        xp.stop_trace()
        found = sorted(Path(trace_dir).glob("plugins/profile/*/*.trace.json.gz"))
        if not found:
            raise SystemExit(f"{kind}, {rows} rows: torch_xla's profiler wrote no trace under {trace_dir}")
        with gzip.open(found[-1]) as file:
            events = [e for e in json.load(file)["traceEvents"] if e.get("ph") == "X"]
    durations = [e["dur"] for e in events if _DOT.match(e["name"])]
    if len(durations) != args.products * args.repeats:
        raise SystemExit(
            f"{kind}, {rows} rows: the trace holds {len(durations)} dot operations, expected "
            f"{args.products * args.repeats}: XLA merged or split the products"
        )
    return statistics.median(durations)


def eager_us(kind: str, rows: int, args: argparse.Namespace) -> float:
    """Microseconds per product of ``kind`` with eager PyTorch on the CPU (median of the runs)."""
    import torch

    step = program(kind, rows, args, torch.device("cpu"))
    times = []
    for _ in range(args.repeats + 3):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) / args.products)
    return 1e6 * statistics.median(times[3:])


def main(argv: list[str] | None = None) -> list[list[object]]:
    """Time every kind at every row count; print the table and return its rows."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="8,16,32,64,128,256", help="row counts, comma-separated")
    parser.add_argument("--in-features", type=int, default=256, help="the weight's columns")
    parser.add_argument("--out-features", type=int, default=640, help="the weight's rows")
    parser.add_argument("--products", type=int, default=24, help="products per program")
    parser.add_argument("--repeats", type=int, default=10, help="programs timed per kind and row count")
    parser.add_argument("--threads", type=int, default=1, help="eager PyTorch's CPU threads")
    parser.add_argument("--quick", action="store_true", help="a minimal run (the smoke test's)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.in_features, args.out_features, args.products, args.repeats = "4", 8, 12, 3, 2
    import torch

    torch.set_num_threads(args.threads)
    rows_list = [int(r) for r in args.rows.split(",")]
    print(
        "\n".join(
            machine_lines(
                [
                    f"weight {args.out_features} x {args.in_features}, eager on {args.threads} thread(s), XLA on its own pool"
                ]
            )
        )
    )
    table: list[list[object]] = []
    for rows in rows_list:
        for kind in KINDS:
            xla, eager = xla_dot_us(kind, rows, args), eager_us(kind, rows, args)
            gflops = 2 * rows * args.in_features * args.out_features / xla / 1e3
            table.append([rows, kind, xla, eager, f"{xla / eager:.2f}x", gflops])
    print(
        markdown_table(
            ["rows", "product", "xla µs", "eager µs", "xla / eager", "xla GFLOP/s"],
            table,
        )
    )
    return table


if __name__ == "__main__":
    main()
