"""Captured training steps on XLA devices (torch_xla's CPU backend) for tests/test_xla.py.

``python tests/_xla_compiled_worker.py SST_DIR OUT`` trains the SST Tree-LSTM with captured steps
(``TraceTrainer(compile="on")``, torch.compile's ``openxla`` backend) with one replica per XLA CPU
device (``CPU_NUM_DEVICES``, through ``xmp.spawn``), on a 32-step batch-size trace whose steps give
the replicas varying numbers of minibatches. (Several CPU devices are threads of one process, where
the trainer runs the steps lazily instead, and says so.) Each replica trains twice: straight through, writing
a checkpoint at step 16, and again from that checkpoint in a fresh trainer; it saves both final
parameters, its XLA compilations after every step and its capture count. ``train_on_cpu`` is the
one-process eager reference. It must start in a fresh process (``xmp.spawn`` needs an
uninitialized runtime).
"""

from __future__ import annotations

import copy
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

MINIBATCH = 4
TRACE = [8, 16, 4, 12] * 8  # 32 steps: 2, 4, 1, 3 minibatches in all (a replica of two may have none)
CHECKPOINT_STEP = 16
DIMS = (8, 8)


def _data(sst: str) -> tuple[list[Any], Any]:
    from torchfold.examples.datasets import Vocab, load_sst

    trees = load_sst(sst, split="train", max_trees=sum(TRACE[:4]) * 2)
    return trees, Vocab.build(trees)


def _model(vocab: Any) -> torch.nn.Module:
    from torchfold.examples.models import TreeLSTM

    torch.manual_seed(0)
    return TreeLSTM(len(vocab), *DIMS)


def _trainer(
    model: torch.nn.Module,
    trees: list[Any],
    build: Any,
    world_size: int,
    rank: int,
    compile: str,
    **kwargs: Any,
) -> Any:
    from torchfold.examples.models import tree_lstm_loss
    from torchfold.train import AccumulatingOptimizer, StepLoader, TraceTrainer

    optimizer = AccumulatingOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), lr_rule="linear", ref_batch_size=8
    )
    loader = StepLoader(
        trees, MINIBATCH, build=build, trace=TRACE, seed=3, replication_factor=world_size, rank=rank
    )
    return TraceTrainer(model, optimizer, loader, tree_lstm_loss, progress=False, compile=compile, **kwargs)


def train_on_cpu(sst: str) -> list[torch.Tensor]:
    """The reference: one process, eager, unpadded plans."""
    from torchfold.examples.models import TreeLSTMBuild

    trees, vocab = _data(sst)
    model = _model(vocab)
    _trainer(model, trees, TreeLSTMBuild(vocab), 1, 0, "off").fit(max_steps=len(TRACE))
    return [p.detach().clone() for p in model.parameters()]


def _replica(index: int, sst: str, out: str, initial: torch.nn.Module) -> None:
    import torch_xla
    import torch_xla.debug.metrics as met
    import torch_xla.runtime as xr

    from torchfold import StaticShapes
    from torchfold.examples.models import TreeLSTMBuild
    from torchfold.train.checkpoint import checkpoint_path

    try:
        world_size, rank = xr.world_size(), xr.global_ordinal()
        trees, vocab = _data(sst)
        shapes = StaticShapes()
        for start in range(0, len(trees), MINIBATCH):  # fitted on the host: the same on every replica
            shapes.fit(TreeLSTMBuild(vocab)(trees[start : start + MINIBATCH])[0])  # type: ignore[arg-type]
        device = torch_xla.device()
        compilations: list[int] = []

        def count(_: Any) -> None:
            data = met.metric_data("CompileTime")
            compilations.append(0 if data is None else int(data[0]))

        # One replica: a checkpoint mid-run, and a resume from it. (Checkpoints of several torch_xla
        # replicas hold only rank 0's generator states: they cannot be resumed yet.)
        checkpoints = Path(f"{out}.checkpoints") if world_size == 1 else None

        def captured(**kwargs: Any) -> Any:
            """A trainer with captured steps on a fresh copy of the initial model, its own envelope copy."""
            model = copy.deepcopy(initial).to(device)
            build = TreeLSTMBuild(vocab, shapes=copy.deepcopy(shapes))
            return _trainer(model, trees, build, world_size, rank, "on", **kwargs)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = captured(
                checkpoint_dir=checkpoints, checkpoint_every=CHECKPOINT_STEP, keep_checkpoints=10
            )
        trainer.on_step = count
        stats = trainer.fit(max_steps=len(TRACE))
        straight = [p.detach().cpu() for p in trainer.model.parameters()]
        captures = trainer.compiled.captures if trainer.compiled is not None else 0

        resumed_params = None
        if checkpoints is not None:
            resumed = captured()
            resumed.load_checkpoint(checkpoint_path(checkpoints, CHECKPOINT_STEP))
            resumed.fit(max_steps=len(TRACE))
            resumed_params = [p.detach().cpu() for p in resumed.model.parameters()]
        torch.save(
            {
                "world_size": world_size,
                "rank": rank,
                "params": straight,
                "resumed_params": resumed_params,
                "compilations": compilations,
                "captures": captures,
                "warnings": [str(w.message) for w in caught],
                "local_minibatches": [s.local_minibatches for s in stats],
            },
            f"{out}.rank{rank}",
        )
    except BaseException:
        traceback.print_exc()  # a replica's error would otherwise surface only as the others' timeout
        sys.stderr.flush()
        raise


if __name__ == "__main__":
    import torch_xla.distributed.xla_multiprocessing as xmp

    sst_dir, out_path = sys.argv[1], sys.argv[2]
    xmp.spawn(_replica, args=(sst_dir, out_path, _model(_data(sst_dir)[1])))
