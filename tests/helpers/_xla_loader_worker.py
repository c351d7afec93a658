"""StepLoader defaults on torch_xla replicas, for tests/train/test_xla.py.

``python tests/helpers/_xla_loader_worker.py OUT`` first asks :func:`torchfold.train.world` in the parent
(torch_xla imported, runtime not started: it must answer one process and leave the runtime alone,
or ``xmp.spawn`` would refuse to start), then runs one replica per XLA CPU device
(``CPU_NUM_DEVICES``) through ``xmp.spawn``. Each builds a StepLoader with default
``num_replicas`` and ``rank`` and saves what it read to ``OUT.rankN``.
"""

from __future__ import annotations

import sys

import torch

DATASET = 32  # one epoch: the trace's sum
BATCH = 2
TRACE = [8, 4, 12, 2, 6]


def _replica(index: int, out: str) -> None:
    from torchfold.train import StepLoader, world

    found = world()
    loader = StepLoader(list(range(DATASET)), BATCH, trace=TRACE, seed=3)
    steps = [[mb.indices for mb in step] for step in loader]
    result = {
        "index": index,
        "world": (found.size, found.rank, found.source),
        "loader": (loader.num_replicas, loader.rank),
        "steps": steps,
    }
    torch.save(result, f"{out}.rank{found.rank}")


def main(out: str) -> None:
    import torch_xla
    import torch_xla.distributed.xla_multiprocessing as xmp

    from torchfold.train import world

    assert world().size == 1 and world().rank == 0, world()
    assert not torch_xla._XLAC._xla_runtime_is_initialized(), "world() started the XLA runtime"
    xmp.spawn(_replica, args=(out,))


if __name__ == "__main__":
    main(sys.argv[1])
