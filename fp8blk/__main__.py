"""``python -m fp8blk``: the command line (``fp8blk.cli``)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
