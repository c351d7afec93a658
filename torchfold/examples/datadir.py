"""Where the example data lives: an argument, else ``$TORCHFOLD_DATA``; no directory is assumed."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ENV_VAR", "data_root"]

ENV_VAR = "TORCHFOLD_DATA"


def data_root(root: str | os.PathLike[str] | None = None) -> Path | None:
    """The data directory: ``root`` if given, else ``$TORCHFOLD_DATA``, else ``None``.

    Nothing is guessed: a caller without either falls back to generated or bundled data, or
    raises saying how to get the data.

    Args:
        root: an explicit directory; returned as is (not checked), so that the caller's error
            names the path the user gave.

    >>> data_root("/some/where")
    PosixPath('/some/where')
    """
    if root is not None:
        return Path(root)
    env = os.environ.get(ENV_VAR)
    return Path(env) if env else None
