"""Renamed public names: the old name still works, with a ``FutureWarning`` naming the new one."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Collection, Mapping
from typing import Any

__all__ = ["RenamedAttribute", "moved_names", "warn_renamed"]

_warned: set[str] = set()


def warn_renamed(old: str, new: str, *, since: str | None = None, stacklevel: int = 3) -> None:
    """Warn once per process that ``old`` is deprecated (``since`` a release) in favour of ``new``.

    A ``FutureWarning``, as for every renamed public name; ``stacklevel`` 3 points at the caller of
    the function that calls this one.
    """
    if old not in _warned:
        _warned.add(old)
        when = f" since {since}" if since else ""
        warnings.warn(f"{old} is deprecated{when}; use {new}", FutureWarning, stacklevel=stacklevel)


def moved_names(
    module: str,
    names: Mapping[str, tuple[str, str, str]],
    *,
    since: str | None = None,
    lazy: Collection[str] = (),
) -> Callable[[str], Any]:
    """A PEP 562 ``__getattr__`` for ``module`` under which names that moved still resolve.

    ``names`` maps an old name to ``(where, attribute, new)``: reading it imports ``where`` and
    returns its ``attribute``, after :func:`warn_renamed` says once that ``module.old`` is
    deprecated in favour of ``new`` (the spelling users should write). The submodules named in
    ``lazy`` load on first use, without a warning.

    Example:
        >>> import warnings
        >>> resolve = moved_names("pkg", {"Old": ("collections", "OrderedDict", "pkg.New")})
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     resolve("Old").__name__
        'OrderedDict'
        >>> str(caught[0].message)
        'pkg.Old is deprecated; use pkg.New'
    """

    def __getattr__(name: str) -> Any:
        if name in lazy:
            return importlib.import_module(f"{module}.{name}")
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        where, attribute, new = names[name]
        warn_renamed(f"{module}.{name}", new, since=since)
        return getattr(importlib.import_module(where), attribute)

    return __getattr__


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
