"""``python3 -m tests.stress``: see tests/stress/cli.py."""

import sys

from tests.stress.cli import main

sys.exit(main())
