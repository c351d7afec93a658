"""``python -m torchfold train`` on XLA against the same command on the plain CPU, taking turns.

Each round runs the trainer command once per variant, in the order given, in fresh processes
of this Python (the same environment: with torch_xla installed, ``PJRT_DEVICE=CPU`` for the XLA
runs, so XLA runs on its CPU backend), and reads each run's ``--history``: sentences per second
over a window of steps (the steps' own seconds, so start-up, data loading and the warm-up's
compilations stay out) and the last loss (the same for every variant, to the printed digits,
when they train alike). The table gives every run and each XLA run's ratio to the CPU run of its round.

Variants are ``DEVICE/COMPILE`` pairs of the trainer's ``--device`` and ``--compile``:
``cpu/off`` (eager, the reference), ``xla/auto`` (every step replayed: a minibatch program per
minibatch, then the update program), ``xla/off`` (run op by op); ``DEVICE/COMPILE/WORKERS`` sets the
trainer's ``--workers`` too (default 1: folds built in one worker process; 0: in the trainer's),
and a last ``/packed`` adds ``--pack-levels`` (``xla/auto/packed``, ``xla/auto/0/packed``).

Usage::

    PJRT_DEVICE=CPU .venv-xla/bin/python benchmarks/trainer_xla.py --data ../shared/data --rounds 2
    .venv/bin/python benchmarks/trainer_xla.py --quick --variants cpu/off   # no torch_xla needed
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness import DATA_DIR, REPO_ROOT, machine_lines, markdown_table


def trainer_command(args: argparse.Namespace, device: str, compile: str, history: Path) -> list[str]:
    """The measured command: SST Tree-LSTM, a constant trace of ``--trees``, one minibatch a step."""
    return [
        sys.executable,
        "-m",
        "torchfold",
        "train",
        "--data",
        str(args.data),
        "--trace",
        str(args.trees),
        "--minibatch-size",
        str(args.trees),
        "--max-steps",
        str(args.steps),
        "--embedding-dim",
        str(args.dims),
        "--hidden-dim",
        str(args.dims),
        "--threads",
        "1",
        "--no-progress",
        "--log-every",
        "0",
        "--history",
        str(history),
        "--device",
        device,
        "--compile",
        compile,
        *(["--max-train", str(args.max_train)] if args.max_train else []),
    ]


def run_once(args: argparse.Namespace, variant: str, scratch: Path) -> dict[str, Any]:
    """One trainer run of ``variant``: its sentences/s and ms per step over the window, and its last loss."""
    device, compile, *more = variant.split("/")
    history = scratch / f"{variant.replace('/', '-')}.jsonl"
    history.unlink(missing_ok=True)
    env = {**os.environ}
    if device == "xla":
        env.setdefault("PJRT_DEVICE", "CPU")
    extra = [arg for part in more for arg in (["--pack-levels"] if part == "packed" else ["--workers", part])]
    done = subprocess.run(
        trainer_command(args, device, compile, history) + extra,
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=args.timeout,
    )
    if done.returncode != 0:
        raise SystemExit(f"{variant}: the trainer exited with {done.returncode}:\n{done.stderr[-3000:]}")
    steps = [json.loads(line) for line in history.read_text().splitlines()]
    first, last = args.window
    window = [s for s in steps if first <= s["step"] + 1 <= last]  # step numbers count from 0
    if not window:
        raise SystemExit(f"{variant}: no step in the window {first}-{last} (the run made {len(steps)})")
    seconds = sum(s["seconds"] for s in window)
    return {
        "variant": variant,
        "sentences/s": sum(s["batch_size"] for s in window) / seconds,
        "ms/step": 1000 * seconds / len(window),
        "last loss": steps[-1]["loss"],
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the rounds, print the table; every run's results (with its round and ratio to the CPU)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--data",
        type=Path,
        default=DATA_DIR,
        help="the data directory holding sst/ (default: the shared data)",
    )
    parser.add_argument("--trees", type=int, default=25, help="trees per step (one minibatch)")
    parser.add_argument("--dims", type=int, default=128, help="embedding and hidden size")
    parser.add_argument("--steps", type=int, default=80, help="steps per run")
    parser.add_argument(
        "--window",
        type=int,
        nargs=2,
        default=(21, 80),
        metavar=("FIRST", "LAST"),
        help="steps timed (from 1)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="times each variant runs, taking turns")
    parser.add_argument(
        "--variants", default="cpu/off,xla/auto", help="DEVICE/COMPILE[/WORKERS][/packed], in order"
    )
    parser.add_argument("--max-train", type=int, default=None, help="train on the first N trees only")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per trainer run")
    parser.add_argument("--quick", action="store_true", help="a minimal run (the smoke test's)")
    args = parser.parse_args(argv)
    if args.quick:
        args.trees, args.dims, args.steps, args.window, args.rounds, args.max_train = 4, 8, 4, (2, 4), 1, 48
    variants = args.variants.split(",")
    for variant in variants:
        parts = variant.split("/")
        if (
            len(parts) < 2
            or parts[0] not in ("cpu", "xla")
            or not re.fullmatch(r"(/\d+)?(/packed)?", "".join(f"/{p}" for p in parts[2:]))
        ):
            parser.error(
                f"--variants: {variant!r} is not DEVICE/COMPILE[/WORKERS][/packed] with DEVICE cpu or xla, like "
                "xla/auto, xla/auto/0 or xla/auto/1/packed"
            )
        if parts[-1] == "packed" and parts[0] == "cpu" and parts[1] != "on":
            parser.error(
                f"--variants: {variant!r} packs static shapes, which the CPU has only with compile on (cpu/on/packed)"
            )
    print("\n".join(machine_lines([f"command: {' '.join(trainer_command(args, 'D', 'C', Path('H')))}"])))
    rows: list[list[object]] = []
    runs: list[dict[str, Any]] = []
    ratios: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for number in range(1, args.rounds + 1):
            results = [run_once(args, variant, Path(scratch)) for variant in variants]
            cpu = next((r["sentences/s"] for r in results if r["variant"].startswith("cpu/")), None)
            for result in results:
                ratio = result["sentences/s"] / cpu if cpu else float("nan")
                if not result["variant"].startswith("cpu/"):
                    ratios.setdefault(result["variant"], []).append(ratio)
                runs.append({**result, "round": number, "vs cpu": ratio})
                rows.append(
                    [
                        number,
                        result["variant"],
                        result["sentences/s"],
                        result["ms/step"],
                        f"{ratio:.2f}x",
                        f"{result['last loss']:.6f}",
                    ]
                )
    first, last = args.window
    print(
        markdown_table(
            [
                "round",
                "device/compile",
                f"sentences/s, steps {first}-{last}",
                "ms/step",
                "vs cpu",
                "last loss",
            ],
            rows,
        )
    )
    for variant, values in ratios.items():
        print(f"{variant} / cpu: median {statistics.median(values):.2f}x over {len(values)} round(s)")
    return runs


if __name__ == "__main__":
    main()
