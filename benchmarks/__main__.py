"""`python -m benchmarks [command] ...`: the suite and every benchmark (see `benchmarks/cli.py`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
