"""A user's per-sample task: SST sentiment with a recursive Tree-LSTM written for one tree.

``forward(model, tree)`` is plain PyTorch for one sample; the run batches it with
``torchfold.autobatch``. The command line trains it with ``--task _sample_task:make_task``
(``tests/helpers`` on the path); the data is the SST sample under ``tests/data/sst``.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from torchfold.examples.models import TreeLSTM
from torchfold.examples.sst import Tree, Vocab, read_sst_file
from torchfold.train import Task

SST_TRAIN = Path(__file__).resolve().parents[1] / "data" / "sst" / "train.txt"


def tree_loss(model: TreeLSTM, tree: Tree, vocab: Vocab) -> torch.Tensor:
    """The tree's loss: the mean cross-entropy of its nodes' labels, computed recursively."""
    losses: list[torch.Tensor] = []

    def walk(node: Tree) -> tuple[torch.Tensor, torch.Tensor]:
        if node.is_leaf:
            h, c = model.leaf(torch.tensor([vocab[node.word or ""]]))
        else:
            left, right = (walk(child) for child in node.children)
            h, c = model.node(*left, *right)
        losses.append(F.cross_entropy(model.logits(h), torch.tensor([node.label])))
        return h, c

    walk(tree)
    return torch.stack(losses).mean()


def make_task(max_train: int = 12, hidden_dim: int = 8) -> Task:
    trees = read_sst_file(SST_TRAIN, max_trees=max_train)
    vocab = Vocab.build(trees)
    return Task(
        "sst-per-sample",
        train=trees,
        model=functools.partial(TreeLSTM, len(vocab), hidden_dim, hidden_dim),
        forward=functools.partial(tree_loss, vocab=vocab),
        settings={"hidden_dim": hidden_dim},
    )
