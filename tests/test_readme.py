"""The README's quickstart runs as written and prints the plan it shows."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_quickstart_runs_and_prints_the_documented_plan() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    quickstart = next(b for b in blocks if "fold.apply" in b)
    assert len(quickstart.strip().splitlines()) <= 25
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(quickstart, str(README), "exec"), {})
    printed = output.getvalue()
    assert printed.startswith("torch.Size([3, 16])\n")
    shown = re.search(r"```\n(Fold: .*?)```", README.read_text(), flags=re.S)
    assert shown is not None
    assert printed.split("\n", 1)[1] == shown.group(1)
