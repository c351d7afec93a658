"""Renamed :mod:`torchfold.engine.planner` (a fold is planned, ``torch.compile`` compiles); this name warns.

``compile_fold`` is :func:`~torchfold.engine.planner.plan_fold`'s old name.

>>> import warnings
>>> with warnings.catch_warnings(record=True):
...     from torchfold.engine.compiler import compile_fold
"""

import warnings

from torchfold._deprecation import moved_names
from torchfold.engine.planner import *  # noqa: F403
from torchfold.engine.planner import plan_fold

__all__ = ["plan_fold"]

warnings.warn(
    "torchfold.engine.compiler moved to torchfold.engine.planner; import it from there",
    FutureWarning,
    stacklevel=2,
)


# PEP 562: the old function name resolves, warning once.
__getattr__ = moved_names(
    "torchfold.engine.compiler",
    {"compile_fold": ("torchfold.engine.planner", "plan_fold", "torchfold.engine.planner.plan_fold")},
)
