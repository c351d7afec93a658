"""Deprecated since torchfold 0.2: ``torchfold.models`` is :mod:`torchfold.examples.models`.

0.1's module path still imports (``from torchfold.models import ...``), with a ``FutureWarning``;
every name resolves to the new module's object.
"""

from __future__ import annotations

import warnings
from typing import Any

from torchfold.examples import models as _new

warnings.warn(
    "torchfold.models is deprecated since torchfold 0.2; use torchfold.examples.models",
    FutureWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    # PEP 562: every name of the new module, as the same object
    return getattr(_new, name)


def __dir__() -> list[str]:
    return dir(_new)
