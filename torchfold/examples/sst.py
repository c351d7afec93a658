"""SST (the Stanford Sentiment Treebank): trees, their parser, the splits, labels and a vocabulary.

SST comes as one PTB s-expression per line with a 0-4 sentiment label at every node::

    (3 (2 (2 The) (2 Rock)) (4 (3 (2 is) (4 ...)) (2 .)))

:func:`parse_tree` turns a line into an immutable :class:`Tree` whose leaves carry a word and
a label (the unary preterminals ``(2 The)`` become leaves) and whose internal nodes have
exactly two children. :func:`load_sst` reads a split from a directory (an argument, else
``$TORCHFOLD_DATA``: :func:`~torchfold.examples.datadir.data_root`), and :class:`Vocab` maps
words to ids. Without the data, :func:`torchfold.examples.generated.generate_sst` makes
SST-format trees.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from torchfold._validate import check_int
from torchfold.examples.datadir import ENV_VAR, data_root

__all__ = [
    "NEUTRAL",
    "NUM_FINE_LABELS",
    "SST_SPLITS",
    "Tree",
    "TreeParseError",
    "Vocab",
    "binary_label",
    "binary_trees",
    "fine_label",
    "load_sst",
    "parse_tree",
    "read_sst_file",
]

SST_SPLITS = ("train", "dev", "test")
NUM_FINE_LABELS = 5
NEUTRAL = 2


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
    children. Labels are SST's five sentiment classes, integers 0-4.

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
            if label >= NUM_FINE_LABELS:  # else a model's loss fails later, naming no line
                raise fail(
                    f"expected a label from 0 to {NUM_FINE_LABELS - 1} (SST's sentiment classes), got {label}",
                    i + 1,
                )
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

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as root:  # SST's layout: DIR/sst/dev.txt (or DIR/dev.txt)
    ...     (Path(root) / "sst").mkdir()
    ...     _ = (Path(root) / "sst" / "dev.txt").write_text("(3 (2 a) (3 (3 good) (2 film)))\\n")
    ...     trees = load_sst(root, "dev")
    >>> trees[0].label, trees[0].words()
    (3, ['a', 'good', 'film'])
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
        check_int("min_count", min_count, hint="how often a word must be seen to be kept")
        check_int("max_size", max_size, 0, optional=True, hint="how many words to keep; None: all")
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
