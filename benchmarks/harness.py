"""Shared helpers for the benchmark scripts: machine description, timing, markdown tables.

Importable without torch (the DyNet benchmark runs in its own environment without it).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    # The scripts run from a checkout (python benchmarks/x.py) without torchfold installed.
    sys.path.insert(0, str(REPO_ROOT))


# The benchmarks' data: $TORCHFOLD_DATA, else ../shared/data next to the repository (torchfold
# itself assumes no directory; the scripts name theirs here).
DATA_DIR = Path(os.environ.get("TORCHFOLD_DATA") or REPO_ROOT.parent / "shared" / "data")


def add_sst_data_argument(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    """``--data FILE``: SST-format trees; default ``DATA_DIR/sst/train.txt`` when present, else None."""
    default = DATA_DIR / "sst" / "train.txt"
    parser.add_argument("--data", type=Path, default=default if default.is_file() else None, help=help)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (falls back to platform.processor())."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_lines(extra: Sequence[str] = ()) -> list[str]:
    """Lines describing the machine and software, printed above every table."""
    lines = [
        f"machine: {cpu_model()}, {os.cpu_count()} logical cores, {platform.system()} {platform.release()}",
        f"python {platform.python_version()}",
    ]
    try:
        import torch

        lines.append(f"torch {torch.__version__}, torch.get_num_threads() = {torch.get_num_threads()}")
    except ImportError:
        pass
    lines.append(f"torchfold: {source_version()}")
    lines.append(
        f"clock: {clock_name()} ({'elapsed time' if clock_name() == 'wall' else 'CPU time of the process'})"
    )
    lines.extend(extra)
    return lines


def source_version() -> str:
    """The checkout's commit, and whether torchfold/ has uncommitted changes (what was measured)."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "torchfold"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown commit (not a git checkout)"
    changed = sorted({line[3:].strip() for line in dirty.splitlines() if line.strip()})
    return f"commit {commit}" + (f" + uncommitted changes to {', '.join(changed)}" if changed else "")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Render rows as a GitHub markdown table (floats with 3 significant digits... or more when large)."""

    def cell(value: object) -> str:
        if isinstance(value, float):
            if value >= 100:
                return f"{value:,.0f}"
            if value >= 10:
                return f"{value:.1f}"
            return f"{value:.3g}" if value < 1 else f"{value:.2f}"
        return str(value)

    text_rows = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text_rows)) for i, h in enumerate(header)]
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |"]
    out.append("| " + " | ".join("-" * w for w in widths) + " |")
    out.extend(
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in text_rows
    )
    return "\n".join(out)


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = CLOCKS["wall"]


def use_clock(name: str) -> None:
    """Time with ``wall`` (elapsed) or ``cpu`` (this process's CPU time) seconds from now on.

    On a machine shared with other jobs, CPU time of a single-threaded run is close to what
    the elapsed time would be on an idle machine; elapsed time also counts waiting for a core.
    """
    global _clock
    _clock = CLOCKS[name]


def clock_name() -> str:
    """``wall`` or ``cpu``: what :func:`time_calls` measures."""
    return next(name for name, fn in CLOCKS.items() if fn is _clock)


def add_clock_argument(parser: argparse.ArgumentParser) -> None:
    """The ``--clock`` option shared by the scripts."""
    parser.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="wall",
        help="wall: elapsed time; cpu: the process's CPU time (steadier on a shared machine; use with --threads 1)",
    )


def time_calls(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds taken by each of ``repeats`` calls of ``fn``, on the clock chosen by :func:`use_clock`."""
    times = []
    clock = _clock
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return times


def interleaved(
    fns: dict[str, Callable[[], object]], rounds: int, calls: dict[str, int] | None = None
) -> dict[str, list[float]]:
    """Time each function in turn, ``rounds`` times over, so that machine noise hits all alike.

    Args:
        fns: name -> function of no arguments (one unit of work, e.g. one optimizer update).
        rounds: how many times to cycle through all functions.
        calls: name -> calls per round (default 1), to time fewer of a slow version.

    Returns:
        name -> seconds per call, one entry per call made.
    """
    calls = calls or {}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].extend(time_calls(fn, calls.get(name, 1)))
    return times


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence."""
    return statistics.median(values)
