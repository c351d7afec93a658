"""torchfold: dynamic batching for PyTorch, and training with a batch size that changes every step.

Record deferred node operations on a :class:`Fold`, then run every group of same-op nodes at
the same depth as one batched call with :meth:`Fold.apply`, or compile them to a picklable
:class:`FoldPlan` that a :class:`StepLoader` builds in worker processes. The training half
(traces, loader, optimizer wrapper, loop, distributed helpers) lives in :mod:`torchfold.train`;
the example models and data in :mod:`torchfold.models` and :mod:`torchfold.datasets`.
"""

from torchfold import datasets, models, train
from torchfold._compile import FoldPlan
from torchfold._errors import FoldError
from torchfold._fold import Fold
from torchfold._node import Node
from torchfold._prefetch import Prefetcher
from torchfold._static import StaticPlan, StaticShapes, StaticShapesWarning
from torchfold._unfold import Unfold, UnfoldNode
from torchfold._version import __version__

# The training names users call most, also at the root (the rest: torchfold.train).
from torchfold.train import (
    AccumulatingOptimizer,
    BatchSizeTrace,
    ElasticConfig,
    Minibatch,
    Step,
    StepLoader,
    TraceBatchSampler,
    TraceTrainer,
    init_distributed,
)

__all__ = [
    "AccumulatingOptimizer",
    "BatchSizeTrace",
    "ElasticConfig",
    "Fold",
    "FoldError",
    "FoldPlan",
    "Minibatch",
    "Node",
    "Prefetcher",
    "StaticPlan",
    "StaticShapes",
    "StaticShapesWarning",
    "Step",
    "StepLoader",
    "TraceBatchSampler",
    "TraceTrainer",
    "Unfold",
    "UnfoldNode",
    "__version__",
    "datasets",
    "init_distributed",
    "models",
    "train",
]
