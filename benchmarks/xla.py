"""Tree-LSTM training on XLA with and without static shapes, beside plain CPU: compilations and speed.

Trains ``torchfold.examples.models.TreeLSTM`` (embedding = hidden = 128, Adam, a loss at every node,
each tree weighing the same) on consecutive SST training batches, one Fold per batch, one
``torch_xla.sync()`` per step, in one process:

* ``cpu``: plain PyTorch on the CPU (no padding: the CPU default);
* ``xla unpadded``: ``Fold(shapes=None)``: every batch is a new graph (run on fewer batches);
* ``xla static``: ``Fold(shapes=StaticShapes(...))`` with ``apply(padded=True)`` and the loss
  weighting padded rows 0, so that forward, loss, backward and update repeat one graph per
  envelope version;
* ``xla static, fitted``: the same, after fitting the envelope to the first ``--warmup`` batches'
  plans on the host (``StaticShapes.fit``: no tensor op, milliseconds), so warm-up compiles once;
* ``xla captured``: fitted static shapes, and the forward, loss and backward captured once per
  layout (``torchfold.train.capture.compiled.CompiledLoss``, torch.compile on XLA: its default backend) and
  replayed with each batch's index tensors: no op is recorded per batch; the update stays lazy;
* ``xla captured and update``: the same, and the optimizer's update compiled too
  (``torchfold.train.capture.compiled.CompiledUpdate``, Adam with ``capturable=True``);
* ``xla replayed``: fitted static shapes, and each step as two programs replayed from XLA's
  cache: the minibatch program (forward, loss, backward, the gradient's accumulation), captured
  once per layout, and the update program (Adam's update), captured once
  (``torchfold.train.capture.XlaPrograms``, what ``TraceTrainer`` runs on XLA);
  ``xla replayed packed``: the same with ``StaticShapes(pack_levels=True)`` (tree nodes run later
  than their depth where there is room: less padding); ``xla replayed plain linear``: the same
  with ``F.linear`` captured as it is (``XlaPrograms(transpose_weights=False)``: the forward
  products read the weights transposed, which XLA's CPU backend runs slower);
  ``xla replayed shallow`` / ``xla replayed deep`` as below;
* ``xla captured shallow`` / ``xla captured deep`` (and ``xla captured and update shallow`` /
  ``... deep``): the same on batches of the shallowest and of the deepest trees, to show how the
  host time per step grows with depth.

Prints, per variant, new compilations in the warm-up and after it, compile seconds, padding
waste (padded calls / real calls - 1), steady-state sentences/s (batches after the warm-up) and
the host's milliseconds per steady step (building the plan aside: issuing the step, op by op,
captured or replayed).
Run with torch_xla on its CPU backend::

    PJRT_DEVICE=CPU .venv-xla/bin/python benchmarks/xla.py --trees 25 --batches 100
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from harness import add_sst_data_argument, machine_lines, markdown_table

from torchfold import Fold, StaticPlan, StaticShapes
from torchfold.examples.datasets import Tree, Vocab, load_sst
from torchfold.examples.models import TreeLSTM, encode_trees
from torchfold.train.capture import XlaPrograms
from torchfold.train.capture.compiled import CompiledLoss, CompiledUpdate


def node_weights(roots: list[int], trees: int) -> list[float]:
    """Per node: 1 / (nodes of its tree * trees), so the loss is a mean per tree, then over trees."""
    weights: list[float] = []
    start = 0
    for root in roots:
        size = root + 1 - start
        weights += [1 / (size * trees)] * size
        start = root + 1
    return weights


def node_loss(model: torch.nn.Module, outputs: list[torch.Tensor], targets: tuple[Any, Any]) -> torch.Tensor:
    """Cross-entropy at every node, weighted (padded rows weigh 0)."""
    [states] = outputs
    labels, weights = targets
    return (F.cross_entropy(model.logits(states), labels, reduction="none") * weights).sum()  # type: ignore[operator]


PHASES: dict[str, float] = {}
# per step: the host's time to issue forward, loss, backward and update (op by op, or replayed)
HOST: list[float] = []


def train(
    device: torch.device,
    batches: list[list[Tree]],
    vocab: Vocab,
    shapes: StaticShapes | None,
    on_step: Callable[[int], None],
    captured: bool = False,
    compiled_update: bool = False,
    replayed: bool = False,
    transpose_weights: bool | None = None,
) -> list[float]:
    """One training run; returns the loss of every step (read after the run: no host sync in the loop)."""
    torch.manual_seed(0)
    model = TreeLSTM(len(vocab), 128, 128).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, capturable=compiled_update or replayed)
    step = CompiledLoss(model, node_loss, device=device) if captured else None
    update = CompiledUpdate(optimizer, device=device) if compiled_update else optimizer.step
    # reduction="sum": node_loss is already the batch's mean per tree (its node weights sum to 1)
    replay = (
        XlaPrograms(model, node_loss, optimizer, reduction="sum", transpose_weights=transpose_weights)
        if replayed
        else None
    )
    losses = []
    for number, trees in enumerate(batches):
        started = time.perf_counter()
        fold = Fold(shapes=shapes if shapes is not None else None)
        nodes, labels, roots = encode_trees(fold, trees, vocab)
        plan = fold.plan([nodes])
        planned = time.perf_counter()
        PHASES["record + plan (+ pad)"] += planned - started
        weights = plan.pad(0, node_weights(roots, len(trees))).to(device, torch.float32)
        targets = plan.pad(0, labels).to(device)
        if replay is not None:
            assert isinstance(plan, StaticPlan)
            replay.run_minibatch(plan, (targets, weights), len(trees))  # forward, loss, backward: replayed
            losses.append(replay.update([0.01], len(trees)))  # the update, replayed; the step's loss
            issued = time.perf_counter()
            PHASES["apply + loss + backward + step"] += issued - planned
            HOST.append(issued - planned)
            on_step(number)
            PHASES["sync (launch, wait when timed)"] += time.perf_counter() - issued
            continue
        optimizer.zero_grad(set_to_none=step is None)  # a captured step's gradients stay where they are
        if step is not None:
            assert isinstance(plan, StaticPlan)
            loss = step(plan, (targets, weights))  # forward, loss and backward, replayed
        else:
            loss = node_loss(model, plan.apply(model, padded=True), (targets, weights))
            loss.backward()
        update()
        losses.append(loss.detach())
        issued = time.perf_counter()
        PHASES["apply + loss + backward + step"] += issued - planned
        HOST.append(issued - planned)
        on_step(number)
        PHASES["sync (launch, wait when timed)"] += time.perf_counter() - issued
    return [float(loss) for loss in losses]


def run_variant(
    name: str,
    device: torch.device,
    batches: list[list[Tree]],
    vocab: Vocab,
    shapes: StaticShapes | None,
    warmup: int,
    captured: bool = False,
    compiled_update: bool = False,
    replayed: bool = False,
    transpose_weights: bool | None = None,
) -> dict[str, Any]:
    xla = device.type == "xla"
    stamps: list[float] = []
    compiles: list[tuple[int, float]] = []
    if xla:
        import torch_xla
        import torch_xla.debug.metrics as met

        def compile_state() -> tuple[int, float]:
            data = met.metric_data("CompileTime")
            return (0, 0.0) if data is None else (int(data[0]), data[1] / 1e9)

        def on_step(number: int) -> None:
            torch_xla.sync()  # launches the step's graph; it runs while the host issues the next one
            if number in (warmup - 1, len(batches) - 1):  # the steady window starts and ends idle
                torch_xla._XLAC._xla_wait_device_ops(devices=[])
            stamps.append(time.perf_counter())
            compiles.append(compile_state())

        compiles.append(compile_state())
    else:

        def on_step(number: int) -> None:
            stamps.append(time.perf_counter())

    PHASES.clear()
    PHASES.update(
        dict.fromkeys(
            ["record + plan (+ pad)", "apply + loss + backward + step", "sync (launch, wait when timed)"], 0.0
        )
    )
    HOST.clear()
    start = time.perf_counter()
    losses = train(
        device, batches, vocab, shapes, on_step, captured, compiled_update, replayed, transpose_weights
    )
    row: dict[str, Any] = {"variant": name, "batches": len(batches)}
    steady = stamps[-1] - stamps[warmup - 1] if len(stamps) > warmup else float("nan")
    sentences = sum(len(trees) for trees in batches[warmup:])
    row["wall s"] = round(stamps[-1] - start, 1)
    row["steady sentences/s"] = round(sentences / steady, 1)
    row["host ms/step"] = round(1000 * sum(HOST[warmup:]) / max(1, len(HOST[warmup:])), 1)
    # (the median leaves out a step that compiles: a layout first seen after the warm-up)
    row["host ms/step, median"] = round(1000 * statistics.median(HOST[warmup:]), 2) if HOST[warmup:] else "-"
    row["mean depth"] = round(sum(tree_depth(t) for b in batches for t in b) / sum(map(len, batches)), 1)
    if xla:
        row["compilations, warm-up"] = compiles[warmup][0] - compiles[0][0] if len(compiles) > warmup else "-"
        row["compilations after"] = compiles[-1][0] - compiles[min(warmup, len(compiles) - 1)][0]
        row["compile s"] = round(compiles[-1][1] - compiles[0][1], 1)
    if shapes is not None:
        row["waste"] = round(shapes.waste, 2)
        row["envelope versions"] = shapes.version
    row["final loss"] = round(losses[-1], 4)
    row["ms/batch: " + ", ".join(PHASES)] = " / ".join(
        f"{1000 * v / len(batches):.0f}" for v in PHASES.values()
    )
    return row


def fitted_shapes(batches: list[list[Tree]], vocab: Vocab, pack_levels: bool = False) -> StaticShapes:
    """An envelope fitted on the host to ``batches``' plans (no tensor op), its waste counter reset."""
    shapes = StaticShapes(pack_levels=pack_levels)
    for batch in batches:
        fold = Fold()
        nodes, _, _ = encode_trees(fold, batch, vocab)
        shapes.cover(fold.plan([nodes]))
    shapes.real_calls = shapes.padded_calls = 0  # count the waste of the training run only
    return shapes


def tree_depth(tree: Tree) -> int:
    """Levels from the root to the deepest leaf (a leaf: 1)."""
    return 1 + max((tree_depth(child) for child in tree.children), default=0)


def count_candidates(batches: list[list[Tree]], vocab: Vocab, warmup: int) -> None:
    """How many distinct graphs each padding scheme needs over ``batches`` (host only: plans, no tensors).

    A graph is identified by what XLA would see change: the sequence of (depth, op, calls) and the
    request's rows (a lower bound: the gathers' layout can differ too); the envelope by its version.
    """
    ladder = StaticShapes()
    envelope = StaticShapes()
    packed = StaticShapes(pack_levels=True)
    keys: dict[str, list[Any]] = {
        "no padding": [],
        "each group padded to its bucket": [],
        "... and levels to 8": [],
    }
    versions = []
    for trees in batches:
        fold = Fold()
        nodes, _, _ = encode_trees(fold, trees, vocab)
        plan = fold.plan([nodes])
        assert not isinstance(plan, StaticPlan)
        plain = (*tuple((s.depth, s.name, s.num_calls) for s in plan.groups), plan.sizes[0])
        bucketed = (
            *tuple((s.depth, s.name, ladder.bucket(s.num_calls)) for s in plan.groups),
            ladder.bucket(plan.sizes[0]),
        )
        levels = -(-(max(s.depth for s in plan.groups) + 1) // 8) * 8
        for name, key in zip(keys, (plain, bucketed, (*bucketed, levels)), strict=True):
            keys[name].append(key)
        envelope.cover(plan)
        packed.cover(plan)
        versions.append((envelope.version, packed.version))
        if len(versions) == warmup:  # the waste after the warm-up
            for counted in (envelope, packed):
                counted.real_calls = counted.padded_calls = 0
    rows = []
    for name, seq in keys.items():
        late = sum(1 for i, key in enumerate(seq) if i >= warmup and key not in seq[:i])
        rows.append([name, len(set(seq)), late])
    for number, name, counted in (
        (0, "grow-only envelope (StaticShapes)", envelope),
        (1, "... with levels packed (pack_levels=True)", packed),
    ):
        late = sum(
            1 for i in range(max(warmup, 1), len(versions)) if versions[i][number] != versions[i - 1][number]
        )
        rows.append([name, counted.version, late, f"{counted.waste:.2f}"])
    print(f"{len(batches[0])} trees per batch, {len(batches)} batches")
    print(
        markdown_table(
            [
                "scheme",
                "distinct graphs",
                f"new after batch {warmup}",
                f"envelope waste after batch {warmup}",
            ],
            [row if len(row) == 4 else [*row, "-"] for row in rows],
        )
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_sst_data_argument(parser, "SST train.txt (default: the shared data)")
    parser.add_argument("--trees", type=int, default=25, help="trees per batch")
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20, help="batches before steady state")
    parser.add_argument("--unpadded-batches", type=int, default=8, help="batches for the unpadded XLA run")
    parser.add_argument(
        "--variants",
        default="cpu,xla unpadded,xla static,xla static fitted,xla captured,xla captured shallow,xla captured deep",
    )
    parser.add_argument(
        "--candidates", action="store_true", help="only count each scheme's graphs (host only)"
    )
    parser.add_argument(
        "--first-tree",
        type=int,
        default=0,
        help="--candidates from this training tree on (unseen by the defaults)",
    )
    args = parser.parse_args(argv)
    if args.candidates:
        trees = load_sst(
            args.data.parent if args.data else None,
            "train",
            max_trees=args.first_tree + args.trees * args.batches,
        )[args.first_tree :]
        batches = [trees[i * args.trees : (i + 1) * args.trees] for i in range(args.batches)]
        count_candidates(batches, Vocab.build(trees), args.warmup)
        return
    os.environ.setdefault("PJRT_DEVICE", "CPU")  # read when torch_xla is imported: its CPU backend by default
    import torch_xla

    torch.set_num_threads(1)
    # autograd learns the XLA device when it is first used: before any backward on the CPU
    torch.zeros(1, device=torch_xla.device()).sum().item()
    trees = load_sst(args.data.parent if args.data else None, "train", max_trees=args.trees * args.batches)
    vocab = Vocab.build(trees)
    batches = [trees[i * args.trees : (i + 1) * args.trees] for i in range(args.batches)]
    rows = []
    for variant in args.variants.split(","):
        if variant == "cpu":
            rows.append(run_variant(variant, torch.device("cpu"), batches, vocab, None, args.warmup))
        elif variant == "xla unpadded":
            count = min(args.unpadded_batches, len(batches))
            rows.append(
                run_variant(variant, torch_xla.device(), batches[:count], vocab, None, min(2, count - 1))
            )
        elif variant == "xla static":
            rows.append(run_variant(variant, torch_xla.device(), batches, vocab, StaticShapes(), args.warmup))
        elif variant in (
            "xla static fitted",
            "xla captured",
            "xla captured and update",
            "xla captured shallow",
            "xla captured deep",
            "xla captured and update shallow",
            "xla captured and update deep",
            "xla replayed",
            "xla replayed packed",
            "xla replayed plain linear",
            "xla replayed shallow",
            "xla replayed deep",
        ):
            chosen = batches
            if variant.endswith(("shallow", "deep")):
                # the shallowest (deepest) half of the trees, shuffled: batches of one kind, in no order of depth
                ordered = sorted(trees, key=tree_depth, reverse=variant.endswith("deep"))[: len(trees) // 2]
                random.Random(0).shuffle(ordered)
                chosen = [ordered[i * args.trees : (i + 1) * args.trees] for i in range(args.batches // 2)]
            shapes = fitted_shapes(chosen[: args.warmup], vocab, pack_levels=variant.endswith("packed"))
            rows.append(
                run_variant(
                    variant,
                    torch_xla.device(),
                    chosen,
                    vocab,
                    shapes,
                    args.warmup,
                    variant.startswith("xla captured"),
                    "and update" in variant,
                    variant.startswith("xla replayed"),
                    False if variant.endswith("plain linear") else None,
                )
            )
        else:
            parser.error(f"unknown variant {variant!r}")
        print(rows[-1], flush=True)
    print(
        "\n".join(
            machine_lines([f"torch_xla {torch_xla.__version__}, PJRT_DEVICE={os.environ['PJRT_DEVICE']}"])
        )
    )
    print(f"{args.trees} trees per batch, {args.batches} batches, warm-up {args.warmup} batches")
    columns = sorted(
        {key for row in rows for key in row}, key=lambda k: list(rows[0]).index(k) if k in rows[0] else 99
    )
    print(markdown_table(columns, [[row.get(c, "-") for c in columns] for row in rows]))


if __name__ == "__main__":
    main()
