"""The Lightning recipe of docs/guide/lightning-accelerate.md with one intra-op thread and with more.

The guide tells a Lightning or accelerate loop to run one intra-op thread per process, as
``TraceTrainer`` does by default. This runs the page's shared part and its Lightning recipe (two
epochs, 40 trees, ``trainer.fit`` timed alone) in fresh processes of this Python, taking turns
between the thread counts, and prints each run's elapsed and CPU seconds and their medians. The
page sets one thread; a run here sets its count after the shared part, before the recipe.

Needs the integrations extra (``pip install 'pytorch-fold[integrations]'``).

Usage::

    .venv/bin/python benchmarks/recipe_threads.py --rounds 6              # 1 thread vs os.cpu_count()
    .venv/bin/python benchmarks/recipe_threads.py --rounds 3 --threads 1 4 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from harness import REPO_ROOT, machine_lines, markdown_table

PAGE = REPO_ROOT / "docs" / "guide" / "lightning-accelerate.md"

# One run, in its own process: the page's shared block, the thread count, the timed Lightning block.
RUN = """
import json, re, sys, time
import torch
blocks = re.findall(r"^```python\\n(.*?)^```$", open(sys.argv[1], encoding="utf-8").read(), flags=re.S | re.M)
scope = {}
exec(compile(blocks[0], sys.argv[1], "exec"), scope)
torch.set_num_threads(int(sys.argv[2]))
wall, cpu = time.perf_counter(), time.process_time()
exec(compile(blocks[1], sys.argv[1], "exec"), scope)
print(json.dumps({"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu,
                  "threads": torch.get_num_threads(), "global_step": scope["trainer"].global_step}))
"""


def run_once(threads: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # the count is the argument's, not the environment's
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-c", RUN, str(PAGE), str(threads)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="runs per thread count, taking turns")
    parser.add_argument(
        "--threads", type=int, nargs="+", default=None, help="thread counts (default: 1 and os.cpu_count())"
    )
    args = parser.parse_args()
    counts = args.threads or sorted({1, os.cpu_count() or 1})
    runs: dict[int, list[dict[str, float]]] = {n: [] for n in counts}
    rows = []
    for r in range(args.rounds):
        for n in counts:
            load = f"{os.getloadavg()[0]:.2f}"  # the machine's other work, as the run starts
            result = run_once(n)
            runs[n].append(result)
            rows.append([r + 1, int(result["threads"]), result["wall"], result["cpu"], load])
            print(
                f"round {r + 1}, {n} thread(s): {result['wall']:.2f} s elapsed, {result['cpu']:.2f} s CPU",
                flush=True,
            )
    print("\n".join(machine_lines([f"command: {' '.join(sys.argv)}"])))
    print(markdown_table(["round", "threads", "elapsed s", "CPU s", "load average"], rows))
    medians = [
        [n, statistics.median(x["wall"] for x in runs[n]), statistics.median(x["cpu"] for x in runs[n])]
        for n in counts
    ]
    print(markdown_table(["threads", "median elapsed s", "median CPU s"], medians))
    steps = {x["global_step"] for n in counts for x in runs[n]}
    if len(steps) != 1:  # every run trains the same steps, whatever its threads
        raise SystemExit(f"the runs disagree on the number of optimizer steps: {sorted(steps)}")


if __name__ == "__main__":
    main()
