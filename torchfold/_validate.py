"""Argument checks shared by the whole package, so every module words the same mistake the same way.

``check_int`` for int arguments of functions and classes; ``brief`` for a value read from a file, as
an error message shows it; ``positive_int``, ``non_negative_int``,
``positive_float``, ``non_negative_float``, ``seed_int`` and ``thread_count`` as argparse types of the command lines
(``demo``, ``trace``, ``train``).
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Literal, overload

import torch

__all__ = [
    "brief",
    "check_int",
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "positive_int",
    "seed_int",
    "thread_count",
]

THREADS_PER_CPU = 4  # --threads above cpu_count() x this is refused: huge counts crash torch's pool
SEED_MAX = 2**63 - 1  # torch and the samplers take seeds up to 2**64 - 1; the epoch is added to it


@overload
def check_int(
    name: str, value: object, minimum: int | None = 1, *, optional: Literal[False] = False, hint: str = ""
) -> int: ...
@overload
def check_int(
    name: str, value: object, minimum: int | None = 1, *, optional: Literal[True], hint: str = ""
) -> int | None: ...
def check_int(
    name: str, value: object, minimum: int | None = 1, *, optional: bool = False, hint: str = ""
) -> int | None:
    """``value`` if it is an int (not a bool) of at least ``minimum``, else an error naming it.

    The one check of an int argument: a value of another type is a ``TypeError``, an int below
    ``minimum`` (``None``: any int) a ``ValueError``; ``optional`` also takes ``None``; ``hint``
    (the fix, where the rule alone does not say it) ends the message.

    >>> check_int("num_samples", 3)
    3
    >>> check_int("seed", None, 0, optional=True) is None
    True
    >>> check_int("epochs", 2.0, 0, optional=True)
    Traceback (most recent call last):
    ...
    TypeError: epochs must be None or an int, got float 2.0
    >>> check_int("num_samples", 0, hint="the minibatch's sample count")
    Traceback (most recent call last):
    ...
    ValueError: num_samples must be a positive int, got 0; the minibatch's sample count
    """
    if optional and value is None:
        return None
    either = "None or " if optional else ""
    end = f"; {hint}" if hint else ""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be {either}an int, got {type(value).__name__} {value!r}{end}")
    if minimum is not None and value < minimum:
        rule = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {either}{rule}, got {value}{end}")
    return value


def brief(value: object) -> str:
    """A value for an error message: a tensor by dtype and shape, anything else by a short repr.

    >>> brief(torch.zeros(2, 3)), brief("x" * 100)
    ('a torch.float32 tensor of shape (2, 3)', "'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx... (str)")
    """
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:60]}... ({type(value).__name__})"


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
    if not math.isfinite(value):  # an infinite learning rate or step time only makes nan later
        raise argparse.ArgumentTypeError(f"must be a finite positive number, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text, float, "a number >= 0")
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value}")
    return value


def seed_int(text: str) -> int:
    value = int(_number(text, int, "an integer seed"))
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to {SEED_MAX} (2**63 - 1), got {value}")
    return value


def max_threads() -> int:
    """The most threads ``--threads`` accepts on this machine."""
    cpus: int | None = getattr(os, "process_cpu_count", os.cpu_count)()  # 3.13: the CPUs it may use
    return max(1, cpus or 1) * THREADS_PER_CPU


def thread_count(text: str) -> int:
    value = positive_int(text)
    limit = max_threads()
    if value > limit:
        raise argparse.ArgumentTypeError(
            f"must be at most {limit} ({THREADS_PER_CPU} per CPU of this machine), got {value}"
        )
    return value
