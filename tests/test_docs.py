"""The documentation stays whole: its examples run, every page is in the nav, every public module
has an API page. (``make docs`` builds it with ``mkdocs build --strict``.)"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_hooks" not in p.parts)


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", page.read_text(), flags=re.S | re.M)


# What each page's examples print, as the page says in its comments.
PRINTS = {
    "index.md": "tensor([1., 3., 5.])\n",
    "guide/engine.md": (
        "Fold: 15 nodes in 4 batched groups over 4 depths\n"
        "  depth 0: leaf x 9 (int64[9])\n"
        "  depth 1: node x 3 (float32[3x16], float32[3x16])\n"
        "  depth 2: node x 2 (float32[2x16], float32[2x16])\n"
        "  depth 3: node x 1 (float32[1x16], float32[1x16])\n"
        "depth 5\nready 3\n"
    ),
    "guide/static-shapes.md": "torch.Size([3, 1]) torch.Size([16, 1])\n",
    "guide/training.md": "[32, 64, 96, 64, 32]\n2\n(4, ['eval/samples'])\n",
    "guide/your-model.md": "parity 48\n",
}


# Pages whose examples need an extra: a lane of their own runs them (and checks their results).
RUN_ELSEWHERE = {"guide/lightning-accelerate.md": "tests/integrations (make test-integrations)"}


@pytest.mark.parametrize(
    "page",
    [p for p in PAGES if python_blocks(p) and p.relative_to(DOCS).as_posix() not in RUN_ELSEWHERE],
    ids=lambda p: str(p.relative_to(DOCS)),
)
def test_python_examples_run(page: Path) -> None:
    # A page's blocks run in order in one namespace, as a reader would type them.
    out = io.StringIO()
    scope: dict[str, object] = {}
    with contextlib.redirect_stdout(out):
        for block in python_blocks(page):
            exec(compile(block, str(page), "exec"), scope)
    name = page.relative_to(DOCS).as_posix()
    assert out.getvalue().startswith(PRINTS[name]), (name, out.getvalue())


def _hook(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, DOCS / "_hooks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_page_is_in_the_nav() -> None:
    # docs/ pages, and the benchmark results the repo_files hook serves from the repository
    nav = set(re.findall(r":\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M))
    served = {path for path in _hook("repo_files").repository_files() if path.endswith(".md")}
    assert "benchmarks/results/tree_lstm.md" in served
    assert nav == {p.relative_to(DOCS).as_posix() for p in PAGES} | served


def test_the_site_links_the_notebooks_and_the_benchmark_results() -> None:
    served = set(_hook("repo_files").repository_files())
    notebooks = {f"notebooks/{p.name}" for p in (ROOT / "notebooks").glob("*.ipynb")}
    assert len(notebooks) == 7 and notebooks <= served
    listed = set(re.findall(r"\]\((notebooks/[^)]+\.ipynb)\)", (DOCS / "notebooks.md").read_text()))
    assert listed == notebooks
    assert "](benchmarks/results/" in (DOCS / "contributing.md").read_text()


def test_every_public_module_has_an_api_page() -> None:
    documented = {
        line.split()[1]
        for page in (DOCS / "api").glob("*.md")
        for line in page.read_text().splitlines()
        if line.startswith("::: ")
    }
    modules = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for sub in ("engine", "train", "examples")
        for p in (ROOT / "torchfold" / sub).rglob("*.py")
        if not p.name.startswith("_")
    }
    assert modules - documented == set()
    assert {
        "torchfold",
        "torchfold.engine",
        "torchfold.train",
        "torchfold.examples",
        "torchfold.cli",
    } <= documented


def test_pictures_match_the_repository_originals() -> None:
    # mkdocs serves only what is under docs/, so the engine page keeps copies of img/.
    for copy in (DOCS / "guide" / "img").iterdir():
        assert copy.read_bytes() == (ROOT / "img" / copy.name).read_bytes(), copy.name


def test_doctest_blocks_render_as_code() -> None:
    spec = importlib.util.spec_from_file_location("doctest_fences", DOCS / "_hooks" / "doctest_fences.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = "Example:\n    >>> [[1, 2]]\n    [[1, 2]]\n\nAfter."
    assert (
        module.fence_doctests(text)
        == "Example:\n    ```pycon\n    >>> [[1, 2]]\n    [[1, 2]]\n    ```\n\nAfter."
    )
