#!/usr/bin/env python3
"""Training checkpoint (any TP/PP) -> HF folder. Same as `areal-mcore convert mcore-to-hf`."""

import sys

from areal_mcore.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "mcore-to-hf", *sys.argv[1:]]))
