"""The C part of recording and planning, where torchfold was built with it.

Installing torchfold compiles the extension ``torchfold.engine._record`` where a C compiler is
found (see ``docs/design/recording.md``). :data:`BUILT` says whether it was; its types and
function are here, or None without it, and the callers then do everything in Python.
``plain_group``'s last argument is a scratch buffer that must be all 0xff bytes; it is left so,
and the planner makes one per plan (``torchfold.engine.planner``).

>>> from torchfold.engine import native
>>> native.BUILT in (True, False)
True
"""

from __future__ import annotations

__all__ = ["BUILT", "SCRATCH_BYTES_PER_SOURCE", "FastAdd", "FastSplit", "Recorder", "plain_group"]

try:
    from torchfold.engine._record import SCRATCH_BYTES_PER_SOURCE, FastAdd, FastSplit, Recorder, plain_group

    #: whether the C part was built (else recording and planning are Python alone)
    BUILT = True
except ImportError:  # built without a C compiler
    FastAdd = FastSplit = Recorder = plain_group = None  # type: ignore[assignment,misc]
    SCRATCH_BYTES_PER_SOURCE = 0
    BUILT = False
