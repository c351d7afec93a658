"""Argument checks shared by the whole package, so every module words the same mistake the same way.

``check_int`` for int arguments of functions and classes; ``positive_int``, ``non_negative_int``
and ``positive_float`` as argparse types of the command lines (``demo``, ``trace``, ``train``).
"""

from __future__ import annotations

import argparse

__all__ = ["check_int", "non_negative_int", "positive_float", "positive_int"]


def check_int(name: str, value: object, minimum: int = 1) -> int:
    """``value`` if it is an int (not a bool) of at least ``minimum``, else a TypeError/ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        rule = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {rule}, got {value}")
    return value


def _number(text: str, kind: type[int] | type[float], rule: str) -> float:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}") from None


def positive_int(text: str) -> int:
    value = int(_number(text, int, "a positive integer"))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(_number(text, int, "an integer >= 0"))
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = _number(text, float, "a positive number")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value}")
    return value
