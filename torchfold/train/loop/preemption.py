"""Preemption: SIGTERM stops a training run after the step in progress, with a checkpoint to resume from.

Schedulers send SIGTERM before they take a machine back. While a :class:`SigtermGuard` handles
it (:meth:`TraceTrainer.fit <torchfold.train.TraceTrainer.fit>` installs one), the signal only
sets :attr:`SigtermGuard.received`: the trainer finishes the current step, the ranks agree to
stop, one checkpoint is written and :meth:`~torchfold.train.TraceTrainer.fit` raises
:class:`Preempted`, which a script turns into the exit status :data:`PREEMPTED_EXIT_CODE` (the
command line does). A second SIGTERM, or ``timeout`` seconds without reaching the end of the
step and its checkpoint, exits at once with status 143 (128 + SIGTERM, what a shell reports for
a process killed by SIGTERM) and a message on stderr.

Outside :meth:`~torchfold.train.TraceTrainer.fit` there is no step to finish: while
:func:`terminated_on_sigterm` handles it (the command line's ``train`` does, around all it
does), SIGTERM raises :class:`Terminated` where the program stands, as Ctrl-C raises
``KeyboardInterrupt``, so that ``finally`` blocks release what they hold; the command line ends
with one line and :data:`PREEMPTED_EXIT_CODE`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["PREEMPTED_EXIT_CODE", "Preempted", "SigtermGuard", "Terminated", "terminated_on_sigterm"]

#: Exit status of a run stopped by SIGTERM after writing its checkpoint (``EX_TEMPFAIL``: run it again).
PREEMPTED_EXIT_CODE = 75

_FORCED_EXIT_CODE = 128 + signal.SIGTERM  # what a shell reports for a process killed by SIGTERM


class Preempted(Exception):
    """:meth:`TraceTrainer.fit <torchfold.train.TraceTrainer.fit>` stopped on SIGTERM after a step, with a checkpoint to resume from.

    Args:
        step: the global step the run resumes at (steps completed).
        checkpoint: the checkpoint written, or ``None`` when the trainer has no ``checkpoint_dir``.

    A script ends with ``sys.exit(PREEMPTED_EXIT_CODE)`` on it, so that a scheduler or a
    supervisor can tell a preemption from a failure.

    >>> str(Preempted(3, None))
    'SIGTERM received: stopped after step 2 and the trainer has no checkpoint_dir, so nothing was saved'
    """

    exit_code = PREEMPTED_EXIT_CODE

    def __init__(self, step: int, checkpoint: Path | None) -> None:
        self.step = step
        self.checkpoint = checkpoint
        where = (
            f"wrote checkpoint {checkpoint}; run the same command again to resume, on any number of processes"
            if checkpoint is not None
            else "the trainer has no checkpoint_dir, so nothing was saved"
        )
        super().__init__(f"SIGTERM received: stopped after step {step - 1} and {where}")


class SigtermGuard:
    """Turns SIGTERM into a request to stop after the current step, read from :attr:`received`.

    Args:
        rank: this process's rank, named in the messages on stderr.

    >>> guard = SigtermGuard(rank=0)
    >>> with guard.handling(timeout=120.0, step=lambda: 7):
    ...     guard.received
    False
    """

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        #: a SIGTERM arrived while :meth:`handling` was active (reset when it ends)
        self.received = False

    @contextlib.contextmanager
    def handling(self, timeout: float, step: Callable[[], int]) -> Iterator[None]:
        """Inside, SIGTERM sets :attr:`received`; a second one, or ``timeout`` seconds after the
        first, exits the process at once. ``step()`` is the step in progress, for the message.

        Only the main thread can handle signals: elsewhere nothing is installed.
        """
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        timers: list[threading.Timer] = []

        def on_sigterm(signum: int, frame: object) -> None:
            if self.received:
                self._forced_exit("a second SIGTERM")
            self.received = True
            print(
                f"torchfold: rank {self.rank}: SIGTERM received: finishing step {step()}, then writing a checkpoint "
                f"(a second SIGTERM, or {timeout:g} s, exits at once)",
                file=sys.stderr,
                flush=True,
            )
            why = f"the step and its checkpoint took longer than preemption_timeout={timeout:g} s"
            timer = threading.Timer(timeout, self._forced_exit, (why,))
            timer.daemon = True
            timer.start()
            timers.append(timer)

        previous = signal.signal(signal.SIGTERM, on_sigterm)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)
            for timer in timers:
                timer.cancel()
            self.received = False

    def _forced_exit(self, why: str) -> None:
        print(
            f"torchfold: rank {self.rank}: {why}; exiting now without a checkpoint",
            file=sys.stderr,
            flush=True,
        )
        os._exit(_FORCED_EXIT_CODE)


class Terminated(BaseException):
    """SIGTERM arrived outside a training step, under :func:`terminated_on_sigterm`.

    A ``BaseException``, as ``KeyboardInterrupt`` is: ``except Exception`` blocks let it through.
    """


@contextlib.contextmanager
def terminated_on_sigterm() -> Iterator[None]:
    """Inside, SIGTERM raises :class:`Terminated` where the main thread stands (a second one, while
    the first unwinds, exits at once with status 143); a :class:`SigtermGuard` inside takes over
    while it handles the signal. The previous handler comes back at the end.

    A process forked inside (a loader's worker) that inherits the handler dies of SIGTERM as it
    would without it. Off the main thread nothing is installed.

    >>> with terminated_on_sigterm():
    ...     signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    True
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    owner = os.getpid()
    raised: list[bool] = []  # (a SIGTERM raised Terminated already)

    def on_sigterm(signum: int, frame: object) -> None:
        if os.getpid() != owner:  # a forked child: SIGTERM's own action
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if raised:
            print("torchfold: a second SIGTERM; exiting now", file=sys.stderr, flush=True)
            os._exit(_FORCED_EXIT_CODE)
        raised.append(True)
        raise Terminated

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
