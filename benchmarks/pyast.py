"""The pyast task (an n-ary SiblingTreeLSTM over the standard library's functions): Fold, hand batching, eager.

Times forward + backward of the root loss over minibatches of functions, one intra-op thread,
the versions interleaved round after round (the median pass is reported):

* ``eager``: the plain recursive model (:func:`~torchfold.examples.models.forward_ast`), one
  call per node, what you write without batching;
* ``hand-batched``: batching written by hand, the way ``tree_lstm.py`` batches the binary
  Tree-LSTM: every call of the minibatch (leaf, sibling merge, node) hash-consed (identical
  subtrees computed once), put at its depth in the dependency graph, and per depth one batched
  ``sibling`` and one batched ``node`` call, their inputs fetched with one concatenation of the
  earlier results they read and one ``index_select`` (for ``h`` and for ``c``). Its indices are
  built once per minibatch, outside the timed loop (``hand-batched, run only``) or inside it;
* ``torchfold``: a :class:`~torchfold.Fold` per minibatch
  (:class:`~torchfold.examples.models.RootBuild`: record, plan, run), and its plans built
  beforehand (``run only``, as a loader worker would ship them), the fair match for the
  hand-batched run.

Before timing, the script checks that every version gives the same loss and gradients as eager
on the first minibatch, and that the hand-batched root states equal the Fold's on every minibatch.

    python benchmarks/pyast.py --functions 512 --minibatch 32
    python benchmarks/pyast.py --root torchfold --functions 40 --minibatch 8 --rounds 1   # smoke run
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import harness
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from torchfold import FoldPlan, StaticPlan
from torchfold.examples.models import RootBuild, SiblingTreeLSTM, forward_ast, root_loss
from torchfold.examples.pyast import KINDS, AstSample, AstTree, python_functions

# --------------------------------------------------------------------------------------------
# Hand batching: the minibatch's calls hash-consed, grouped by depth, every index precomputed

_LEAF, _SIBLING, _NODE = 0, 1, 2


@dataclass(frozen=True)
class Step:
    """One batched call: which earlier results it reads and at which rows.

    ``sibling`` steps read the rows of their left inputs, then of their right ones; ``node``
    steps read their merged children's rows and take ``kinds``.
    """

    kinds: Tensor | None  # a node step's kinds; None for a sibling step
    sources: list[int]  # earlier results read (0: the leaves, i + 1: step i), concatenated in order
    rows: Tensor  # rows of that concatenation
    size: int  # calls in the step


@dataclass(frozen=True)
class HandPlan:
    """Everything the hand-batched forward needs for one minibatch."""

    leaf_kinds: Tensor
    steps: list[Step]  # in dependency order
    roots: Step  # where the roots' states are (kinds None)
    labels: Tensor
    calls: int  # distinct calls computed (after hash-consing)


def make_hand_plan(samples: Sequence[AstSample]) -> HandPlan:
    """Hash-cons the minibatch's calls, group them by (depth, op) and precompute every gather index."""
    uid_of: dict[tuple[int, int, int], int] = {}  # (op, kind or left uid, child uid) -> uid
    keys: list[tuple[int, int, int]] = []
    depth: list[int] = []

    def intern(key: tuple[int, int, int], d: int) -> int:
        uid = uid_of.get(key)
        if uid is None:
            uid = uid_of[key] = len(keys)
            keys.append(key)
            depth.append(d)
        return uid

    def visit(tree: AstTree) -> int:
        kind, children = tree
        if not children:
            return intern((_LEAF, kind, -1), 0)
        merged = visit(children[0])
        for child in children[1:]:
            right = visit(child)
            merged = intern((_SIBLING, merged, right), 1 + max(depth[merged], depth[right]))
        return intern((_NODE, kind, merged), 1 + depth[merged])

    roots = [visit(sample.tree) for sample in samples]
    # results in execution order: the leaves, then per depth the sibling step and the node step
    groups: dict[tuple[int, int], list[int]] = {}
    for uid, key in enumerate(keys):
        groups.setdefault((depth[uid], key[0]), []).append(uid)
    order = sorted(groups)
    result_of = [0] * len(keys)
    row_of = [0] * len(keys)
    for result, group in enumerate(order):
        for row, uid in enumerate(groups[group]):
            result_of[uid], row_of[uid] = result, row

    def gather(inputs: list[int], kinds: Tensor | None, size: int) -> Step:
        sources = sorted({result_of[uid] for uid in inputs})
        start, offset = {}, 0
        for source in sources:
            start[source] = offset
            offset += len(groups[order[source]])
        rows = torch.tensor([start[result_of[uid]] + row_of[uid] for uid in inputs], dtype=torch.int64)
        return Step(kinds, sources, rows, size)

    steps = []
    for group in order[1:]:
        members = groups[group]
        if group[1] == _SIBLING:
            inputs = [keys[uid][1] for uid in members] + [keys[uid][2] for uid in members]
            steps.append(gather(inputs, None, len(members)))
        else:
            kinds = torch.tensor([keys[uid][1] for uid in members], dtype=torch.int64)
            steps.append(gather([keys[uid][2] for uid in members], kinds, len(members)))
    return HandPlan(
        leaf_kinds=torch.tensor([keys[uid][1] for uid in groups[(0, _LEAF)]], dtype=torch.int64),
        steps=steps,
        roots=gather(roots, None, len(roots)),
        labels=torch.tensor([sample.label for sample in samples], dtype=torch.int64),
        calls=len(keys),
    )


def _read(results: list[Tensor], step: Step) -> Tensor:
    """The rows ``step`` reads: one concatenation of its sources (none for one) and one ``index_select``."""
    source = (
        results[step.sources[0]] if len(step.sources) == 1 else torch.cat([results[s] for s in step.sources])
    )
    return source.index_select(0, step.rows)


def hand_roots(model: SiblingTreeLSTM, plan: HandPlan) -> Tensor:
    """The roots' ``h``, one batched call per step of ``plan``."""
    h, c = model.leaf(plan.leaf_kinds)
    hs, cs = [h], [c]
    for step in plan.steps:
        h_in, c_in = _read(hs, step), _read(cs, step)
        if step.kinds is None:
            n = step.size
            h, c = model.sibling(h_in[:n], c_in[:n], h_in[n:], c_in[n:])
        else:
            h, c = model.node(step.kinds, h_in, c_in)
        hs.append(h)
        cs.append(c)
    return _read(hs, plan.roots)


# --------------------------------------------------------------------------------------------
# The versions: one minibatch's loss each (the mean cross-entropy of its roots)


@dataclass(frozen=True)
class Batch:
    """A minibatch, with its hand-batching indices and its Fold plan built outside the timed loop."""

    samples: list[AstSample]
    hand: HandPlan
    fold: tuple[FoldPlan | StaticPlan, tuple[np.ndarray, np.ndarray]]  # RootBuild's output


def eager_loss(model: SiblingTreeLSTM, batch: Batch) -> Tensor:
    h = torch.cat([forward_ast(model, s.tree)[0] for s in batch.samples])
    return F.cross_entropy(model.logits(h), torch.tensor([s.label for s in batch.samples]))


def hand_loss(model: SiblingTreeLSTM, batch: Batch) -> Tensor:
    plan = make_hand_plan(batch.samples)
    return F.cross_entropy(model.logits(hand_roots(model, plan)), plan.labels)


def hand_run_loss(model: SiblingTreeLSTM, batch: Batch) -> Tensor:
    return F.cross_entropy(model.logits(hand_roots(model, batch.hand)), batch.hand.labels)


def fold_loss(model: SiblingTreeLSTM, batch: Batch) -> Tensor:
    plan, targets = RootBuild()(batch.samples)
    return root_loss(model, plan.apply(model), targets)


def fold_run_loss(model: SiblingTreeLSTM, batch: Batch) -> Tensor:
    plan, targets = batch.fold
    return root_loss(model, plan.apply(model), targets)


VERSIONS: dict[str, Callable[[SiblingTreeLSTM, Batch], Tensor]] = {
    "eager": eager_loss,
    "hand-batched": hand_loss,
    "hand-batched, run only": hand_run_loss,
    "torchfold": fold_loss,
    "torchfold, run only": fold_run_loss,
}


def make_batches(samples: Sequence[AstSample], minibatch: int) -> list[Batch]:
    batches = []
    for i in range(0, len(samples), minibatch):
        chunk = list(samples[i : i + minibatch])
        batches.append(Batch(chunk, make_hand_plan(chunk), RootBuild()(chunk)))
    return batches


def check_same(model: SiblingTreeLSTM, batches: Sequence[Batch]) -> float:
    """Assert that every version gives eager's loss and gradients on the first minibatch, and the
    hand-batched roots equal the Fold's on every minibatch; return the first minibatch's loss."""
    results = {}
    for name, loss_fn in VERSIONS.items():
        copied = copy.deepcopy(model)
        loss = loss_fn(copied, batches[0])
        loss.backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in copied.parameters()]
        results[name] = (loss.detach(), grads)
    ref_loss, ref_grads = results["eager"]
    for name, (loss, grads) in results.items():
        torch.testing.assert_close(
            loss, ref_loss, rtol=1e-5, atol=1e-6, msg=f"{name}: loss differs from eager's"
        )
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(
                g, r, rtol=1e-4, atol=1e-6, msg=f"{name}: gradient differs from eager's"
            )
    with torch.no_grad():
        for i, batch in enumerate(batches):
            [fold_states] = batch.fold[0].apply(model)
            torch.testing.assert_close(
                hand_roots(model, batch.hand),
                fold_states,
                rtol=1e-5,
                atol=1e-6,
                msg=f"minibatch {i}: hand-batched roots differ from the Fold's",
            )
    return float(ref_loss)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--functions", type=int, default=512, help="training functions to time (default 512)")
    parser.add_argument("--minibatch", type=int, default=32)
    parser.add_argument("--hidden-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="timed passes of each version, interleaved")
    parser.add_argument(
        "--root", type=Path, default=None, help="folder of .py files (default: the standard library)"
    )
    harness.add_clock_argument(parser)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Run the benchmark; return each version's median seconds per pass."""
    args = parse_args(argv)
    harness.use_clock(args.clock)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    samples, _ = python_functions(args.functions, 1, root=args.root)
    model = SiblingTreeLSTM(len(KINDS), 32, args.hidden_dim)
    start = time.perf_counter()
    batches = make_batches(samples, args.minibatch)
    prepare = time.perf_counter() - start
    loss = check_same(model, batches)

    def run_pass(loss_fn: Callable[[SiblingTreeLSTM, Batch], Tensor]) -> Callable[[], None]:
        def run() -> None:
            for batch in batches:
                loss_fn(model, batch).backward()

        return run

    passes: dict[str, Callable[[], object]] = {name: run_pass(fn) for name, fn in VERSIONS.items()}
    for run in passes.values():
        run()  # warm-up
    times = harness.interleaved(passes, args.rounds)
    seconds = {name: harness.median(t) for name, t in times.items()}

    nodes = sum(s.size for s in samples)
    calls = sum(b.hand.calls for b in batches)
    print("\n".join(harness.machine_lines()))
    print(
        f"{len(samples)} functions, {nodes} nodes, {len(batches)} minibatches of {args.minibatch}, "
        f"hidden {args.hidden_dim}; {calls / len(batches):.0f} distinct calls per minibatch "
        f"(leaf, sibling, node; {nodes / len(batches):.0f} nodes), "
        f"{sum(len(b.hand.steps) + 1 for b in batches) / len(batches):.1f} batched steps per minibatch"
    )
    print(f"checked: all versions give eager's loss ({loss:.6f}) and gradients; hand roots == Fold roots")
    print(f"indices and plans built outside the timed loop in {prepare:.2f} s (both, every minibatch)")
    print(f"median of {args.rounds} interleaved passes (forward + backward of every minibatch):")
    rows = [
        [name, seconds[name], len(samples) / seconds[name], nodes / seconds[name],
         seconds["eager"] / seconds[name], seconds["hand-batched, run only"] / seconds[name]]
        for name in VERSIONS
    ]  # fmt: skip
    print(
        harness.markdown_table(
            ["version", "s per pass", "functions/s", "nodes/s", "x eager", "x hand (run only)"], rows
        )
    )
    return seconds


if __name__ == "__main__":
    main()
