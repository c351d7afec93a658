"""How a training step runs: eagerly, or captured once and replayed (:class:`StepRunner`).

:func:`step_runner` picks one mechanism from the device, the world, the optimizer and
``compile=``; the trainer calls its :meth:`~StepRunner.minibatch` and :meth:`~StepRunner.update`
and nothing else.

The package's names load on first use, each from its own module: importing one runner does
not import the others' mechanisms.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_HOME = {
    "CudaRunner": "runner",
    "EagerRunner": "runner",
    "StepRunner": "runner",
    "XlaRunner": "runner",
    "step_runner": "runner",
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
