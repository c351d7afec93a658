"""What TorchDynamo's guards cost per step under ``compile="on"`` on XLA, against the step.

The SST Tree-LSTM (``torchfold.examples.models``) on torch_xla, the runner of ``compile="on"``
(TorchDynamo's guards in front of programs captured from its graphs): after every layout has been
captured, each call of the compiled step (TorchDynamo's frame) is timed, and the time spent inside
the program's call (:class:`~torchfold.train.capture.dynamo_programs.XlaGraphPrograms`: binding
the inputs and launching the captured program) is subtracted: what is left is TorchDynamo's own
work per call (checking the frame's guards, building the graph's inputs, applying side effects).
It is set against a whole step of one minibatch (forward, backward, the optimizer's update, the
loss read back) timed in the same run.

Usage::

    PJRT_DEVICE=CPU .venv-xla/bin/python benchmarks/dynamo_guard_cost.py --data ../shared/data
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from harness import DATA_DIR, machine_lines

from torchfold.engine.static import StaticShapesOverflow
from torchfold.examples.datasets import Vocab, load_sst
from torchfold.examples.models import TreeLSTM, TreeLSTMBuild, tree_lstm_loss
from torchfold.train import AccumulatingOptimizer, StepMechanism, fit_static_shapes
from torchfold.train.capture import step_runner
from torchfold.train.capture.dynamo_programs import XlaGraphPrograms
from torchfold.train.data.loader import to_device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DATA_DIR), help="the SST folder (or a train.txt)")
    parser.add_argument("--trees", type=int, default=400)
    parser.add_argument("--minibatch-size", type=int, default=25)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import torch_xla

    torch.set_num_threads(1)
    for line in machine_lines():
        print(line)
    device = torch_xla.device()
    trees = load_sst(args.data, max_trees=args.trees)
    vocab = Vocab.build(trees)
    mechanism = StepMechanism(device, compile="on")
    shapes = fit_static_shapes(
        trees, TreeLSTMBuild(vocab), args.minibatch_size, shapes=mechanism.static_shapes()
    )
    build = TreeLSTMBuild(vocab, shapes=shapes)
    batches = []
    for start in range(0, len(trees) - args.minibatch_size + 1, args.minibatch_size):
        try:
            batches.append(to_device(build(trees[start : start + args.minibatch_size]), device))
        except StaticShapesOverflow:  # (the trainer splits such a minibatch)
            continue
    torch.manual_seed(0)
    model = TreeLSTM(len(vocab), 128, 128).to(device)
    optimizer = AccumulatingOptimizer(mechanism.optimizer(torch.optim.Adam, model.parameters(), lr=1e-3))
    runner = step_runner(model, tree_lstm_loss, optimizer, device=device, compile="on")
    compiled = runner.compiled
    assert compiled is not None and compiled.programs is not None
    inside: list[float] = []
    original = XlaGraphPrograms._run

    def timed_run(self: XlaGraphPrograms, graph: Any, call_args: list[Any]) -> Any:
        started = time.perf_counter()
        try:
            return original(self, graph, call_args)
        finally:
            inside.append(time.perf_counter() - started)

    XlaGraphPrograms._run = timed_run  # type: ignore[method-assign]
    # the compiled step's call, from just after begin() to just before finish(): TorchDynamo's
    # frame (its guards, the graph's inputs, side effects) around the program's call
    calls: list[float] = []
    steps: list[float] = []
    clock = {"begun": 0.0}
    original_begin, original_finish = XlaGraphPrograms.begin, XlaGraphPrograms.finish

    def timed_begin(self: XlaGraphPrograms, *, warm_up: bool = False) -> None:
        original_begin(self, warm_up=warm_up)
        clock["begun"] = time.perf_counter()

    def timed_finish(self: XlaGraphPrograms, loss: torch.Tensor) -> bool:
        calls.append(time.perf_counter() - clock["begun"])
        return original_finish(self, loss)

    XlaGraphPrograms.begin = timed_begin  # type: ignore[method-assign]
    XlaGraphPrograms.finish = timed_finish  # type: ignore[method-assign]

    def step(batch: Any) -> None:
        plan, targets = batch
        runner.run_minibatch(plan, targets, args.minibatch_size, sole_minibatch=True)
        loss_sum, _ = runner.update()
        assert loss_sum is not None
        float(loss_sum)

    for batch in batches:  # every layout captured
        step(batch)
    for batch in batches:
        step(batch)
    inside.clear()
    calls.clear()
    for _ in range(args.rounds):
        for batch in batches:
            started = time.perf_counter()
            step(batch)
            steps.append(time.perf_counter() - started)
    frame = [call - run for call, run in zip(calls, inside, strict=True)]
    step_ms = statistics.median(steps) * 1e3
    call_ms = statistics.median(calls) * 1e3
    frame_us = statistics.median(frame) * 1e6
    print(
        f"{len(steps)} steps of one minibatch ({args.minibatch_size} trees), {len(batches)} batches x {args.rounds} rounds"
    )
    print(f"step (forward, backward, update, loss read): median {step_ms:.2f} ms")
    print(f"compiled step's call (TorchDynamo's frame and the program's): median {call_ms:.3f} ms")
    print(f"TorchDynamo's own work per call (guards, inputs, side effects): median {frame_us:.1f} us")
    print(f"= {frame_us / 1e3 / step_ms * 100:.2f}% of a step")


if __name__ == "__main__":
    main()
