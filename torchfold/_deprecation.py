"""Renamed public names: the old name still works, with a ``FutureWarning`` naming the new one."""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["RenamedAttribute", "warn_renamed"]

_warned: set[str] = set()


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn once per process that ``old`` is deprecated in favour of ``new`` (a ``FutureWarning``).

    ``stacklevel`` 3 points at the caller of the function that calls this one.
    """
    if old not in _warned:
        _warned.add(old)
        warnings.warn(f"{old} is deprecated; use {new}", FutureWarning, stacklevel=stacklevel)


class RenamedAttribute:
    """A read-only attribute kept under its old name: reading it warns and returns ``new``.

    Example:
        >>> import warnings
        >>> class Loader:
        ...     minibatch_size = 4
        ...     batch_size = RenamedAttribute("minibatch_size", "samples per minibatch")
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     Loader().batch_size
        4
        >>> str(caught[0].message)
        'Loader.batch_size is deprecated; use Loader.minibatch_size (samples per minibatch)'
    """

    def __init__(self, new: str, meaning: str) -> None:
        self.new, self.meaning = new, meaning
        self.old = self.__doc__ = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.owner, self.old = owner.__name__, name
        self.__doc__ = f"Deprecated: :attr:`{self.new}` ({self.meaning})."

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        if instance is None:
            return self
        warnings.warn(
            f"{self.owner}.{self.old} is deprecated; use {self.owner}.{self.new} ({self.meaning})",
            FutureWarning,
            stacklevel=2,
        )
        return getattr(instance, self.new)

    def __set__(self, instance: object, value: Any) -> None:
        raise AttributeError(
            f"{self.owner}.{self.old} is deprecated and read-only; set {self.owner}.{self.new}"
        )
