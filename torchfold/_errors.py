"""The one exception type torchfold raises for graph and apply failures, and how context joins others."""

import sys

__all__ = ["FoldError", "add_note"]


def add_note(error: BaseException, note: str) -> None:
    """Add where an error happened to it, keeping its type (``except RuntimeError`` still catches it).

    ``error.add_note(note)``; on Python 3.10, which has no ``add_note``, the note goes where 3.11
    keeps notes (``__notes__``): readable, though 3.10's tracebacks do not print it.
    """
    if sys.version_info >= (3, 11):
        error.add_note(note)
    else:
        error.__notes__ = [*getattr(error, "__notes__", []), note]  # type: ignore[attr-defined]


class FoldError(Exception):
    """A fold graph could not be recorded, planned or applied.

    The message names the op, the depth and the offending node, and says how to fix it.
    Bad arguments to constructors and functions raise ``ValueError`` / ``TypeError`` instead.
    """
