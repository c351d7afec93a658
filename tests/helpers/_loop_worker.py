"""Shared pieces of the training-loop tests: real SST trees, a small float64 Tree-LSTM, rank entry points.

Spawned ranks import this module by name (through ``_dist_worker.run_ranks``), so it holds only
top-level functions.
"""

from __future__ import annotations

import os
import random
import re
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from torchfold.examples.datasets import Tree, Vocab, data_root, generate_sst, parse_tree

MINIBATCH = 6
NUM_TREES = 120
MAX_WORDS = 10
# Over 120 trees: epoch 0 is steps 0..7 (the last one cut to the 12 trees left), epoch 1 steps
# 8..13 (the last cut to 6). Steps of 6 trees leave one of two (two of three) ranks without a
# minibatch; steps of 30 or 36 give ranks several minibatches to accumulate.
TRACE = [12, 6, 18, 30, 6, 24, 12, 18, 36, 6, 30, 24, 18, 12, 6]
LR = 0.01
REF_BATCH = 12
EMBEDDING, HIDDEN = 8, 12

_WORD = re.compile(r"\(\d+ [^()\s]+\)")  # a preterminal: (label word)
_TREES: dict[int, list[Tree]] = {}


def _short_sst_trees(path: Path, n: int) -> list[Tree]:
    """The first ``n`` trees of ``path`` with at most MAX_WORDS words, parsing only those lines."""
    trees = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if len(_WORD.findall(line)) <= MAX_WORDS:
                trees.append(parse_tree(line.rstrip("\n"), source=str(path), line_number=number))
                if len(trees) == n:
                    break
    return trees


def sst_trees(n: int = NUM_TREES) -> list[Tree]:
    """The first ``n`` real SST training trees of at most MAX_WORDS words (shallow: fast tests).

    Generated SST-format trees of that size when the data is absent.
    """
    if n not in _TREES:
        root = data_root()
        if root is not None and (Path(root) / "sst" / "train.txt").is_file():
            _TREES[n] = _short_sst_trees(Path(root) / "sst" / "train.txt", n)
            if len(_TREES[n]) < n:  # a sample too small would shrink every test's batches unseen
                raise ValueError(
                    f"{root}/sst/train.txt holds {len(_TREES[n])} trees of at most {MAX_WORDS} words, not {n}"
                )
        else:
            _TREES[n] = generate_sst(n, seed=0, max_words=MAX_WORDS)
    return _TREES[n]


def make_model(vocab: Vocab, seed: int = 0) -> torch.nn.Module:
    from torchfold.examples.models import TreeLSTM

    torch.manual_seed(seed)
    return TreeLSTM(len(vocab), EMBEDDING, HIDDEN).double()


def dropout_tree_loss(model: torch.nn.Module, outputs: Sequence[torch.Tensor], targets: Any) -> torch.Tensor:
    """The Tree-LSTM loss with dropout on the node states and a Python-random jitter.

    Uses torch's and Python's generators in every minibatch, so only a resume that restores every
    rank's generators continues exactly.
    """
    [states] = outputs
    labels, _ = targets
    logits = model.logits(F.dropout(states, p=0.3, training=True))  # type: ignore[operator]
    return F.cross_entropy(logits, torch.as_tensor(labels)) * (1.0 + 0.1 * random.random())


def make_trainer(
    trees: list[Tree],
    *,
    lr_rule: str = "linear",
    dropout: bool = False,
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 0,
    seed: int = 0,
    on_step: Any = None,
    num_workers: int = 0,
    minibatch_seed: int | None = None,
    max_device_batch_size: int | None = None,
    lr: float = LR,
    **options: Any,
) -> Any:
    """A TraceTrainer on ``trees`` for this process's rank, Adam with ``lr_rule``; ``options`` to TraceTrainer."""
    from torchfold.examples.models import TreeLSTMBuild, tree_lstm_loss
    from torchfold.train.data.loader import StepLoader
    from torchfold.train.loop.trainer import TraceTrainer
    from torchfold.train.optim.optimizer import AccumulatingOptimizer

    vocab = Vocab.build(trees)
    random.seed(seed)  # with make_model's torch seed: every run starts from the same generator states
    model = make_model(vocab, seed)
    optimizer = AccumulatingOptimizer(
        torch.optim.Adam(model.parameters(), lr=lr),
        lr_rule=lr_rule,  # type: ignore[arg-type]
        ref_batch_size=None if lr_rule == "constant" else REF_BATCH,
    )
    loader = StepLoader(
        trees,
        None if max_device_batch_size else MINIBATCH,
        build=TreeLSTMBuild(vocab),
        trace=TRACE,
        seed=3,
        num_workers=num_workers,
        max_device_batch_size=max_device_batch_size,
    )
    return TraceTrainer(
        model,
        optimizer,
        loader,
        dropout_tree_loss if dropout else tree_lstm_loss,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        progress=False,
        on_step=on_step,
        seed=minibatch_seed,
        **options,
    )


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def train_rank(rank: int, world_size: int, port: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One rank of a gloo group: train once per entry of ``runs``; each gives params and history.

    A run may have ``die_after`` (rank, step): that rank SIGKILLs itself once the checkpoint that
    follows that step is written, in the next step's ``on_step`` (which runs before that step's
    checkpoint); the others report how they failed. ``resume``
    continues from the newest checkpoint in ``checkpoint_dir``.
    """
    import time

    from torchfold.train.distributed.world import init_distributed

    init_distributed("gloo", rank=rank, world_size=world_size, master_port=port, timeout=5.0)
    trees = sst_trees()
    results: dict[str, Any] = {}
    for run in runs:
        die_rank, die_step = run.get("die_after", (-1, -1))

        def on_step(stats: Any, die_rank: int = die_rank, die_step: int = die_step) -> None:
            if rank == die_rank and stats.step == die_step + 1:
                os.kill(os.getpid(), signal.SIGKILL)

        trainer = make_trainer(
            trees,
            lr_rule=run.get("lr_rule", "linear"),
            dropout=run.get("dropout", False),
            checkpoint_dir=run.get("checkpoint_dir"),
            checkpoint_every=run.get("checkpoint_every", 0),
            seed=100 + rank,  # different on purpose: rank 0's initial values must win
            on_step=on_step,
            minibatch_seed=run.get("minibatch_seed"),
            max_device_batch_size=run.get("max_device_batch_size"),
        )
        resumed = trainer.resume() if run.get("resume") else None
        start = time.monotonic()
        try:
            history = trainer.fit()
        except RuntimeError as e:
            results[run["name"]] = {"error": str(e), "seconds": time.monotonic() - start}
            continue
        results[run["name"]] = {
            "params": params_of(trainer.model),
            "history": history,
            "resumed": None if resumed is None else resumed.name,
        }
    return results
