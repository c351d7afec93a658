"""The README's examples run as written (the quickstart with the plan it shows, DataLoader-built
plans, the training snippets), and the README stays a user guide: short, no lab notes, no dead links."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def quickstart() -> tuple[str, str]:
    """The Quickstart section's one python block and the output block shown under it."""
    section = re.search(r"^## Quickstart\n(.*?)^## ", README.read_text(), flags=re.S | re.M)
    assert section is not None, "README.md has no '## Quickstart' section"
    blocks = re.findall(r"^```(\w*)\n(.*?)^```$", section.group(1), flags=re.S | re.M)
    code = [body for lang, body in blocks if lang == "python"]
    shown = [body for lang, body in blocks if not lang]
    assert len(code) == 1 and len(shown) == 1, "the Quickstart has one python block and its output"
    return code[0], shown[0]


def test_quickstart_runs_and_prints_the_documented_plan() -> None:
    code, shown = quickstart()
    assert len(code.strip().splitlines()) <= 25
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(code, str(README), "exec"), {})
    assert output.getvalue() == "torch.Size([3, 16])\n" + shown


def test_readme_is_a_short_user_guide() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 350
    for heading in ("## Install", "## Quickstart", "## How it works", "## Command line", "## API map"):
        assert f"\n{heading}\n" in text, heading
    assert "make demo" in text and "make test" in text
    # No lab notebook: issue numbers, commit hashes, run numbers.
    assert not re.search(r"\bissue \d+|#\d+\b|\brun \d+\b", text, flags=re.I)
    hashes = [
        w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"[a-f]", w) and re.search(r"\d", w)
    ]
    assert not hashes, hashes


def test_readme_links_point_at_files_that_exist() -> None:
    text = README.read_text()
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (README.parent / target).exists(), target


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


def test_captured_step_snippet_runs_the_trace_in_a_loop_of_ones_own() -> None:
    scope: dict[str, object] = {}
    exec(compile(next(b for b in python_blocks() if "optimizer.minibatch" in b), str(README), "exec"), scope)
    exec(compile(next(b for b in python_blocks() if "captured_step" in b), str(README), "exec"), scope)
    losses = scope["losses"]
    assert len(losses) == 5 and all(isinstance(x, float) and x > 0 for x in losses)  # type: ignore[arg-type, attr-defined]
    assert scope["optimizer"].steps == 10 and scope["optimizer"].last_batch_size == 32  # type: ignore[attr-defined]


def test_dataloader_snippet_trains_on_plans_built_in_a_worker() -> None:
    snippet = next(b for b in python_blocks() if "fold.plan" in b)
    scope: dict[str, object] = {}
    exec(compile(snippet, str(README), "exec"), scope)
    loss = scope["loss"]
    assert isinstance(loss, torch.Tensor) and torch.isfinite(loss)
    assert scope["optimizer"].state  # type: ignore[attr-defined]  # Adam stepped
