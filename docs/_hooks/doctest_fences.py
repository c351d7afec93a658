"""A griffe extension for the API pages: doctest examples in docstrings render as code.

torchfold's docstrings put their examples under ``Example:`` (or directly in the text), which
griffe renders as Markdown: ``>>>`` lines would read as prose, and doctest output such as
``[[0, 1], [2, 3]]`` as link references. Fencing each doctest block keeps it code, exactly as
written, without changing the docstrings (which pytest runs as doctests).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_PROMPT = re.compile(r"^(\s*)>>> ")


def fence_doctests(text: str) -> str:
    """Wrap every doctest block (a ``>>>`` line up to the next blank line) in a ``pycon`` fence."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        match = _PROMPT.match(lines[i])
        if match is None:
            out.append(lines[i])
            i += 1
            continue
        indent = match.group(1)
        out.append(f"{indent}```pycon")
        while i < len(lines) and lines[i].strip():
            out.append(lines[i])
            i += 1
        out.append(f"{indent}```")
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    """Fence the doctest blocks of every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(obj.docstring.value)
