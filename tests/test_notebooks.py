"""Every notebook in ``notebooks/`` runs top to bottom without an error (small size), as from a clone.

Each notebook is executed with nbclient in a fresh ``python3`` kernel, with
``TORCHFOLD_NOTEBOOK_SIZE=small``, from a temporary copy (the committed file, with its outputs,
is never rewritten) laid out as in a clone: ``notebooks/`` beside ``tests/data`` (the tests' data
folder), and no ``$TORCHFOLD_DATA``, so the notebooks find the clone's data by themselves.
Notebooks added later are picked up by the glob. The committed outputs name no folder of the
machine that ran them, and the torchfold version they print is this one.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

import torchfold
from tests.conftest import DATA_DIR

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 120  # the small size keeps every notebook well under a minute on a laptop CPU
# What a notebook prints when it found no data and made some up.
FALLBACKS = ("no SST data", "SYNTHETIC", "GENERATED trees")
# Absolute paths: a temporary folder, a home, a work tree (POSIX, macOS, Windows).
MACHINE_PATH = re.compile(r"(?<![\w.])(/tmp/|/var/folders/|/home/|/Users/|/root/|/work/|[A-Z]:\\)")


def _texts(notebook: nbformat.NotebookNode) -> list[str]:
    """The text of every output of every code cell (streams, results, errors)."""
    texts = []
    for cell in notebook.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if "text" in out:
                texts.append(out.text)
            texts.append(str(out.get("data", {}).get("text/plain", "")))
            texts.extend(out.get("traceback", []))
    return texts


def test_there_are_notebooks() -> None:
    assert len(NOTEBOOKS) >= 3, f"expected the numbered notebooks in notebooks/, found {NOTEBOOKS}"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_without_errors(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "data").symlink_to(DATA_DIR.resolve(), target_is_directory=True)
    copy = tmp_path / "notebooks" / path.name
    shutil.copyfile(path, copy)
    notebook = nbformat.read(copy, as_version=4)
    monkeypatch.setenv("TORCHFOLD_NOTEBOOK_SIZE", "small")  # the kernel inherits the environment
    monkeypatch.delenv("TORCHFOLD_DATA", raising=False)  # the clone's tests/data, found by the notebook
    client = NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(copy.parent)}},
    )
    try:
        client.execute()
    except CellExecutionError as error:
        pytest.fail(f"{path.name}: a cell failed:\n{error}", pytrace=False)
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code_cells, f"{path.name} has no code cells"
    assert all(cell.get("execution_count") for cell in code_cells), f"{path.name}: a code cell did not run"
    errors = [out for cell in code_cells for out in cell.outputs if out.output_type == "error"]
    assert not errors, f"{path.name}: error outputs {errors}"
    made_up = [line for text in _texts(notebook) for line in text.splitlines() if line.startswith(FALLBACKS)]
    assert not made_up, f"{path.name} did not find the clone's data in tests/data: {made_up}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_committed_outputs_name_no_machine_folder_and_this_version(path: Path) -> None:
    texts = _texts(nbformat.read(path, as_version=4))
    paths = [line for text in texts for line in text.splitlines() if MACHINE_PATH.search(line)]
    assert not paths, f"{path.name}: outputs name folders of the machine that ran them: {paths}"
    versions = {
        v
        for text in texts
        for v in re.findall(r"torchfold (\d+\.\d+\.\d+(?:\.?(?:dev|a|b|rc|post)\d*)?)", text)
    }
    assert versions <= {torchfold.__version__}, (
        f"{path.name}: outputs of torchfold {versions}, this is {torchfold.__version__}: run it again "
        "(from notebooks/, without $TORCHFOLD_DATA) and commit its outputs"
    )
