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

import os as _os
import signal as _signal
import sys as _sys
import threading as _threading

# -- SIGTERM while `python -m torchfold train` starts ---------------------------------------------
# NOTE: `python -m torchfold` imports this package, and with it torch (about a second), before any
# code of the command line runs: a scheduler's SIGTERM then killed the run without a word (status
# 143), where the command promises status 75 and a line. So, before the engine imports torch, a
# process started as `python -m torchfold train` or `torchfold train` (and no other) handles
# SIGTERM until the command installs its own (torchfold.train.loop.preemption.terminated_on_sigterm):
# nothing has started yet, so it writes the line and exits at once.

_EARLY_SIGTERM_LINE = (
    "torchfold train: SIGTERM received before training started: stopped (nothing was written); run the same "
    "command again to start, or to resume from the newest checkpoint"
)


def _starting_train(argv: list[str], orig_argv: list[str]) -> bool:
    """Whether this process is ``python -m torchfold train ...`` or ``torchfold train ...``, importing torchfold.

    >>> _starting_train(["-m", "train", "--trace", "8"], ["python", "-u", "-m", "torchfold", "train"])
    True
    >>> _starting_train(["-m", "trace", "check"], ["python", "-m", "torchfold", "trace", "check"])
    False
    >>> _starting_train(["/venv/bin/torchfold", "train"], ["python", "/venv/bin/torchfold", "train"])
    True
    >>> _starting_train(["-m", "train"], ["python", "-m", "other", "train"])
    False
    """
    if len(argv) < 2 or argv[1] != "train":
        return False
    if argv[0] == "-m":  # runpy imports the package first: sys.argv[0] says "-m" meanwhile
        module = next((orig_argv[i + 1] for i, a in enumerate(orig_argv[:-1]) if a == "-m"), None)
        return module == "torchfold"
    return _os.path.basename(argv[0]) in ("torchfold", "torchfold.exe")


def _exit_on_early_sigterm(signum: int, frame: object) -> None:
    _os.write(2, f"{_EARLY_SIGTERM_LINE}\n".encode())
    _os._exit(75)  # torchfold.train.PREEMPTED_EXIT_CODE (this must not import torch)


if (
    _threading.current_thread() is _threading.main_thread()
    and _starting_train(_sys.argv, getattr(_sys, "orig_argv", []))
    and _signal.getsignal(_signal.SIGTERM) is _signal.SIG_DFL  # a parent's SIG_IGN stays
):
    _signal.signal(_signal.SIGTERM, _exit_on_early_sigterm)

from torchfold import engine  # noqa: E402
from torchfold._deprecation import moved_names  # noqa: E402
from torchfold._version import __version__  # noqa: E402
from torchfold.engine import *  # noqa: E402, F403 (the root holds the engine's public names)

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
