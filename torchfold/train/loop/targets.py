"""The targets a loader's build returns, checked against its plan's padded rows.

A plan padded into static shapes (on XLA, with ``compile="on"``) gives ``apply(model,
padded=True)`` more rows per request than the request has nodes, so per-node targets must be
padded the same way: ``plan.pad(request, values)``, padded rows weighing 0. A build that forgets
trains on the CPU, where plans are not padded, and fails on XLA inside the loss, in torch's words
(``Expected input batch_size (24) to match target batch_size (16)``). So the trainer checks the
targets of every padded plan (:func:`check_target_rows`) and, where the run's plans are not
padded, builds the run's first minibatch once more into static shapes to check it the same way
(:func:`probe_target_rows`): the mistake then shows on the CPU first, before the run reaches a
device that pads.
"""

from __future__ import annotations

import contextlib
import inspect
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from torchfold.engine.static.shapes import StaticPlan, StaticShapes

__all__ = ["check_target_rows", "probe_target_rows"]


def _arrays(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    """The tensors and numpy arrays in ``value`` (tuples, lists and dicts walked), with where they are."""
    if isinstance(value, torch.Tensor | np.ndarray):
        yield path, value
    elif isinstance(value, tuple | list):
        for number, part in enumerate(value):
            yield from _arrays(part, f"{path}[{number}]")
    elif isinstance(value, dict):
        for key, part in value.items():
            yield from _arrays(part, f"{path}[{key!r}]")


def check_target_rows(plan: Any, targets: Any, *, probed: bool = False) -> None:
    """Refuse targets with a row per node of a request of ``plan`` that were not padded like it.

    Only a :class:`~torchfold.StaticPlan` pads; a target (a tensor or numpy array, also inside
    tuples, lists and dicts) whose rows are the nodes of a padded request, and no request's padded
    rows, is per-node data left unpadded. ``probed``: the plan was built only to check (see
    :func:`probe_target_rows`), which the message says.

    >>> import torch, torchfold
    >>> fold = torchfold.Fold(shapes=torchfold.StaticShapes(min_rows=4))
    >>> plan = fold.plan([[fold.add(torch.neg, 1), fold.add(torch.neg, 2)]])
    >>> check_target_rows(plan, (plan.pad(request=0, values=[1, 0]),))  # padded: 4 rows
    >>> check_target_rows(plan, (torch.tensor([1, 0]),))
    Traceback (most recent call last):
    ...
    ValueError: the targets of the loader's build have 2 rows (targets[0]) but the plan's padded batch has 4 (request 0: 2 nodes padded to 4 by static shapes); pad every per-node target in build with plan.pad(request=0, values=...), padded rows weighing 0 (fill=0 for weights, fill=-100 for cross_entropy's ignore_index)
    """
    if not isinstance(plan, StaticPlan):
        return
    padded = [
        (request, size, capacity)
        for request, (size, capacity) in enumerate(zip(plan.sizes, plan.capacities, strict=True))
        if size != capacity
    ]
    if not padded:
        return
    capacities = set(plan.capacities)
    for path, array in _arrays(targets, "targets"):
        if array.ndim == 0 or array.shape[0] in capacities:
            continue
        rows = int(array.shape[0])
        for request, size, capacity in padded:
            if rows == size:
                how = (
                    ", as on XLA and in compiled runs: this run's first minibatch, built once more that way to check"
                    if probed
                    else ""
                )
                raise ValueError(
                    f"the targets of the loader's build have {rows} rows ({path}) but the plan's padded batch has "
                    f"{capacity} (request {request}: {size} nodes padded to {capacity} by static shapes{how}); pad "
                    f"every per-node target in build with plan.pad(request={request}, values=...), padded rows "
                    "weighing 0 (fill=0 for weights, fill=-100 for cross_entropy's ignore_index)"
                )


def _takes_shapes(build: Callable[..., Any]) -> bool:
    """Whether ``build`` can be called as ``build(items, shapes=...)`` (a task's build can)."""
    try:
        parameters = inspect.signature(build).parameters
    except (TypeError, ValueError):  # no signature to read: do not guess
        return False
    return "shapes" in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


@contextlib.contextmanager
def _random_states_kept() -> Iterator[None]:
    """Put back the global generators a build may draw from (torch's CPU one, ``random``, numpy's)."""
    python, numpy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy)


def probe_target_rows(build: Callable[..., Any] | None, items: Sequence[Any]) -> None:
    """Build ``items`` once more into fresh static shapes and check its targets (:func:`check_target_rows`).

    For a run whose plans are not padded (the CPU, without ``compile="on"``): so that targets
    left unpadded are refused there, not first on XLA. Only a build that takes ``shapes`` (a
    :class:`~torchfold.train.Task`'s does) can be asked; the global generators are put back, so
    the run draws what it would have drawn. A build that fails or returns no ``(plan, targets)``
    this way is left alone: this run does not pad, and a run that does says so where it builds.
    """
    if build is None or not _takes_shapes(build):
        return
    with _random_states_kept():
        try:
            built = build(items, shapes=StaticShapes())
        except Exception:  # (see above: the probe is only a check, for a run that pads elsewhere)
            return
    if isinstance(built, tuple) and len(built) == 2:
        check_target_rows(*built, probed=True)
