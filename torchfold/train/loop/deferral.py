"""A step reported after the next one is launched, so that the host runs ahead of the device.

In one process on an accelerator, reading a step's loss waits for the device to finish the step.
:meth:`TraceTrainer.fit <torchfold.train.TraceTrainer.fit>` therefore holds a launched step in a
:class:`DeferredReport` and reports it after launching the next one: the device runs that step
while the host waits for the loss of this one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["DeferredReport"]

Held = TypeVar("Held")


class DeferredReport(Generic[Held]):
    """At most one launched step waiting for its report, ``report(held, until)``.

    ``until`` is when the step's time ends (the next step's start), or ``None``: now.

    Example:
        >>> reports = []
        >>> deferred = DeferredReport(lambda step, until: reports.append(step))
        >>> with deferred.reporting_the_last():
        ...     deferred.hold(0)
        ...     deferred.report(until=None, ahead=1)  # after step 1 is launched
        ...     deferred.hold(1)
        >>> reports
        [0, 1]
    """

    def __init__(self, report: Callable[[Held, float | None], None]) -> None:
        self._report = report
        self._held: tuple[Held] | None = None
        #: while a held step is reported after the next one was launched: that next step
        self.ahead: int | None = None

    def hold(self, held: Held) -> None:
        """Hold a launched step back from its report."""
        self._held = (held,)

    def report(self, until: float | None, ahead: int | None = None) -> None:
        """Report the held step, if any (``ahead``: the step launched after it, if one was)."""
        if self._held is None:
            return
        (held,), self._held = self._held, None  # cleared first: a failing report records it once
        self.ahead = ahead
        try:
            self._report(held, until)
        finally:
            self.ahead = None

    @contextlib.contextmanager
    def reporting_the_last(self) -> Iterator[None]:
        """Report the step still held at the end; after a failure too, where it can be read."""
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):  # the step before the failure ran: record it if it can
                self.report(until=None)
            raise
        self.report(until=None)
