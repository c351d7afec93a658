"""Batch-size traces: the global batch size of every optimizer step.

A :class:`BatchSizeTrace` is an immutable sequence of positive integers, one per optimizer step
(global over all ranks). Make one from

* a ``step,batchsize`` CSV file (:meth:`BatchSizeTrace.from_csv`),
* a Python list (``BatchSizeTrace([32, 32, 64])``) or an int (:meth:`BatchSizeTrace.constant`,
  unbounded unless given ``num_steps``),
* a schedule (:meth:`~BatchSizeTrace.linear`, :meth:`~BatchSizeTrace.stepwise`,
  :meth:`~BatchSizeTrace.from_schedule` with ``"linear:32:256:1000"``-style specs),
* a resource-availability trace, devices available over time
  (:meth:`BatchSizeTrace.from_availability`; the reading and conversion are in
  :mod:`torchfold.train.schedule.availability`).

Learning-rate rules are in :mod:`torchfold.train.optim.lr`, plotting in :mod:`torchfold.train.schedule.plot`.

:func:`as_trace` accepts any of these, and is what the sampler and the training loop call; its
rule for a string (a file, ``"256"``, ``"32,64,96"``, a schedule) is also the command line's
``--trace`` (:meth:`BatchSizeTrace.parse`): one syntax everywhere.

CSV format
----------
One ``step,batchsize`` row per step, in UTF-8; spaces around fields, blank lines and ``\\r\\n``
line endings are accepted. Steps and batch sizes are plain decimal integers (ASCII digits, no
``+``, ``_`` or exponent). The ``step,batchsize`` header is optional: the first row is a header
exactly when its first field does not start with a digit, and it must then read ``step,batchsize``.
Steps count up by one from 0; the numbering may restart at 0, which appends a new segment (the example trace
``step_batchsize_example.csv`` is a 10-step warm-up followed by an 800-step run, both numbered
from 0). Any other gap or repeat is an error naming the file and line.

Epochs
------
:meth:`BatchSizeTrace.epoch` splits the trace into epochs over a dataset of ``dataset_size``
samples. The step counter is global: epoch ``e + 1`` starts with the trace step after the last
step of epoch ``e``. A step never crosses an epoch boundary. When the next step's batch does not
fit into the samples left in the epoch:

* ``drop_last=False`` (default, as in PyTorch): that step runs with the samples that are left
  (a final, smaller step) and consumes its trace step; every sample is used once per epoch.
* ``drop_last=True``: the epoch ends, the left-over samples (fewer than that step's batch) are
  not used in this epoch, and the step becomes the first step of the next epoch, so every step
  has exactly its trace batch size.

A trace that ends inside an epoch gives that epoch only the steps it has (``truncated``: a trace
shorter than one epoch trains its steps, as it says); the epochs after it are too short (a
``ValueError`` names the trace, the epoch and the samples it lacks).
"""

from __future__ import annotations

import csv
import hashlib
import math
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Union, cast, overload

from torchfold._validate import check_int
from torchfold.train.schedule.availability import availability_batch_sizes
from torchfold.train.schedule.csvrows import (
    check_num_steps,
    csv_rows,
    looks_numeric,
    parse_int,
    show,
    text_lines,
)
from torchfold.train.schedule.plot import plot_trace

__all__ = ["BatchSizeTrace", "EpochSteps", "TraceLike", "as_trace"]


@dataclass(frozen=True)
class EpochSteps:
    """The steps of one epoch: which global trace steps it runs and their actual batch sizes.

    Args:
        epoch: epoch number, from 0.
        first_step: global step index (into the trace) of the epoch's first step.
        batch_sizes: global batch size of each step of the epoch; the last one is smaller than
            the trace's when ``drop_last=False`` cut it at the end of the dataset.
        dataset_size: number of samples in the dataset.
        truncated: the trace ends inside this epoch: its last steps run, and the epoch's other
            samples (:attr:`leftover`) are not used.
    """

    epoch: int
    first_step: int
    batch_sizes: tuple[int, ...]
    dataset_size: int
    truncated: bool = False

    @property
    def num_steps(self) -> int:
        """Number of optimizer steps in the epoch."""
        return len(self.batch_sizes)

    @property
    def steps(self) -> range:
        """Global step indices of the epoch."""
        return range(self.first_step, self.first_step + self.num_steps)

    @property
    def end_step(self) -> int:
        """Global step index of the next epoch's first step."""
        return self.first_step + self.num_steps

    @property
    def num_samples(self) -> int:
        """Samples used in the epoch."""
        return sum(self.batch_sizes)

    @property
    def leftover(self) -> int:
        """Samples of the dataset not used in the epoch (0 unless ``drop_last=True`` or :attr:`truncated`)."""
        return self.dataset_size - self.num_samples


class BatchSizeTrace:
    """The global batch size of every optimizer step, validated.

    Args:
        batch_sizes: one positive int per step.
        source: where the sizes came from, used in error messages (a file name, ``"<list>"``).
        line_numbers: for traces read from a file, the line of each step (for error messages).
        restarts: step indices at which the file's step numbering restarted at 0.

    >>> trace = BatchSizeTrace([32, 32, 64, 64, 128])
    >>> len(trace), trace[2], trace.total_samples
    (5, 64, 320)
    >>> [e.batch_sizes for e in trace.split_epochs(dataset_size=100, num_epochs=2)]
    [(32, 32, 36), (64, 36)]
    """

    def __init__(
        self,
        batch_sizes: Iterable[int],
        *,
        source: str = "<list>",
        line_numbers: Sequence[int] | None = None,
        restarts: Sequence[int] = (),
    ) -> None:
        if isinstance(batch_sizes, (str, bytes)) or not isinstance(batch_sizes, Iterable):
            raise TypeError(
                f"batch_sizes should be an iterable of ints, got {type(batch_sizes).__name__}; "
                "use BatchSizeTrace.from_csv(path) for a file or as_trace() for any trace-like value"
            )
        sizes = tuple(batch_sizes)
        self._source = source
        self._lines = None if line_numbers is None else tuple(line_numbers)
        if self._lines is not None and len(self._lines) != len(sizes):
            raise ValueError(f"line_numbers has {len(self._lines)} entries for {len(sizes)} steps")
        for i, size in enumerate(sizes):
            if isinstance(size, bool) or not isinstance(size, int):
                raise TypeError(
                    f"{self.where(i)}: batch size should be an int, got {type(size).__name__} {size!r}"
                )
            if size <= 0:
                raise ValueError(f"{self.where(i)}: batch size should be positive, got {size}")
        if not sizes:
            raise ValueError(f"{source}: a trace needs at least one step, got none")
        self._sizes = sizes
        self._unbounded = False
        self._restarts = tuple(restarts)
        # Per (dataset_size, drop_last): first step of each epoch found so far, and whether the
        # trace has run out (so the list is final).
        self._epoch_cache: dict[tuple[int, bool], list[int]] = {}
        self._epoch_cache_final: set[tuple[int, bool]] = set()

    # -- constructors -------------------------------------------------------------------------

    @classmethod
    def constant(cls, batch_size: int, num_steps: int | None = None) -> BatchSizeTrace:
        """The same batch size at every step; unbounded (any number of epochs) without ``num_steps``.

        Args:
            batch_size: global batch size of every step.
            num_steps: length of the trace, or ``None`` for a trace without end.

        >>> BatchSizeTrace.constant(64, 3).batch_sizes
        (64, 64, 64)
        >>> BatchSizeTrace.constant(64).num_steps is None
        True
        """
        check_int("batch_size", batch_size)
        if num_steps is not None:
            check_int("num_steps", num_steps)
            check_num_steps(f"constant:{batch_size}:{num_steps}", num_steps)
            return cls([batch_size] * num_steps, source=f"constant:{batch_size}:{num_steps}")
        trace = cls([batch_size], source=f"constant:{batch_size}")
        trace._unbounded = True
        return trace

    @classmethod
    def linear(cls, start: int, end: int, num_steps: int, multiple_of: int = 1) -> BatchSizeTrace:
        """A linear ramp from ``start`` to ``end`` over ``num_steps`` steps.

        Args:
            start: batch size of the first step.
            end: batch size of the last step.
            num_steps: number of steps.
            multiple_of: round every size to the nearest multiple of this (at least this), e.g. the
                minibatch size.

        >>> BatchSizeTrace.linear(32, 128, 5, multiple_of=32).batch_sizes
        (32, 64, 96, 96, 128)
        """
        for name, value in (("start", start), ("end", end), ("num_steps", num_steps)):
            check_int(name, value)
        check_int("multiple_of", multiple_of)
        check_num_steps(f"linear:{start}:{end}:{num_steps}", num_steps)
        sizes = []
        for i in range(num_steps):
            exact = start if num_steps == 1 else start + (end - start) * i / (num_steps - 1)
            sizes.append(max(multiple_of, multiple_of * math.floor(exact / multiple_of + 0.5)))
        return cls(sizes, source=f"linear:{start}:{end}:{num_steps}")

    @classmethod
    def stepwise(cls, phases: Sequence[tuple[int, int]]) -> BatchSizeTrace:
        """Piecewise-constant batch sizes: ``phases`` is a list of ``(batch_size, num_steps)``.

        >>> BatchSizeTrace.stepwise([(32, 2), (64, 1)]).batch_sizes
        (32, 32, 64)
        """
        sizes: list[int] = []
        for i, phase in enumerate(phases):
            if not (isinstance(phase, tuple) and len(phase) == 2):
                raise TypeError(f"phases[{i}] should be a (batch_size, num_steps) tuple, got {phase!r}")
            size, steps = phase
            check_int(f"phases[{i}] batch_size", size)
            check_int(f"phases[{i}] num_steps", steps)
            check_num_steps(f"phases[:{i + 1}]", len(sizes) + steps)
            sizes += [size] * steps
        spec = ",".join(f"{b}x{n}" for b, n in phases)
        return cls(sizes, source=f"steps:{spec}")

    @classmethod
    def from_schedule(cls, spec: str, multiple_of: int = 1) -> BatchSizeTrace:
        """A trace from a schedule spec; ``+`` concatenates parts.

        Parts: ``constant:BATCH:STEPS``, ``linear:START:END:STEPS`` (rounded to ``multiple_of``),
        ``steps:BATCHxSTEPS,BATCHxSTEPS,...``.

        Args:
            spec: the schedule, e.g. ``"linear:32:256:100+constant:256:900"``.
            multiple_of: rounding for linear ramps.

        >>> BatchSizeTrace.from_schedule("steps:32x2,64x1+constant:16:2").batch_sizes
        (32, 32, 64, 16, 16)
        """
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"schedule should be a non-empty string like 'linear:32:256:1000', got {spec!r}")
        usage = "expected constant:BATCH:STEPS, linear:START:END:STEPS or steps:BATCHxSTEPS,... joined by '+'"
        parts: list[BatchSizeTrace] = []
        for part in spec.split("+"):
            kind, _, rest = part.strip().partition(":")
            fields = rest.split(":")
            try:
                if kind == "constant" and len(fields) == 2:
                    parts.append(cls.constant(int(fields[0]), int(fields[1])))
                elif kind == "linear" and len(fields) == 3:
                    start, end, steps = (int(f) for f in fields)
                    parts.append(cls.linear(start, end, steps, multiple_of))
                elif kind == "steps" and len(fields) == 1:
                    phases = []
                    for phase in fields[0].split(","):
                        size, sep, count = phase.strip().partition("x")
                        if not sep:
                            raise ValueError(f"phase {phase!r} is not BATCHxSTEPS")
                        phases.append((int(size), int(count)))
                    parts.append(cls.stepwise(phases))
                else:
                    raise ValueError(usage)
            except ValueError as e:
                raise ValueError(f"bad schedule part {part.strip()!r} in {spec!r}: {e}") from e
        trace = parts[0]
        for other in parts[1:]:
            trace = trace + other
        return cls(trace.batch_sizes, source=spec)

    @classmethod
    def parse(cls, text: str, *, option: str = "--trace") -> BatchSizeTrace:
        """The trace a command-line value names: :func:`as_trace`'s rule for a string, with every
        mistake a ``ValueError`` that starts with ``option`` and ``text`` (the option the value
        came from) and says how to write it.

        Args:
            text: the value, e.g. ``"256"``, ``"32,64,96"``, ``"linear:32:256:1000"`` or ``"traces/run.csv"``.
            option: the name that messages give the value (default ``--trace``).

        >>> BatchSizeTrace.parse("steps:32x2,64x1").batch_sizes
        (32, 32, 64)
        >>> BatchSizeTrace.parse("256").num_steps is None  # a constant: as many steps as asked
        True
        >>> BatchSizeTrace.parse("2.5")
        Traceback (most recent call last):
        ...
        ValueError: --trace 2.5: a constant global batch size must be a whole number of samples, e.g. --trace 2
        """
        if not isinstance(text, str):
            raise TypeError(f"{option} must be given as a string, got {type(text).__name__} {text!r}")
        try:
            return _from_text(text, option)
        except (ValueError, TypeError, OSError) as e:  # a bad file too: on the command line, a usage mistake
            if isinstance(e, ValueError) and str(e).startswith(option):
                raise
            message = str(e) if str(e).startswith(option) else f"{option} {text}: {e}"
            raise ValueError(message) from e

    @classmethod
    def from_csv(cls, path: str | os.PathLike[str]) -> BatchSizeTrace:
        """Read a ``step,batchsize`` CSV file (header optional; see the module docstring).

        Errors name the file and the line.

        Args:
            path: the CSV file.
        """
        path = Path(path)
        sizes: list[int] = []
        lines: list[int] = []
        restarts: list[int] = []
        expected = 0
        with path.open(newline="", encoding="utf-8-sig") as f:  # tolerate a byte-order mark
            reader = csv.reader(text_lines(f, path))
            first = True
            for line, fields, row in csv_rows(reader, path):
                where = f"{path}, line {line}"
                if first:
                    first = False
                    if not looks_numeric(fields[0]):
                        if [field.lower() for field in fields] != ["step", "batchsize"]:
                            hint = ""
                            if len(fields) >= 3 and fields[1].lower() == "time":
                                hint = (
                                    "; this looks like a resource-availability trace: convert it with "
                                    "BatchSizeTrace.from_availability or `python -m torchfold trace convert`"
                                )
                            raise ValueError(
                                f"{where}: header should be 'step,batchsize', got {show(','.join(row), 60)}{hint}"
                            )
                        continue
                if len(fields) != 2:
                    raise ValueError(
                        f"{where}: expected 2 fields 'step,batchsize', got {len(fields)}: {show(','.join(row), 60)}"
                    )
                step_text, size_text = fields
                step = parse_int(step_text, "step", where)
                size = parse_int(size_text, "batch size", where)
                if step < 0:
                    raise ValueError(f"{where}: step should be >= 0 (steps count from 0), got {step}")
                if step == 0 and expected > 0:
                    restarts.append(len(sizes))
                elif step < expected:
                    raise ValueError(f"{where}: repeated step {step}; expected step {expected}")
                elif step > expected:
                    missing = f"step {expected}" if step == expected + 1 else f"steps {expected}..{step - 1}"
                    raise ValueError(f"{where}: missing {missing} before step {step}")
                if size <= 0:
                    raise ValueError(f"{where}: batch size should be positive, got {size}")
                sizes.append(size)
                lines.append(line)
                expected = step + 1
        if not sizes:
            raise ValueError(f"{path}: no steps; expected 'step,batchsize' rows")
        return cls(sizes, source=str(path), line_numbers=lines, restarts=restarts)

    @classmethod
    def from_availability(
        cls,
        path: str | os.PathLike[str],
        per_device_batch: int,
        step_time: float,
        *,
        max_steps: int | None = None,
    ) -> BatchSizeTrace:
        """A trace from a resource-availability trace: devices available over time.

        The file is read by :func:`~torchfold.train.schedule.availability.read_availability` (``,Time,GPUs`` rows; row ``i`` holds from its
        time until row ``i + 1``'s). Steps take ``step_time`` seconds and run
        with ``devices * per_device_batch`` samples; an interval holds the steps whose start time
        falls in it (counted on the absolute clock, so fractions of a step carry over between
        intervals). Intervals with zero devices give no steps: training pauses.

        Args:
            path: the availability CSV file.
            per_device_batch: samples per device per step.
            step_time: seconds per optimizer step.
            max_steps: stop after this many steps.

        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "gpus.csv"
        >>> _ = p.write_text(",Time,GPUs\\n0,100,2\\n1,110,0\\n2,120,4\\n3,125,4\\n")
        >>> BatchSizeTrace.from_availability(p, per_device_batch=16, step_time=4).batch_sizes
        (32, 32, 32, 64, 64)
        """
        sizes, lines = availability_batch_sizes(path, per_device_batch, step_time, max_steps=max_steps)
        return cls(sizes, source=str(Path(path)), line_numbers=lines)

    # -- the sequence ---------------------------------------------------------------------------

    @property
    def source(self) -> str:
        """Where the trace came from (file name, ``"<list>"`` or a schedule spec)."""
        return self._source

    @property
    def num_steps(self) -> int | None:
        """Number of steps, or ``None`` for an unbounded constant trace."""
        return None if self._unbounded else len(self._sizes)

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """All batch sizes (for an unbounded constant trace: its one size)."""
        return self._sizes

    @property
    def restarts(self) -> tuple[int, ...]:
        """Step indices at which the file's step numbering restarted at 0 (one per appended segment)."""
        return self._restarts

    @property
    def total_samples(self) -> int:
        """Sum of all batch sizes (a ``ValueError`` for an unbounded trace)."""
        self.require_bounded("total_samples")
        return sum(self._sizes)

    def __len__(self) -> int:
        self.require_bounded("len()")
        return len(self._sizes)

    @overload
    def __getitem__(self, step: int) -> int: ...
    @overload
    def __getitem__(self, step: slice) -> tuple[int, ...]: ...
    def __getitem__(self, step: int | slice) -> int | tuple[int, ...]:
        if isinstance(step, slice):
            self.require_bounded("slicing")
            return self._sizes[step]
        if self._unbounded:
            if step < 0:
                raise IndexError(f"step {step} of an unbounded trace; steps count from 0")
            return self._sizes[0]
        return self._sizes[step]

    def __iter__(self) -> Iterator[int]:
        self.require_bounded("iteration")
        return iter(self._sizes)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BatchSizeTrace):
            return NotImplemented
        return self._sizes == other._sizes and self._unbounded == other._unbounded

    def __hash__(self) -> int:
        return hash((self._sizes, self._unbounded))

    def __add__(self, other: BatchSizeTrace) -> BatchSizeTrace:
        if not isinstance(other, BatchSizeTrace):
            return NotImplemented
        self.require_bounded("concatenation")
        other.require_bounded("concatenation")
        return BatchSizeTrace(self._sizes + other._sizes, source=f"{self.source}+{other.source}")

    def __repr__(self) -> str:
        if self._unbounded:
            return f"BatchSizeTrace.constant({self._sizes[0]})"
        return f"<BatchSizeTrace {self.source!r}: {len(self._sizes)} steps, batch {min(self._sizes)}..{max(self._sizes)}>"

    def fingerprint(self) -> str:
        """A short hash of the batch sizes, to check that a checkpoint belongs to this trace."""
        text = f"constant:{self._sizes[0]}" if self._unbounded else ",".join(map(str, self._sizes))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def run_lengths(self, end: int) -> list[list[int]]:
        """The batch sizes of steps ``0..end-1`` as ``[size, count]`` runs: how a checkpoint records
        the steps it took (short for a constant or piecewise trace; ints only, for ``weights_only``).

        >>> BatchSizeTrace([8, 8, 16, 8]).run_lengths(3)
        [[8, 2], [16, 1]]
        >>> BatchSizeTrace.constant(32).run_lengths(1000)
        [[32, 1000]]
        """
        check_int("end", end, minimum=0)
        if self._unbounded:
            return [[self._sizes[0], end]] if end else []
        if end > len(self._sizes):
            raise ValueError(f"end={end} is past the trace's {len(self._sizes)} steps ({self._source!r})")
        runs: list[list[int]] = []
        for size in self._sizes[:end]:
            if runs and runs[-1][0] == size:
                runs[-1][1] += 1
            else:
                runs.append([size, 1])
        return runs

    def first_difference(self, runs: Sequence[Sequence[int]]) -> tuple[int, int, int | None] | None:
        """Where this trace departs from the steps ``runs`` records (:meth:`run_lengths`): ``(step,
        the recorded size, this trace's size)``, the last ``None`` where this trace has ended; ``None``
        where its first steps are those (it may go on longer: a run resumed with it trains on).

        >>> BatchSizeTrace([8, 8, 16, 32]).first_difference([[8, 2], [16, 1]]) is None
        True
        >>> BatchSizeTrace([8, 12, 16]).first_difference([[8, 2], [16, 1]])
        (1, 8, 12)
        >>> BatchSizeTrace([8, 8]).first_difference([[8, 2], [16, 1]])
        (2, 16, None)
        """
        step = 0
        for size, count in runs:
            for s in range(step, step + count):
                if self.num_steps is not None and s >= self.num_steps:
                    return s, size, None
                if self[s] != size:
                    return s, size, self[s]
                if self._unbounded:  # every step the same: one comparison speaks for the run
                    break
            step += count
        return None

    def largest_minibatch_size(self, at_most: int = 25) -> int:
        """The largest minibatch size up to ``at_most`` that divides every batch size of this trace.

        A trace converted from an availability trace holds multiples of its per-device batch (176,
        224, 240, ... samples), which a fixed minibatch size would not divide.

        >>> BatchSizeTrace([176, 224, 240]).largest_minibatch_size()
        16
        >>> BatchSizeTrace([100, 50]).largest_minibatch_size()
        25
        """
        at_most = check_int("at_most", at_most)
        common = math.gcd(*self._sizes)
        return max(size for size in range(1, min(at_most, common) + 1) if common % size == 0)

    def where(self, step: int) -> str:
        """Where step ``step`` was defined, for error messages: ``"file.csv, line 12 (step 10)"``."""
        if self._lines is not None and 0 <= step < len(self._lines):
            return f"{self._source}, line {self._lines[step]} (step {step})"
        return f"{self._source}, step {step}"

    def require_bounded(self, what: str) -> None:
        """Raise a ``ValueError`` saying that ``what`` needs an end, if this trace is unbounded.

        >>> BatchSizeTrace.constant(8).require_bounded("len()")
        Traceback (most recent call last):
        ...
        ValueError: len() needs a trace with an end, but BatchSizeTrace.constant(8) is unbounded; ...
        """
        if self._unbounded:
            raise ValueError(
                f"{what} needs a trace with an end, but {self!r} is unbounded; "
                "give num_steps: BatchSizeTrace.constant(batch_size, num_steps)"
            )

    # -- validation and epochs ------------------------------------------------------------------

    def check_minibatch_size(self, minibatch_size: int) -> None:
        """Raise a ``ValueError`` naming the first step whose batch is not a multiple of ``minibatch_size``."""
        check_int("minibatch_size", minibatch_size)
        for step, size in enumerate(self._sizes):
            if size % minibatch_size:
                raise ValueError(
                    f"{self.where(step)}: batch size {size} is not a multiple of minibatch_size={minibatch_size}; "
                    f"use a minibatch size that divides every batch size, or round the trace"
                )

    def epoch(self, epoch: int, dataset_size: int, *, drop_last: bool = False) -> EpochSteps:
        """The steps of epoch ``epoch`` over ``dataset_size`` samples (see the module docstring).

        Args:
            epoch: epoch number, from 0.
            dataset_size: number of samples in the dataset.
            drop_last: leave out the samples that do not fill the next step's batch (``True``) or
                run them as a final smaller step (``False``).

        Raises:
            ValueError: the trace ends before the epoch does.
        """
        check_int("epoch", epoch, minimum=0)
        check_int("dataset_size", dataset_size)
        if not isinstance(drop_last, bool):
            raise TypeError(f"drop_last should be a bool, got {drop_last!r}")
        starts = self._epoch_starts(dataset_size, drop_last, upto=epoch + 1)
        if len(starts) <= epoch + 1:
            last = len(starts) - 1  # the trace ends inside this epoch
            if epoch == last and starts[-1] < len(self._sizes):
                # Its steps run: the trace says what to train, even when it ends before the data does.
                return EpochSteps(
                    epoch, starts[-1], tuple(self._sizes[starts[-1] :]), dataset_size, truncated=True
                )
            raise self._too_short(starts, dataset_size)
        first, end = starts[epoch], starts[epoch + 1]
        sizes = [self[s] for s in range(first, end)]
        used = sum(sizes)
        if not drop_last and used > dataset_size:
            sizes[-1] -= used - dataset_size
        return EpochSteps(epoch, first, tuple(sizes), dataset_size)

    def _too_short(self, starts: list[int], dataset_size: int) -> ValueError:
        last = len(starts) - 1  # the epoch the trace ends in
        left = dataset_size - sum(self._sizes[starts[-1] :])
        steps = len(self._sizes) - starts[-1]
        covers = f"{last} full epochs" + (f" and {steps} steps of epoch {last}" if steps else "")
        return ValueError(
            f"trace {self.source!r} is too short: it has {len(self._sizes)} steps "
            f"({self.total_samples} samples in all) and ends {left} samples before the end of epoch "
            f"{last} over dataset_size={dataset_size} (that epoch starts at step {starts[-1]}); "
            f"use a longer trace or fewer epochs (it covers {covers})"
        )

    def _epoch_starts(self, dataset_size: int, drop_last: bool, upto: int | None) -> list[int]:
        """First global step of epochs ``0..upto`` (or of every epoch the trace completes, and the end).

        Shorter than ``upto + 1`` when the trace ends inside an epoch. Cached per dataset size.
        """
        key = (dataset_size, drop_last)
        starts = self._epoch_cache.setdefault(key, [0])
        while (upto is None or len(starts) <= upto) and key not in self._epoch_cache_final:
            end = self._epoch_end(len(starts) - 1, starts[-1], dataset_size, drop_last)
            if end is None:
                self._epoch_cache_final.add(key)
                break
            starts.append(end)
        return starts

    def _epoch_end(self, epoch: int, first: int, dataset_size: int, drop_last: bool) -> int | None:
        """Global step after the last step of the epoch starting at ``first``; None if the trace ends first."""
        if self._unbounded:
            size = self._sizes[0]
            if drop_last and size > dataset_size:
                raise self._no_step_error(epoch, first, dataset_size)
            return first + (dataset_size // size if drop_last else -(-dataset_size // size))
        left, step, n = dataset_size, first, len(self._sizes)
        while left > 0 and step < n:
            size = self._sizes[step]
            if drop_last and size > left:
                if step == first:
                    raise self._no_step_error(epoch, first, dataset_size)
                return step
            left -= size
            step += 1
        return None if left > 0 else step

    def _no_step_error(self, epoch: int, step: int, dataset_size: int) -> ValueError:
        return ValueError(
            f"{self.where(step)}: batch size {self[step]} is larger than dataset_size={dataset_size}, "
            f"so with drop_last=True epoch {epoch} would have no step; use drop_last=False or a smaller batch"
        )

    def split_epochs(
        self, dataset_size: int, num_epochs: int | None = None, *, drop_last: bool = False
    ) -> list[EpochSteps]:
        """Split the trace into ``num_epochs`` complete epochs (default: every full epoch it covers).

        Raises:
            ValueError: the trace is too short for ``num_epochs`` complete epochs (naming the trace
                and epoch); a truncated last epoch (see :meth:`epoch`) does not count here.
        """
        full = self.num_full_epochs(dataset_size, drop_last=drop_last)
        if num_epochs is None:
            num_epochs = full
        check_int("num_epochs", num_epochs, minimum=0)
        if num_epochs > full:
            raise self._too_short(self._epoch_starts(dataset_size, drop_last, upto=None), dataset_size)
        return [self.epoch(e, dataset_size, drop_last=drop_last) for e in range(num_epochs)]

    def num_full_epochs(self, dataset_size: int, *, drop_last: bool = False) -> int:
        """How many complete epochs over ``dataset_size`` samples the trace covers."""
        self.require_bounded("num_full_epochs")
        check_int("dataset_size", dataset_size)
        return len(self._epoch_starts(dataset_size, drop_last, upto=None)) - 1

    def num_epochs(self, dataset_size: int, *, drop_last: bool = False) -> int:
        """Epochs over ``dataset_size`` samples the trace has steps in: the full ones and a truncated last one."""
        full = self.num_full_epochs(dataset_size, drop_last=drop_last)
        starts = self._epoch_starts(dataset_size, drop_last, upto=None)
        return full + (1 if starts[-1] < len(self._sizes) else 0)

    # -- output ---------------------------------------------------------------------------------

    def to_csv(self, path: str | os.PathLike[str]) -> None:
        """Write the trace as a ``step,batchsize`` CSV file (with header) that :meth:`from_csv` reads back."""
        self.require_bounded("to_csv")
        with Path(path).open("w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f, lineterminator="\n")
            writer.writerow(["step", "batchsize"])
            writer.writerows(enumerate(self._sizes))

    plot = plot_trace
    """Plot batch size over steps (with ``lr``, the learning rate too) to a PNG.

    ``trace.plot(path, ...)`` is :func:`~torchfold.train.schedule.plot.plot_trace` ``(trace, path, ...)``: one signature.
    """


TraceLike = Union[BatchSizeTrace, str, "os.PathLike[str]", Sequence[int], int]

# the forms of a trace written as text, as errors list them
_FORMS = (
    "a step,batchsize CSV file, an integer (a constant batch size: 256), a list of batch sizes (32,64,96) "
    "or a schedule (constant:BATCH:STEPS, linear:START:END:STEPS or steps:BATCHxSTEPS,..., joined by '+': "
    "linear:32:256:1000+constant:256:9000)"
)

_INT = r"[-+]?[0-9]+"  # ASCII digits: str.isdigit() also takes other scripts'
_FLOAT = r"[-+]?([0-9]*\.[0-9]+|[0-9]+\.[0-9]*)([eE][-+]?[0-9]+)?|[-+]?[0-9]+[eE][-+]?[0-9]+"


def as_trace(trace: TraceLike) -> BatchSizeTrace:
    """Turn a trace-like value into a :class:`BatchSizeTrace`: the one rule for every ``trace=``
    argument (:class:`~torchfold.train.StepLoader`, :class:`~torchfold.train.TraceBatchSampler`)
    and, through :meth:`BatchSizeTrace.parse`, for the command line's ``--trace``.

    Args:
        trace: a :class:`BatchSizeTrace` (returned as is), a sequence of ints, an int (an
            unbounded constant trace), a path (a ``step,batchsize`` CSV file), or a string in any
            form the command line takes: ``"256"`` (a constant), ``"32,64,96"`` (a list),
            ``"linear:32:256:1000"`` (a schedule, :meth:`BatchSizeTrace.from_schedule`) or the CSV
            file's path. A string that is a number or a list is never read as a file name; one
            with a ``:`` is a file name only when that file exists.

    Raises:
        ValueError / TypeError: a value of none of these forms, naming it and the forms; a bad
            file, naming it and the line.
        FileNotFoundError: a string of no other form that names no file (the message lists the forms).

    >>> as_trace(256)
    BatchSizeTrace.constant(256)
    >>> as_trace([32, 64]).batch_sizes
    (32, 64)
    >>> as_trace("32,64,96").batch_sizes
    (32, 64, 96)
    >>> as_trace("linear:32:128:4").batch_sizes
    (32, 64, 96, 128)
    >>> as_trace("linear:32:128")
    Traceback (most recent call last):
    ...
    ValueError: trace 'linear:32:128': bad schedule part 'linear:32:128' in 'linear:32:128': expected ...
    """
    if isinstance(trace, BatchSizeTrace):
        return trace
    if isinstance(trace, bool):
        raise TypeError(
            f"trace should be a BatchSizeTrace, a string, a path, a list of ints or an int, got {trace!r}"
        )
    if isinstance(trace, int):
        return BatchSizeTrace.constant(trace)
    if isinstance(trace, str):
        return _from_text(trace, None)
    if isinstance(trace, os.PathLike):
        return BatchSizeTrace.from_csv(trace)
    if isinstance(trace, Sequence):
        return BatchSizeTrace(cast("Sequence[int]", trace))
    raise TypeError(
        f"trace should be a BatchSizeTrace, a string ({_FORMS}), a path, a list of ints or an int, "
        f"got {type(trace).__name__}"
    )


def _from_text(text: str, option: str | None) -> BatchSizeTrace:
    """The trace ``text`` names (see :func:`as_trace`); errors start with ``option text`` (the
    command line's) or, without ``option``, with ``trace 'text'``."""
    where = f"{option} {text}" if option is not None else f"trace {text!r}"

    def spelled(value: int) -> str:  # how the user writes a constant where the value came from
        return f"{option} {value}" if option is not None else f"trace={value}"

    value = text.strip()
    if re.fullmatch(_INT, value):
        if int(value) < 1:
            raise ValueError(
                f"{where}: a constant global batch size must be a positive integer (samples per step)"
            )
        return as_trace(int(value))
    if re.fullmatch(_FLOAT, value):
        raise ValueError(
            f"{where}: a constant global batch size must be a whole number of samples, e.g. "
            f"{spelled(max(1, round(float(value))))}"
        )
    if "," in value and re.fullmatch(r"[-+0-9.eE,\s]+", value):
        fields = [field.strip() for field in value.split(",")]
        for number, field in enumerate(fields):
            if not re.fullmatch(_INT, field):
                raise ValueError(
                    f"{where}: a list of batch sizes holds whole numbers separated by commas (32,64,96), "
                    f"got {field!r} at position {number}"
                )
            if int(field) < 1:
                raise ValueError(
                    f"{where}: batch sizes must be positive integers, got {field} at position {number}"
                )
        return BatchSizeTrace([int(field) for field in fields], source=value)
    path = Path(text)
    if not value:
        raise ValueError(f"{where}: empty; give {_FORMS}")
    if path.is_dir():
        raise ValueError(f"{where} is a directory; give {_FORMS}")
    if ":" in text and not path.exists():
        try:
            return BatchSizeTrace.from_schedule(value)
        except ValueError as e:  # (its message says how a schedule is written)
            raise ValueError(f"{where}: {e}") from e
    if not path.exists():
        raise FileNotFoundError(f"{where}: no such file, and no other form of trace: give {_FORMS}")
    return BatchSizeTrace.from_csv(path)  # (its errors name the file and the line)
