"""Moved to :mod:`torchfold.train.capture.compiled` (the step mechanisms live in one package); this name warns.

>>> import warnings
>>> with warnings.catch_warnings(record=True):
...     import torchfold.train.compiled
"""

import warnings

from torchfold.train.capture.compiled import *  # noqa: F403
from torchfold.train.capture.compiled import __all__  # noqa: F401

warnings.warn(
    "torchfold.train.compiled moved to torchfold.train.capture.compiled; import it from there",
    FutureWarning,
    stacklevel=2,
)
