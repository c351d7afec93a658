"""The README's examples run as written (the quickstart with the plan it shows, DataLoader-built
plans, the training snippets), and the README stays a user guide: short, no lab notes, no dead links."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
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


# The README's command-line section names its inputs by placeholder; the test data stands for them.
CLI_INPUTS = {
    "path/to/sst": "sst",
    "trace.csv": "traces/step_batchsize_example.csv",
    "tpu_availability.csv": "traces/gcp_tpuv2-8_cores.csv",
    "gpu_availability.csv": "traces/gcp_a100_gpus.csv",
}
# Appended to the long-running commands so that a test runs them in seconds: smaller models,
# fewer trees and steps. Options given later win; none of them changes what is checked up front.
CLI_QUICK = {
    "demo": ["--max-train", "60", "--max-dev", "20", "--embedding-dim", "8", "--hidden-dim", "8"],
    "train": ["--max-steps", "2", "--embedding-dim", "8", "--hidden-dim", "8"],
    "elastic": ["--max-steps", "4", "--max-train", "48"],
}
# For train --task TASK, in place of CLI_QUICK["train"] (whose size flags are the sst task's): the
# pyast task reads the functions of torchfold's own sources instead of the whole standard library.
TASK_QUICK = {
    "pyast": [
        "--max-steps", "2", "--task-arg", f"root={README.parent / 'torchfold'}",
        "--task-arg", "eval_size=16", "--task-arg", "hidden_dim=8",
    ],
    "my_tasks:make_task": ["--max-steps", "2"],
}  # fmt: skip
GUIDE = README.parent / "docs" / "guide" / "your-model.md"


def write_task_module(folder: Path) -> None:
    """The guide's ``my_tasks.py``, which the README's ``--task my_tasks:make_task`` names, into ``folder``."""
    [module] = [b for b in re.findall(r"^```python\n(.*?)^```$", GUIDE.read_text(), flags=re.S | re.M)
                if b.startswith('"""my_tasks.py"""')]  # fmt: skip
    (folder / "my_tasks.py").write_text(module)


def cli_commands() -> list[str]:
    """The ``python -m torchfold ...`` lines of the README's "Command line" section, comments cut."""
    section = re.search(r"^## Command line\n(.*?)^## ", README.read_text(), flags=re.S | re.M)
    assert section is not None, "README.md has no '## Command line' section"
    blocks = re.findall(r"^```bash\n(.*?)^```$", section.group(1), flags=re.S | re.M)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith("python -m torchfold ")]


def cli_argv(command: str, data: Path, python: str) -> list[str]:
    """``command`` as an argument list: ``python`` for python, the test data for the placeholders,
    and the quick options of :data:`CLI_QUICK` (:data:`TASK_QUICK` for a ``--task``) appended."""
    argv = [str(data / CLI_INPUTS[word]) if word in CLI_INPUTS else word for word in shlex.split(command)]
    assert argv[:3] == ["python", "-m", "torchfold"], command
    task = argv[argv.index("--task") + 1] if "--task" in argv else None
    quick = TASK_QUICK[task] if task is not None else CLI_QUICK.get(argv[3], [])
    return [python, *argv[1:], *quick]


def test_install_leads_with_what_works_today() -> None:
    section = re.search(r"^## Install\n(.*?)^## ", README.read_text(), flags=re.S | re.M)
    assert section is not None
    commands = re.findall(r"^pip install (\S+)", section.group(1), flags=re.M)
    # from the clone; the registry's name only once a release is published, after the lines that work now
    assert commands[0] == ".", commands
    registry = [c for c in commands if "pytorch-fold" in c and not c.startswith("dist/")]
    assert not registry, registry
    assert "`pip install pytorch-fold`" in section.group(1)


def test_the_api_map_names_modules_where_they_are() -> None:
    """Every module the API map names imports without a warning that it moved, and every name it
    lists is found where its row says: ``from torchfold.train.schedule import BatchSizeTrace`` once
    failed, the map having said so."""
    section = re.search(r"^## API map\n(.*?)^## |^## API map\n(.*)", README.read_text(), flags=re.S | re.M)
    assert section is not None
    rows: list[tuple[list[str], list[str]]] = []
    for row in re.findall(r"^\| (`torchfold[^|]*) \| ([^|]*) \|$", section.group(0), flags=re.M):
        names = re.findall(r"`([.\w]+)`", row[0])
        parent = names[0].rpartition(".")[0]
        modules = [names[0]] + [parent + name for name in names[1:]]  # `.node` beside `torchfold.engine.fold`
        # the names it holds: every `identifier` or `dotted.path` (not `python -m torchfold`, `elastic run`);
        # those after "`sub.module`: " are read as a reader reads them, in that submodule
        text = re.sub(
            r"`([\w.]+)`: ((?:`[\w.]+`(?:, )?)+)",
            lambda m: ", ".join(f"`{m.group(1)}.{name}`" for name in re.findall(r"`([\w.]+)`", m.group(2))),
            row[1],
        )
        rows.append((modules, re.findall(r"`([A-Za-z_]\w*(?:\.\w+)*)`", text)))
    modules = [m for row_modules, _ in rows for m in row_modules]
    listed = [name for _, names in rows for name in names]
    assert "torchfold.engine.node" in modules and "schedule.trace.BatchSizeTrace" in listed, rows
    assert len(listed) > 40  # the map's names were read
    # A name resolves in one of its row's modules: an attribute, or a submodule (`schedule.trace.X`).
    probe = (
        "import importlib, sys, warnings; warnings.simplefilter('error')\n"
        "def find(module, path):\n"
        "    value = importlib.import_module(module)\n"
        "    for part in path.split('.'):\n"
        "        if hasattr(value, part):\n"
        "            value = getattr(value, part)\n"
        "        elif isinstance(value, type(sys)):\n"
        "            try:\n"
        "                value = importlib.import_module(f'{value.__name__}.{part}')\n"
        "            except ModuleNotFoundError:\n"
        "                return False\n"
        "        else:\n"
        "            return False\n"
        "    return True\n"
        "missing = []\n"
        f"for modules, names in {rows!r}:\n"
        "    for module in modules:\n"
        "        importlib.import_module(module)\n"
        "    missing += [f'{name} (in none of {modules})' for name in names if not any(find(m, name) for m in modules)]\n"
        "assert not missing, missing\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(README.parent), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
