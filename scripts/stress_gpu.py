#!/usr/bin/env python3
"""The randomized stress of pinxfer (tests/stress/, every byte checked): this script is its
command line from a checkout, as scripts/gpu_check.sh's ``stress`` step calls it. Arguments
and report: ``python3 scripts/stress_gpu.py --help``, the docstring of tests/stress/__init__.py.

    python3 -X faulthandler scripts/stress_gpu.py --mode both --seconds 90 --json stress.json
"""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # the checkout's pinxfer (with _C built in place) and tests/

from tests.stress.cli import main

if __name__ == "__main__":
    sys.exit(main())
