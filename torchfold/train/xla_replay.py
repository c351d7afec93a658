"""Moved to :mod:`torchfold.train.capture.xla_replay` (the step mechanisms live in one package); this name warns.

>>> import warnings
>>> with warnings.catch_warnings(record=True):
...     import torchfold.train.xla_replay
"""

import warnings

from torchfold.train.capture.xla_replay import *  # noqa: F403
from torchfold.train.capture.xla_replay import __all__  # noqa: F401

warnings.warn(
    "torchfold.train.xla_replay moved to torchfold.train.capture.xla_replay; import it from there",
    FutureWarning,
    stacklevel=2,
)
