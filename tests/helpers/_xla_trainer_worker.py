"""TraceTrainer on XLA devices (torch_xla's CPU backend) for tests/train/test_xla.py.

``python tests/helpers/_xla_trainer_worker.py SST_DIR OUT COMPILE STEPS [--fail-rank R] [--optimizer adam]
[--resume DIR]`` trains the SST
Tree-LSTM with static-shape plans, one replica per XLA CPU device (``CPU_NUM_DEVICES``, through
``xmp.spawn``; several CPU devices are threads of one process), for the first ``STEPS`` steps of
a batch-size trace whose steps give the replicas varying numbers of minibatches (a replica of
two may have none). ``COMPILE`` is the trainer's ``compile`` (``on``: steps captured with
torch.compile's ``openxla`` backend; ``off``: lazy). Past 16 steps it also writes a checkpoint
at step 16 and trains again from it in a fresh trainer. Each replica saves its final
parameters, its XLA compilations after every step, its capture counts (torch.compile's, and the
programs its XLA runner replays: minibatch and update programs, 0 without one), why those
replays stopped (if they did) and any warnings; with
``FAIL_RANK``, that replica's loss raises at its third minibatch and every replica saves the
error it stopped with. ``--optimizer adam`` trains with ``Adam(capturable=True)`` instead of SGD
with momentum (both replay on XLA). ``--resume DIR``
trains only from the step-16 checkpoint in ``DIR`` (written by a run on any number of devices)
to ``STEPS``. ``train_on_cpu`` is the one-process eager reference. It must start in a fresh
process (``xmp.spawn`` needs an uninitialized runtime).
"""

from __future__ import annotations

import argparse
import copy
import sys
import threading
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

MINIBATCH = 4
TRACE = [8, 16, 4, 12] * 8  # 32 steps: 2, 4, 1, 3 minibatches in all
CHECKPOINT_STEP = 16
DIMS = (8, 8)
# XLA's compile counter is one per process, and several CPU devices are threads of one process:
# the replicas read it together, after every replica has finished its step (rank 0's checkpoint
# included) and before any starts the next, or one replica's count would take in another's
# compilations a step early or late.
_COUNTING: dict[int, threading.Barrier] = {}
_COUNTING_LOCK = threading.Lock()


def _counting_barrier(world_size: int) -> threading.Barrier:
    with _COUNTING_LOCK:
        return _COUNTING.setdefault(world_size, threading.Barrier(world_size))


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
    steps: int,
    loss: Any = None,
    optimizer: str = "sgd",
    **kwargs: Any,
) -> Any:
    from torchfold.examples.models import tree_lstm_loss
    from torchfold.train import AccumulatingOptimizer, StepLoader, TraceTrainer

    params = model.parameters()
    base = (
        torch.optim.Adam(params, lr=0.01, capturable=next(model.parameters()).device.type == "xla")
        if optimizer == "adam"
        else torch.optim.SGD(params, lr=0.1, momentum=0.9)
    )
    wrapped = AccumulatingOptimizer(base, lr_rule="linear", ref_batch_size=8)
    loader = StepLoader(
        trees, MINIBATCH, build=build, trace=TRACE[:steps], seed=3, num_replicas=world_size, rank=rank
    )
    return TraceTrainer(
        model, wrapped, loader, loss or tree_lstm_loss, progress=False, compile=compile, **kwargs
    )


def train_on_cpu(sst: str, steps: int, optimizer: str = "sgd") -> list[torch.Tensor]:
    """The reference: one process, eager, unpadded plans."""
    from torchfold.examples.models import TreeLSTMBuild

    trees, vocab = _data(sst)
    model = _model(vocab)
    _trainer(model, trees, TreeLSTMBuild(vocab), 1, 0, "off", steps, optimizer=optimizer).fit()
    return [p.detach().clone() for p in model.parameters()]


def _failing_loss(fail_rank: int, rank: int) -> Any:
    """The Tree-LSTM loss, raising at its third call on ``fail_rank``."""
    from torchfold.examples.models import tree_lstm_loss

    calls = [0]

    def loss(model: torch.nn.Module, outputs: list[torch.Tensor], targets: Any) -> torch.Tensor:
        calls[0] += 1
        if rank == fail_rank and calls[0] == 3:
            raise ValueError(f"injected failure on rank {rank}")
        return tree_lstm_loss(model, outputs, targets)

    return loss


def _refused(runner: Any) -> str | None:
    """Why the runner's replays (its minibatch and update programs) stopped; None if they did not,
    or it has none."""
    programs = getattr(runner, "programs", None)
    return None if programs is None else programs.refused


def _replica(index: int, sst: str, out: str, args: argparse.Namespace, initial: Any) -> None:
    import torch_xla
    import torch_xla.debug.metrics as met
    import torch_xla.runtime as xr

    from torchfold import StaticShapes
    from torchfold.examples.models import TreeLSTMBuild
    from torchfold.train.loop.checkpoint import checkpoint_path

    compile, steps, fail_rank = args.compile, args.steps, args.fail_rank
    world_size, rank = xr.world_size(), xr.global_ordinal()
    result: dict[str, Any] = {"world_size": world_size, "rank": rank}
    try:
        trees, vocab = _data(sst)
        shapes = StaticShapes(depth_buckets=False)  # one layout: compilations stop after the warm-up
        for start in range(0, len(trees), MINIBATCH):  # fitted on the host: the same on every replica
            shapes.cover(TreeLSTMBuild(vocab)(trees[start : start + MINIBATCH])[0])  # type: ignore[arg-type]
        device = torch_xla.device()
        compilations: list[int] = []

        together = _counting_barrier(world_size)

        def count(_: Any) -> None:
            together.wait(timeout=600)
            data = met.metric_data("CompileTime")
            compilations.append(0 if data is None else int(data[0]))
            together.wait(timeout=600)

        # A checkpoint mid-run (rank 0 writes it, with every replica's generator states), and a resume from it
        resume = fail_rank is None and steps > CHECKPOINT_STEP
        checkpoints = Path(f"{out}.checkpoints") if resume else None
        loss = None if fail_rank is None else _failing_loss(fail_rank, rank)

        def trainer(**kwargs: Any) -> Any:
            """A trainer on a fresh copy of the initial model (the replicas are threads sharing one
            generator: a model seeded in each could differ), with its own envelope copy."""
            model = copy.deepcopy(initial).to(device)
            build = TreeLSTMBuild(vocab, shapes=copy.deepcopy(shapes))
            return _trainer(
                model, trees, build, world_size, rank, compile, steps, loss, args.optimizer, **kwargs
            )

        if args.resume is not None:  # only the second half, from another run's checkpoint
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                resumed = trainer()
                resumed.load_checkpoint(checkpoint_path(Path(args.resume), CHECKPOINT_STEP))
                resumed.on_step = count
                resumed.fit()
            result["warnings"] = [str(w.message) for w in caught]
            result["resumed_params"] = [p.detach().cpu() for p in resumed.model.parameters()]
            result["compilations"] = compilations
            # the programs the runner replays (minibatch and update programs), and why it stopped, if it did
            result["replays"] = resumed.runner.captures
            result["refused"] = _refused(resumed.runner)
            return

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            straight = trainer(
                checkpoint_dir=checkpoints, checkpoint_every=CHECKPOINT_STEP, keep_checkpoints=10
            )
            straight.on_step = count
            stats = straight.fit()
        result["warnings"] = [str(w.message) for w in caught]
        result["params"] = [p.detach().cpu() for p in straight.model.parameters()]
        result["compilations"] = compilations
        result["captures"] = straight.compiled.captures if straight.compiled is not None else 0
        result["update"] = type(getattr(straight.runner, "compiled_update", None)).__name__
        result["programs"] = straight.runner.captures  # every program the runner replays (0: none)
        result["refused"] = _refused(straight.runner)
        result["local_minibatches"] = [s.local_minibatches for s in stats]
        if checkpoints is not None:
            resumed = trainer()
            resumed.load_checkpoint(checkpoint_path(checkpoints, CHECKPOINT_STEP))
            resumed.fit()
            result["resumed_params"] = [p.detach().cpu() for p in resumed.model.parameters()]
    except BaseException as error:
        _counting_barrier(world_size).abort()  # a replica waiting to count would wait out its timeout
        result["error"] = f"{type(error).__name__}: {error}"
        traceback.print_exc()  # a replica's error would otherwise surface only as the others' timeout
        sys.stderr.flush()
        raise
    finally:
        torch.save(result, f"{out}.rank{rank}")


if __name__ == "__main__":
    import torch_xla.distributed.xla_multiprocessing as xmp

    parser = argparse.ArgumentParser()
    parser.add_argument("sst")
    parser.add_argument("out")
    parser.add_argument("compile", choices=("on", "off", "auto", "replay"))
    parser.add_argument("steps", type=int)
    parser.add_argument("--fail-rank", type=int)
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    parser.add_argument("--resume")
    options = parser.parse_args()
    initial_model = _model(_data(options.sst)[1])
    xmp.spawn(_replica, args=(options.sst, options.out, options, initial_model))
