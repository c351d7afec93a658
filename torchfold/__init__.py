"""torchfold: dynamic batching for PyTorch, and training with a batch size that changes every step.

Record deferred node operations on a :class:`Fold`, then run every group of same-op nodes at
the same depth as one batched call with :meth:`Fold.apply`, or plan them into a picklable
:class:`FoldPlan` that a :class:`torchfold.train.StepLoader` builds in worker processes.

The root holds the engine. Three subpackages load on first use, so ``import torchfold`` stays
light: :mod:`torchfold.train` (traces, loader, optimizer wrapper, trainer, distributed and
elastic training), :mod:`torchfold.examples` (SST, MNIST, example models) and
:mod:`torchfold.cli` (``python -m torchfold``).

Example:
    >>> import torch, torchfold
    >>> class Model(torch.nn.Module):
    ...     def double(self, x):
    ...         return 2 * x
    >>> f = torchfold.Fold()
    >>> a = f.add("double", torch.ones(1, 2))
    >>> f.apply(Model(), [[f.add("double", a)]])
    [tensor([[4., 4.]])]
"""

from __future__ import annotations

# _early_sigterm first, before the engine imports torch: `python -m torchfold train` exits 75 with
# a line on a SIGTERM while it starts (importing it installs the handler in that process only).
from torchfold import _early_sigterm, engine  # noqa: F401
from torchfold._deprecation import moved_names
from torchfold._version import __version__
from torchfold.engine import *  # noqa: F403 (the root holds the engine's public names)

_SUBPACKAGES = ("cli", "examples", "train")

__all__ = ["__version__", *engine.__all__, *_SUBPACKAGES]

# Names that moved in 0.2: the old spelling still works, warning once with the new one.
_MOVED = {
    # torch.nn.Unfold is another thing: the eager twin is EagerFold
    "Unfold": ("torchfold.engine.eager", "EagerFold", "torchfold.EagerFold"),
    "UnfoldNode": ("torchfold.engine.eager", "EagerNode", "torchfold.EagerNode"),
    "datasets": ("torchfold.examples", "datasets", "torchfold.examples.datasets"),
    "models": ("torchfold.examples", "models", "torchfold.examples.models"),
    **{
        name: ("torchfold.train", name, f"torchfold.train.{name}")
        for name in (
            "AccumulatingOptimizer",
            "BatchSizeTrace",
            "ElasticConfig",
            "Minibatch",
            "Prefetcher",
            "Step",
            "StepLoader",
            "TraceBatchSampler",
            "TraceTrainer",
            "init_distributed",
        )
    },
}
# PEP 562: the subpackages load on first use, and moved names resolve with one warning.
__getattr__ = moved_names("torchfold", _MOVED, since="torchfold 0.2", lazy=_SUBPACKAGES)


def __dir__() -> list[str]:
    return sorted([*globals(), *_SUBPACKAGES])
