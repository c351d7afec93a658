"""The example data in one namespace: SST trees (real or generated) and MNIST.

The code lives in one module per concept: :mod:`~torchfold.examples.datadir` (where the data is:
an argument or ``$TORCHFOLD_DATA``), :mod:`~torchfold.examples.sst` (trees, the parser, splits,
labels, :class:`Vocab`), :mod:`~torchfold.examples.generated` (SST-format trees with a learnable
rule, no data needed) and :mod:`~torchfold.examples.mnist`. Nothing here downloads anything
unless asked to.
"""

from __future__ import annotations

from torchfold.examples.datadir import ENV_VAR, data_root
from torchfold.examples.generated import generate_sst, generate_sst_lines
from torchfold.examples.mnist import MnistData, load_mnist
from torchfold.examples.sst import (
    NEUTRAL,
    NUM_FINE_LABELS,
    SST_SPLITS,
    Tree,
    TreeParseError,
    Vocab,
    binary_label,
    binary_trees,
    fine_label,
    load_sst,
    parse_tree,
    read_sst_file,
)

__all__ = [
    "ENV_VAR",
    "NEUTRAL",
    "NUM_FINE_LABELS",
    "SST_SPLITS",
    "MnistData",
    "Tree",
    "TreeParseError",
    "Vocab",
    "binary_label",
    "binary_trees",
    "data_root",
    "fine_label",
    "generate_sst",
    "generate_sst_lines",
    "load_mnist",
    "load_sst",
    "parse_tree",
    "read_sst_file",
]
