"""No module of the package, the benchmarks or the scripts uses another module's private name.

A name that starts with one underscore belongs to its module: another module that imports it
(``from torchfold.x import _y``) or reads it (``x._y`` with ``x`` a module) ties itself to that
module's inside. What is shared is public, in a module whose name says what it holds.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("torchfold", "benchmarks", "scripts")


def _module_name(path: Path, root: Path) -> str:
    """``torchfold.train.schedule.trace`` for a package module; a benchmark or script is imported by its stem."""
    parts = path.relative_to(root).with_suffix("").parts
    if parts[0] != "torchfold":
        return parts[-1]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _uses(path: Path, name: str, modules: set[str]) -> list[str]:
    """The private names of other project modules that the file ``path`` (module ``name``) uses."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    bound: dict[str, str] = {}  # local name -> the project module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                local = alias.asname or alias.name.partition(".")[0]
                bound[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    bound[alias.asname or alias.name] = f"{base}.{alias.name}"
                if _private(alias.name) and base in modules and base != name:
                    found.append(f"line {node.lineno}: from {base} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in bound:
                module = ".".join([bound[value.id], *reversed(chain)])
                if module in modules and module != name:
                    found.append(f"line {node.lineno}: {module}.{node.attr}")
    return sorted(found)


def private_uses(root: Path) -> dict[str, list[str]]:
    """Per file under ``root``'s project folders, its uses of other modules' private names."""
    paths = {
        _module_name(path, root): path for folder in FOLDERS for path in sorted((root / folder).rglob("*.py"))
    }
    modules = set(paths) | {name.rpartition(".")[0] for name in paths if "." in name}
    uses = {str(path.relative_to(root)): _uses(path, name, modules) for name, path in paths.items()}
    return {path: found for path, found in uses.items() if found}


def test_no_module_uses_another_modules_private_name() -> None:
    found = private_uses(ROOT)
    assert not found, (
        "private names used across modules (make them public where they are shared):\n"
        + "\n".join(f"{path} {use}" for path, uses in found.items() for use in uses)
    )


def test_the_check_sees_both_kinds_of_use(tmp_path: Path) -> None:
    package = tmp_path / "torchfold" / "sub"
    package.mkdir(parents=True)
    (tmp_path / "torchfold" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "inner.py").write_text(
        "_secret = 1\nshared = 2\n\n\ndef _helper() -> int:\n    return _secret\n"
    )
    (package / "outer.py").write_text(
        "from torchfold.sub.inner import _secret, shared\n"
        "from torchfold.sub import inner\n"
        "from . import inner as again\n"
        "\n"
        "value = inner._helper() + again._secret + shared + inner.shared\n"
    )
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "bench.py").write_text(
        "import torchfold.sub.inner\n\ntorchfold.sub.inner._helper()\n"
    )
    assert private_uses(tmp_path) == {
        "benchmarks/bench.py": ["line 3: torchfold.sub.inner._helper"],
        "torchfold/sub/outer.py": [
            "line 1: from torchfold.sub.inner import _secret",
            "line 5: torchfold.sub.inner._helper",
            "line 5: torchfold.sub.inner._secret",
        ],
    }


# -- reading another module's objects' private attributes (``fold._tape``) ---------------------


def _own_private_attributes(tree: ast.Module) -> set[str]:
    """The private attributes a module gives its objects: set on an object (``self._x = ...``),
    named in a class body (methods, class attributes, ``__slots__``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    names.add(item.name)
                for target in item.targets if isinstance(item, ast.Assign) else []:
                    if isinstance(target, ast.Name):
                        names.add(target.id)
                        if target.id == "__slots__":
                            names.update(
                                c.value
                                for c in ast.walk(item.value)
                                if isinstance(c, ast.Constant) and isinstance(c.value, str)
                            )
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
    return {name for name in names if _private(name)}


def private_attribute_reads(root: Path) -> dict[str, list[str]]:
    """Per file under ``root``'s project folders, its reads ``obj._name`` of a private attribute
    that only other modules of the package give their objects (``self`` and ``cls`` aside).

    Attributes of other libraries' objects (a tensor's ``_version``) are not the package's, and a
    module may read what it sets itself."""
    paths = sorted(path for folder in FOLDERS for path in (root / folder).rglob("*.py"))
    trees = {path: ast.parse(path.read_text(encoding="utf-8")) for path in paths}
    own = {path: _own_private_attributes(tree) for path, tree in trees.items()}
    package = [path for path in paths if path.relative_to(root).parts[0] == "torchfold"]
    found: dict[str, list[str]] = {}
    for path, tree in trees.items():
        others = set().union(*(own[other] for other in package if other != path))
        reads = sorted(
            {
                ast.unparse(node)
                for node in ast.walk(tree)
                if isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Load)
                and node.attr in others - own[path]
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            }
        )
        if reads:
            found[str(path.relative_to(root))] = reads
    return found


# None left: a node's handle and tape reference are read through node.py's getters
# (``handle_of``, ``tape_ref_of``: the slots' attrgetters, as fast as the bare reads in bulk), and
# the plan runner that also reports each group's argument shapes is plan.py's ``apply_plan``.
KNOWN_PRIVATE_READS: dict[str, list[str]] = {}


def test_no_module_reads_private_attributes_of_another_modules_objects() -> None:
    """``fold._tape``, ``shapes._levels``, ``trace._require_bounded``: what another module needs of
    an object is a public method or property of it."""
    found = private_attribute_reads(ROOT)
    assert found == KNOWN_PRIVATE_READS, (
        "private attributes read across modules (give the object a public method or property; "
        "where one was opened up, shorten KNOWN_PRIVATE_READS):\n"
        + "\n".join(f"{path}: {', '.join(reads)}" for path, reads in found.items())
    )


def test_the_attribute_check_sees_a_read_across_modules(tmp_path: Path) -> None:
    package = tmp_path / "torchfold"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "fold.py").write_text(
        "class Fold:\n"
        "    __slots__ = ('_groups', '_tape')\n\n"
        "    def __init__(self) -> None:\n"
        "        self._tape = []\n"
        "        self._groups = {}\n\n"
        "    def _plan(self) -> int:\n"
        "        return len(self._tape)\n\n\n"
        "def size(fold: Fold) -> int:\n"
        "    return len(fold._tape)\n"  # its own module's object: allowed
    )
    (package / "planner.py").write_text(
        "def plan(fold, tensor):\n"
        "    tensor._version\n"  # another library's attribute: not the package's
        "    return fold._tape, fold._plan(), fold.groups\n"
    )
    assert private_attribute_reads(tmp_path) == {"torchfold/planner.py": ["fold._plan", "fold._tape"]}
