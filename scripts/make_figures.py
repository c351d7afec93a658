"""Regenerate the README's pictures from real folds: ``python scripts/make_figures.py``.

* ``img/dyn_batching_simple.png``: the 2^n chain, ``exp`` (doubling) applied 4 times to 1.
* ``img/dyn_batching_complex.png``: ``B(a1, a2)`` split in two, ``C(bc, a3)``, ``D(bd, c)``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import torchfold


class Arithmetic(torch.nn.Module):
    """The toy ops of the pictures and of notebook 01."""

    def exp(self, x: torch.Tensor) -> torch.Tensor:
        """Doubling: after n applications to 1 the value is 2**n."""
        return 2 * x

    def a(self, x: torch.Tensor) -> torch.Tensor:
        return x.float()

    def B(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x - y, x + y

    def C(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y

    def D(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x - y


def chain_fold() -> tuple[torchfold.Fold, list[torchfold.Node]]:
    fold = torchfold.Fold()
    nodes = [fold.add("exp", 1)]
    for _ in range(3):
        nodes.append(fold.add("exp", nodes[-1]))
    return fold, nodes


def tree_fold() -> tuple[torchfold.Fold, torchfold.Node]:
    fold = torchfold.Fold()
    a1, a2, a3 = (fold.add("a", v) for v in (1, 2, 5))
    bc, bd = fold.add("B", a1, a2).split(2)
    c = fold.add("C", bc, a3)
    return fold, fold.add("D", bd, c)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "img")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = Arithmetic()

    fold, nodes = chain_fold()
    (values,) = fold.apply(model, [nodes])
    print(fold, "\nvalues:", values.tolist())
    fold.draw(args.out / "dyn_batching_simple.png", title=f"exp applied 4 times to 1 -> {values.tolist()}")

    fold, d = tree_fold()
    (value,) = fold.apply(model, [[d]])
    print(fold, "\nD =", value.item())
    fold.draw(
        args.out / "dyn_batching_complex.png",
        title=f"D(bd, C(bc, a3)) with (bc, bd) = B(a1, a2) -> {value.item():g}",
    )


if __name__ == "__main__":
    main()
