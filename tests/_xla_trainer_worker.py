"""TraceTrainer on XLA devices (torch_xla's CPU backend) for tests/test_xla.py.

``python tests/_xla_trainer_worker.py OUT.pt`` trains the SST Tree-LSTM with one replica per
XLA CPU device (``CPU_NUM_DEVICES``, through ``xmp.spawn``) on a batch-size trace whose steps
give the replicas different numbers of minibatches (one of them none), with static-shape plans;
it saves each replica's final parameters and its XLA compilations per step. ``train_on_cpu``
is the single-process reference. It must start in a fresh process (``xmp.spawn`` needs an
uninitialized runtime).
"""

from __future__ import annotations

import copy
import sys
import traceback
from typing import Any

import torch

MINIBATCH = 4
# Repeated once, so the second half of the steps has the minibatch counts of the first: no new graph
TRACE = [8, 16, 4, 12] * 2
DIMS = (8, 8)


def _data() -> tuple[list[Any], Any]:
    from torchfold.examples.datasets import Vocab, load_sst

    trees = load_sst(split="train", max_trees=sum(TRACE))
    return trees, Vocab.build(trees)


def _setup() -> tuple[list[Any], Any, torch.nn.Module]:
    """Data and the initial model (seeded: call it outside replica threads, which share the generator)."""
    from torchfold.examples.models import TreeLSTM

    trees, vocab = _data()
    torch.manual_seed(0)
    return trees, vocab, TreeLSTM(len(vocab), *DIMS)


def _trainer(model: torch.nn.Module, trees: list[Any], build: Any, world_size: int, rank: int) -> Any:
    from torchfold.examples.models import tree_lstm_loss
    from torchfold.train import AccumulatingOptimizer, StepLoader, TraceTrainer

    optimizer = AccumulatingOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), lr_rule="linear", ref_batch_size=8
    )
    loader = StepLoader(
        trees, MINIBATCH, build=build, trace=TRACE, seed=3, replication_factor=world_size, rank=rank
    )
    return TraceTrainer(model, optimizer, loader, tree_lstm_loss, progress=False)


def train_on_cpu() -> list[torch.Tensor]:
    from torchfold.examples.models import TreeLSTMBuild

    trees, vocab, model = _setup()
    _trainer(model, trees, TreeLSTMBuild(vocab), 1, 0).fit()
    return [p.detach().clone() for p in model.parameters()]


def _replica(index: int, out: str, initial: torch.nn.Module) -> None:
    import torch_xla
    import torch_xla.debug.metrics as met
    import torch_xla.runtime as xr

    from torchfold import StaticShapes
    from torchfold.examples.models import TreeLSTMBuild

    try:
        world_size, rank = xr.world_size(), xr.global_ordinal()
        trees, vocab = _data()
        # The replicas are threads sharing one global CPU generator here, so a model seeded in each
        # could differ; every replica starts from a copy of the one made before xmp.spawn
        model = copy.deepcopy(initial)
        shapes = StaticShapes()
        for start in range(0, len(trees), MINIBATCH):  # fitted on the host: the same on every replica
            shapes.fit(TreeLSTMBuild(vocab)(trees[start : start + MINIBATCH])[0])  # type: ignore[arg-type]
        model = model.to(torch_xla.device())
        compilations: list[int] = []

        def count(_: Any) -> None:
            data = met.metric_data("CompileTime")
            compilations.append(0 if data is None else int(data[0]))

        trainer = _trainer(model, trees, TreeLSTMBuild(vocab, shapes=shapes), world_size, rank)
        trainer.on_step = count
        stats = trainer.fit()
        torch.save(
            {
                "world_size": world_size,
                "rank": rank,
                "params": [p.detach().cpu() for p in model.parameters()],
                "compilations": compilations,
                "local_minibatches": [s.local_minibatches for s in stats],
                "seconds": [s.seconds for s in stats],  # each step's, all-reduce wait included
                "envelope_versions": shapes.version,
            },
            f"{out}.rank{rank}",
        )
    except BaseException:
        traceback.print_exc()  # a replica's error would otherwise surface only as the others' timeout
        sys.stderr.flush()
        raise


if __name__ == "__main__":
    import torch_xla.distributed.xla_multiprocessing as xmp

    xmp.spawn(_replica, args=(sys.argv[1], _setup()[2]))
