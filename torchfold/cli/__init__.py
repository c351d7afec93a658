"""Command line: ``python -m torchfold demo|elastic|trace|train ...`` (also installed as ``torchfold``).

One module per command (:mod:`~torchfold.cli.demo`, :mod:`~torchfold.cli.elastic`,
:mod:`~torchfold.cli.trace`, :mod:`~torchfold.cli.train`); nothing else in the package imports
this one.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

__all__ = ["main"]

USAGE = """usage: python -m torchfold COMMAND [ARGS...]

commands:
  demo     train a small Tree-LSTM with dynamic batching (SST trees from a path, or generated ones)
  elastic  drive a real elastic training through a resource-availability trace (elastic run --help)
  trace    check, convert and plot batch-size traces (python -m torchfold trace --help)
  train    train a Tree-LSTM on SST with a batch-size trace, also under torchrun (train --help)
"""

# Each command's module is imported only when it runs, so `--help` and one command do not pay
# for the others' imports (the training half, the examples, matplotlib).
COMMANDS = {
    "demo": "torchfold.cli.demo",
    "elastic": "torchfold.cli.elastic",
    "trace": "torchfold.cli.trace",
    "train": "torchfold.cli.train",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; the exit status: 0 done, 2 a usage mistake, 75 preempted (``train``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(
            f"torchfold: unknown command {name!r}; expected one of {sorted(COMMANDS)}\n\n{USAGE}",
            file=sys.stderr,
        )
        return 2
    command: int = importlib.import_module(COMMANDS[name]).main(rest)
    return command
