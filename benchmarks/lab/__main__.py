"""`python -m syncline.lab COMMAND ...`: the network lab's commands (see `cli.py`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
