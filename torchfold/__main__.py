"""``python -m torchfold``: the command line (:mod:`torchfold.cli`)."""

import sys

from torchfold.cli import main

if __name__ == "__main__":
    sys.exit(main())
