"""Building the next batches' folds in a background thread while the current one trains.

Recording a fold is Python work (``add`` per node); running it is mostly C++ that releases the
GIL (autograd's backward, large kernels). :class:`Prefetcher` overlaps the two: a worker
thread calls ``build(batch)`` for upcoming batches and the training loop receives finished
results in order. An exception in the build is re-raised in the consumer, its own type with a note
naming the batch number;
a consumer waiting longer than ``timeout`` gets an error instead of a hang.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import Generic, TypeVar

from torchfold._errors import FoldError, add_note
from torchfold._validate import check_int

__all__ = ["Prefetcher"]

B = TypeVar("B")
T = TypeVar("T")


class _Failure:
    __slots__ = ("error", "index")

    def __init__(self, index: int, error: BaseException) -> None:
        self.index = index
        self.error = error


_DONE = object()


class Prefetcher(Generic[B, T], Iterator[T]):
    """Iterate over ``build(batch)`` for each batch, computed ahead in a background thread.

    Args:
        batches: the batches (any iterable; consumed by the worker thread).
        build: turns one batch into what a training step needs, typically a recorded
            :class:`~torchfold.Fold` and the nodes/targets to apply it to.
        prefetch_factor: how many built batches may wait ready (default 2).
        timeout: seconds to wait for the next built batch before raising (default: no limit).

    Use it as a context manager (or call :meth:`close`) so the worker stops when the loop
    ends early.

    Example:
        >>> import torch, torchfold
        >>> def build(values):
        ...     fold = torchfold.Fold()
        ...     return fold, [fold.add("exp", v) for v in values]
        >>> class Doubler(torch.nn.Module):
        ...     def exp(self, x):
        ...         return 2 * x
        >>> with torchfold.train.Prefetcher([[1, 2], [3]], build) as ready:
        ...     for fold, nodes in ready:
        ...         print(fold.apply(Doubler(), [nodes])[0].tolist())
        [2, 4]
        [6]
    """

    def __init__(
        self,
        batches: Iterable[B],
        build: Callable[[B], T],
        *,
        prefetch_factor: int = 2,
        timeout: float | None = None,
    ) -> None:
        check_int("prefetch_factor", prefetch_factor)
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be positive seconds or None, got {timeout!r}")
        self._build = build
        self._timeout = timeout
        self._ready: queue.Queue[object] = queue.Queue(maxsize=prefetch_factor)
        self._stop = threading.Event()
        self._finished = False
        self._timed_out = False  # a build was overdue: closing does not wait for it
        self._thread = threading.Thread(
            target=self._work, args=(iter(batches),), name="torchfold-prefetch", daemon=True
        )
        self._thread.start()

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._ready.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _work(self, batches: Iterator[B]) -> None:
        index = 0
        try:
            for batch in batches:
                if not self._put(self._build(batch)):
                    return
                index += 1
        except BaseException as error:  # re-raised on the consumer side
            self._put(_Failure(index, error))
            return
        self._put(_DONE)

    def __iter__(self) -> Prefetcher[B, T]:
        return self

    def __next__(self) -> T:
        if self._finished:
            raise StopIteration
        try:
            item = self._ready.get(timeout=self._timeout)
        except queue.Empty:
            self._timed_out = True
            self.close(wait=False)  # the build may be stuck: do not wait for it to return
            raise FoldError(
                f"Prefetcher: no batch was ready within timeout={self._timeout}s; the build function may be "
                "stuck or too slow for this timeout (raise it, or pass timeout=None)"
            ) from None
        if item is _DONE:
            self._finished = True
            self._thread.join()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            if isinstance(item.error, StopIteration):
                # Raised as it is, it would end the consumer's loop as if the batches were done.
                raise RuntimeError(
                    f"Prefetcher: build raised StopIteration for batch {item.index}; a StopIteration would end the "
                    "loop silently, so it is raised as this RuntimeError (the original is its __cause__)"
                ) from item.error
            # The build's own exception, so `except UnicodeDecodeError:` (or the user's type) catches it.
            add_note(item.error, f"torchfold.train.Prefetcher: while building batch {item.index}")
            raise item.error
        return item  # type: ignore[return-value]

    def close(self, wait: bool = True) -> None:
        """Stop the worker and drop batches built ahead (safe to call more than once).

        With ``wait`` (default) this returns once the worker has finished the build it is in,
        waiting at most ``timeout`` seconds if one was given, and not at all after a batch was
        not ready in time. A worker still in a build when ``close`` returns discards its result
        when done; it is a daemon thread, so one stuck for good does not keep the program alive.
        """
        self._finished = True
        self._stop.set()
        while True:
            try:
                self._ready.get_nowait()
            except queue.Empty:
                break
        if wait and not self._timed_out:
            self._thread.join(self._timeout)  # a build stuck for good must not hang the with-block

    def __enter__(self) -> Prefetcher[B, T]:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()
