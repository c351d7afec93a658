"""The package's layout keeps its architecture: no import cycles, the engine apart, a light root."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "torchfold"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(path: Path, types: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """The absolute import statements of ``path`` at any level (in functions too), but those under
    ``if TYPE_CHECKING`` (for annotations alone) unless ``types``."""

    def visit(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not types:
            for child in node.orelse:
                yield from visit(child)
            return
        if isinstance(node, ast.Import) or (
            isinstance(node, ast.ImportFrom) and node.module and node.level == 0
        ):
            yield node
        for child in ast.iter_child_nodes(node):
            yield from visit(child)

    return visit(ast.parse(path.read_text(encoding="utf-8")))


def _imports(path: Path, modules: set[str], types: bool = False) -> set[str]:
    """The torchfold modules ``path`` imports at run time, at any level (in functions too; with
    ``types``, also those under ``if TYPE_CHECKING``, for annotations alone)."""
    found: set[str] = set()
    for node in _import_nodes(path, types):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else str(node.module))
        else:
            found.update(alias.name for alias in node.names)
    return {name for name in found if name in modules}


def _graph(types: bool = False) -> dict[str, set[str]]:
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    # compiled modules (their stubs say they exist) import no torchfold module
    compiled = {_module_name(path) for path in PACKAGE.rglob("*.pyi")} - set(paths)
    modules = set(paths) | compiled
    # (a package's own type imports name what its __getattr__ loads lazily: no need of them)
    graph = {
        name: _imports(path, modules, types and path.name != "__init__.py") - {name}
        for name, path in paths.items()
    }
    graph.update({name: set() for name in compiled})
    # A module's import also runs its package's __init__: count that edge too.
    for name, deps in graph.items():
        for dep in list(deps):
            parent = dep.rpartition(".")[0]
            while parent and parent != "torchfold":
                if parent != name and not name.startswith(parent + "."):
                    deps.add(parent)
                parent = parent.rpartition(".")[0]
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in graph[node]:
            if dep not in index:
                strongconnect(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            strongconnect(node)
    return found


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


# The static-shapes modules still name each other's types (the layout's ``Slot`` in the padded
# plan's annotations, the padded plan in the layout's code): that one is known.
KNOWN_TYPE_CYCLES = ("torchfold.engine.static.",)


def test_no_import_cycles_through_type_imports() -> None:
    """Imports for annotations alone count too: a module that needs another's type while that one
    imports it (plot.py and trace.py did) is one concept split in two, or a type to move."""
    cycles = [
        cycle
        for cycle in _cycles(_graph(types=True))
        if not all(module.startswith(KNOWN_TYPE_CYCLES) for module in cycle)
    ]
    assert cycles == []


def test_imports_in_functions_and_for_types_are_seen(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(
        "from typing import TYPE_CHECKING\n\n"
        "if TYPE_CHECKING:\n    from torchfold.train.schedule.trace import BatchSizeTrace\n\n\n"
        "def f() -> None:\n    from torchfold.train.schedule.plot import plot_trace\n"
    )
    modules = {"torchfold.train.schedule.trace", "torchfold.train.schedule.plot"}
    assert _imports(tmp_path / "m.py", modules) == {"torchfold.train.schedule.plot"}
    assert _imports(tmp_path / "m.py", modules, types=True) == modules


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("forbidden", ["torchfold.train", "torchfold.examples", "torchfold.cli"])
def test_engine_imports_nothing_above_it(forbidden: str) -> None:
    graph = _graph()
    engine = {name: deps for name, deps in graph.items() if name.startswith("torchfold.engine")}
    assert engine, "no engine modules found"
    offenders = {name: sorted(d for d in deps if d.startswith(forbidden)) for name, deps in engine.items()}
    assert {name: deps for name, deps in offenders.items() if deps} == {}


# The layers, bottom to top: a module imports modules of its own layer and of the layers below,
# never one above. ``x.*`` is the package ``x`` and every module under it; a plain name is that
# module alone (the ``torchfold.train`` package re-exports the layers' public names, so it sits
# above them all, though its subpackages are below it). Where the two modules at the top of
# ``torchfold/train/`` sit, by their imports: ``loss`` (``PlanLoss``, a protocol) imports nothing of
# the training half and the optimizer's precision and the runners name it, so it is the bottom;
# ``task`` imports nothing of it either and nothing of it imports ``task`` (the CLI and the examples
# do): the loop runs without a task, so it sits above the loop.
LAYERS: list[tuple[str, ...]] = [
    ("torchfold._deprecation", "torchfold._errors", "torchfold._validate", "torchfold._version"),
    # the engine, bottom to top: the recorded graph, its plans and their execution, the front ends
    ("torchfold.engine._record", "torchfold.engine.native", "torchfold.engine.devices"),
    ("torchfold.engine.node",),
    (
        "torchfold.engine.ir",
        "torchfold.engine.ops",
        "torchfold.engine.resolve",
        "torchfold.engine.draw",
        "torchfold.engine.readiness",
    ),
    ("torchfold.engine.executor",),
    ("torchfold.engine.static.*",),
    ("torchfold.engine.plan",),
    ("torchfold.engine.planner",),
    ("torchfold.engine.fold", "torchfold.engine.eager", "torchfold.engine.autobatching"),
    ("torchfold.engine",),
    ("torchfold.train.loss", "torchfold.train.persample"),
    ("torchfold.train.distributed.*",),
    ("torchfold.train.optim.*",),
    ("torchfold.train.schedule.*",),
    ("torchfold.train.data.*",),
    ("torchfold.train.capture.*",),
    ("torchfold.train.loop.*",),
    ("torchfold.train.task",),
    ("torchfold.train",),
    ("torchfold.examples.*",),
    ("torchfold.cli.*",),
    ("torchfold", "torchfold.__main__"),
]


def _layer_of(module: str, layers: list[tuple[str, ...]]) -> int | None:
    """The index in ``layers`` of the layer that holds ``module`` (None: in none of them)."""
    for number, entries in enumerate(layers):
        for entry in entries:
            package = entry.removesuffix(".*")
            if module == package or (entry.endswith(".*") and module.startswith(package + ".")):
                return number
    return None


def _upward(graph: dict[str, set[str]], layers: list[tuple[str, ...]], layer: int) -> dict[str, list[str]]:
    """Each module of layer number ``layer`` that imports a module of a layer above it, with those modules."""
    offenders = {
        name: sorted(dep for dep in deps if (_layer_of(dep, layers) or 0) > layer)
        for name, deps in graph.items()
        if _layer_of(name, layers) == layer
    }
    return {name: deps for name, deps in offenders.items() if deps}


def test_every_module_has_a_layer() -> None:
    """A new module or subpackage is placed in ``LAYERS`` (by where its imports put it)."""
    assert sorted(name for name in _graph() if _layer_of(name, LAYERS) is None) == []


@pytest.mark.parametrize(
    "layer", range(len(LAYERS)), ids=[entries[0].removesuffix(".*") for entries in LAYERS]
)
def test_no_import_points_up(layer: int) -> None:
    assert _upward(_graph(), LAYERS, layer) == {}


@pytest.mark.parametrize(
    "layer", range(len(LAYERS)), ids=[entries[0].removesuffix(".*") for entries in LAYERS]
)
def test_no_type_import_points_up(layer: int) -> None:
    """Imports for annotations alone keep the order too: a type a lower layer needs from a higher
    one is a type in the wrong layer (the runner's mechanisms' types, which the trainer's
    ``compiled`` and ``replay`` name, are below the loop)."""
    assert _upward(_graph(types=True), LAYERS, layer) == {}


def test_the_layer_check_finds_an_import_between_layers() -> None:
    layers = [("lib.low",), ("lib.high.*",), ("lib",)]
    graph = {
        "lib.low": {"lib.high.a"},
        "lib.high.a": {"lib.low"},
        "lib.high.b": {"lib"},
        "lib": {"lib.high.b"},
    }
    assert _layer_of("lib.high", layers) == 1 and _layer_of("lib.other", layers) is None
    assert _upward(graph, layers, 0) == {"lib.low": ["lib.high.a"]}
    assert _upward(graph, layers, 1) == {"lib.high.b": ["lib"]}
    assert _upward(graph, layers, 2) == {}


# What the modules outside ``torchfold/train/capture/`` may import from it: the runner and the
# captured step, never a mechanism behind them (``compiled``, ``cuda_replay``, ``xla_programs``,
# ``guards``): the runner picks and drives those. One name a line.
CAPTURE_NAMES_OUTSIDE = {
    "StepMechanism",
    "StepRunner",
    "step_runner",
    "CapturedStep",
    "captured_step",
}
# Benchmarks that time one mechanism itself (a program, a capture), not a run of the trainer.
MECHANISM_BENCHMARKS = {"xla.py", "xla_profile.py", "xla_dots.py", "gpu_tree_lstm.py", "dynamo_guard_cost.py"}
CAPTURE = "torchfold.train.capture"


def _names_from_capture(path: Path) -> list[str]:
    """What the file ``path`` imports at run time from ``torchfold.train.capture`` (its package or
    modules), ``line N: name`` each; a module imported whole (``import torchfold.train.capture.x``,
    ``from torchfold.train import capture``) is its name. Imports under ``if TYPE_CHECKING`` name
    types for annotations and run nothing: the layer checks above see those."""
    found: list[str] = []
    for node in _import_nodes(path):
        if isinstance(node, ast.ImportFrom):
            module = str(node.module)
            for alias in node.names:
                full = f"{module}.{alias.name}"
                if module == CAPTURE or module.startswith(CAPTURE + "."):
                    found.append(f"line {node.lineno}: {alias.name}")
                elif full == CAPTURE or full.startswith(CAPTURE + "."):
                    found.append(f"line {node.lineno}: {full}")
        else:
            found.extend(
                f"line {node.lineno}: {alias.name}"
                for alias in node.names
                if alias.name == CAPTURE or alias.name.startswith(CAPTURE + ".")
            )
    return found


def _capture_mechanisms_named(package: Path) -> dict[str, list[str]]:
    """Per file of ``package`` outside its ``train/capture/``, the names it imports from capture
    beyond ``CAPTURE_NAMES_OUTSIDE``."""
    offenders = {
        str(path.relative_to(package.parent)): [
            use for use in _names_from_capture(path) if use.partition(": ")[2] not in CAPTURE_NAMES_OUTSIDE
        ]
        for path in sorted(package.rglob("*.py"))
        if (package / "train" / "capture") not in path.parents
    }
    return {path: uses for path, uses in offenders.items() if uses}


def test_only_the_runner_is_named_outside_capture() -> None:
    """Above the step mechanisms, code asks :class:`StepMechanism` how steps run and drives the
    runner it makes; which mechanism runs a step (eager, ``torch.compile``, CUDA graph replay, XLA
    programs) is capture's. The benchmarks and scripts too, but those that time one mechanism."""
    assert _capture_mechanisms_named(PACKAGE) == {}
    root = PACKAGE.parent
    tools = [p for folder in ("benchmarks", "scripts") for p in sorted((root / folder).rglob("*.py"))]
    assert any(p.name == "variable_trace.py" for p in tools)
    offenders = {
        str(p.relative_to(root)): uses
        for p in tools
        if p.name not in MECHANISM_BENCHMARKS
        and (uses := [u for u in _names_from_capture(p) if u.partition(": ")[2] not in CAPTURE_NAMES_OUTSIDE])
    }
    assert offenders == {}


def test_the_capture_check_finds_a_mechanism_named_outside(tmp_path: Path) -> None:
    package = tmp_path / "torchfold"
    (package / "train" / "capture").mkdir(parents=True)
    (package / "train" / "capture" / "runner.py").write_text(
        "from torchfold.train.capture.compiled import CompiledLoss\n"  # inside capture: its own
    )
    (package / "cli.py").write_text(
        "from typing import TYPE_CHECKING\n\n"
        "from torchfold.train.capture import StepRunner, step_runner\n"
        "from torchfold.train import capture\n\n"
        "if TYPE_CHECKING:\n    from torchfold.train.capture.cuda_replay import CudaStepReplay\n\n\n"
        "def run() -> None:\n    from torchfold.train.capture.compiled import wants_compile\n"
        "    import torchfold.train.capture.guards\n"
    )
    assert _capture_mechanisms_named(package) == {
        "torchfold/cli.py": [
            "line 4: torchfold.train.capture",
            "line 11: wants_compile",
            "line 12: torchfold.train.capture.guards",
        ]
    }


def test_nothing_imports_the_cli() -> None:
    graph = _graph()
    users = {name for name, deps in graph.items() if any(d.startswith("torchfold.cli") for d in deps)}
    assert {name for name in users if not name.startswith("torchfold.cli")} <= {"torchfold.__main__"}


def test_at_most_eight_modules_at_the_root() -> None:
    assert len(list(PACKAGE.glob("*.py"))) <= 8


def test_import_torchfold_is_light() -> None:
    code = "import sys, torchfold; print(sorted(m for m in sys.modules if m.startswith('torchfold')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = eval(out)
    heavy = [m for m in loaded if m.startswith(("torchfold.train", "torchfold.examples", "torchfold.cli"))]
    assert heavy == []
    modules = eval(
        subprocess.run(
            [sys.executable, "-c", "import sys, torchfold; print(sorted(sys.modules))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    assert "matplotlib" not in modules
    assert "greenlet" not in modules  # loaded by the first autobatch call


def test_shipped_code_assumes_no_data_directory() -> None:
    mentions = [str(p) for p in PACKAGE.rglob("*.py") if "shared/data" in p.read_text(encoding="utf-8")]
    assert mentions == []


def test_subpackages_load_lazily() -> None:
    import torchfold

    assert torchfold.train.StepLoader.__name__ == "StepLoader"
    assert torchfold.examples.datasets.__name__ == "torchfold.examples.datasets"


# The device policy: the only modules that ask what kind a device is. Everything else asks them
# (on_host, is_cuda, is_xla, needs_static_shapes, runner_kind...), so a new kind of device, or a
# new answer for one, is one edit.
_DEVICE_POLICY = {"torchfold.engine.devices", "torchfold.train.distributed.devices"}


def _is_kind_of_device(node: ast.expr) -> bool:
    """``x.type`` (a device's kind), or ``str(...)`` of something named a device (``str(device)``)."""
    if isinstance(node, ast.Attribute):
        return node.attr == "type"
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "str"
        and "device" in ast.unparse(node).lower()
    )


def _device_kind_tests(path: Path) -> list[int]:
    """The lines of ``path`` that test a device's kind: a comparison with ``x.type`` on either side
    (``device.type == "xla"``, ``"cuda" != t.device.type``, ``d.type in (...)``), or a string test
    of ``str(device)`` / ``x.type`` (``str(device).startswith("xla")``, ``"cuda" in str(device)``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(side, ast.Attribute) and side.attr == "type" for side in sides) or (
                any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)
                and any(_is_kind_of_device(side) for side in node.comparators)
            ):
                found.append(node.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("startswith", "endswith")
            and _is_kind_of_device(node.func.value)
        ):
            found.append(node.lineno)
    return found


def _device_kind_testers(root: Path = PACKAGE) -> dict[str, list[int]]:
    tests = {
        _module_name(p) if root == PACKAGE else str(p): _device_kind_tests(p) for p in root.rglob("*.py")
    }
    return {name: lines for name, lines in tests.items() if lines}


def test_only_the_device_policy_tests_a_devices_kind() -> None:
    testers = _device_kind_testers()
    assert {name: lines for name, lines in testers.items() if name not in _DEVICE_POLICY} == {}
    assert set(_graph()) >= _DEVICE_POLICY  # the allowed modules exist (renamed: update the list)


def test_the_device_kind_finder_sees_each_form(tmp_path: Path) -> None:
    forms = [
        'device.type == "xla"',
        '"cuda" != tensor.device.type',
        'torch.device(d).type in ("cpu", "cuda")',
        'str(device).startswith("xla")',
        '"cuda" in str(device)',
    ]
    for number, form in enumerate(forms):
        (tmp_path / f"m{number}.py").write_text(
            f"import torch\n\ndef f(device, tensor, d):\n    return {form}\n"
        )
    fine = 'def g(device, name, error):\n    return is_xla(device), name == "type", "CUDA" in str(error)\n'
    (tmp_path / "fine.py").write_text(fine)
    assert _device_kind_testers(tmp_path) == {str(tmp_path / f"m{n}.py"): [4] for n in range(len(forms))}
