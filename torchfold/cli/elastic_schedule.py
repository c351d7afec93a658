"""The schedule of an elastic run: an availability trace mapped onto optimizer steps and process groups.

No processes are run here (that is :mod:`torchfold.cli.elastic`): :func:`elastic_schedule` turns the
trace's intervals into a :class:`ElasticSchedule` of steps and :class:`Segment` s, one per stretch of
one process count, or a pause.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torchfold._validate import check_int
from torchfold.train.schedule.availability import AvailabilityInterval

__all__ = ["ElasticSchedule", "ScheduledStep", "Segment", "elastic_schedule", "processes_for"]


def processes_for(devices: int, peak_devices: int, max_processes: int) -> int:
    """The processes that stand for ``devices`` when ``peak_devices`` map to ``max_processes``.

    Proportional and rounded up, so any available device keeps at least one process running,
    and only zero devices give zero processes: ``ceil(devices * max_processes / peak_devices)``.

    Args:
        devices: devices available, ``0 <= devices <= peak_devices``.
        peak_devices: the most devices the trace ever has (maps to ``max_processes``).
        max_processes: the most processes to run.

    >>> [processes_for(d, 56, 3) for d in (0, 1, 18, 19, 37, 38, 56)]
    [0, 1, 1, 2, 2, 3, 3]
    """
    check_int("devices", devices, minimum=0)
    check_int("peak_devices", peak_devices)
    check_int("max_processes", max_processes)
    if devices > peak_devices:
        raise ValueError(f"devices={devices} is more than peak_devices={peak_devices}")
    return -(-devices * max_processes // peak_devices)


@dataclass(frozen=True)
class ScheduledStep:
    """One optimizer step of an elastic run: when it starts in the trace and what was available then.

    Args:
        step: global step index (into the batch-size trace).
        trace_time: seconds since the trace's first row at which the step starts.
        devices: devices the trace has then.
        processes: processes that stand for them (:func:`processes_for`).
        line: the trace file's line that holds the step.
    """

    step: int
    trace_time: float
    devices: int
    processes: int
    line: int


@dataclass(frozen=True)
class Segment:
    """Consecutive steps with one process count (a group of processes), or a pause without devices.

    Args:
        index: position in the elastic run, from 0.
        processes: the group's processes; 0 for a pause.
        first_step: the first step the group runs (for a pause: the step it delays).
        end_step: the step after its last (``== first_step`` for a pause).
        start_time: trace seconds (since the first row) at which the segment starts.
        end_time: trace seconds at which it ends.
    """

    index: int
    processes: int
    first_step: int
    end_step: int
    start_time: float
    end_time: float

    @property
    def is_pause(self) -> bool:
        """True for a span without devices, where no process runs."""
        return self.processes == 0

    @property
    def num_steps(self) -> int:
        """Steps planned for the segment (0 for a pause)."""
        return self.end_step - self.first_step


@dataclass(frozen=True)
class ElasticSchedule:
    """The steps and segments of an elastic run (see :func:`elastic_schedule`).

    Args:
        steps: every step, in order.
        segments: groups and pauses, in order; groups' steps cover ``steps`` without gaps.
        peak_devices: the most devices the trace has (maps to the most processes).
        step_time: trace seconds per step.
    """

    steps: tuple[ScheduledStep, ...]
    segments: tuple[Segment, ...]
    peak_devices: int
    step_time: float

    @property
    def num_steps(self) -> int:
        """Steps in the elastic run."""
        return len(self.steps)

    @property
    def groups(self) -> tuple[Segment, ...]:
        """The segments that run processes."""
        return tuple(s for s in self.segments if not s.is_pause)

    @property
    def pauses(self) -> tuple[Segment, ...]:
        """The segments without devices."""
        return tuple(s for s in self.segments if s.is_pause)


def elastic_schedule(
    intervals: Sequence[AvailabilityInterval],
    *,
    step_time: float,
    max_processes: int,
    max_steps: int | None = None,
    source: str = "<intervals>",
) -> ElasticSchedule:
    """Map an availability trace onto steps and process groups.

    Step slots start every ``step_time`` seconds from the first row; an interval holds the slots
    whose start falls in it (as in :meth:`~torchfold.train.BatchSizeTrace.from_availability`,
    which gives the same steps). A slot in an interval with devices is an optimizer step; one
    without devices is a pause. Consecutive steps with the same process count form one segment
    (one group of processes), so a change of the device count restarts the run only when the
    process count changes. A pause that no step follows is left out.

    Args:
        intervals: the trace's rows (:func:`~torchfold.train.schedule.availability.read_availability`).
        step_time: trace seconds per step.
        max_processes: processes for the trace's peak device count (:func:`processes_for`).
        max_steps: keep at most this many steps.
        source: the trace's name, for messages.

    Raises:
        ValueError: no interval ever has a device, or no step slot falls in one (naming
            ``source`` and the fix).

    >>> rows = [(0, 30, 4, 2), (30, 50, 6, 3), (50, 70, 0, 4), (70, 90, 2, 5)]
    >>> schedule = elastic_schedule([AvailabilityInterval(*r) for r in rows], step_time=10, max_processes=3)
    >>> [(s.processes, s.first_step, s.end_step) for s in schedule.segments]
    [(2, 0, 3), (3, 3, 5), (0, 5, 5), (1, 5, 7)]
    >>> [s.trace_time for s in schedule.steps]
    [0.0, 10.0, 20.0, 30.0, 40.0, 70.0, 80.0]
    """
    if isinstance(step_time, bool) or not isinstance(step_time, (int, float)) or not step_time > 0:
        raise ValueError(f"step_time should be a positive number of seconds, got {step_time!r}")
    check_int("max_processes", max_processes)
    if max_steps is not None:
        check_int("max_steps", max_steps)
    step_time = float(step_time)
    if not intervals:
        raise ValueError(f"{source}: no intervals; an availability trace needs at least 2 rows")
    peak = max(interval.devices for interval in intervals)
    if peak == 0:
        raise ValueError(
            f"{source}: no device is available at any time (all {len(intervals)} intervals have 0 devices); "
            "an elastic run needs a trace with at least one device"
        )
    origin = intervals[0].start_time
    if not math.isfinite((intervals[-1].end_time - origin) / step_time):
        raise ValueError(f"{source}: too many steps to count at step_time={step_time!r} s; use a larger one")
    limit = sys.maxsize if max_steps is None else max_steps
    steps: list[ScheduledStep] = []
    # (processes, first_step, end_step, start_time, end_time) of the segment being built.
    segments: list[list[Any]] = []
    for interval in intervals:
        if len(steps) >= limit:
            break
        slots = interval.num_steps(step_time, origin)
        if slots <= 0:
            continue  # shorter than a step and holding no step's start: not seen at this step time
        first_slot = math.ceil((interval.start_time - origin) / step_time - 1e-9)
        processes = processes_for(interval.devices, peak, max_processes)
        if processes > 0:
            slots = min(slots, limit - len(steps))
            if len(steps) + slots > 10_000_000:
                raise ValueError(
                    f"{source}: at step_time={step_time!r} s the trace holds more than 10000000 steps; "
                    "pass --max-steps or a larger --step-time"
                )
        start, end = first_slot * step_time, (first_slot + slots) * step_time
        if segments and segments[-1][0] == processes:
            segments[-1][2] += 0 if processes == 0 else slots
            segments[-1][4] = end
        else:
            segments.append([processes, len(steps), len(steps) + (slots if processes else 0), start, end])
        if processes > 0:
            steps += [
                ScheduledStep(
                    len(steps) + k, (first_slot + k) * step_time, interval.devices, processes, interval.line
                )
                for k in range(slots)
            ]
    while segments and segments[-1][0] == 0:
        segments.pop()  # a pause at the end delays nothing
    if not steps:
        raise ValueError(
            f"{source}: no step fits: no interval with devices > 0 holds the start of a {step_time} s step; "
            "use a smaller --step-time"
        )
    return ElasticSchedule(
        steps=tuple(steps),
        segments=tuple(Segment(i, *fields) for i, fields in enumerate(segments)),
        peak_devices=peak,
        step_time=step_time,
    )
