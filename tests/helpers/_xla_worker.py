"""Training on XLA devices (torch_xla's CPU backend) for tests/train/test_xla.py.

``python tests/helpers/_xla_worker.py OUT.pt`` runs one replica per XLA CPU device (``CPU_NUM_DEVICES``)
through ``xmp.spawn``, each training with AccumulatingOptimizer on its share of every step (the
gradient sum then goes through ``xm.all_reduce``), and saves every replica's final parameters
and LR factors to ``OUT.pt``. It must start in a fresh process: torch_xla's runtime may not be
initialized before ``xmp.spawn``.
"""

from __future__ import annotations

import copy
import os
import sys
import traceback
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_worker import make_model, mnist_rows, train

MINIBATCH = 8
# Global batches of 8 leave one of two replicas without a minibatch.
TRACE = [8, 24, 16, 40, 8, 32]
RULES = ["constant", "linear", "adascale"]


def train_on_xla(
    rule: str, initial: torch.nn.Module, data: tuple[torch.Tensor, torch.Tensor], num_replicas: int, rank: int
) -> dict[str, Any]:
    """Train a copy of ``initial`` as rank ``rank`` of ``num_replicas`` on this thread's XLA device.

    The model is made on the CPU beforehand: ``torch.manual_seed`` also seeds every XLA device,
    and on a replica thread it would wait for the other replicas' devices, which may be waiting
    in an all-reduce for this one.
    """
    import torch_xla

    from torchfold.train.distributed.world import xla_sync

    device = torch_xla.device()
    model = copy.deepcopy(initial).to(device)
    x, y = data
    x, y = x.to(device), y.to(device)
    # Compile the minibatch graph on every replica before training: XLA's CPU collectives give up
    # after 10 s, and a replica compiling its first forward/backward while another already waits
    # in the all-reduce can exceed that on a busy machine.
    warmup = list(range(MINIBATCH))
    torch.nn.functional.cross_entropy(model(x[warmup]), y[warmup]).backward()
    model.zero_grad(set_to_none=True)
    xla_sync()
    result = train(model, rule, (x, y), TRACE, MINIBATCH, num_replicas, rank)
    result["params"] = [p.cpu() for p in result["params"]]
    result["device"] = str(device)
    return result


def _replica(index: int, initial: torch.nn.Module, data: tuple[torch.Tensor, torch.Tensor], out: str) -> None:
    import torch_xla.runtime as xr

    from torchfold.train.distributed.world import world

    world_size, rank = xr.world_size(), xr.global_ordinal()
    assert world() == (world_size, rank, "torch_xla")
    try:
        results = {rule: train_on_xla(rule, initial, data, world_size, rank) for rule in RULES}
    except BaseException:
        # A replica thread's exception would only surface after the others gave up waiting for it.
        traceback.print_exc()
        sys.stderr.flush()
        raise
    torch.save({"world_size": world_size, "rank": rank, "results": results}, f"{out}.rank{rank}")


def main(out: str) -> None:
    import torch_xla.distributed.xla_multiprocessing as xmp

    data = mnist_rows(sum(TRACE))
    xmp.spawn(_replica, args=(make_model(seed=100), data, out))


if __name__ == "__main__":
    main(sys.argv[1])
