"""The random number generators a training run draws from, and the one rule for each: seed, save, restore, check.

A run draws from torch's generator (the CPU's, and every CUDA device's), Python's ``random``,
NumPy's global generator and, on an XLA device, that device's seed. Each is one entry of the
table below, with how to seed it, capture its state, restore it and check a state read from a
file; everything that touches the generators goes through this module:

* :func:`seed_generators` seeds them all from one int (the trainer's ``seed=``, before every
  minibatch, from :func:`derived_seed` of the seed, the step and the minibatch's position);
* :func:`rng_state` captures their states as tensors and plain containers (so a checkpoint loads
  with ``weights_only=True``), :func:`set_rng_state` restores them, and
  :func:`rng_state_problem` says what is wrong with a state read from a file before any
  generator has been touched.

>>> seed_generators(derived_seed(0, step=5, position=1))
>>> state = rng_state()
>>> a = torch.rand(2)
>>> set_rng_state(state)
>>> torch.equal(a, torch.rand(2))
True
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from torchfold._validate import brief
from torchfold.train.distributed.devices import is_xla

__all__ = ["derived_seed", "rng_state", "rng_state_problem", "seed_generators", "set_rng_state"]


def derived_seed(seed: int, step: int, position: int) -> int:
    """A seed in ``[0, 2**63)`` mixed from three ints (NumPy's ``SeedSequence``: nearby inputs, unrelated seeds).

    >>> derived_seed(0, 5, 1) == derived_seed(0, 5, 1) != derived_seed(0, 5, 2)
    True
    """
    return int(np.random.SeedSequence([seed, step, position]).generate_state(1, np.uint64)[0] >> np.uint64(1))


@dataclass(frozen=True)
class _Generator:
    """One generator: its key in a state, and how to seed it, capture, restore and check its state.

    ``device`` is the run's device (``None``: the host's generators only); ``get`` returns ``None``
    where the generator is not in use (nothing to save), ``set`` skips a state it cannot apply here.
    """

    name: str
    required: bool  # every state holds it (states of older torchfold versions too)
    seed: Callable[[int, torch.device | None], None]
    get: Callable[[torch.device | None], Any]
    set: Callable[[Any, torch.device | None], None]
    problem: Callable[[Any], str | None]


def _on_xla(device: torch.device | None) -> bool:
    return device is not None and is_xla(device)


# -- torch (CPU) --


def _torch_seed(seed: int, device: torch.device | None) -> None:
    torch.manual_seed(seed)  # also every CUDA device: the "cuda" entry needs no seeding of its own


def _torch_problem(saved: Any) -> str | None:
    expected = torch.get_rng_state()
    if not isinstance(saved, torch.Tensor) or saved.dtype != expected.dtype or saved.shape != expected.shape:
        return f"'torch' should be a {expected.dtype} tensor of shape {tuple(expected.shape)}, got {brief(saved)}"
    try:
        torch.Generator().set_state(saved.cpu())  # a throwaway generator: the process's own is untouched
    except RuntimeError as e:
        return f"'torch' is not a state of torch's generator ({' '.join(str(e).split())[:100]})"
    return None


# -- CUDA --


def _cuda_get(device: torch.device | None) -> Any:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.get_rng_state_all()
    return None


def _cuda_set(saved: Any, device: torch.device | None) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved)


def _cuda_problem(saved: Any) -> str | None:
    if not isinstance(saved, list) or not all(isinstance(t, torch.Tensor) for t in saved):
        return f"'cuda' should be a list of tensors (one per device), got {brief(saved)}"
    return None


# -- Python's random --


def _python_get(device: torch.device | None) -> Any:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _python_set(saved: Any, device: torch.device | None) -> None:
    version, internal, gauss = saved
    random.setstate((version, tuple(internal), gauss))


def _python_problem(saved: Any) -> str | None:
    try:
        version, internal, gauss = saved
        random.Random().setstate((version, tuple(internal), gauss))
    except (TypeError, ValueError) as e:
        return f"'python' is not a state of Python's random module ({e}), got {brief(saved)}"
    return None


# -- NumPy's global generator --


def _numpy_get(device: torch.device | None) -> Any:
    name, keys, pos, has_gauss, cached = cast(tuple[Any, ...], np.random.get_state(legacy=True))
    return [name, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(cached)]


def _numpy_state(saved: Any) -> tuple[Any, ...]:
    name, keys, pos, has_gauss, cached = saved
    return (name, keys.numpy().astype(np.uint32), pos, has_gauss, cached)


def _numpy_problem(saved: Any) -> str | None:
    try:
        np.random.RandomState().set_state(_numpy_state(saved))
    except (AttributeError, IndexError, TypeError, ValueError) as e:
        return f"'numpy' is not a state of NumPy's global generator ({e}), got {brief(saved)}"
    return None


# -- an XLA device's seed --


def _xla_seed(seed: int, device: torch.device | None) -> None:
    if _on_xla(device):
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(seed, device=device)


def _xla_get(device: torch.device | None) -> Any:
    if not _on_xla(device):
        return None
    import torch_xla.core.xla_model as xm

    return int(xm.get_rng_state(device=device))


def _xla_problem(saved: Any) -> str | None:
    if not isinstance(saved, int) or isinstance(saved, bool):
        return f"'xla' should be an int (an XLA device's seed), got {brief(saved)}"
    return None


_GENERATORS = (
    _Generator(
        "torch",
        required=True,
        seed=_torch_seed,
        get=lambda device: torch.get_rng_state(),
        set=lambda saved, device: torch.set_rng_state(saved),
        problem=_torch_problem,
    ),
    _Generator(
        "cuda",
        required=False,
        seed=lambda seed, device: None,  # torch.manual_seed seeded it
        get=_cuda_get,
        set=_cuda_set,
        problem=_cuda_problem,
    ),
    _Generator(
        "python",
        required=True,
        seed=lambda seed, device: random.seed(seed),
        get=_python_get,
        set=_python_set,
        problem=_python_problem,
    ),
    _Generator(
        "numpy",
        required=False,
        seed=lambda seed, device: np.random.seed(seed % 2**32),
        get=_numpy_get,
        set=lambda saved, device: np.random.set_state(_numpy_state(saved)),
        problem=_numpy_problem,
    ),
    _Generator(
        "xla",
        required=False,
        seed=_xla_seed,
        get=_xla_get,
        set=_xla_seed,  # an XLA device's state is its seed
        problem=_xla_problem,
    ),
)


def seed_generators(seed: int, device: torch.device | None = None) -> None:
    """Seed every generator this process draws from: torch (CPU and CUDA), Python, NumPy, and an XLA ``device``."""
    for generator in _GENERATORS:
        generator.seed(seed, device)


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """The states of torch's, CUDA's (if initialized), Python's and NumPy's generators, and an XLA ``device``'s seed.

    Only tensors and plain containers, so it can go into a checkpoint.

    >>> state = rng_state()
    >>> a = torch.rand(2)
    >>> set_rng_state(state)
    >>> torch.equal(a, torch.rand(2))
    True
    """
    states = {generator.name: generator.get(device) for generator in _GENERATORS}
    return {name: state for name, state in states.items() if state is not None}


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Restore generator states captured by :func:`rng_state` (those present in ``state``; the XLA
    seed on ``device``)."""
    for generator in _GENERATORS:
        if generator.name in state:
            generator.set(state[generator.name], device)


def rng_state_problem(state: object) -> str | None:
    """What is wrong with one process's :func:`rng_state` as read from a file, or ``None``.

    Each generator's state is tried on a throwaway generator, so a bad one is found before any
    of the process's own generators (or the model) has been changed.

    >>> rng_state_problem(rng_state()) is None
    True
    >>> rng_state_problem({"torch": 0})
    "expected a dict with 'torch' and 'python' entries, got {'torch': 0}"
    """
    required = [generator.name for generator in _GENERATORS if generator.required]
    if not isinstance(state, dict) or any(name not in state for name in required):
        entries = " and ".join(repr(name) for name in required)
        return f"expected a dict with {entries} entries, got {brief(state)}"
    for generator in _GENERATORS:
        if generator.name in state:
            problem = generator.problem(state[generator.name])
            if problem is not None:
                return problem
    return None
