"""The C part of recording and planning, and the one switch for it.

Installing torchfold compiles the extension ``torchfold.engine._record`` where a C compiler is
found (see ``docs/design/recording.md``). :data:`BUILT` says whether it was; its types and
function are here, or None without it. :func:`enabled` says whether recording and planning use
it now (``Fold.add`` and ``Node.split`` in C, the gathers of plain groups planned in C): True
where it was built. :func:`use` switches it off and on again, for the whole process or, as a
context manager, for a block; the results are the same either way, only the time differs. This
module is the one place that knows: the engine's modules hand it their C methods
(:func:`install`) and ask :func:`enabled`.

``plain_group``'s last argument is a scratch buffer that must be all 0xff bytes; it is left so,
and the planner makes one per plan (``torchfold.engine.planner``).

>>> from torchfold.engine import native
>>> native.BUILT in (True, False), native.enabled() == native.BUILT
(True, True)
>>> with native.use(False):  # record and plan in Python alone, as without the C part
...     native.enabled()
False
>>> native.enabled() == native.BUILT  # as it was again after the block
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = [
    "BUILT",
    "SCRATCH_BYTES_PER_SOURCE",
    "FastAdd",
    "FastSplit",
    "Recorder",
    "enabled",
    "install",
    "plain_group",
    "use",
]

try:
    from torchfold.engine._record import SCRATCH_BYTES_PER_SOURCE, FastAdd, FastSplit, Recorder, plain_group

    #: whether the C part was built (else recording and planning are Python alone)
    BUILT = True
except ImportError:  # built without a C compiler
    FastAdd = FastSplit = Recorder = plain_group = None  # type: ignore[assignment,misc]
    SCRATCH_BYTES_PER_SOURCE = 0
    BUILT = False

_enabled = BUILT  # the switch (see use)
# (class, attribute, Python function, its C wrapper) for each method install put in place
_methods: list[tuple[type, str, Callable[..., Any], Any]] = []


def enabled() -> bool:
    """Whether recording and planning use the C part now: :data:`BUILT`, unless :func:`use` switched it off."""
    return _enabled


def install(owner: type, name: str, wrap: Callable[[Callable[..., Any]], Any]) -> None:
    """Make ``owner.name`` the C wrapper ``wrap(python_function)`` while the C part is on, and the
    Python function while it is off (nothing at all where it was not built).

    The wrapper leaves to the Python function every call it does not handle, with the same
    results, so switching changes only the time. ``Fold.add`` and ``Node.split`` are installed so.
    """
    if not BUILT:
        return
    python = owner.__dict__[name]
    fast = wrap(python)
    _methods.append((owner, name, python, fast))
    setattr(owner, name, fast if _enabled else python)


class _Switch:
    """What :func:`use` returns: the switch is set already; as a context manager, it puts the
    state it found back on exit."""

    def __init__(self, previous: bool) -> None:
        self.previous = previous

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        _set(self.previous)


def use(on: bool) -> _Switch:
    """Record and plan with the C part (``on=True``, the default where it was built) or in Python alone.

    It takes effect at once, for every fold of the process (a fold made while it was off makes its
    C recorder at its first ``add`` after it is on again); used as a context manager, the state
    before it comes back at the end of the block. The tests and ``benchmarks/fold_overhead.py``
    compare the two ways with it.

    Example:
        >>> import torch, torchfold
        >>> from torchfold.engine import native
        >>> with native.use(False):
        ...     fold = torchfold.Fold()
        ...     fold.apply(torch.nn.Module(), [[fold.add(torch.neg, 1), fold.add(torch.neg, 2)]])
        [tensor([-1, -2])]

    Raises:
        TypeError: ``on`` is not a bool.
        RuntimeError: ``on`` is True and torchfold was built without its C part.
    """
    if not isinstance(on, bool):
        raise TypeError(f"native.use(on={on!r}): on must be True or False")
    if on and not BUILT:
        raise RuntimeError(
            "native.use(True): torchfold was installed without its C part (no C compiler was found); "
            "reinstall it with one (pip install -e . or make env) to record and plan in C"
        )
    switch = _Switch(_enabled)
    _set(on)
    return switch


def _set(on: bool) -> None:
    global _enabled
    _enabled = on
    for owner, name, python, fast in _methods:
        setattr(owner, name, fast if on else python)
