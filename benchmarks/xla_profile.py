"""Where a replayed XLA training step spends its device time: alone, and inside the trainer.

Both runs take a torch_xla profiler trace (``torch_xla.debug.profiler``) of replayed steps
(``XlaPrograms``: each step of one minibatch is two compiled programs, the minibatch program's
forward, loss and backward, then the update program's Adam) and sum the time of the compiled
programs' operations ("thunks" of XLA's CPU backend: ``dot``, fusions, copies...) per step, by
kind:

* ``alone``: the SST Tree-LSTM's steps on plans built ahead in this process (the static shapes
  fitted as ``python -m torchfold train --device xla`` fits them), nothing else running;
* ``trainer``: the trainer command of ``benchmarks/trainer_xla.py`` on XLA, traced over a window
  of its steps, with its loader's fold-building worker and its host running beside the device.

On the CPU backend the device is the machine's own cores: the difference between the two columns
is what the host and the worker take from it.

Usage::

    PJRT_DEVICE=CPU .venv-xla/bin/python benchmarks/xla_profile.py --data ../shared/data
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import os
import random
import re
import statistics
import subprocess
import tempfile
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from harness import DATA_DIR, REPO_ROOT, machine_lines, markdown_table
from trainer_xla import trainer_command

# A compiled program's operation in the trace: a name and numbers (``dot.248``, ``copy.3.clone``).
_THUNK = re.compile(r"^([a-z_\-]+)(\.\d+)+(\.clone)?$")
_EXECUTE = "ThunkExecutor::Execute"
_EXECUTION = "ThunkExecutor::Execute (wait for completion)"
# A replayed step of one minibatch executes two programs: the minibatch program, the update program.
PROGRAMS_PER_STEP = 2

# Run in the trainer's process: trace from replayed step FIRST (counted from 1, by its minibatch: one
# a step) until step LAST's loss has been read (the trainer reads it after launching the next step:
# so at the minibatch after that). The programs run synchronously: a step's two start and end inside.
_TRAINER_HOOK = """
import atexit, os, runpy, sys
import torch_xla.debug.profiler as xp
from torchfold.train.capture import XlaPrograms
first, last, where = int(os.environ["PROFILE_FIRST"]), int(os.environ["PROFILE_LAST"]), os.environ["PROFILE_DIR"]
call, count = XlaPrograms.run_minibatch, [0]
def traced(self, *args, **kwargs):
    count[0] += 1
    if count[0] == first:
        xp.start_trace(where)
        atexit.register(xp.stop_trace)  # the run ends first (the last step's loss is read at the end)
    if count[0] == last + 2:
        atexit.unregister(xp.stop_trace)
        xp.stop_trace()
    return call(self, *args, **kwargs)
XlaPrograms.run_minibatch = traced
sys.argv = ["torchfold", *sys.argv[1:]]
runpy.run_module("torchfold", run_name="__main__", alter_sys=True)
"""


def step_times(trace_dir: Path, per_step: int = 1) -> dict[str, Any]:
    """Per step (``per_step`` consecutive executed programs in the trace, a step's programs in
    time order): its programs' wall time and the time of their operations, by kind; medians.

    An execution runs on one thread from its first ``ThunkExecutor::Execute`` to the end of its
    wait for completion, which every execution records once. Its operations run in that window
    (on that thread and the pool's). The wait alone is not the window: when the thunks ran
    inline (e.g. on a loaded machine) they ran before it, and the wait took no time.
    """
    found = sorted(trace_dir.glob("plugins/profile/*/*.trace.json.gz"))
    if not found:
        raise SystemExit(f"no profiler trace under {trace_dir}: torch_xla wrote none")
    with gzip.open(found[-1]) as file:
        events = [e for e in json.load(file)["traceEvents"] if e.get("ph") == "X"]
    executions = sorted((e for e in events if e["name"] == _EXECUTION), key=lambda e: e["ts"])
    launches: dict[Any, list[float]] = defaultdict(list)  # per thread: when its executions started
    for e in sorted((e for e in events if e["name"] == _EXECUTE), key=lambda e: e["ts"]):
        launches[e["tid"]].append(e["ts"])
    previous: dict[Any, float] = defaultdict(lambda: float("-inf"))  # per thread: the last execution's end
    # every operation once: (start, duration in ms, kind), in time order
    thunks = sorted(
        (e["ts"], e["dur"] / 1000, match.group(1))
        for e in events
        if (match := _THUNK.match(e["name"])) and not e["name"].startswith("call.")
    )
    starts = [start for start, _, _ in thunks]
    walls, sums, kinds = [], [], []
    for execution in executions:
        end, thread = execution["ts"] + execution["dur"], execution["tid"]
        started = launches[thread]
        first = bisect.bisect_left(started, previous[thread])
        start = started[first] if first < len(started) and started[first] <= end else execution["ts"]
        previous[thread] = end
        inside = thunks[bisect.bisect_left(starts, start) : bisect.bisect_right(starts, end)]
        if not inside:
            continue
        by_kind: dict[str, float] = defaultdict(float)
        for _, ms, kind in inside:
            by_kind[kind] += ms
        walls.append((end - start) / 1000)
        sums.append(sum(by_kind.values()))
        kinds.append(by_kind)
    steps = len(walls) // per_step  # (a step whose programs the trace did not all hold is left out)
    if not steps:
        raise SystemExit(f"the trace under {trace_dir} holds no executed program of a whole step")
    step_walls = [sum(walls[n * per_step : (n + 1) * per_step]) for n in range(steps)]
    step_sums = [sum(sums[n * per_step : (n + 1) * per_step]) for n in range(steps)]
    step_kinds: list[dict[str, float]] = []
    for n in range(steps):
        by_kind = defaultdict(float)
        for program in kinds[n * per_step : (n + 1) * per_step]:
            for kind, ms in program.items():
                by_kind[kind] += ms
        step_kinds.append(by_kind)
    every = {kind for by_kind in step_kinds for kind in by_kind}
    return {
        "steps": steps,
        "wall": statistics.median(step_walls),
        "operations": statistics.median(step_sums),
        "kinds": {kind: statistics.median(k.get(kind, 0.0) for k in step_kinds) for kind in every},
    }


def minibatches(trees: list[Any], size: int, count: int, seed: int) -> list[list[Any]]:
    """``count`` minibatches of ``size`` trees, drawn as a shuffling loader draws them."""
    rng, order = random.Random(seed), list(range(len(trees)))
    out: list[list[Any]] = []
    while len(out) < count:
        rng.shuffle(order)
        out += [[trees[i] for i in order[s : s + size]] for s in range(0, len(order) - size + 1, size)]
    return out[:count]


def profile_alone(args: argparse.Namespace, trace_dir: Path) -> dict[str, Any]:
    """Replayed steps of plans built ahead, in this process: warm-up over ``--warmup`` steps, then
    ``--steps`` traced steps of the layouts the warm-up compiled."""
    import torch
    import torch_xla
    import torch_xla.debug.profiler as xp

    from torchfold.examples.models import TreeLSTM, TreeLSTMBuild, tree_lstm_loss, tree_lstm_shapes
    from torchfold.examples.sst import Vocab, load_sst
    from torchfold.train.capture import XlaPrograms

    torch.set_num_threads(1)
    trees = load_sst(args.data, "train", max_trees=args.max_train)
    vocab = Vocab.build(trees)
    # the trainer's own fitting, not a copy of it; unfrozen: these minibatches are not a loader's, nothing splits them
    shapes = tree_lstm_shapes(trees, vocab, args.trees).freeze(False)
    build = TreeLSTMBuild(vocab, shapes)
    plans: list[tuple[Any, Any]] = [
        build(batch) for batch in minibatches(trees, args.trees, args.warmup + 4 * args.steps, 0)
    ]
    device = torch_xla.device()
    torch.manual_seed(0)
    model = TreeLSTM(len(vocab), args.dims, args.dims).to(device)
    programs = XlaPrograms(
        model, tree_lstm_loss, torch.optim.Adam(model.parameters(), lr=0.01, capturable=True)
    )

    def run(plan: Any, targets: Iterable[Any]) -> None:
        programs.run_minibatch(plan, tuple(torch.from_numpy(t).to(device) for t in targets), args.trees)
        programs.update([0.01], args.trees).item()

    for plan, targets in plans[: args.warmup]:
        run(plan, targets)
    warm = {plan.layout.key for plan, _ in plans[: args.warmup]}
    traced = [p for p in plans[args.warmup :] if p[0].layout.key in warm][: args.steps] or plans[: args.steps]
    xp.start_trace(str(trace_dir))
    for plan, targets in traced:
        run(plan, targets)
    xp.stop_trace()
    return step_times(trace_dir, PROGRAMS_PER_STEP)


def profile_trainer(args: argparse.Namespace, trace_dir: Path, scratch: Path) -> dict[str, Any]:
    """The trainer command on XLA, its replayed steps from ``--warmup + 1`` on traced (``--steps``, and
    the one the host launched ahead of the last, when it finished before the trace stopped)."""
    whole = argparse.Namespace(**{**vars(args), "steps": args.warmup + args.steps})  # steps it trains
    command = trainer_command(whole, "xla", "replay", scratch / "history.jsonl")
    command[1:3] = ["-c", _TRAINER_HOOK]  # instead of ``-m torchfold``
    env = {
        **os.environ,
        "PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "CPU"),
        "PROFILE_FIRST": str(args.warmup + 1),
        "PROFILE_LAST": str(args.warmup + args.steps),
        "PROFILE_DIR": str(trace_dir),
    }
    done = subprocess.run(
        command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=args.timeout
    )
    if done.returncode != 0:
        raise SystemExit(f"the trainer exited with {done.returncode}:\n{done.stderr[-3000:]}")
    return step_times(trace_dir, PROGRAMS_PER_STEP)


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Profile both runs, print the table; per run, its medians per step (ms)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, default=DATA_DIR, help="the data directory holding sst/")
    parser.add_argument("--trees", type=int, default=25, help="trees per step (one minibatch)")
    parser.add_argument("--dims", type=int, default=128, help="embedding and hidden size")
    parser.add_argument("--warmup", type=int, default=40, help="replayed steps before the traced ones")
    parser.add_argument("--steps", type=int, default=20, help="replayed steps traced")
    parser.add_argument("--runs", default="alone,trainer", help="which runs: alone, trainer, or both")
    parser.add_argument("--max-train", type=int, default=None, help="train on the first N trees only")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for the trainer run")
    parser.add_argument("--top", type=int, default=12, help="kinds of operation listed")
    parser.add_argument("--quick", action="store_true", help="a minimal run (the smoke test's)")
    args = parser.parse_args(argv)
    if args.quick:
        args.trees, args.dims, args.warmup, args.steps, args.max_train = 4, 8, 3, 2, 48
    runs = args.runs.split(",")
    if not runs or any(run not in ("alone", "trainer") for run in runs):
        parser.error(f"--runs: {args.runs!r} must name alone, trainer or both, like alone,trainer")
    print(
        "\n".join(
            machine_lines(
                [
                    f"{args.trees} trees per step, dims {args.dims}, {args.steps} steps traced after {args.warmup}"
                ]
            )
        )
    )
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for run in runs:
            trace_dir = Path(scratch) / run
            if run == "alone":
                results[run] = profile_alone(args, trace_dir)
            else:
                results[run] = profile_trainer(args, trace_dir, Path(scratch))
    kinds = sorted(
        {k for r in results.values() for k in r["kinds"]},
        key=lambda k: -max(r["kinds"].get(k, 0) for r in results.values()),
    )
    rows: list[list[object]] = [
        ["programs' wall time", *(r["wall"] for r in results.values())],
        ["its operations, summed", *(r["operations"] for r in results.values())],
        *([kind, *(r["kinds"].get(kind, 0.0) for r in results.values())] for kind in kinds[: args.top]),
        ["steps traced", *(r["steps"] for r in results.values())],
    ]
    print(markdown_table(["ms per step (median)", *results], rows))
    return results


if __name__ == "__main__":
    main()
