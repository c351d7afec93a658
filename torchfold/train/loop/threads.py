"""How many intra-op CPU threads a training process uses: one rule, for the trainer and the command line.

A fold's operations are many and small (a batched op per tree depth), so an intra-op pool of
many threads mostly wakes and waits, and a machine's processes (``torchrun``'s ranks, each with
its fold workers) would oversubscribe its cores. So a training process runs
:data:`DEFAULT_THREADS` intra-op thread unless the user chose: ``num_threads=`` (the command
line's ``--threads``), an environment variable the thread pools read (:data:`THREAD_ENV_VARS`),
or a ``torch.set_num_threads()`` call before the run. The fold workers
(:class:`~torchfold.train.StepLoader`'s ``num_workers``) run one thread each: PyTorch's
DataLoader sets that in every worker it starts.
"""

from __future__ import annotations

import os

import torch

__all__ = ["DEFAULT_THREADS", "THREAD_ENV_VARS", "set_intra_op_threads"]

#: intra-op threads of a training process whose user chose none
DEFAULT_THREADS = 1

#: environment variables that set the intra-op thread count (a user's choice, kept)
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

# What the process had when torchfold was imported, and what this module set since: a count
# other than these was set by the user.
_AT_IMPORT = torch.get_num_threads()
_ours: int | None = None
_said: str | None = None  # the last line said


def set_intra_op_threads(num_threads: int | None = None) -> str | None:
    """Set this process's intra-op thread count by the rule (see the module); says what it did, once.

    Args:
        num_threads: the count to use; ``None``: keep the user's choice (an environment variable,
            or ``torch.set_num_threads`` called before), else :data:`DEFAULT_THREADS`.

    Returns:
        one line saying the count and where it came from, or ``None`` where the process has
        been told that line already (a second trainer, a second ``fit``).

    >>> n = torch.get_num_threads()
    >>> set_intra_op_threads(n) == f"{n} intra-op CPU thread(s) per process (num_threads={n})"
    True
    >>> set_intra_op_threads(n) is None  # said already
    True
    """
    global _said
    line = _rule(num_threads)
    if line == _said:
        return None
    _said = line
    return line


def _rule(num_threads: int | None) -> str:
    global _ours
    if num_threads is not None:
        torch.set_num_threads(num_threads)
        _ours = num_threads
        return f"{num_threads} intra-op CPU thread(s) per process (num_threads={num_threads})"
    current = torch.get_num_threads()
    named = [name for name in THREAD_ENV_VARS if os.environ.get(name, "").strip()]
    if named:
        return f"{current} intra-op CPU thread(s) per process (kept: {named[0]} is set)"
    if current not in (_AT_IMPORT, _ours):
        return f"{current} intra-op CPU thread(s) per process (kept: torch.set_num_threads was called)"
    torch.set_num_threads(DEFAULT_THREADS)
    _ours = DEFAULT_THREADS
    return (
        f"{DEFAULT_THREADS} intra-op CPU thread(s) per process, torchfold's default for a fold's small "
        "ops; choose with num_threads=, OMP_NUM_THREADS or torch.set_num_threads()"
    )
