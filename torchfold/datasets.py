"""Deprecated since torchfold 0.2: ``torchfold.datasets`` is :mod:`torchfold.examples.datasets`.

0.1's module path still imports (``from torchfold.datasets import ...``), with a ``FutureWarning``;
the module is the new one itself, so its names are the same objects.
"""

from __future__ import annotations

import sys
import warnings

from torchfold.examples import datasets as _new

warnings.warn(
    "torchfold.datasets is deprecated since torchfold 0.2; use torchfold.examples.datasets",
    FutureWarning,
    stacklevel=2,
)
sys.modules[__name__] = _new  # the import statement binds the new module
