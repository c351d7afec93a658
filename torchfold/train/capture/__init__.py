"""How a training step runs: eagerly, or captured once and replayed (:class:`StepRunner`).

:class:`StepMechanism` picks one mechanism from the device, the world, the optimizer and
``compile=`` (and says what the run needs around it: static shapes, the optimizer's options);
the trainer calls its runner's :meth:`~StepRunner.run_minibatch` and :meth:`~StepRunner.update` and
nothing else. Above this package, only :class:`StepMechanism`, :class:`StepRunner`,
:func:`step_runner`, :func:`captured_step` and :class:`CapturedStep` are used.

The package's names load on first use, each from its own module: importing one runner does
not import the others' mechanisms.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchfold.train.capture.mechanism import StepMechanism, step_runner
    from torchfold.train.capture.runner import CudaRunner, EagerRunner, StepRunner, XlaRunner
    from torchfold.train.capture.step import CapturedStep, captured_step
    from torchfold.train.capture.xla_programs import XlaPrograms, xla_programs_unavailable

__all__ = [
    "CapturedStep",
    "CudaRunner",
    "EagerRunner",
    "StepMechanism",
    "StepRunner",
    "XlaPrograms",
    "XlaRunner",
    "captured_step",
    "step_runner",
    "xla_programs_unavailable",
]

_HOME = {
    "CudaRunner": "runner",
    "EagerRunner": "runner",
    "StepRunner": "runner",
    "XlaRunner": "runner",
    "StepMechanism": "mechanism",
    "step_runner": "mechanism",
    "CapturedStep": "step",
    "captured_step": "step",
    "XlaPrograms": "xla_programs",
    "xla_programs_unavailable": "xla_programs",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
