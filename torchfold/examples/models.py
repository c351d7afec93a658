"""Reference models whose methods are fold ops: a binary Tree-LSTM for SST, an n-ary one for ASTs, an MLP for MNIST.

Every op takes and returns batched tensors (one row per node), so the same method serves a
:class:`~torchfold.Fold` (one call per group of nodes), an :class:`~torchfold.EagerFold` (one
call per node) and plain eager code. :func:`encode_tree` records a tree on a fold;
:func:`forward_tree` is the plain recursive computation it must match. :class:`TreeLSTMBuild`
and :func:`tree_lstm_loss` are the two halves of the SST training loss for a
:class:`~torchfold.train.StepLoader` (building plans in workers) and :class:`~torchfold.train.TraceTrainer`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from torchfold._validate import check_int
from torchfold.engine.fold import Fold
from torchfold.engine.plan import FoldPlan
from torchfold.engine.static.shapes import StaticPlan, StaticShapes
from torchfold.examples.datasets import Tree, Vocab
from torchfold.train.data.envelope import fit_static_shapes

__all__ = [
    "MLP",
    "RootBuild",
    "SiblingTreeLSTM",
    "TreeLSTM",
    "TreeLSTMBuild",
    "encode_ast",
    "encode_tree",
    "encode_trees",
    "forward_ast",
    "forward_tree",
    "root_loss",
    "tree_lstm_loss",
    "tree_lstm_shapes",
]


class TreeLSTM(nn.Module):
    """Binary Tree-LSTM (Tai et al., 2015, N-ary with N=2): one forget gate per child.

    A leaf reads its word embedding ``x``; an internal node reads its children's states::

        leaf:  i, o, u = W x + b                      c = σ(i) ⊙ tanh(u)
        node:  i, f_l, f_r, o, u = U [h_l; h_r] + b   c = σ(i) ⊙ tanh(u) + σ(f_l) ⊙ c_l + σ(f_r) ⊙ c_r
        both:  h = σ(o) ⊙ tanh(c)

    All gates of a step come from one fused ``Linear``. The fold ops are :meth:`leaf`,
    :meth:`node` (both return ``(h, c)``) and :meth:`logits`.

    Args:
        vocab_size: number of word ids (``len(vocab)``).
        embedding_dim: size of the word embeddings (default 128).
        hidden_dim: size of ``h`` and ``c`` (default 128).
        num_classes: number of labels per node (default 5, SST's fine-grained labels).
        sparse: give the embedding sparse gradients (default ``False``): backward then touches
            only the rows looked up, not all ``vocab_size x embedding_dim`` of them. Pair it with
            lazy Adam: ``torch.optim.SparseAdam`` for :meth:`sparse_parameters` and
            ``torch.optim.Adam`` for :meth:`dense_parameters` (what DyNet does by default for
            lookup parameters). Worth it when the vocabulary is much larger than the words of a
            batch; it is a different optimizer (rows not looked up keep their moments), so
            runs with and without it do not match step for step.

    Example:
        >>> import torch, torchfold
        >>> from torchfold.examples.datasets import Vocab, parse_tree
        >>> tree = parse_tree("(3 (2 not) (1 bad))")
        >>> vocab = Vocab.build([tree])
        >>> model = TreeLSTM(len(vocab), embedding_dim=8, hidden_dim=16)
        >>> fold = torchfold.Fold()
        >>> nodes, labels = zip(*encode_tree(fold, tree, vocab))
        >>> [h] = fold.apply(model, [list(nodes)])
        >>> model.logits(h).shape, labels
        (torch.Size([3, 5]), (2, 1, 3))
    """

    def __init__(
        self,
        vocab_size: int,
        embedding_dim: int = 128,
        hidden_dim: int = 128,
        num_classes: int = 5,
        *,
        sparse: bool = False,
    ) -> None:
        super().__init__()
        for name, value in (
            ("vocab_size", vocab_size),
            ("embedding_dim", embedding_dim),
            ("hidden_dim", hidden_dim),
            ("num_classes", num_classes),
        ):
            check_int(name, value)
        if not isinstance(sparse, bool):
            raise TypeError(f"sparse must be a bool, got {sparse!r}")
        self.hidden_dim = hidden_dim
        self.embedding = nn.Embedding(vocab_size, embedding_dim, sparse=sparse)
        self.leaf_gates = nn.Linear(embedding_dim, 3 * hidden_dim)  # i, o, u
        self.node_gates = nn.Linear(2 * hidden_dim, 5 * hidden_dim)  # i, f_l, f_r, o, u
        self.classifier = nn.Linear(hidden_dim, num_classes)

    def sparse_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients are sparse (the embedding), or none without ``sparse=True``.

        >>> model = TreeLSTM(100, 8, 8, sparse=True)
        >>> optimizers = [
        ...     torch.optim.SparseAdam(model.sparse_parameters()),
        ...     torch.optim.Adam(model.dense_parameters()),
        ... ]
        """
        return [cast(nn.Parameter, self.embedding.weight)] if self.embedding.sparse else []

    def dense_parameters(self) -> list[nn.Parameter]:
        """Every parameter not in :meth:`sparse_parameters` (all of them without ``sparse=True``)."""
        sparse = {id(p) for p in self.sparse_parameters()}
        return [p for p in self.parameters() if id(p) not in sparse]

    def leaf(self, word_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """States of leaves: ``word_ids`` of shape ``(n,)`` -> ``(h, c)``, each ``(n, hidden_dim)``."""
        return _leaf_cell(self.leaf_gates(self.embedding(word_ids)), self.hidden_dim)

    def node(
        self, h_left: torch.Tensor, c_left: torch.Tensor, h_right: torch.Tensor, c_right: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """States of internal nodes from their children's: four ``(n, hidden_dim)`` -> ``(h, c)``."""
        gates = self.node_gates(torch.cat((h_left, h_right), dim=1))
        return _binary_cell(gates, c_left, c_right, self.hidden_dim)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Class scores ``(n, num_classes)`` of nodes with states ``h`` ``(n, hidden_dim)``."""
        return self.classifier(h)


def _leaf_cell(gates: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An LSTM cell with no state before it, from its gates ``(n, 3 * size)`` (input, output, candidate): ``(h, c)``."""
    # split, not slicing: backward then joins the pieces' gradients in one cat, where each
    # slice's backward zero-fills a whole gates-sized tensor (and they are summed after)
    sig, u = gates.split((2 * size, size), dim=1)
    i, o = sig.sigmoid().split(size, dim=1)
    c = i * u.tanh()
    return o * c.tanh(), c


def _binary_cell(
    gates: torch.Tensor, c_left: torch.Tensor, c_right: torch.Tensor, size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A binary Tree-LSTM cell from its gates ``(n, 5 * size)`` (input, two forgets, output,
    candidate) and its two children's memories: ``(h, c)``."""
    sig, u = gates.split((4 * size, size), dim=1)
    i, f_left, f_right, o = sig.sigmoid().split(size, dim=1)
    c = i * u.tanh() + f_left * c_left + f_right * c_right
    return o * c.tanh(), c


class _Recorder(Protocol):
    """What :func:`encode_tree` needs: ``Fold`` and ``EagerFold`` both fit."""

    def add(self, op: Any, *args: Any) -> Any: ...


def encode_tree(fold: _Recorder, tree: Tree, vocab: Vocab) -> list[tuple[Any, int]]:
    """Record a :class:`TreeLSTM` over ``tree`` on ``fold``; one ``(h node, label)`` per tree node.

    Nodes come in post-order (children first, root last), so ``fold.apply(model, [[h for h, _
    in pairs]])`` gives every node's state for a loss at every node. Works the same with
    :class:`~torchfold.EagerFold` (eager values instead of deferred nodes).

    Args:
        fold: a :class:`~torchfold.Fold` (or ``EagerFold``) to record on.
        tree: the tree to encode.
        vocab: maps leaf words to ids (unknown words to its ``unk_id``).

    >>> import torchfold
    >>> from torchfold.examples.datasets import parse_tree
    >>> pairs = encode_tree(torchfold.Fold(), parse_tree("(3 (2 a) (3 (2 a) (4 film)))"), Vocab(["a", "film"]))
    >>> [label for _, label in pairs]
    [2, 2, 4, 3, 3]
    """
    out: list[tuple[Any, int]] = []
    _encode(fold.add, vocab.stoi.get, vocab.unk_id, tree, out.append)
    return out


def _encode(
    add: Callable[..., Any],
    word_id: Callable[[str, int], int],
    unk_id: int,
    tree: Tree,
    emit: Callable[[tuple[Any, int]], None],
) -> tuple[Any, Any]:
    """Post-order recursion of :func:`encode_tree` with its look-ups bound once (the hot path)."""
    if tree.word is not None:
        h, c = add("leaf", word_id(tree.word, unk_id)).split(2)
    else:
        left, right = tree.children
        h_left, c_left = _encode(add, word_id, unk_id, left, emit)
        h_right, c_right = _encode(add, word_id, unk_id, right, emit)
        h, c = add("node", h_left, c_left, h_right, c_right).split(2)
    emit((h, tree.label))
    return h, c


def encode_trees(
    fold: _Recorder, trees: Iterable[Tree], vocab: Vocab
) -> tuple[list[Any], list[int], list[int]]:
    """Record many trees on one fold: every node's ``h`` node, its label, and where the roots are.

    Returns ``(nodes, labels, roots)``: ``nodes[i]`` has label ``labels[i]``, and
    ``nodes[roots[k]]`` is the root of the k-th tree (each tree's nodes in post-order).

    >>> import torchfold
    >>> from torchfold.examples.datasets import parse_tree
    >>> trees = [parse_tree("(3 (2 a) (4 film))"), parse_tree("(1 bad)")]
    >>> nodes, labels, roots = encode_trees(torchfold.Fold(), trees, Vocab(["a", "film", "bad"]))
    >>> labels, roots
    ([2, 4, 3, 1], [2, 3])
    """
    pairs: list[tuple[Any, int]] = []
    roots: list[int] = []
    add, get, unk, emit = fold.add, vocab.stoi.get, vocab.unk_id, pairs.append
    for tree in trees:
        _encode(add, get, unk, tree, emit)
        roots.append(len(pairs) - 1)
    nodes = [node for node, _ in pairs]
    labels = [label for _, label in pairs]
    return nodes, labels, roots


def forward_tree(model: TreeLSTM, tree: Tree, vocab: Vocab) -> tuple[torch.Tensor, list[int]]:
    """The plain eager recursive Tree-LSTM: every node's ``h`` (post-order, ``(nodes, hidden_dim)``) and label.

    No fold involved: the reference that :func:`encode_tree` + ``Fold.apply`` must equal.

    >>> from torchfold.examples.datasets import parse_tree
    >>> tree = parse_tree("(3 (2 a) (4 film))")
    >>> vocab = Vocab(["a", "film"])
    >>> h, labels = forward_tree(TreeLSTM(len(vocab), 4, 6), tree, vocab)
    >>> tuple(h.shape), labels
    ((3, 6), [2, 4, 3])
    """
    device = model.embedding.weight.device
    states: list[torch.Tensor] = []
    labels: list[int] = []

    def visit(node: Tree) -> tuple[torch.Tensor, torch.Tensor]:
        if node.word is not None:
            h, c = model.leaf(torch.tensor([vocab[node.word]], device=device))
        else:
            h_left, c_left = visit(node.children[0])
            h_right, c_right = visit(node.children[1])
            h, c = model.node(h_left, c_left, h_right, c_right)
        states.append(h)
        labels.append(node.label)
        return h, c

    visit(tree)
    return torch.cat(states), labels


class TreeLSTMBuild:
    """The half of the SST loss that runs in loader workers: a minibatch of trees to a plan and targets.

    Records every tree on one fold and returns ``(plan, (labels, weights))``: ``plan`` gives every
    node's ``h`` (post-order, tree after tree), ``labels`` every node's label (int64) and
    ``weights`` its weight in the minibatch's loss, ``1 / (nodes of its tree * trees)`` (float64),
    as numpy arrays (they cross processes cheaper than tensors). :func:`tree_lstm_loss` is the
    other half.

    With ``shapes``, plans are padded into that :class:`~torchfold.StaticShapes` envelope (for
    XLA: the graphs repeat) and so are the targets, padded rows weighing 0. Each loader worker
    pads into its own copy of the envelope: fit it to the dataset first and freeze it
    (:func:`tree_lstm_shapes`, as ``python -m torchfold train --device xla`` does with the
    envelope :meth:`~torchfold.train.StepMechanism.static_shapes` gives); the loader
    then splits a minibatch that does not fit into smaller ones that do, and the copies grow
    (with a warning, and graphs of their own) only for a tree that does not fit alone.

    Args:
        vocab: maps the trees' words to the model's embedding ids.
        shapes: pad plans and targets into this envelope (default ``None``: no padding).

    >>> from torchfold.examples.datasets import parse_tree
    >>> trees = [parse_tree("(3 (2 a) (4 film))"), parse_tree("(1 bad)")]
    >>> plan, (labels, weights) = TreeLSTMBuild(Vocab(["a", "film", "bad"]))(trees)
    >>> plan, labels.tolist(), weights.tolist()
    (FoldPlan(2 groups, 4 nodes, 1 request), [2, 4, 3, 1], [0.16666666666666666, 0.16666666666666666, 0.16666666666666666, 0.5])
    """

    def __init__(self, vocab: Vocab, shapes: StaticShapes | None = None) -> None:
        self.vocab = vocab
        self.shapes = shapes

    def __call__(
        self, trees: Sequence[Tree], shapes: StaticShapes | None = None
    ) -> tuple[FoldPlan | StaticPlan, tuple[np.ndarray, np.ndarray]]:
        """Record ``trees``; ``shapes`` (a :class:`~torchfold.train.Task`'s build argument) overrides the constructor's."""
        fold = Fold(shapes=shapes if shapes is not None else self.shapes)
        nodes, labels, roots = encode_trees(fold, trees, self.vocab)
        sizes = np.diff(np.asarray([-1, *roots], dtype=np.int64)).astype(np.int64)
        weights = np.repeat(1 / (sizes * len(sizes)), sizes)
        plan = fold.plan([nodes])
        return plan, (plan.pad(0, np.asarray(labels, dtype=np.int64)).numpy(), plan.pad(0, weights).numpy())


def tree_lstm_shapes(
    trees: Sequence[Tree],
    vocab: Vocab,
    minibatch_size: int,
    *,
    pack_levels: bool = False,
    depth_buckets: bool = True,
    max_minibatches: int | None = None,
    seed: int = 0,
) -> StaticShapes:
    """An envelope for :class:`TreeLSTMBuild`, fitted to the minibatches of a pass over ``trees`` and frozen.

    :func:`~torchfold.train.fit_static_shapes` with this model's build (see there); pass the
    result as ``TreeLSTMBuild(vocab, shapes=...)``. ``pack_levels`` and ``depth_buckets`` are
    :class:`~torchfold.StaticShapes`' (for steps traced lazily on XLA, ``depth_buckets=False``:
    :meth:`~torchfold.train.StepMechanism.static_shapes` says why).

    >>> from torchfold.examples.datasets import generate_sst
    >>> trees = generate_sst(30, seed=0)
    >>> shapes = tree_lstm_shapes(trees, Vocab.build(trees), 10)
    >>> shapes.frozen, shapes.plans  # 3 minibatches, 2 passes (the second grew nothing)
    (True, 6)
    """
    return fit_static_shapes(
        trees,
        TreeLSTMBuild(vocab),
        minibatch_size,
        shapes=StaticShapes(pack_levels=pack_levels, depth_buckets=depth_buckets),
        max_minibatches=max_minibatches,
        seed=seed,
    )


def tree_lstm_loss(
    model: nn.Module, outputs: Sequence[torch.Tensor], targets: tuple[Any, Any]
) -> torch.Tensor:
    """The half of the SST loss that runs in the trainer: cross-entropy at every node, per tree, then over trees.

    Each tree weighs the same whatever its size (its loss is the mean over its nodes), so the
    loss of a minibatch is a mean over its trees, and minibatches of a step combine into exactly
    the loss of the whole global batch. Reads no value back to the host.

    Args:
        model: the :class:`TreeLSTM` (its ``logits``).
        outputs: ``plan.apply(model, padded=True)`` for a plan of :class:`TreeLSTMBuild` (padded
            rows, if any, weigh 0).
        targets: its ``(labels, weights)`` (numpy arrays or tensors).

    >>> from torchfold.examples.datasets import parse_tree
    >>> trees = [parse_tree("(3 (2 a) (4 film))"), parse_tree("(1 bad)")]
    >>> vocab = Vocab.build(trees)
    >>> plan, targets = TreeLSTMBuild(vocab)(trees)
    >>> _ = torch.manual_seed(0)
    >>> model = TreeLSTM(len(vocab), 4, 8)
    >>> loss = tree_lstm_loss(model, plan.apply(model), targets)
    >>> loss.shape, loss.requires_grad
    (torch.Size([]), True)
    """
    [states] = outputs
    labels, weights = (torch.as_tensor(t, device=states.device) for t in targets)
    losses = F.cross_entropy(model.logits(states), labels, reduction="none")  # type: ignore[operator]
    return (losses * weights.to(losses.dtype)).sum()


class MLP(nn.Module):
    """A multilayer perceptron with ReLU between layers (default 784-200-100-10, for MNIST).

    ``forward`` (also available as the fold op ``classify``) maps rows ``(n, in_features)`` to
    logits ``(n, num_classes)``, so a fold can batch single images recorded as
    ``fold.add("classify", image_row)`` with ``image_row`` of shape ``(1, 784)``.

    Args:
        in_features: input size (784 = 28 x 28).
        hidden: sizes of the hidden layers.
        num_classes: output size.

    Example:
        >>> import torch, torchfold
        >>> model = MLP()
        >>> f = torchfold.Fold()
        >>> images = torch.rand(3, 784)
        >>> nodes = [f.add("classify", images[i : i + 1]) for i in range(3)]
        >>> torch.testing.assert_close(f.apply(model, [nodes])[0], model(images))
    """

    def __init__(
        self, in_features: int = 784, hidden: Sequence[int] = (200, 100), num_classes: int = 10
    ) -> None:
        super().__init__()
        check_int("in_features", in_features)
        for i, size in enumerate(hidden):
            check_int(f"hidden[{i}]", size)
        check_int("num_classes", num_classes)
        sizes = [in_features, *hidden, num_classes]
        layers: list[nn.Module] = []
        for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
            if i:
                layers.append(nn.ReLU())
            layers.append(nn.Linear(fan_in, fan_out))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(n, num_classes)`` for rows ``x`` ``(n, in_features)``."""
        return self.layers(x)

    def classify(self, x: torch.Tensor) -> torch.Tensor:
        """The same as :meth:`forward`, under the op name used in folds."""
        return self.layers(x)


class SiblingTreeLSTM(nn.Module):
    """A Tree-LSTM for n-ary trees: each node's children folded left to right, then the node read.

    For trees whose nodes have any number of children (a Python function's AST): a node without
    children is a :meth:`leaf`; a node with children runs :meth:`sibling` over them (a binary
    Tree-LSTM cell that merges the state so far with the next child's, left to right) and then
    :meth:`node` (an LSTM step reading the node's own kind with that state). Three ops of fixed
    arity, so a fold batches them whatever the children counts; a node with many children makes
    a deep fold (one level per sibling).

    Args:
        num_kinds: number of node kinds (``len(torchfold.examples.pyast.KINDS)``).
        embedding_dim: size of a kind's embedding (default 32).
        hidden_dim: size of ``h`` and ``c`` (default 64).
        num_classes: labels per tree (default 2).

    Example:
        >>> import torchfold
        >>> model = SiblingTreeLSTM(10, 4, 8)
        >>> fold = torchfold.Fold()
        >>> h, c = encode_ast(fold, (3, ((1, ()), (2, ((4, ()),)))))
        >>> [states] = fold.apply(model, [[h]])
        >>> tuple(model.logits(states).shape)
        (1, 2)
    """

    def __init__(
        self, num_kinds: int, embedding_dim: int = 32, hidden_dim: int = 64, num_classes: int = 2
    ) -> None:
        super().__init__()
        for name, value in (
            ("num_kinds", num_kinds),
            ("embedding_dim", embedding_dim),
            ("hidden_dim", hidden_dim),
            ("num_classes", num_classes),
        ):
            check_int(name, value)
        self.hidden_dim = hidden_dim
        self.embedding = nn.Embedding(num_kinds, embedding_dim)
        self.leaf_gates = nn.Linear(embedding_dim, 3 * hidden_dim)  # i, o, u
        self.sibling_gates = nn.Linear(2 * hidden_dim, 5 * hidden_dim)  # i, f_left, f_right, o, u
        self.node_gates = nn.Linear(embedding_dim + hidden_dim, 4 * hidden_dim)  # i, f, o, u
        self.classifier = nn.Linear(hidden_dim, num_classes)

    def leaf(self, kinds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """States of childless nodes: ``kinds`` ``(n,)`` -> ``(h, c)``, each ``(n, hidden_dim)``."""
        return _leaf_cell(self.leaf_gates(self.embedding(kinds)), self.hidden_dim)

    def sibling(
        self, h_left: torch.Tensor, c_left: torch.Tensor, h_right: torch.Tensor, c_right: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The children so far (left) merged with the next child (right): four ``(n, hidden_dim)`` -> ``(h, c)``."""
        gates = self.sibling_gates(torch.cat((h_left, h_right), dim=1))
        return _binary_cell(gates, c_left, c_right, self.hidden_dim)

    def node(
        self, kinds: torch.Tensor, h_children: torch.Tensor, c_children: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A node with children: its kind ``(n,)`` and its merged children's state -> ``(h, c)``."""
        size = self.hidden_dim
        gates = self.node_gates(torch.cat((self.embedding(kinds), h_children), dim=1))
        sig, u = gates.split((3 * size, size), dim=1)
        i, f, o = sig.sigmoid().split(size, dim=1)
        c = i * u.tanh() + f * c_children
        return o * c.tanh(), c

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Class scores ``(n, num_classes)`` of trees with root states ``h``."""
        return self.classifier(h)


def encode_ast(fold: _Recorder, tree: tuple[int, tuple[Any, ...]]) -> tuple[Any, Any]:
    """Record a :class:`SiblingTreeLSTM` over ``tree`` (``(kind, (children...))``) on ``fold``; its root's ``(h, c)``."""
    add = fold.add
    kind, children = tree
    if not children:
        return tuple(add("leaf", kind).split(2))
    h, c = encode_ast(fold, children[0])
    for child in children[1:]:
        h_child, c_child = encode_ast(fold, child)
        h, c = add("sibling", h, c, h_child, c_child).split(2)
    return tuple(add("node", kind, h, c).split(2))


def forward_ast(
    model: SiblingTreeLSTM, tree: tuple[int, tuple[Any, ...]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain eager recursion :func:`encode_ast` + ``Fold.apply`` must equal: the root's ``(h, c)``, ``(1, hidden_dim)`` each."""
    kind, children = tree
    kinds = torch.tensor([kind], device=model.embedding.weight.device)
    if not children:
        return model.leaf(kinds)
    h, c = forward_ast(model, children[0])
    for child in children[1:]:
        h_child, c_child = forward_ast(model, child)
        h, c = model.sibling(h, c, h_child, c_child)
    return model.node(kinds, h, c)


class RootBuild:
    """A minibatch of labelled trees to ``(plan, (labels, weights))``: the roots' states, one label each.

    For samples with ``tree`` and ``label`` attributes (:class:`~torchfold.examples.pyast.AstSample`)
    and a model recorded by :func:`encode_ast`. Each root weighs ``1 / len(samples)``; with
    ``shapes``, plan and targets are padded into that envelope and padded rows weigh 0.
    :func:`root_loss` is the other half.

    >>> from torchfold.examples.pyast import AstSample
    >>> samples = [AstSample((1, ((2, ()),)), 1, "x.py:1 f", 2, 2), AstSample((3, ()), 0, "x.py:2 g", 1, 1)]
    >>> plan, (labels, weights) = RootBuild()(samples)
    >>> labels.tolist(), weights.tolist()
    ([1, 0], [0.5, 0.5])
    """

    def __call__(
        self, samples: Sequence[Any], shapes: StaticShapes | None = None
    ) -> tuple[FoldPlan | StaticPlan, tuple[np.ndarray, np.ndarray]]:
        fold = Fold(shapes=shapes)
        roots = [encode_ast(fold, sample.tree)[0] for sample in samples]
        plan = fold.plan([roots])
        labels = np.asarray([sample.label for sample in samples], dtype=np.int64)
        weights = np.full(len(samples), 1 / len(samples))
        return plan, (plan.pad(0, labels).numpy(), plan.pad(0, weights).numpy())


def root_loss(model: nn.Module, outputs: Sequence[torch.Tensor], targets: tuple[Any, Any]) -> torch.Tensor:
    """Cross-entropy of each tree's root, weighted (a mean over the trees, padded rows 0): :class:`RootBuild`'s other half."""
    [states] = outputs
    labels, weights = (torch.as_tensor(t, device=states.device) for t in targets)
    losses = F.cross_entropy(model.logits(states), labels, reduction="none")  # type: ignore[operator]
    return (losses * weights.to(losses.dtype)).sum()
