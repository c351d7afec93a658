"""Package metadata for torchfold (build settings and tool configuration live in pyproject.toml)."""

import re
from pathlib import Path

from setuptools import Extension, find_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"', (HERE / "torchfold" / "_version.py").read_text()).group(1)  # type: ignore[union-attr]

# The extras the dev extra holds too (the tests run the notebooks and the docs' hooks).
NOTEBOOKS = [
    "matplotlib>=3.6",
    "torchvision>=0.16",
    "mlxtend>=0.23",
    "nbclient>=0.9",
    "nbformat>=5.9",
    "ipykernel>=6",
]
DOCS = ["mkdocs>=1.6", "mkdocstrings[python]>=0.26", "mkdocs-material>=9.5"]

# The distribution's name: `torchfold` on the index is another project (NEAR AI's 2018 TorchFold),
# so this one installs as `pytorch-fold` and is still imported as `torchfold`.
setup(
    name="pytorch-fold",
    version=VERSION,
    description="Dynamic batching for PyTorch models over trees, graphs and other variable structures, "
    "and training with a batch size that changes step by step.",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    author="The torchfold developers",
    license_expression="Apache-2.0",
    license_files=["LICENSE"],
    python_requires=">=3.10",
    packages=find_packages(include=["torchfold", "torchfold.*"]),
    package_data={"torchfold": ["py.typed", "engine/_record.pyi"]},
    # recording's and planning's common calls in C; optional: without a C compiler torchfold
    # installs and runs the same code in Python (torchfold.engine.native.BUILT says which)
    ext_modules=[Extension("torchfold.engine._record", ["torchfold/engine/_record.c"], optional=True)],
    install_requires=["torch>=2.1", "numpy>=1.23", "tqdm>=4.60", "greenlet>=3.0"],
    extras_require={
        # Fold.draw, trace and replay plots
        "plot": ["matplotlib>=3.6"],
        # TPUs (and XLA's CPU backend): a torch_xla only imports beside the torch it was built
        # against, so the extra pins a matching pair (the one the XLA tests run on)
        "xla": ["torch==2.9.0", "torch_xla==2.9.0"],
        # the recipes of docs/guide/lightning-accelerate.md (tests/integrations, `make test-integrations`)
        "integrations": ["lightning>=2.0", "accelerate>=0.26"],
        # TraceTrainer's metrics in TensorBoard (torchfold.train.loop.tensorboard: torch's SummaryWriter needs it)
        "tensorboard": ["tensorboard>=2.14"],
        "notebooks": NOTEBOOKS,
        "docs": DOCS,
        # setuptools: tests/test_wheel.py builds the wheel without build isolation; the extras the
        # tests import (the docs' hooks, the notebooks and their kernel, the plots, the TensorBoard
        # writer), so that `pip install -e '.[dev]'` and `pytest` run the whole suite (the XLA tests
        # and the DyNet benchmark need environments of their own: see the Makefile)
        "dev": [
            "pytest>=7",
            "pytest-timeout>=2.1",
            "hypothesis>=6.80",
            "ruff>=0.5",
            "mypy>=1.8",
            "setuptools>=77",
            "tensorboard>=2.14",
            *dict.fromkeys(NOTEBOOKS + DOCS),  # matplotlib (the plot extra) included
        ],
    },
    entry_points={"console_scripts": ["torchfold=torchfold.cli:main"]},
    keywords=["pytorch", "dynamic batching", "tree-lstm", "torch_xla", "elastic training"],
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Operating System :: OS Independent",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: 3.13",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: Software Development :: Libraries :: Python Modules",
        "Typing :: Typed",
    ],
)
