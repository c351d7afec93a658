"""Deprecated since torchfold 0.2: ``torchfold.datasets`` is :mod:`torchfold.examples.datasets`.

0.1's module path still imports (``from torchfold.datasets import ...``), with a ``FutureWarning``;
every name resolves to the new module's object.
"""

from __future__ import annotations

import warnings
from typing import Any

from torchfold.examples import datasets as _new

warnings.warn(
    "torchfold.datasets is deprecated since torchfold 0.2; use torchfold.examples.datasets",
    FutureWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    # PEP 562: every name of the new module, as the same object
    return getattr(_new, name)


def __dir__() -> list[str]:
    return dir(_new)
