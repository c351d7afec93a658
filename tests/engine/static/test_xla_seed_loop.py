"""The seed-style loop on XLA (the XLA lane: ``PJRT_DEVICE=CPU``, ``pytest -m xla``): a user's own loop
of ``fold.apply``, a loss on its outputs and Adam, over SST batches of 10 trees.

The documented form (outputs and targets padded to the envelope: ``plan.apply(model, padded=True)``
and ``plan.pad``) compiles nothing after a warm-up; the exact form (``fold.apply(model, [nodes])``
on a default ``Fold``) would compile the loss and backward anew for every new size, and is told
so once.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.xla

# the envelope's warm-up (StaticShapes' warmup=20 plans), then 8 batches that must compile nothing: a
# prefix of the 40 this ran before, whose batches 20-39 compiled nothing either
BATCHES, TREES = 28, 10


def _sst(data_dir: Any) -> tuple[list[list[Any]], Any]:
    from torchfold.examples.datasets import Vocab, load_sst

    trees = load_sst(split="train", max_trees=BATCHES * TREES)
    return [trees[i * TREES : (i + 1) * TREES] for i in range(BATCHES)], Vocab.build(trees)


def _compilations() -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return 0 if data is None else int(data[0])


@pytest.mark.timeout(900)  # 28 traced training steps: 2-3 minutes on a loaded 2-core machine
def test_the_documented_seed_loop_compiles_nothing_after_the_warm_up(data_dir: Any) -> None:
    import torch_xla

    from torchfold import Fold, StaticShapes
    from torchfold.examples.models import TreeLSTM, encode_trees

    batches, vocab = _sst(data_dir)
    device = torch_xla.device()
    torch.manual_seed(0)
    model = TreeLSTM(len(vocab), 8, 8).to(device)  # (the graphs' structure, not their width, is the point)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    counts = [_compilations()]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no advice to pad: it is padded
        for trees in batches:
            fold = Fold(device=device, shapes=StaticShapes.of(model))
            nodes, labels, _roots = encode_trees(fold, trees, vocab)
            plan = fold.plan([nodes])
            [states] = plan.apply(model, padded=True)
            targets = plan.pad(0, labels, fill=-100).to(device)  # padded rows: cross_entropy's ignore_index
            loss = F.cross_entropy(model.logits(states), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            torch_xla.sync()
            counts.append(_compilations())
    new = [b - a for a, b in itertools.pairwise(counts)]
    assert sum(new[:20]) >= 1 and sum(new[20:]) == 0, f"compilations per batch: {new}"


def test_the_exact_seed_loop_is_told_once_to_pad(data_dir: Any) -> None:
    import torch_xla

    from torchfold import Fold
    from torchfold.engine.static.padded import EXACT_SIZES_WARN
    from torchfold.examples.models import TreeLSTM, encode_trees

    batches, vocab = _sst(data_dir)
    device = torch_xla.device()
    torch.manual_seed(0)
    model = TreeLSTM(len(vocab), 8, 8).to(device)
    seen: list[tuple[int, str, str]] = []
    before = _compilations()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for number, trees in enumerate(batches[: EXACT_SIZES_WARN + 2]):
            fold = Fold(device=device)  # the default: padded into the module's envelope, exact outputs
            nodes, labels, _roots = encode_trees(fold, trees, vocab)
            [states] = fold.apply(model, [nodes])
            loss = F.cross_entropy(model.logits(states), torch.tensor(labels, device=device))
            loss.backward()  # traced only: each batch's graph would compile at a sync (minutes here, so none)
            seen += [
                (number, str(w.message), w.filename) for w in caught if "exact outputs" in str(w.message)
            ]
            caught.clear()
    assert _compilations() == before
    assert len(seen) == 1, seen  # once, after a few batches of new sizes
    number, message, where = seen[0]
    assert number == EXACT_SIZES_WARN - 1, seen  # SST's first batches: a new size each
    assert "TreeLSTM" in message and "apply(model, padded=True)" in message and "plan.pad" in message
    assert where == __file__  # it points at the loop's fold.apply
