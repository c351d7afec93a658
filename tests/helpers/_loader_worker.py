"""Module-level pieces of the loader tests: spawned workers and interrupted scripts import them by name."""

from __future__ import annotations

import json
import os
import subprocess
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


class TwoArgumentError(Exception):
    """A user exception whose constructor takes two arguments (DataLoader rebuilds from a message)."""

    def __init__(self, path: str, line: int) -> None:
        super().__init__(path, line)
        self.path, self.line = path, line

    def __str__(self) -> str:
        return f"{self.path}, line {self.line}: bad tree"


def raising_build(kind: str) -> Any:
    """A build that raises an exception of ``kind`` for the minibatch holding item 5."""
    return _RaisingBuild(kind)


class _RaisingBuild:
    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __call__(self, items: list[int]) -> tuple[Any, np.ndarray]:
        if 5 in items:
            if self.kind == "unicode":
                b"\xff".decode("utf-8")
            if self.kind == "json":
                json.loads("{")
            if self.kind == "subprocess":
                raise subprocess.CalledProcessError(3, ["parse", "trees.txt"])
            if self.kind == "user":
                raise TwoArgumentError("trees.txt", 7)
            if self.kind == "stop":
                next(iter([]))
        return square_build(items)


def slow_build(items: list[int]) -> tuple[Any, np.ndarray]:
    """``square_build`` taking 0.2 s (for interrupting a loop with workers busy)."""
    time.sleep(0.2)
    return square_build(items)


def wrong_build(items: list[int]) -> list[int]:
    """Returns the items, not (FoldPlan, targets)."""
    return items


def collecting_build(items: list[int]) -> tuple[Any, np.ndarray]:
    """``square_build`` after a garbage collection (what a worker may run into at any time)."""
    import gc

    gc.collect()
    return square_build(items)
