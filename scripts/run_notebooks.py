"""Execute the notebooks in place, saving their outputs: ``python scripts/run_notebooks.py``.

Runs every ``notebooks/*.ipynb`` (or the ones named) top to bottom in a fresh ``python3``
kernel, with the notebook's folder as working directory, and writes it back with its outputs
(images included), so the committed notebooks show a real run. Progress-bar updates are
collapsed to their final state and per-cell timing metadata is left out, to keep diffs small.

    python scripts/run_notebooks.py                   # the committed run (size "full")
    python scripts/run_notebooks.py --size small      # the quick run CI does (not for committing)
    python scripts/run_notebooks.py notebooks/01-baby-steps.ipynb
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
SIZE_VARIABLE = "TORCHFOLD_NOTEBOOK_SIZE"


def execute(path: Path, *, size: str, timeout: int, kernel_name: str = "python3") -> nbformat.NotebookNode:
    """Run the notebook at ``path`` with ``TORCHFOLD_NOTEBOOK_SIZE=size``; return it with outputs.

    Raises ``nbclient.exceptions.CellExecutionError`` on the first cell that fails and
    ``CellTimeoutError`` when a cell runs longer than ``timeout`` seconds.
    """
    notebook = nbformat.read(path, as_version=4)
    previous = os.environ.get(SIZE_VARIABLE)
    os.environ[SIZE_VARIABLE] = size  # the kernel inherits this process's environment
    try:
        client = NotebookClient(
            notebook,
            timeout=timeout,
            kernel_name=kernel_name,
            resources={"metadata": {"path": str(path.parent)}},
            coalesce_streams=True,
            record_timing=False,
        )
        client.execute()
    finally:
        if previous is None:
            del os.environ[SIZE_VARIABLE]
        else:
            os.environ[SIZE_VARIABLE] = previous
    notebook.metadata.pop("widgets", None)
    return notebook


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "notebooks", nargs="*", type=Path, help="notebooks to run (default: notebooks/*.ipynb)"
    )
    parser.add_argument(
        "--size",
        choices=("small", "full"),
        default="full",
        help=f"sets {SIZE_VARIABLE}: 'full' (default) for the committed outputs, 'small' for a quick check",
    )
    parser.add_argument("--timeout", type=int, default=900, help="seconds allowed per cell (default 900)")
    parser.add_argument("--dry-run", action="store_true", help="execute but do not write the notebooks back")
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted(NOTEBOOKS.glob("*.ipynb"))
    if not paths:
        print(f"no notebooks found in {NOTEBOOKS}", file=sys.stderr)
        return 1
    for path in paths:
        start = time.perf_counter()
        print(f"{path}: running (size {args.size}) ...", flush=True)
        notebook = execute(path.resolve(), size=args.size, timeout=args.timeout)
        seconds = time.perf_counter() - start
        if not args.dry_run:
            nbformat.write(notebook, path)
        print(f"{path}: done in {seconds:.1f} s{'' if args.dry_run else ', outputs saved'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
