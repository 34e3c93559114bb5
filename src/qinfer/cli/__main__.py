"""`python -m qinfer.cli ...`: the `qinfer` command without its console script."""

import sys

from qinfer.cli import main

if __name__ == "__main__":  # not when a tool walks the package's modules
    sys.exit(main())
