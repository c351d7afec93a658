"""The single source of torchfold's version (read by ``setup.py`` without importing the package)."""

__version__ = "0.2.0"
