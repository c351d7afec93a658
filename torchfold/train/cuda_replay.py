"""Moved to :mod:`torchfold.train.capture.cuda_replay` (the step mechanisms live in one package); this name warns.

>>> import warnings
>>> with warnings.catch_warnings(record=True):
...     import torchfold.train.cuda_replay
"""

import warnings

from torchfold.train.capture.cuda_replay import *  # noqa: F403
from torchfold.train.capture.cuda_replay import __all__  # noqa: F401

warnings.warn(
    "torchfold.train.cuda_replay moved to torchfold.train.capture.cuda_replay; import it from there",
    FutureWarning,
    stacklevel=2,
)
