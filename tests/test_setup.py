"""``setup.py``'s extras: ``pip install -e '.[dev]'`` then ``pytest`` has what the tests import."""

from __future__ import annotations

import re
import runpy
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]


def _extras() -> dict[str, list[str]]:
    """``extras_require`` as setup.py passes it (setup() itself is not run)."""
    captured: dict[str, Any] = {}
    with mock.patch("setuptools.setup", lambda **kwargs: captured.update(kwargs)):
        runpy.run_path(str(ROOT / "setup.py"))
    return dict(captured["extras_require"])


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_the_dev_extra_holds_every_extra_the_tests_import() -> None:
    extras = _extras()
    dev = _names(extras["dev"])
    # tests/test_docs.py (the docs' hooks import mkdocs and griffe), tests/test_notebooks.py (nbclient
    # and a kernel running the notebooks), the plots' tests, the TensorBoard writer's test
    for extra in ("docs", "notebooks", "plot", "tensorboard"):
        assert _names(extras[extra]) <= dev, (extra, _names(extras[extra]) - dev)
    assert {"pytest", "pytest-timeout", "hypothesis", "mkdocs", "nbclient", "ipykernel"} <= dev
    assert len(extras["dev"]) == len(set(extras["dev"])), extras["dev"]  # each requirement once
