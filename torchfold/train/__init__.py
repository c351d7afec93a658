"""The training half of torchfold: batch-size traces, the step loader, the optimizer wrapper, the loop.

Everything for training with a global batch size that changes every step, on one process or
many (``torchrun``), in one namespace; the engine (``Fold``, ``FoldPlan``) is at the root.

>>> import torchfold.train as tt
>>> loader = tt.StepLoader(list(range(10)), minibatch_size=2, trace=[4, 6], shuffle=False)
>>> [[mb.indices for mb in step] for step in loader]
[[[0, 1], [2, 3]], [[4, 5], [6, 7], [8, 9]]]
"""

from torchfold._deprecation import moved_names
from torchfold.train.capture import CapturedStep, StepMechanism, captured_step
from torchfold.train.data.envelope import fit_static_shapes
from torchfold.train.data.loader import Minibatch, Step, StepLoader, to_device
from torchfold.train.data.prefetch import Prefetcher
from torchfold.train.data.sampler import StepSplit, TraceBatchSampler
from torchfold.train.distributed.elastic import ElasticConfig
from torchfold.train.distributed.world import (
    RunContext,
    World,
    all_reduce_sum_,
    broadcast_parameters,
    check_same_on_all_ranks,
    default_device,
    fingerprint,
    init_distributed,
    is_main_process,
    run_context,
    world,
)
from torchfold.train.distributed.world import (
    get_rank as get_rank,  # deprecated: world().rank
)
from torchfold.train.distributed.world import (
    get_world_size as get_world_size,  # deprecated: world().size
)
from torchfold.train.loop.preemption import PREEMPTED_EXIT_CODE, Preempted
from torchfold.train.loop.trainer import PlanLoss, StepStats, TraceTrainer
from torchfold.train.optim.lr import scaled_lr
from torchfold.train.optim.optimizer import AccumulatingOptimizer
from torchfold.train.schedule.trace import BatchSizeTrace, EpochSteps, as_trace
from torchfold.train.task import BUILTIN_TASKS, Task, load_task

__all__ = [
    "BUILTIN_TASKS",
    "PREEMPTED_EXIT_CODE",
    "AccumulatingOptimizer",
    "BatchSizeTrace",
    "CapturedStep",
    "ElasticConfig",
    "EpochSteps",
    "Minibatch",
    "PlanLoss",
    "Preempted",
    "Prefetcher",
    "RunContext",
    "Step",
    "StepLoader",
    "StepMechanism",
    "StepSplit",
    "StepStats",
    "Task",
    "TraceBatchSampler",
    "TraceTrainer",
    "World",
    "all_reduce_sum_",
    "as_trace",
    "broadcast_parameters",
    "captured_step",
    "check_same_on_all_ranks",
    "default_device",
    "fingerprint",
    "fit_static_shapes",
    "init_distributed",
    "is_main_process",
    "load_task",
    "run_context",
    "scaled_lr",
    "to_device",
    "world",
]


# Names that were renamed (in torchfold a plan is a compiled fold): the old spelling still works,
# warning once with the new one.
__getattr__ = moved_names(
    "torchfold.train",
    {"StepPlan": ("torchfold.train.data.sampler", "StepSplit", "torchfold.train.StepSplit")},
)
