"""Every notebook in ``notebooks/`` runs top to bottom without an error (small size).

Each notebook is executed with nbclient in a fresh ``python3`` kernel, with
``TORCHFOLD_NOTEBOOK_SIZE=small``, from a temporary copy (the committed file, with its outputs,
is never rewritten). Notebooks added later are picked up by the glob.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 120  # the small size keeps every notebook well under a minute on a laptop CPU


def test_there_are_notebooks() -> None:
    assert len(NOTEBOOKS) >= 3, f"expected the numbered notebooks in notebooks/, found {NOTEBOOKS}"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_without_errors(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    copy = tmp_path / path.name
    shutil.copyfile(path, copy)
    notebook = nbformat.read(copy, as_version=4)
    monkeypatch.setenv("TORCHFOLD_NOTEBOOK_SIZE", "small")  # the kernel inherits the environment
    client = NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
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
