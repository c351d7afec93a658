"""Module-level pieces of the loader tests: spawned workers and interrupted scripts import them by name."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from torchfold.engine.fold import Fold


def square_build(items: list[int]) -> tuple[Any, np.ndarray]:
    """A plan squaring every item, and the items as targets."""
    fold = Fold()
    nodes = [fold.add("square", float(i)) for i in items]
    return fold.plan([nodes]), np.asarray(items)


def failing_build(items: list[int]) -> tuple[Any, np.ndarray]:
    """``square_build``, failing on item 13 (a bad sample)."""
    if 13 in items:
        raise ValueError(f"item 13 is corrupt (worker pid {os.getpid()})")
    return square_build(items)


def slow_build(items: list[int]) -> tuple[Any, np.ndarray]:
    """``square_build`` taking 0.2 s (for interrupting a loop with workers busy)."""
    time.sleep(0.2)
    return square_build(items)


def wrong_build(items: list[int]) -> list[int]:
    """Returns the items, not (FoldPlan, targets)."""
    return items
