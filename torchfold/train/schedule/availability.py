"""Resource-availability traces: how many devices were available over time, and the batch sizes that follows.

A resource-availability trace (e.g. ``traces/gcp_a100_gpus.csv``: ``,Time,GPUs`` rows) is not a
batch-size trace: :func:`read_availability` reads its intervals, and
:func:`availability_batch_sizes` turns them into one global batch per optimizer step
(devices x per-device batch, held for the steps that fit each interval), which
:meth:`BatchSizeTrace.from_availability <torchfold.train.BatchSizeTrace.from_availability>` wraps.
"""

from __future__ import annotations

import csv
import itertools
import math
import os
from pathlib import Path
from typing import NamedTuple

from torchfold._validate import check_int
from torchfold.train.schedule.csvrows import (
    DIGITS,
    MAX_TRACE_STEPS,
    NUMBER,
    csv_rows,
    parse_int,
    show,
    text_lines,
)

__all__ = ["AvailabilityInterval", "availability_batch_sizes", "read_availability"]


class AvailabilityInterval(NamedTuple):
    """One row of a resource-availability trace: ``devices`` from ``start_time`` until ``end_time``.

    Times are the file's (seconds); ``line`` is the row's line in the file, for messages.
    """

    start_time: float
    end_time: float
    devices: int
    line: int

    def num_steps(self, step_time: float, origin: float) -> int:
        """How many step starts ``origin + k * step_time`` (k >= 0) fall in ``[start_time, end_time)``.

        Counted on the absolute clock, so fractions of a step carry over between intervals.

        >>> AvailabilityInterval(104.0, 110.0, 2, line=3).num_steps(4.0, origin=100.0)  # 104, 108
        2
        """
        return math.ceil((self.end_time - origin) / step_time - 1e-9) - math.ceil(
            (self.start_time - origin) / step_time - 1e-9
        )


def read_availability(path: str | os.PathLike[str]) -> list[AvailabilityInterval]:
    """Read a resource-availability trace: the intervals of its device counts, in time order.

    The file has a header with a ``Time`` column (seconds) and the device count in the last
    column, e.g. ``,Time,GPUs`` (index, unix time, count). Row ``i`` holds from its time until
    row ``i + 1``'s; the last row only marks the end. Errors name the file and line.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "gpus.csv"
    >>> _ = p.write_text(",Time,GPUs\\n0,100,2\\n1,110,0\\n2,120,4\\n")
    >>> [(i.start_time, i.end_time, i.devices, i.line) for i in read_availability(p)]
    [(100.0, 110.0, 2, 2), (110.0, 120.0, 0, 3)]
    """
    path = Path(path)
    rows: list[tuple[int, float, int]] = []  # (line, time, devices)
    with path.open(newline="", encoding="utf-8-sig") as f:  # tolerate a byte-order mark
        reader = csv.reader(text_lines(f, path))
        header = next(csv_rows(reader, path), (0, [], []))[2] or None
        names = [name.strip().lower() for name in header or []]
        if "time" not in names or len(names) < 2 or names[-1] == "time":
            raise ValueError(
                f"{path}, line 1: header should name a 'Time' column and end with the device count "
                f"column (e.g. ',Time,GPUs'), got {show(','.join(header or []), 60)}"
            )
        time_col = names.index("time")
        for line, fields, _ in csv_rows(reader, path):
            where = f"{path}, line {line}"
            if len(fields) != len(names):
                raise ValueError(f"{where}: expected {len(names)} fields like the header, got {len(fields)}")
            if not NUMBER.fullmatch(fields[time_col]):
                raise ValueError(f"{where}: time should be a number, got {show(fields[time_col])}")
            time = float(fields[time_col])
            if not math.isfinite(time):
                raise ValueError(f"{where}: time should be finite, got {show(fields[time_col])}")
            if not DIGITS.fullmatch(fields[-1]):
                raise ValueError(f"{where}: device count should be an integer >= 0, got {show(fields[-1])}")
            devices = parse_int(fields[-1], "device count", where)
            if rows and time <= rows[-1][1]:
                raise ValueError(f"{where}: time {time} does not increase (previous row: {rows[-1][1]})")
            rows.append((line, time, devices))
    if len(rows) < 2:
        raise ValueError(f"{path}: needs at least 2 rows (a start and an end time), got {len(rows)}")
    return [
        AvailabilityInterval(start, end, devices, line)
        for (line, start, devices), (_, end, _) in itertools.pairwise(rows)
    ]


def availability_batch_sizes(
    path: str | os.PathLike[str],
    per_device_batch: int,
    step_time: float,
    *,
    max_steps: int | None = None,
) -> tuple[list[int], list[int]]:
    """The global batch size of every step of a resource-availability trace, and each step's file line.

    Steps take ``step_time`` seconds and run with ``devices * per_device_batch`` samples; an
    interval holds the steps whose start time falls in it (counted on the absolute clock, so
    fractions of a step carry over between intervals). Intervals with zero devices give no steps:
    training pauses. :meth:`BatchSizeTrace.from_availability
    <torchfold.train.BatchSizeTrace.from_availability>` makes a trace of them.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "gpus.csv"
    >>> _ = p.write_text(",Time,GPUs\\n0,100,2\\n1,110,0\\n2,120,4\\n3,125,4\\n")
    >>> availability_batch_sizes(p, per_device_batch=16, step_time=4)
    ([32, 32, 32, 64, 64], [2, 2, 2, 4, 4])
    """
    check_int("per_device_batch", per_device_batch)
    if isinstance(step_time, bool) or not isinstance(step_time, (int, float)) or not step_time > 0:
        raise ValueError(f"step_time should be a positive number of seconds, got {step_time!r}")
    if max_steps is not None:
        check_int("max_steps", max_steps)
    path = Path(path)
    intervals = read_availability(path)
    t0 = intervals[0].start_time
    span = intervals[-1].end_time - t0
    if not math.isfinite(span / step_time):
        raise ValueError(
            f"{path}: its {span:g} s at step_time={step_time!r} s are too many steps to count; "
            "use a larger step time"
        )
    # Step k starts at t0 + k * step_time; it belongs to the interval holding its start.
    counts = [(interval.line, interval.devices, interval.num_steps(step_time, t0)) for interval in intervals]
    total = sum(count for _, devices, count in counts if devices > 0)
    num_steps = total if max_steps is None else min(total, max_steps)
    if num_steps > MAX_TRACE_STEPS:
        raise ValueError(
            f"{path}: at step_time={step_time!r} s its {span:g} s hold {total:.4g} steps, more than the "
            f"{MAX_TRACE_STEPS} a trace may have; pass max_steps (--max-steps) or a larger step time"
        )
    sizes: list[int] = []
    lines: list[int] = []
    for line, devices, count in counts:  # only the steps kept are built
        if devices > 0 and len(sizes) < num_steps:
            count = min(count, num_steps - len(sizes))
            sizes += [devices * per_device_batch] * count
            lines += [line] * count
    if not sizes:
        raise ValueError(
            f"{path}: no step fits: no interval with devices > 0 holds the start of a {step_time} s step"
        )
    return sizes, lines
