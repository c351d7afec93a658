"""Reading the CSV files of traces: rows with line numbers, strict integers, errors naming file and line.

Shared by :mod:`torchfold.train.schedule.trace` (``step,batchsize`` files) and
:mod:`torchfold.train.schedule.availability` (``,Time,GPUs`` files).
"""

from __future__ import annotations

import codecs
import csv
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "DIGITS",
    "MAX_TRACE_STEPS",
    "NUMBER",
    "check_num_steps",
    "csv_rows",
    "looks_numeric",
    "parse_int",
    "show",
    "text_lines",
]

# More steps than any real run takes (large runs take ~1e6): a longer trace comes from a unit
# mistake (a step time in hours read as seconds, a time gap of years) and would not fit in memory.
MAX_TRACE_STEPS = 10_000_000
_INT64_MAX = 2**63 - 1
DIGITS = re.compile(r"[0-9]+")  # ASCII only: \d would also take Arabic-Indic and other digits
NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def csv_rows(reader: Any, path: Path) -> Iterator[tuple[int, list[str], list[str]]]:
    """The non-blank rows of a ``csv.reader`` as (line number, stripped fields, row as read)."""
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as e:  # e.g. a field over csv's size limit
            raise ValueError(f"{path}, line {reader.line_num}: not a CSV row: {e}") from e
        fields = [field.strip() for field in row]
        if any(fields):
            yield reader.line_num, fields, row


def text_lines(handle: Iterable[str], path: Path) -> Iterator[str]:
    """The lines of an open text file; a byte that is not UTF-8 is an error naming its line."""
    try:
        yield from handle
    except UnicodeDecodeError as e:
        data = path.read_bytes()  # only on this error: find the line of the first bad byte
        bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
        try:
            data[bom:].decode("utf-8")
            offset = bom + e.start  # not reached unless the file changed meanwhile
        except UnicodeDecodeError as whole:
            offset = bom + whole.start
        line = data.count(b"\n", 0, offset) + 1
        column = offset - (data.rfind(b"\n", 0, offset) + 1) + 1
        raise ValueError(
            f"{path}, line {line}: byte 0x{data[offset]:02x} at column {column} is not UTF-8 text; "
            "save the file as UTF-8 (or plain ASCII)"
        ) from e


def show(text: str, limit: int = 24) -> str:
    """``text`` quoted for an error message, cut to ``limit`` characters (a bad field may be huge)."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def looks_numeric(text: str) -> bool:
    """Whether a field was meant as a number (so a first row starting with it is not a header)."""
    return re.match(r"[+-]?\d", text) is not None


def _int_to_python(text: str) -> bool:
    """Whether ``int()`` takes ``text`` (also ``+1``, ``1_000``, non-ASCII digits, which files must not use)."""
    try:
        int(text)
    except ValueError:
        return False
    return True


def parse_int(text: str, what: str, where: str) -> int:
    """A plain decimal integer: ASCII digits with an optional ``-``, within int64; else a short ValueError."""
    digits = text[1:] if text.startswith("-") else text
    if not DIGITS.fullmatch(digits):
        rule = "a plain integer (ASCII digits 0-9 only)" if _int_to_python(text) else "an integer"
        raise ValueError(f"{where}: {what} should be {rule}, got {show(text)}")
    if len(digits) > len(str(_INT64_MAX)) or abs(int(text)) > _INT64_MAX:
        raise ValueError(f"{where}: {what} {show(text)} is too large (at most {_INT64_MAX})")
    return int(text)


def check_num_steps(what: str, num_steps: int) -> None:
    """Refuse a trace of more than :data:`MAX_TRACE_STEPS` steps (``what`` names it in the message)."""
    if num_steps > MAX_TRACE_STEPS:
        raise ValueError(
            f"{what} has {num_steps} steps, more than the {MAX_TRACE_STEPS} a trace may have; "
            "check the units, or make a shorter trace"
        )
