"""`python -m qinfer.cli ...`: the `qinfer` command without its console script."""

import sys

from qinfer.cli import main

sys.exit(main())
