"""Release check: the wheel installs into a clean virtual environment and runs the README there.

The wheel and the sdist carry the LICENSE. In the clean environment the wheel runs the README's
quickstart, then (with the ``plot`` extra added) every python block of the README, in order in
one script, and every command of its command-line section on the committed test data.

The environment is made with ``python -m venv``, without system or user site-packages, outside
the repository, with no ``PYTHONPATH``. Installing torch there from the index would unpack
gigabytes (CUDA libraries) for minutes, so the venv is lent this environment's torch instead:
a folder of links to exactly torch and the distributions it requires (their files and
metadata, found from torch's own requirements), added to the venv's path after its own
site-packages. Nothing else of this environment is visible: not torchfold (the test checks
that ``import torchfold`` fails before the wheel goes in, and that the imported one comes from
the venv), not numpy or tqdm (pip must install them from the wheel's requirements: the test
checks they are absent first), not matplotlib (a plain install must not pull it in).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import torchfold
from tests.test_readme import cli_argv, cli_commands, python_blocks, quickstart, write_task_module

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def clean_env() -> dict[str, str]:
    """This process's environment without anything that would let the venv see another torchfold."""
    hidden = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "TORCHFOLD_DATA")  # a user's shell has none of them
    env = {k: v for k, v in os.environ.items() if k not in hidden}
    env["PYTHONNOUSERSITE"] = "1"  # no ~/.local site-packages either
    return env


def run(args: list[str | Path], cwd: Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result


def lend_torch(site: Path, into: Path) -> list[str]:
    """Link torch and every distribution it requires (transitively) into ``into``; add it to ``site``."""
    into.mkdir()
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = ["torch"]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # a requirement whose marker is true but which torch does without here
        found[name] = dist
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    for dist in found.values():
        base = Path(str(dist.locate_file("")))
        tops = {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops - {"__pycache__"}:
            if not (into / top).exists():
                (into / top).symlink_to(base / top)
    (site / "lent-torch.pth").write_text(f"{into}\n")
    return sorted(found)


@pytest.fixture(scope="module")
def work() -> Iterator[Path]:
    # Not pytest's tmp_path, which keeps the last runs' folders: each holds a whole venv.
    with tempfile.TemporaryDirectory(prefix="torchfold-wheel-") as directory:
        path = Path(directory).resolve()
        assert not path.is_relative_to(ROOT), f"{path} must lie outside the repository"
        yield path


@pytest.fixture(scope="module")
def wheel(work: Path) -> Path:
    """The wheel, built from a copy of the sources (so no stale build/ folder can leak into it)."""
    source = work / "source"
    source.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, source / name)
    # (without the extension built in place for the editable install: the wheel builds its own)
    shutil.copytree(
        ROOT / "torchfold", source / "torchfold", ignore=shutil.ignore_patterns("__pycache__", "*.so")
    )
    dist = work / "dist"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", dist, source], work)
    (built,) = dist.glob(
        "pytorch_fold-*.whl"
    )  # the distribution's name: `torchfold` on PyPI is another project
    return built


def test_the_sdist_carries_the_license(work: Path, wheel: Path) -> None:
    sdist = run(
        [
            sys.executable,
            "-c",
            "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))",
            work / "sdist",
        ],
        work / "source",
    ).stdout.split()[-1]
    with tarfile.open(work / "sdist" / sdist) as archive:
        names = archive.getnames()
        top = names[0].split("/")[0]
        assert top == f"pytorch_fold-{torchfold.__version__}", names[:3]
        license_file = archive.extractfile(f"{top}/LICENSE")
        assert license_file is not None and license_file.read() == (ROOT / "LICENSE").read_bytes()


def test_wheel_holds_the_package_and_requires_no_extra(wheel: Path) -> None:
    assert wheel.name.startswith(f"pytorch_fold-{torchfold.__version__}-")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
        requires = [
            line.removeprefix("Requires-Dist: ") for line in lines if line.startswith("Requires-Dist: ")
        ]
        license_text = archive.read(metadata.replace("METADATA", "licenses/LICENSE"))
    assert license_text == (ROOT / "LICENSE").read_bytes() and b"Apache License" in license_text
    assert {"Name: pytorch-fold", "License-Expression: Apache-2.0", "License-File: LICENSE"} <= set(lines)
    assert "Classifier: Typing :: Typed" in lines
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "torchfold").rglob("*.py")}
    assert modules <= names, f"missing from the wheel: {sorted(modules - names)}"
    assert "torchfold/py.typed" in names
    # Fold.add's C part, compiled from its source by the build, with its stub
    assert any(re.fullmatch(r"torchfold/engine/_record\.[\w.-]+\.so", n) for n in names), sorted(names)
    assert "torchfold/engine/_record.pyi" in names
    assert {n.split("/")[0] for n in names} == {"torchfold", metadata.split("/")[0]}
    plain = sorted(re.split(r"[<>=! ;\[]", r)[0] for r in requires if "extra ==" not in r)
    assert plain == ["greenlet", "numpy", "torch", "tqdm"]
    # torch_xla imports only beside the torch it was built for: the extra pins the pair
    assert sorted(r.split(";")[0].strip() for r in requires if 'extra == "xla"' in r) == [
        "torch==2.9.0",
        "torch_xla==2.9.0",
    ]
    extras = {m.group(1) for r in requires if (m := re.search(r"extra == \"(\w+)\"", r))}
    assert extras == {"dev", "docs", "integrations", "notebooks", "plot", "tensorboard", "xla"}


@pytest.mark.timeout(1500)
def test_clean_install_runs_the_readme_outside_the_repository(work: Path, wheel: Path) -> None:
    venv = work / "venv"
    run([sys.executable, "-m", "venv", venv], work)
    python = venv / "bin" / "python"
    outside = work / "run"
    outside.mkdir()
    site = run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], outside).stdout
    lent = lend_torch(Path(site.strip()), work / "torch")
    assert "torch" in lent and not {"torchfold", "numpy", "tqdm", "matplotlib"} & set(lent), lent

    for module in ("torchfold", "numpy", "tqdm", "matplotlib"):
        before = subprocess.run(
            [python, "-c", f"import {module}"], cwd=outside, env=clean_env(), capture_output=True, text=True
        )
        assert before.returncode != 0 and f"No module named '{module}'" in before.stderr, (
            f"the venv is not clean: it imports {module} before the wheel is installed"
        )
    assert run([python, "-c", "import torch; print(torch.__version__)"], outside).stdout.strip() == str(
        torch.__version__
    )

    run([python, "-m", "pip", "install", "--quiet", wheel], outside)

    code, shown = quickstart()
    (outside / "quickstart.py").write_text(code)
    printed = run([python, "quickstart.py"], outside).stdout
    assert printed == "torch.Size([3, 16])\n" + shown

    probe = (
        "import importlib.util, torchfold; from torchfold.engine import native; "
        "print(torchfold.__file__); print(torchfold.__version__); "
        "print(importlib.util.find_spec('matplotlib') is None); print(native.enabled())"
    )
    where, version, no_matplotlib, native = run([python, "-c", probe], outside).stdout.split()
    assert native == "True", (
        "the installed wheel records in Python: its extension is missing or fails to import"
    )
    for module in ("numpy", "tqdm"):  # installed by pip from the wheel's requirements, into the venv
        found = run([python, "-c", f"import {module}; print({module}.__file__)"], outside).stdout.strip()
        assert Path(found).is_relative_to(venv), found
    assert Path(where).is_relative_to(venv), f"torchfold imported from {where}, not the clean venv"
    assert version == torchfold.__version__
    assert no_matplotlib == "True", "a plain install must not pull in matplotlib (the plot extra)"
    # Without the plot extra, Fold.draw says which extra to install.
    draw = "import torchfold; f = torchfold.Fold(); f.add('leaf', 1); f.draw()"
    failed = subprocess.run(
        [python, "-c", draw], cwd=outside, env=clean_env(), capture_output=True, text=True
    )
    assert failed.returncode != 0 and "pip install 'pytorch-fold[plot]'" in failed.stderr, failed.stderr
    usage = run([venv / "bin" / "torchfold", "--help"], outside).stdout
    assert usage.startswith("usage: python -m torchfold")

    # With the plot extra (trace plot draws a PNG): every python block of the README, in order in
    # one script as a reader would paste them, then its command-line section on the test data.
    run([python, "-m", "pip", "install", "--quiet", f"{wheel}[plot]"], outside)
    (outside / "readme_blocks.py").write_text("\n".join(python_blocks()))
    run([python, "readme_blocks.py"], outside)
    data = work / "data"
    shutil.copytree(ROOT / "tests" / "data", data)
    # (the one run of that section: the installed package, outside the repository, as a reader runs it)
    commands = cli_commands()
    words = [c.split()[3] for c in commands]
    assert words == ["demo", "trace", "trace", "trace", "train", "train", "train", "elastic"], words
    write_task_module(outside)  # the current folder: where --task my_tasks:make_task is found
    for command in commands:  # in order: train reads the trace that convert wrote
        run(cli_argv(command, data, str(python)), outside)
    assert (outside / "tpu.csv").is_file() and (outside / "tpu.png").is_file()
    assert list((outside / "runs" / "tpu").glob("*")), "train wrote no checkpoint"
    assert (outside / "runs" / "elastic" / "steps.csv").is_file()
