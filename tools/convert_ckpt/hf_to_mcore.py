#!/usr/bin/env python3
"""HF folder -> step-0 training checkpoint at --tp/--pp/--ep. Same as `areal-mcore convert hf-to-mcore`."""

import sys

from areal_mcore.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "hf-to-mcore", *sys.argv[1:]]))
