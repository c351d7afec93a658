"""The pyast task (an n-ary SiblingTreeLSTM over the standard library's functions): Fold against eager recursion.

Times forward + backward of minibatches of functions, one Fold per minibatch (recording, planning
and running) against the plain recursive model (:func:`~torchfold.examples.models.forward_ast`,
one call per node), on one CPU thread. Hand batching is not measured here (see README.md).

    python benchmarks/pyast.py --functions 512 --minibatch 32
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import time

import torch

from torchfold.examples.models import RootBuild, SiblingTreeLSTM, forward_ast, root_loss
from torchfold.examples.pyast import KINDS, python_functions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--functions", type=int, default=512)
    parser.add_argument("--minibatch", type=int, default=32)
    parser.add_argument("--hidden-dim", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    samples, _ = python_functions(args.functions, 1)
    model = SiblingTreeLSTM(len(KINDS), 32, args.hidden_dim)
    batches = [samples[i : i + args.minibatch] for i in range(0, len(samples), args.minibatch)]
    build = RootBuild()

    def fold_pass() -> None:
        for batch in batches:
            plan, targets = build(batch)
            root_loss(model, plan.apply(model), targets).backward()

    def eager_pass() -> None:
        for batch in batches:
            h = torch.cat([forward_ast(model, s.tree)[0] for s in batch])
            labels = torch.tensor([s.label for s in batch])
            torch.nn.functional.cross_entropy(model.logits(h), labels).backward()

    results = {}
    for name, run in (("fold", fold_pass), ("eager", eager_pass)):
        run()  # warm-up
        start = time.perf_counter()
        run()
        results[name] = time.perf_counter() - start
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    nodes = sum(s.size for s in samples)
    print(
        f"machine: {platform.processor() or platform.machine()}, {platform.python_version()}, torch {torch.__version__}"
    )
    print(
        f"commit {commit}; {len(samples)} functions, {nodes} nodes, minibatch {args.minibatch}, hidden {args.hidden_dim}"
    )
    for name, seconds in results.items():
        print(
            f"{name}: {seconds:.2f} s per pass, {len(samples) / seconds:.0f} functions/s, {nodes / seconds:.0f} nodes/s"
        )
    print(f"fold speed-up over eager: {results['eager'] / results['fold']:.1f}x")


if __name__ == "__main__":
    main()
