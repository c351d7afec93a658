"""The one exception type torchfold raises for graph and apply failures."""

__all__ = ["FoldError"]


class FoldError(Exception):
    """A fold graph could not be recorded, planned or applied.

    The message names the op, the depth and the offending node, and says how to fix it.
    Bad arguments to constructors and functions raise ``ValueError`` / ``TypeError`` instead.
    """
