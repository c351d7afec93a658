"""Tests for torchfold.examples.models: Tree-LSTM and MLP ops, Fold results and gradients == eager ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchfold
from tests.conftest import DATA_DIR
from torchfold.examples.datasets import Tree, Vocab, generate_sst, load_sst, parse_tree
from torchfold.examples.models import MLP, TreeLSTM, encode_tree, encode_trees, forward_tree

SST_DIR = DATA_DIR / "sst"
needs_sst = pytest.mark.usefixtures("data_dir")  # fails (never skips) without the data
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _sst_sample() -> list[Tree]:
    """A handful of real dev trees: the first five, the deepest and the longest of the first 200."""
    trees = load_sst(SST_DIR, "dev", max_trees=200)
    return [*trees[:5], max(trees, key=Tree.height), max(trees, key=len)]


def _model(vocab: Vocab, device: str = "cpu", seed: int = 0) -> TreeLSTM:
    torch.manual_seed(seed)
    return TreeLSTM(len(vocab), embedding_dim=24, hidden_dim=16).double().to(device)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _check_fold_matches_eager(trees: list[Tree], vocab: Vocab, device: str) -> None:
    model = _model(vocab, device)
    eager_states, eager_labels = zip(*(forward_tree(model, tree, vocab) for tree in trees), strict=True)
    eager_h = torch.cat(eager_states)
    labels = torch.tensor([y for ys in eager_labels for y in ys], device=device)
    F.cross_entropy(model.logits(eager_h), labels).backward()
    eager_grads = _grads(model)

    fold = torchfold.Fold(device=device)
    nodes, fold_labels, roots = encode_trees(fold, trees, vocab)
    [fold_h] = fold.apply(model, [nodes])
    F.cross_entropy(model.logits(fold_h), torch.tensor(fold_labels, device=device)).backward()
    fold_grads = _grads(model)

    assert fold_labels == labels.tolist()
    assert roots == [sum(len(t) for t in trees[: k + 1]) - 1 for k in range(len(trees))]
    torch.testing.assert_close(fold_h, eager_h)
    assert fold_grads.keys() == eager_grads.keys() == {n for n, _ in model.named_parameters()}
    for name, grad in eager_grads.items():
        torch.testing.assert_close(
            fold_grads[name], grad, msg=lambda m, name=name: f"gradient of {name}: {m}"
        )


@needs_sst
@pytest.mark.parametrize("device", DEVICES)
def test_fold_states_and_gradients_equal_the_eager_recursion_on_real_sst(device: str) -> None:
    trees = _sst_sample()
    vocab = Vocab.build(load_sst(SST_DIR, "dev", max_trees=100))  # so that some words are unknown
    assert any(vocab[w] == vocab.unk_id for t in trees for w in t.words())
    _check_fold_matches_eager(trees, vocab, device)


@pytest.mark.parametrize("device", DEVICES)
def test_fold_matches_eager_on_generated_trees_with_repeated_subtrees(device: str) -> None:
    # A tiny vocabulary makes many identical leaves and subtrees, which the fold records once.
    trees = generate_sst(30, seed=3, max_words=12)
    trees += [parse_tree("(3 (2 (2 a) (2 a)) (2 (2 a) (2 a)))")] * 2
    _check_fold_matches_eager(trees, Vocab.build(trees), device)


@needs_sst
def test_unfold_twin_gives_the_same_states() -> None:
    trees = _sst_sample()[:3]
    vocab = Vocab.build(trees)
    model = _model(vocab)
    unfold = torchfold.EagerFold(model)
    for tree in trees:
        pairs = encode_tree(unfold, tree, vocab)
        [h] = unfold.apply(model, [[node for node, _ in pairs]])
        expected, labels = forward_tree(model, tree, vocab)
        torch.testing.assert_close(h, expected)
        assert [label for _, label in pairs] == labels == [n.label for n in tree.nodes()]


def test_encode_tree_records_one_leaf_or_node_call_per_tree_node_in_post_order() -> None:
    tree = parse_tree("(1 (2 (2 the) (2 plot)) (1 (2 not) (3 good)))")
    vocab = Vocab(["the", "plot", "not", "good"])
    fold = torchfold.Fold()
    pairs = encode_tree(fold, tree, vocab)
    assert [label for _, label in pairs] == [2, 2, 2, 2, 3, 1, 1]
    assert [node.op for node, _ in pairs] == ["leaf", "leaf", "node", "leaf", "leaf", "node", "node"]
    assert [node.depth for node, _ in pairs] == [0, 0, 1, 0, 0, 1, 2]
    assert len(fold) == 7


def test_leaf_and_node_follow_the_binary_tree_lstm_equations() -> None:
    torch.manual_seed(1)
    model = TreeLSTM(10, embedding_dim=6, hidden_dim=4).double()
    size = 4
    ids = torch.tensor([3, 7])
    x = model.embedding(ids)
    W, b = model.leaf_gates.weight, model.leaf_gates.bias
    i, o, u = ((x @ W[k * size : (k + 1) * size].T + b[k * size : (k + 1) * size]) for k in range(3))
    c_leaf = torch.sigmoid(i) * torch.tanh(u)
    h_leaf = torch.sigmoid(o) * torch.tanh(c_leaf)
    h, c = model.leaf(ids)
    torch.testing.assert_close(c, c_leaf)
    torch.testing.assert_close(h, h_leaf)

    h_l, c_l, h_r, c_r = torch.randn(4, 2, size, dtype=torch.float64)
    U, b = model.node_gates.weight, model.node_gates.bias
    gate = [
        h_l @ U[k * size : (k + 1) * size, :size].T
        + h_r @ U[k * size : (k + 1) * size, size:].T
        + b[k * size : (k + 1) * size]
        for k in range(5)
    ]
    i, f_l, f_r, o, u = gate
    c_node = torch.sigmoid(i) * torch.tanh(u) + torch.sigmoid(f_l) * c_l + torch.sigmoid(f_r) * c_r
    h, c = model.node(h_l, c_l, h_r, c_r)
    torch.testing.assert_close(c, c_node)
    torch.testing.assert_close(h, torch.sigmoid(o) * torch.tanh(c_node))
    assert model.logits(h).shape == (2, 5)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"vocab_size": 0}, ValueError, "vocab_size must be a positive int, got 0"),
        ({"vocab_size": 5, "hidden_dim": 2.5}, TypeError, "hidden_dim must be an int, got float 2.5"),
        ({"vocab_size": 5, "num_classes": True}, TypeError, "num_classes must be an int, got bool True"),
    ],
)
def test_tree_lstm_rejects_bad_sizes(kwargs: dict[str, object], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        TreeLSTM(**kwargs)  # type: ignore[arg-type]


def test_tree_lstm_rejects_a_non_bool_sparse() -> None:
    with pytest.raises(TypeError, match="sparse must be a bool, got 1"):
        TreeLSTM(5, sparse=1)  # type: ignore[arg-type]


def test_sparse_tree_lstm_folds_to_the_dense_gradients_and_splits_its_parameters() -> None:
    trees = generate_sst(6, seed=4, max_words=9)
    vocab = Vocab.build(trees)
    dense = _model(vocab)
    sparse = TreeLSTM(len(vocab), embedding_dim=24, hidden_dim=16, sparse=True).double()
    sparse.load_state_dict(dense.state_dict())
    assert dense.sparse_parameters() == [] and len(dense.dense_parameters()) == len(list(dense.parameters()))
    [weight] = sparse.sparse_parameters()
    assert weight is sparse.embedding.weight
    assert all(p is not weight for p in sparse.dense_parameters())
    for model in (dense, sparse):
        fold = torchfold.Fold()
        nodes, labels, _ = encode_trees(fold, trees, vocab)
        [states] = fold.apply(model, [nodes])
        F.cross_entropy(model.logits(states), torch.tensor(labels)).backward()
    grad = sparse.embedding.weight.grad
    assert grad is not None and grad.is_sparse
    torch.testing.assert_close(grad.to_dense(), dense.embedding.weight.grad)
    for (name, p), q in zip(dense.named_parameters(), sparse.parameters(), strict=True):
        if name != "embedding.weight":
            torch.testing.assert_close(q.grad, p.grad)


def test_mlp_folded_single_rows_equal_the_stacked_batch_with_gradients() -> None:
    torch.manual_seed(0)
    model = MLP().double()
    assert [m.out_features for m in model.layers if isinstance(m, torch.nn.Linear)] == [200, 100, 10]
    images = torch.rand(32, 784, dtype=torch.float64)
    labels = torch.arange(32) % 10

    F.cross_entropy(model(images), labels).backward()
    stacked_grads = _grads(model)

    fold = torchfold.Fold()
    nodes = [fold.add("classify", images[i : i + 1]) for i in range(32)]
    [logits] = fold.apply(model, [nodes])
    torch.testing.assert_close(logits, model(images).detach())
    torch.testing.assert_close(model.classify(images), model(images))
    F.cross_entropy(logits, labels).backward()
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, stacked_grads[name])


def test_mlp_sizes_and_errors() -> None:
    model = MLP(in_features=3, hidden=(), num_classes=2)
    assert model(torch.zeros(4, 3)).shape == (4, 2)
    with pytest.raises(ValueError, match=r"hidden\[0\] must be a positive int, got 0"):
        MLP(hidden=(0,))
    with pytest.raises(TypeError, match=r"in_features must be an int, got float 3\.0"):
        MLP(in_features=3.0)  # type: ignore[arg-type]
