"""``python -m torchfold trace check|convert|plot``: inspect, make and draw batch-size traces.

Examples::

    python -m torchfold trace check trace.csv --minibatch-size 32 --dataset-size 60000 --epochs 12
    python -m torchfold trace convert gcp_a100_gpus.csv --per-device-batch 32 --step-time 10 -o a100.csv
    python -m torchfold trace convert --schedule linear:32:256:100+constant:256:900 --multiple-of 32 -o ramp.csv
    python -m torchfold trace plot trace.csv -o trace.png --lr 0.1 --ref-batch-size 256 --lr-rule linear

Exit status: 0 on success, 1 for a bad trace file or impossible request (the message names the
file and line), 2 for bad command-line usage, a missing input file included.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from torchfold._validate import positive_float, positive_int
from torchfold.train.optim.lr import LR_RULES
from torchfold.train.schedule.trace import BatchSizeTrace, as_trace

__all__ = ["main"]


class _DeprecatedFlag(argparse.Action):
    """An old spelling of a flag: stores into the new one's ``dest`` and says, on stderr, to use the new one."""

    def __init__(self, *args: Any, new: str, **kwargs: Any) -> None:
        self.new = new
        super().__init__(*args, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option: str | None = None,
    ) -> None:
        print(f"{parser.prog}: {option} is deprecated; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


# (check and plot read a trace as train's --trace does: one rule, as_trace)
_TRACE_HELP = (
    "a step,batchsize CSV file or any trace train's --trace takes: a list such as 32,64,96, a schedule such as "
    "steps:16x4,32x4 or linear:32:256:1000, an int (a constant)"
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torchfold trace",
        description="Check, convert and plot batch-size traces (CSV 'step,batchsize', one row per optimizer step).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{check,convert,plot}")

    check = commands.add_parser("check", help="validate a trace and print a summary")
    check.add_argument("file", metavar="TRACE", help=_TRACE_HELP)
    check.add_argument(
        "--minibatch-size", type=positive_int, help="every batch size must be a multiple of it"
    )
    check.add_argument("--dataset-size", type=positive_int, help="samples per epoch, to count epochs")
    check.add_argument("--epochs", type=positive_int, help="fail unless the trace covers this many epochs")
    check.add_argument("--drop-last", action="store_true", help="split epochs with drop_last=True")

    convert = commands.add_parser(
        "convert", help="make a trace from a resource-availability trace (gcp_*.csv) or a schedule"
    )
    convert.add_argument(
        "resource_csv", nargs="?", help="availability CSV with a Time column and a device count"
    )
    convert.add_argument("--per-device-batch", type=positive_int, help="samples per device per step")
    convert.add_argument("--step-time", type=positive_float, help="seconds per optimizer step")
    convert.add_argument("--max-steps", type=positive_int, help="keep at most this many steps")
    convert.add_argument(
        "--schedule",
        help="instead of a file: constant:BATCH:STEPS, linear:START:END:STEPS or steps:BATCHxSTEPS,... "
        "joined by '+', e.g. linear:32:256:1000",
    )
    convert.add_argument(
        "--multiple-of", type=positive_int, default=1, help="round linear ramps to multiples of this"
    )
    convert.add_argument("-o", "--output", required=True, help="output step,batchsize CSV file")

    plot = commands.add_parser("plot", help="plot batch size (and learning rate) over steps to a PNG")
    plot.add_argument("file", metavar="TRACE", help=_TRACE_HELP)
    plot.add_argument("-o", "--output", required=True, help="output PNG file")
    plot.add_argument(
        "--lr", type=positive_float, help="base learning rate at --ref-batch-size: adds an lr panel"
    )
    # the names train gives the same settings (--ref-batch and --rule: hidden, deprecated spellings)
    plot.add_argument(
        "--ref-batch-size",
        type=positive_int,
        help="batch size --lr was tuned for (default: the first step's)",
    )
    plot.add_argument(
        "--lr-rule",
        choices=LR_RULES,
        default="linear",
        help="how the learning rate follows the batch size (default linear)",
    )
    hidden: dict[str, Any] = {
        "action": _DeprecatedFlag,
        "default": argparse.SUPPRESS,
        "help": argparse.SUPPRESS,
    }
    plot.add_argument(
        "--ref-batch", dest="ref_batch_size", type=positive_int, new="--ref-batch-size", **hidden
    )
    plot.add_argument("--rule", dest="lr_rule", choices=LR_RULES, new="--lr-rule", **hidden)
    return parser


def _summary(trace: BatchSizeTrace) -> list[str]:
    sizes = trace.batch_sizes
    if trace.num_steps is None:
        return [f"trace:          {trace.source}", f"steps:          unbounded (every step {sizes[0]})"]
    lines = [
        f"trace:          {trace.source}",
        f"steps:          {len(sizes)}",
        f"batch size:     min {min(sizes)}, max {max(sizes)}, mean {sum(sizes) / len(sizes):.1f}",
        f"total samples:  {sum(sizes)}",
    ]
    if trace.restarts:
        at = ", ".join(trace.where(s) for s in trace.restarts)
        lines.append(f"segments:       {len(trace.restarts) + 1} (step numbering restarts at 0 at {at})")
    return lines


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.epochs is not None and args.dataset_size is None:
        parser.error("--epochs needs --dataset-size")
    trace = as_trace(args.file)
    if args.minibatch_size is not None:
        try:
            trace.check_minibatch_size(args.minibatch_size)
        except ValueError as e:  # the trace module names its parameter; the command line, its flag
            raise ValueError(str(e).replace("minibatch_size=", "--minibatch-size ")) from e
    lines = _summary(trace)
    if args.minibatch_size is not None:
        lines.append(f"minibatch size: {args.minibatch_size} (divides every batch size)")
    if args.dataset_size is not None and trace.num_steps is None:
        lines.append(f"epochs covered: any number of {args.dataset_size} samples (the trace has no end)")
    elif args.dataset_size is not None:
        full = trace.num_full_epochs(args.dataset_size, drop_last=args.drop_last)
        exact = trace.total_samples / args.dataset_size
        lines.append(
            f"epochs covered: {full} full epochs of {args.dataset_size} samples "
            f"({exact:.2f} dataset passes of samples, drop_last={args.drop_last})"
        )
    if args.dataset_size is not None and args.epochs is not None:
        if trace.num_steps is not None:  # (an unbounded one covers any number)
            trace.split_epochs(args.dataset_size, args.epochs, drop_last=args.drop_last)  # raises if short
        last = trace.epoch(args.epochs - 1, args.dataset_size, drop_last=args.drop_last)
        lines.append(f"epochs {args.epochs}: ok, they end after step {last.end_step - 1}")
    print("\n".join(lines))
    return 0


def _convert(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if (args.resource_csv is None) == (args.schedule is None):
        parser.error("convert needs either RESOURCE_CSV or --schedule (not both)")
    if args.schedule is not None:
        if args.per_device_batch is not None or args.step_time is not None:
            parser.error("--per-device-batch and --step-time go with RESOURCE_CSV, not --schedule")
        trace = BatchSizeTrace.from_schedule(args.schedule, multiple_of=args.multiple_of)
        if args.max_steps is not None:
            trace = BatchSizeTrace(trace.batch_sizes[: args.max_steps], source=trace.source)
    else:
        if args.per_device_batch is None or args.step_time is None:
            parser.error("converting RESOURCE_CSV needs --per-device-batch and --step-time")
        trace = BatchSizeTrace.from_availability(
            args.resource_csv, args.per_device_batch, args.step_time, max_steps=args.max_steps
        )
    trace.to_csv(args.output)
    print("\n".join([*_summary(trace), f"written:        {args.output}"]))
    return 0


def _plot(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.ref_batch_size is not None and args.lr is None:
        parser.error("--ref-batch-size needs --lr")
    trace = as_trace(args.file)
    if trace.num_steps is None:
        size = trace.batch_sizes[0]
        raise ValueError(
            f"{args.file} is a constant batch size without an end; give it one, e.g. constant:{size}:1000"
        )
    trace.plot(args.output, lr=args.lr, ref_batch_size=args.ref_batch_size, rule=args.lr_rule)
    print(f"written: {args.output} ({len(trace)} steps)")
    return 0


def main(argv: Sequence[str]) -> int:
    """Run ``trace check|convert|plot`` with ``argv`` (the arguments after ``trace``); return the exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as e:  # argparse exits on --help and on usage errors; report it as a status
        return e.code if isinstance(e.code, int) else 2
    try:
        if args.command == "check":
            return _check(args, parser)
        if args.command == "convert":
            return _convert(args, parser)
        return _plot(args, parser)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    except FileNotFoundError as e:  # a usage mistake: the path on the command line names no file
        print(f"torchfold trace {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError, ImportError) as e:  # ImportError: `plot` without the plot extra
        print(f"torchfold trace {args.command}: error: {e}", file=sys.stderr)
        return 1
