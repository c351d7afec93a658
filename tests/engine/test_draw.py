"""Fold.draw: the picture of a fold, and the error naming the ``plot`` extra when matplotlib is missing."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torchfold

ROOT = Path(__file__).resolve().parents[2]


def test_draw_saves_a_picture(tmp_path: Path) -> None:
    fold = torchfold.Fold()
    fold.add("node", fold.add("leaf", 1), fold.add("leaf", 2))
    fold.draw(tmp_path / "fold.png")
    assert (tmp_path / "fold.png").stat().st_size > 0


def test_draw_without_matplotlib_names_the_plot_extra() -> None:
    # A fresh interpreter with matplotlib blocked, as if the extra were not installed; the rest
    # of the engine still works there.
    script = textwrap.dedent(
        """
        import sys
        sys.modules["matplotlib"] = None
        import torchfold
        fold = torchfold.Fold()
        fold.add("leaf", 1)
        try:
            fold.draw()
        except ImportError as error:
            print(type(error).__name__)
            print(error)
        else:
            print("no error")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    kind, message = result.stdout.splitlines()[:2]
    assert kind == "ModuleNotFoundError"  # the import error's own type, not a new one
    assert message.startswith("Fold.draw needs matplotlib")
    assert "pip install 'pytorch-fold[plot]'" in message
