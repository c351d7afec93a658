"""Python functions as n-ary trees: the running Python's standard library, parsed with :mod:`ast`.

Real data every machine has: :func:`stdlib_files` lists the ``.py`` files of the standard
library (sorted; tests and site-packages left out), :func:`load_functions` parses them and turns
every function definition into an :class:`AstSample`: a tree of node kinds (``If``, ``Call``,
``Name``, ``Constant:int``, ...; the names and values themselves are left out) and a label,
whether the function returns a value (:func:`returns_value`). Trees are n-ary (a body has as
many children as statements) and deep. The split is by file (every fifth file, in sorted order,
is held out for evaluation) and a tree seen once is kept once, so no function is in both.

The data depends on the Python that runs it (3.11's standard library gives about 8,800 training
and 2,300 held-out functions of 10 to 150 nodes); the selection is deterministic for one Python.
"""

from __future__ import annotations

import ast
import os
import random
import sysconfig
import warnings
from dataclasses import dataclass
from pathlib import Path

from torchfold._validate import check_int

__all__ = [
    "KINDS",
    "AstSample",
    "AstTree",
    "kind_of",
    "load_functions",
    "majority_baseline",
    "python_functions",
    "returns_value",
    "stdlib_files",
]

#: A tree: ``(kind id, (child trees...))``; a leaf has no children.
AstTree = tuple[int, tuple["AstTree", ...]]

_SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
_CONSTANT_TYPES = ("NoneType", "bool", "int", "float", "complex", "str", "bytes", "ellipsis")


def _node_kinds() -> list[str]:
    names = {
        name
        for name in dir(ast)
        if isinstance(getattr(ast, name), type)
        and issubclass(getattr(ast, name), ast.AST)
        and not issubclass(getattr(ast, name), ast.expr_context)
        and getattr(ast, name)._fields is not None
    }
    return sorted(names) + [f"Constant:{t}" for t in _CONSTANT_TYPES]


#: The vocabulary of node kinds: id 0 is an unknown kind, then every ``ast`` node class (by name)
#: and ``Constant:<type>`` for each kind of constant. Fixed: it does not depend on the data.
KINDS: tuple[str, ...] = ("<unk>", *_node_kinds())
_KIND_ID = {name: i for i, name in enumerate(KINDS)}


def kind_of(node: ast.AST) -> int:
    """The kind id of ``node`` in :data:`KINDS` (a constant by the type of its value).

    >>> KINDS[kind_of(ast.parse("x = 1").body[0].value)]
    'Constant:int'
    """
    name = f"Constant:{type(node.value).__name__}" if isinstance(node, ast.Constant) else type(node).__name__
    return _KIND_ID.get(name, 0)


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def returns_value(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether ``function`` has a ``return X`` with ``X`` other than ``None`` in its own body.

    A ``return`` inside a nested function, lambda or class does not count: the label depends on
    where in the tree a ``Return`` stands, not only on its presence.

    >>> returns_value(ast.parse("def f(x):\\n    def g():\\n        return 1\\n    return").body[0])
    False
    >>> returns_value(ast.parse("def f(x):\\n    if x:\\n        return x + 1").body[0])
    True
    """
    stack = list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        if isinstance(node, _SCOPES):
            continue
        if isinstance(node, ast.Return) and node.value is not None:
            value = node.value
            if not (isinstance(value, ast.Constant) and value.value is None):
                return True
        stack.extend(ast.iter_child_nodes(node))
    return False


@dataclass(frozen=True, slots=True)
class AstSample:
    """A function as a tree of node kinds, and its label.

    Args:
        tree: ``(kind id, (children...))`` nested tuples (:data:`KINDS` names the ids).
        label: 1 if the function returns a value (:func:`returns_value`), else 0.
        source: where it is defined, ``path:line name`` (the path relative to the library).
        size: number of nodes.
        depth: nodes on the longest root-to-leaf path.
    """

    tree: AstTree
    label: int
    source: str
    size: int
    depth: int


def _tree(node: ast.AST) -> tuple[AstTree, int, int]:
    """``node`` as an :data:`AstTree` (expression contexts left out), with its size and depth."""
    children = [c for c in ast.iter_child_nodes(node) if not isinstance(c, ast.expr_context)]
    built = [_tree(c) for c in children]
    size = 1 + sum(s for _, s, _ in built)
    depth = 1 + max((d for _, _, d in built), default=0)
    return (kind_of(node), tuple(t for t, _, _ in built)), size, depth


def stdlib_files(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """The ``.py`` files of the standard library under ``root`` (default: the running Python's), sorted.

    Test folders (``test``, ``tests``, ``idle_test``) and installed packages are left out.
    """
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise FileNotFoundError(f"no standard library at {base}: pass root=DIR, a folder of .py files")
    return sorted(p for p in base.rglob("*.py") if not _SKIPPED_DIRS & set(p.relative_to(base).parts[:-1]))


def load_functions(
    root: str | os.PathLike[str] | None = None,
    *,
    min_nodes: int = 10,
    max_nodes: int = 150,
    eval_every: int = 5,
) -> tuple[list[AstSample], list[AstSample]]:
    """Every function of ``min_nodes`` to ``max_nodes`` nodes in the standard library: ``(train, eval)``.

    Files are read in sorted order; every ``eval_every``-th file holds evaluation functions, the
    others training ones. A tree already seen (same kinds, same shape) is left out, so that no
    function is in both. Files that do not parse on this Python are skipped.

    Args:
        root: the folder to read (default: the running Python's standard library).
        min_nodes: smallest function kept, in nodes.
        max_nodes: largest function kept, in nodes.
        eval_every: one file in this many goes to the evaluation split.
    """
    check_int("min_nodes", min_nodes)
    check_int("max_nodes", max_nodes, min_nodes, hint="at least min_nodes")
    check_int("eval_every", eval_every, 2)
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    seen: set[AstTree] = set()
    splits: tuple[list[AstSample], list[AstSample]] = ([], [])
    for index, path in enumerate(stdlib_files(base)):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # invalid escape sequences in old files
                module = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError, UnicodeDecodeError):
            continue
        relative = path.relative_to(base).as_posix()
        split = splits[1] if index % eval_every == eval_every - 1 else splits[0]
        for node in ast.walk(module):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            tree, size, depth = _tree(node)
            if not min_nodes <= size <= max_nodes or tree in seen:
                continue
            seen.add(tree)
            label = int(returns_value(node))
            split.append(AstSample(tree, label, f"{relative}:{node.lineno} {node.name}", size, depth))
    return splits


def python_functions(
    train_size: int | None = 4000,
    eval_size: int | None = 1000,
    *,
    seed: int = 0,
    root: str | os.PathLike[str] | None = None,
    min_nodes: int = 10,
    max_nodes: int = 150,
) -> tuple[list[AstSample], list[AstSample]]:
    """A seeded subset of :func:`load_functions`: ``train_size`` training and ``eval_size`` evaluation functions.

    Args:
        train_size: training functions (``None``: all of them).
        eval_size: evaluation functions (``None``: all of them).
        seed: which subset (a seeded shuffle of each split).
        root, min_nodes, max_nodes: as :func:`load_functions`.

    With ``root``, another folder of Python files (here the standard library's ``email`` package,
    a quick example; the default reads the whole standard library):

    >>> import email, pathlib
    >>> train, held_out = python_functions(20, 10, root=pathlib.Path(email.__file__).parent)
    >>> len(train), len(held_out), {s.label for s in train} <= {0, 1}
    (20, 10, True)
    """
    check_int("train_size", train_size, optional=True)
    check_int("eval_size", eval_size, optional=True)
    train, held_out = load_functions(root, min_nodes=min_nodes, max_nodes=max_nodes)
    rng = random.Random(seed)
    rng.shuffle(train)
    rng.shuffle(held_out)
    return train[:train_size], held_out[:eval_size]


def majority_baseline(samples: list[AstSample]) -> float:
    """The accuracy of always predicting the most common label of ``samples``."""
    ones = sum(s.label for s in samples)
    return max(ones, len(samples) - ones) / max(len(samples), 1)
