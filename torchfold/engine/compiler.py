"""Renamed :mod:`torchfold.engine.planner` (a fold is planned, ``torch.compile`` compiles); this name warns.

``compile_fold`` is :func:`~torchfold.engine.planner.plan_fold`'s old name.

>>> import warnings
>>> with warnings.catch_warnings(record=True):
...     from torchfold.engine.compiler import compile_fold
"""

import warnings
from typing import Any

from torchfold.engine.planner import *  # noqa: F403
from torchfold.engine.planner import plan_fold

__all__ = ["plan_fold"]

warnings.warn(
    "torchfold.engine.compiler moved to torchfold.engine.planner; import it from there",
    FutureWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    # PEP 562: the old function name resolves, with a warning at every use.
    if name == "compile_fold":
        warnings.warn(
            "torchfold.engine.compiler.compile_fold is deprecated; use torchfold.engine.planner.plan_fold",
            FutureWarning,
            stacklevel=2,
        )
        return plan_fold
    raise AttributeError(f"module 'torchfold.engine.compiler' has no attribute {name!r}")
