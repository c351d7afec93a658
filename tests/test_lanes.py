"""Every test marked ``xla`` runs in the XLA lane: ``make test-xla`` runs the files its
``XLA_TESTS`` names (one process each), and the other lanes deselect the marker, so a file
missing from that list would never run anywhere."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_file_with_xla_tests_is_in_the_xla_lane() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    block = re.search(r"^XLA_TESTS = ((?:.*\\\n)*.*)$", makefile, re.MULTILINE)
    assert block is not None, "no XLA_TESTS in the Makefile"
    listed = set(block.group(1).replace("\\\n", " ").split())
    marked = {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "tests").rglob("test_*.py")
        if path.name != "test_lanes.py" and "mark.xla" in path.read_text(encoding="utf-8")
    }
    assert marked - listed == set(), f"xla tests outside XLA_TESTS (never run): {sorted(marked - listed)}"
    assert {name for name in listed if not (ROOT / name).is_file()} == set()
