"""SIGTERM while ``python -m torchfold train`` starts: exit status 75 and one line, not a silent 143.

``python -m torchfold`` imports this package, and with it torch (about a second), before any code
of the command line runs; a scheduler's SIGTERM in that time killed the process without a word.
:func:`install` (run on import: the package's ``__init__`` imports this module first) handles
SIGTERM, only in a process started as ``python -m torchfold train`` or ``torchfold train``,
until the command installs its own handling (:func:`torchfold.train.preemption.terminated_on_sigterm`): nothing has started
yet, so it writes the line and exits at once. Stdlib only: it must not import torch.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

__all__ = ["LINE", "install"]

#: What a run stopped by SIGTERM before training prints (the command line's own words).
LINE = (
    "torchfold train: SIGTERM received before training started: stopped (nothing was written); run the same "
    "command again to start, or to resume from the newest checkpoint"
)
_EXIT_STATUS = 75  # torchfold.train.preemption.PREEMPTED_EXIT_CODE, which this module cannot import


def _starting_train(argv: list[str], orig_argv: list[str]) -> bool:
    """Whether this process is ``python -m torchfold train ...`` or ``torchfold train ...``, importing torchfold.

    >>> _starting_train(["-m", "train", "--trace", "8"], ["python", "-u", "-m", "torchfold", "train"])
    True
    >>> _starting_train(["-m", "trace", "check"], ["python", "-m", "torchfold", "trace", "check"])
    False
    >>> _starting_train(["/venv/bin/torchfold", "train"], ["python", "/venv/bin/torchfold", "train"])
    True
    >>> _starting_train(["-m", "train"], ["python", "-m", "other", "train"])
    False
    """
    if len(argv) < 2 or argv[1] != "train":
        return False
    if argv[0] == "-m":  # runpy imports the package first: sys.argv[0] says "-m" meanwhile
        module = next((orig_argv[i + 1] for i, a in enumerate(orig_argv[:-1]) if a == "-m"), None)
        return module == "torchfold"
    return Path(argv[0]).name in ("torchfold", "torchfold.exe")


def _exit(signum: int, frame: object) -> None:
    os.write(2, f"{LINE}\n".encode())
    os._exit(_EXIT_STATUS)


def install() -> None:
    """Handle SIGTERM as described above, if this process starts ``torchfold train`` and SIGTERM
    has its default action (a parent that set it to be ignored keeps that)."""
    if (
        threading.current_thread() is threading.main_thread()
        and _starting_train(sys.argv, getattr(sys, "orig_argv", []))
        and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, _exit)


install()
