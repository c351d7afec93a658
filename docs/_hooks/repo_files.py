"""A mkdocs hook: the site also serves the benchmark results and the notebooks from the repository.

mkdocs only reads ``docs/``; the measured runs live in ``benchmarks/`` (scripts beside their
results) and the executed notebooks in ``notebooks/``, where the README links them. Rather than
copies that drift, this hook adds those files to the build under their repository paths: the
results as pages (``benchmarks/results/tree_lstm.md`` ...), the notebooks and the pictures the
results show as files to download. Their relative links then work on the site as in the
repository.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
# Repository files served by the site, under their paths in the repository.
SERVED = ("benchmarks/README.md", "benchmarks/results/*.md", "notebooks/*.ipynb", "img/*.png")


def repository_files() -> list[str]:
    """The repository paths (POSIX, relative to the root) that the site serves beside ``docs/``."""
    return sorted(p.relative_to(ROOT).as_posix() for pattern in SERVED for p in ROOT.glob(pattern))


def on_files(files: Files, config: Any) -> Files:
    for path in repository_files():
        files.append(
            File(
                path,
                src_dir=str(ROOT),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files
