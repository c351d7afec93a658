"""Moved to :mod:`torchfold.train.capture.xla_linear` (the step mechanisms live in one package); this name warns.

>>> import warnings
>>> with warnings.catch_warnings(record=True):
...     import torchfold.train.xla_linear
"""

import warnings

from torchfold.train.capture.xla_linear import *  # noqa: F403
from torchfold.train.capture.xla_linear import __all__  # noqa: F401

warnings.warn(
    "torchfold.train.xla_linear moved to torchfold.train.capture.xla_linear; import it from there",
    FutureWarning,
    stacklevel=2,
)
