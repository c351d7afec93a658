"""torchfold: dynamic batching for PyTorch, and training with a batch size that changes every step.

Record deferred node operations on a :class:`Fold`, then run every group of same-op nodes at
the same depth as one batched call with :meth:`Fold.apply`.
"""

from torchfold import datasets, models
from torchfold._compile import FoldPlan
from torchfold._distributed import (
    all_reduce_sum_,
    broadcast_parameters,
    check_same_on_all_ranks,
    default_device,
    fingerprint,
    get_rank,
    get_world_size,
    init_distributed,
    is_main_process,
)
from torchfold._elastic import ElasticConfig
from torchfold._errors import FoldError
from torchfold._fold import Fold
from torchfold._loader import Minibatch, Step, StepLoader
from torchfold._loop import StepStats, TraceTrainer, TreeLSTMLoss
from torchfold._node import Node
from torchfold._optim import AccumulatingOptimizer
from torchfold._prefetch import Prefetcher
from torchfold._sampler import StepPlan, TraceBatchSampler
from torchfold._trace import BatchSizeTrace, EpochSteps, as_trace, scaled_lr
from torchfold._unfold import Unfold, UnfoldNode
from torchfold._version import __version__

__all__ = [
    "AccumulatingOptimizer",
    "BatchSizeTrace",
    "ElasticConfig",
    "EpochSteps",
    "Fold",
    "FoldError",
    "FoldPlan",
    "Minibatch",
    "Node",
    "Prefetcher",
    "Step",
    "StepLoader",
    "StepPlan",
    "StepStats",
    "TraceBatchSampler",
    "TraceTrainer",
    "TreeLSTMLoss",
    "Unfold",
    "UnfoldNode",
    "__version__",
    "all_reduce_sum_",
    "as_trace",
    "broadcast_parameters",
    "check_same_on_all_ranks",
    "datasets",
    "default_device",
    "fingerprint",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_main_process",
    "models",
    "scaled_lr",
]
