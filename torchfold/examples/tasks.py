"""The built-in tasks: a Tree-LSTM on SST (``sst``) and an n-ary Tree-LSTM on Python's own ASTs (``pyast``).

Each function returns a :class:`~torchfold.train.Task` (data, build, model, loss, evaluation) and
is what ``python -m torchfold train --task sst`` (or ``--task pyast``) runs; its keyword arguments
are the task's ``--task-arg KEY=VALUE`` options. Write your own the same way (see the guide "Your
model and data").
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from torchfold.engine.fold import Fold
from torchfold.engine.static.shapes import envelope_for
from torchfold.examples.datadir import ENV_VAR, data_root
from torchfold.examples.generated import generate_sst
from torchfold.examples.models import (
    RootBuild,
    SiblingTreeLSTM,
    TreeLSTM,
    TreeLSTMBuild,
    encode_ast,
    encode_trees,
    root_loss,
)
from torchfold.examples.models import tree_lstm_loss as _tree_lstm_loss
from torchfold.examples.pyast import KINDS, majority_baseline, python_functions
from torchfold.examples.sst import Tree, Vocab, load_sst
from torchfold.train.task import Task

__all__ = ["evaluate_roots", "evaluate_sst", "pyast_task", "sst_task"]

_EVAL_BATCH = 256


def _eval_fold(model: nn.Module) -> Fold:
    """A fold to evaluate ``model`` on: on XLA padded into the model's envelope, as training's are.

    An evaluation reads padded outputs (``plan.apply(model, padded=True)``) and masks the rows past
    a batch's own: every batch then runs the same programs, where exact rows (a plain ``Fold()``,
    padded inside ``apply`` and cut) make each batch's node count a program of its own. Elsewhere
    nothing is padded and the outputs are exact.
    """
    device = next(iter(model.parameters()), torch.empty(0)).device
    return Fold(shapes=envelope_for("auto", model, device))


@torch.no_grad()
def evaluate_sst(model: nn.Module, trees: Sequence[Tree], vocab: Vocab) -> dict[str, float]:
    """Root accuracy (5 classes), binary root accuracy (non-neutral roots) and all-node accuracy of a :class:`TreeLSTM`.

    Binary: "positive" when the model puts more probability on labels 3-4 than on 0-1.
    """
    root_correct = node_correct = node_total = binary_correct = binary_total = 0
    for start in range(0, len(trees), _EVAL_BATCH):
        batch = trees[start : start + _EVAL_BATCH]
        fold = _eval_fold(model)
        nodes, labels, roots = encode_trees(fold, batch, vocab)
        plan = fold.plan([nodes])
        [states] = plan.apply(model, padded=True)  # (the rows past the batch's own: masked below)
        logits = model.logits(states)  # type: ignore[operator]
        gold = plan.pad(0, labels, fill=-1).to(logits.device)
        is_root = np.zeros(len(labels), dtype=bool)
        is_root[roots] = True
        root = plan.pad(0, is_root, fill=False).to(logits.device)
        hit = logits.argmax(dim=1) == gold  # (a padded row's gold, -1, is no class)
        node_correct += int(hit.sum())
        node_total += len(labels)
        root_correct += int((hit & root).sum())
        probabilities = logits.softmax(dim=1)
        positive = probabilities[:, 3:].sum(dim=1) > probabilities[:, :2].sum(dim=1)
        polar = root & (gold != 2)
        binary_correct += int(((positive == (gold > 2)) & polar).sum())
        binary_total += int(polar.sum())
    return {
        "root_accuracy": root_correct / max(len(trees), 1),
        "binary_accuracy": binary_correct / max(binary_total, 1),
        "node_accuracy": node_correct / max(node_total, 1),
    }


def sst_task(
    data: str | None = None,
    max_train: int | None = None,
    max_words: int | None = None,
    generate: int | None = None,
    max_eval: int | None = 1000,
    embedding_dim: int = 64,
    hidden_dim: int = 64,
    seed: int = 0,
) -> Task:
    """A binary Tree-LSTM on SST trees, a softmax loss at every node (each tree weighing the same).

    Args:
        data: a folder with SST's ``train.txt`` and ``dev.txt`` (or an ``sst/`` subfolder);
            default ``$TORCHFOLD_DATA``. Without either, ``generate`` is needed.
        max_train: use only the first this many training trees.
        max_words: use only training trees of at most this many words (before ``max_train``).
        generate: without data, train on this many generated SST-like trees (and evaluate on a
            quarter as many others).
        max_eval: evaluate on at most this many dev trees (default 1000).
        embedding_dim: word embedding size (default 64).
        hidden_dim: Tree-LSTM state size (default 64).
        seed: the generated trees' seed.

    >>> task = sst_task(generate=20, max_train=20, hidden_dim=8, embedding_dim=8)  # (or $TORCHFOLD_DATA's)
    >>> task.name, len(task.train), task.settings["vocabulary"] > 1
    ('sst', 20, True)
    """
    root = data_root(data)
    if root is not None:
        if max_words is not None and max_words < 1:
            raise ValueError(f"max_words={max_words}: must be a positive int")
        trees = load_sst(root, "train", max_trees=None if max_words else max_train)
        if max_words:
            short = [t for t in trees if len(t.words()) <= max_words][:max_train]
            if not short and trees:
                fewest = min(len(t.words()) for t in trees)
                raise ValueError(
                    f"max_words={max_words}: no training tree in {root} has at most {max_words} words (the "
                    f"shortest has {fewest}); use max_words={fewest} or more"
                )
            trees = short
        try:
            dev = load_sst(root, "dev", max_trees=max_eval)
        except FileNotFoundError:
            dev = []  # a folder with train.txt only: no evaluation
        origin = f"SST train trees from {root}"
    elif generate is None:
        raise ValueError(
            f"no training data: pass data=DIR (a directory with SST's train.txt, or an sst/ subdirectory) or set "
            f"${ENV_VAR}=DIR; or generate=N to train on N generated trees"
        )
    else:
        count = generate if max_train is None else min(generate, max_train)
        longest = 20 if max_words is None else max_words
        trees = generate_sst(count, seed=seed, min_words=min(2, longest), max_words=longest)
        dev = generate_sst(max(1, count // 4), seed=seed + 1, min_words=min(2, longest), max_words=longest)
        dev = dev[:max_eval]
        origin = f"{count} GENERATED trees (generate={generate})"
    vocab = Vocab.build(trees)
    return Task(
        name="sst",
        train=trees,
        build=TreeLSTMBuild(vocab),
        model=functools.partial(TreeLSTM, len(vocab), embedding_dim, hidden_dim),
        loss=_tree_lstm_loss,
        eval=dev,
        evaluate=functools.partial(evaluate_sst, vocab=vocab) if dev else None,
        description=f"{origin}, vocabulary {len(vocab)}",
        settings={"embedding_dim": embedding_dim, "hidden_dim": hidden_dim, "vocabulary": len(vocab)},
    )


@torch.no_grad()
def evaluate_roots(model: nn.Module, samples: Sequence[object]) -> dict[str, float]:
    """Accuracy of a model's root logits on samples with ``tree`` and ``label`` (:class:`RootBuild`'s)."""
    correct = 0
    for start in range(0, len(samples), _EVAL_BATCH):
        batch = samples[start : start + _EVAL_BATCH]
        fold = _eval_fold(model)
        roots = [encode_ast(fold, sample.tree)[0] for sample in batch]  # type: ignore[attr-defined]
        plan = fold.plan([roots])
        [states] = plan.apply(model, padded=True)
        predicted = model.logits(states).argmax(dim=1)  # type: ignore[operator]
        labels = plan.pad(0, [s.label for s in batch], fill=-1).to(predicted.device)  # type: ignore[attr-defined]
        correct += int((predicted == labels).sum())  # (a padded row's label, -1, is no class)
    return {"accuracy": correct / max(len(samples), 1)}


def pyast_task(
    train_size: int = 4000,
    eval_size: int = 1000,
    min_nodes: int = 10,
    max_nodes: int = 150,
    root: str | None = None,
    embedding_dim: int = 32,
    hidden_dim: int = 64,
    seed: int = 0,
) -> Task:
    """Does a Python function return a value? An n-ary Tree-LSTM over the standard library's ASTs.

    The data is the running Python's standard library (:func:`~torchfold.examples.pyast.python_functions`):
    every function of ``min_nodes`` to ``max_nodes`` nodes as a tree of node kinds, split by file,
    a seeded subset of each split. The model is a :class:`SiblingTreeLSTM` read at the root.

    Args:
        train_size: training functions (default 4000).
        eval_size: held-out functions (default 1000).
        min_nodes: smallest function, in AST nodes (default 10).
        max_nodes: largest function, in AST nodes (default 150).
        root: a folder of ``.py`` files to read instead of the standard library.
        embedding_dim: node-kind embedding size (default 32).
        hidden_dim: state size (default 64).
        seed: which subset.
    """
    folder = os.fspath(root) if root is not None else None
    train, held_out = python_functions(
        train_size, eval_size, seed=seed, root=folder, min_nodes=min_nodes, max_nodes=max_nodes
    )
    if not train:
        raise ValueError(
            f"no function of {min_nodes} to {max_nodes} nodes found in {folder or 'the standard library'}; "
            "widen min_nodes/max_nodes or give another root"
        )
    where = folder or "the standard library"
    nodes = sum(s.size for s in train) / len(train)
    return Task(
        name="pyast",
        train=train,
        build=RootBuild(),
        model=functools.partial(SiblingTreeLSTM, len(KINDS), embedding_dim, hidden_dim),
        loss=root_loss,
        eval=held_out,
        evaluate=evaluate_roots if held_out else None,
        description=(
            f"{len(train)} functions of {where} ({nodes:.0f} nodes each on average, deepest "
            f"{max(s.depth for s in train)}), label 'returns a value' (majority "
            f"{majority_baseline(train):.3f} train, {majority_baseline(held_out):.3f} held out)"
        ),
        settings={
            "embedding_dim": embedding_dim,
            "hidden_dim": hidden_dim,
            "train_size": len(train),
            "max_nodes": max_nodes,
            "min_nodes": min_nodes,
        },
    )
