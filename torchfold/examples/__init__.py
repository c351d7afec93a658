"""Example data and models: SST trees, MNIST, a generator of random trees, Tree-LSTM and MLP models.

One module per concept: ``datadir`` (where the data is), ``sst``, ``generated`` (SST-format trees
without data), ``mnist``, ``models``; ``datasets`` gathers the data ones in one namespace.

Not part of the engine or the training half: the notebooks, benchmarks and the command line use
them. Loaded lazily by ``import torchfold`` (``torchfold.examples`` on first use).
"""

from torchfold.examples import datasets, models

__all__ = ["datasets", "models"]
