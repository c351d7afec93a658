"""Command line: ``python -m torchfold demo|elastic|trace|train ...`` (also installed as ``torchfold``)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

USAGE = """usage: python -m torchfold COMMAND [ARGS...]

commands:
  demo     train a small Tree-LSTM with dynamic batching (SST trees from a path, or generated ones)
  elastic  replay a resource-availability trace with a real elastic training (elastic replay --help)
  trace    check, convert and plot batch-size traces (python -m torchfold trace --help)
  train    train a Tree-LSTM on SST with a batch-size trace, also under torchrun (train --help)
"""


def _commands() -> dict[str, Callable[[Sequence[str]], int]]:
    # Imported lazily so that `--help` and one subcommand do not pay for the others' imports.
    def demo(argv: Sequence[str]) -> int:
        from torchfold._demo import main

        return main(argv)

    def elastic(argv: Sequence[str]) -> int:
        from torchfold._replay import main

        return main(argv)

    def trace(argv: Sequence[str]) -> int:
        from torchfold._trace_cli import main

        return main(argv)

    def train(argv: Sequence[str]) -> int:
        from torchfold._train_cli import main

        return main(argv)

    return {"demo": demo, "elastic": elastic, "trace": trace, "train": train}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    commands = _commands()
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0
    name, rest = args[0], args[1:]
    if name not in commands:
        print(
            f"torchfold: unknown command {name!r}; expected one of {sorted(commands)}\n\n{USAGE}",
            file=sys.stderr,
        )
        return 2
    return commands[name](rest)


if __name__ == "__main__":
    sys.exit(main())
