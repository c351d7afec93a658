"""How a training step runs: eagerly, or captured once and replayed (:class:`StepRunner`).

:func:`step_runner` picks one mechanism from the device, the world, the optimizer and
``compile=``; the trainer calls its :meth:`~StepRunner.minibatch` and :meth:`~StepRunner.update`
and nothing else.
"""

from torchfold.train.capture.runner import CudaRunner, EagerRunner, StepRunner, XlaRunner, step_runner
from torchfold.train.capture.step import CapturedStep, captured_step
from torchfold.train.capture.xla_programs import XlaPrograms, xla_programs_unavailable

__all__ = [
    "CapturedStep",
    "CudaRunner",
    "EagerRunner",
    "StepRunner",
    "XlaPrograms",
    "XlaRunner",
    "captured_step",
    "step_runner",
    "xla_programs_unavailable",
]
