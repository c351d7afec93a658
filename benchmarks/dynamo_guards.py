"""Does TorchDynamo follow each kind of value a step reads? A probe, not a timing.

Each case compiles a small function of a module and an input with ``torch.compile(backend=
"aot_eager")``, calls it once, changes a value the function reads, and compares the compiled
call with the eager one: a class attribute, a numpy scalar, an attribute first set after the
first call, a global first assigned after it, an activation function swapped in an attribute,
and a tensor attribute the function rebinds at every call (a running statistic). Prints the
torch version and, per case, whether the compiled call followed (``True``) or replayed the old
value (``False``).

Usage (each environment: the XLA one pins torch 2.9)::

    .venv/bin/python benchmarks/dynamo_guards.py
    .venv-xla/bin/python benchmarks/dynamo_guards.py
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch


class _Model(torch.nn.Module):
    scale = 2.0  # a class attribute

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))
        self.np_scale = np.float64(2.0)
        self.act: Callable[[torch.Tensor], torch.Tensor] = torch.tanh
        self.center = torch.zeros(3)


def _class_attribute(m: Any, x: torch.Tensor) -> torch.Tensor:
    return (m.w * x * m.scale).sum()


def _numpy_scalar(m: Any, x: torch.Tensor) -> torch.Tensor:
    return (m.w * x * float(m.np_scale)).sum()


def _late_attribute(m: Any, x: torch.Tensor) -> torch.Tensor:
    return (m.w * x * getattr(m, "temperature", 1.0)).sum()


def _late_global(m: Any, x: torch.Tensor) -> torch.Tensor:
    return (m.w * x * globals().get("LATE", 1.0)).sum()


def _swapped_function(m: Any, x: torch.Tensor) -> torch.Tensor:
    return m.act(m.w * x - 2).sum()


def _rebound_tensor(m: Any, x: torch.Tensor) -> torch.Tensor:
    m.center = 0.5 * m.center + 0.5 * (m.w * x).detach()
    return (m.w * x - m.center).sum()


def _set_late_global(m: Any) -> None:
    globals()["LATE"] = 4.0


CASES: dict[str, tuple[Callable[..., torch.Tensor], Callable[[Any], None]]] = {
    "class attribute": (_class_attribute, lambda m: setattr(_Model, "scale", 4.0)),
    "numpy scalar": (_numpy_scalar, lambda m: setattr(m, "np_scale", np.float64(4.0))),
    "attribute set later": (_late_attribute, lambda m: setattr(m, "temperature", 4.0)),
    "global assigned later": (_late_global, _set_late_global),
    "swapped activation": (_swapped_function, lambda m: setattr(m, "act", torch.relu)),
    "rebound tensor attribute": (_rebound_tensor, lambda m: None),
}


def follows(function: Callable[..., torch.Tensor], change: Callable[[Any], None]) -> bool:
    """Whether the compiled ``function`` gives the eager result after ``change``."""
    torch._dynamo.reset()
    _Model.scale = 2.0
    globals().pop("LATE", None)
    compiled, eager = _Model(), _Model()
    x = torch.ones(3)
    step = torch.compile(function, backend="aot_eager")
    step(compiled, x)
    function(eager, x)
    change(compiled)
    change(eager)
    return bool(torch.allclose(step(compiled, x), function(eager, x)))


def main() -> None:
    print(f"torch {torch.__version__}")
    for name, (function, change) in CASES.items():
        print(f"  {name}: {follows(function, change)}")


if __name__ == "__main__":
    main()
