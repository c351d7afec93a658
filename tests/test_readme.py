"""The README's examples run as written: the quickstart (with the plan it shows), DataLoader-built
plans and the training snippet."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_quickstart_runs_and_prints_the_documented_plan() -> None:
    quickstart = next(b for b in python_blocks() if "fold.apply" in b)
    assert len(quickstart.strip().splitlines()) <= 25
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(quickstart, str(README), "exec"), {})
    printed = output.getvalue()
    assert printed.startswith("torch.Size([3, 16])\n")
    shown = re.search(r"```\n(Fold: .*?)```", README.read_text(), flags=re.S)
    assert shown is not None
    assert printed.split("\n", 1)[1] == shown.group(1)


def test_training_snippets_run_the_trace() -> None:
    loop = next(b for b in python_blocks() if "optimizer.minibatch" in b)
    scope: dict[str, object] = {}
    exec(compile(loop, str(README), "exec"), scope)
    assert scope["optimizer"].steps == 5  # type: ignore[attr-defined]
    assert scope["optimizer"].last_batch_size == 32  # type: ignore[attr-defined]
    trainer = next(b for b in python_blocks() if "TraceTrainer" in b)
    exec(
        compile(trainer.replace("tree_lstm_loss)", "tree_lstm_loss, progress=False)"), str(README), "exec"),
        scope,
    )
    stats = scope["stats"]
    assert [s.batch_size for s in stats] == [32, 64, 96, 64, 32]  # type: ignore[attr-defined]
    assert [s.lr for s in stats] == [0.005, 0.01, 0.015, 0.01, 0.005]  # type: ignore[attr-defined]


def test_dataloader_snippet_trains_on_plans_built_in_a_worker() -> None:
    snippet = next(b for b in python_blocks() if "fold.plan" in b)
    scope: dict[str, object] = {}
    exec(compile(snippet, str(README), "exec"), scope)
    loss = scope["loss"]
    assert isinstance(loss, torch.Tensor) and torch.isfinite(loss)
    assert scope["optimizer"].state  # type: ignore[attr-defined]  # Adam stepped
