"""Lets ``import pinxfer`` find this checkout when pinxfer is not installed.

On the GPU machines pinxfer is often built in place (``python setup.py build_ext --inplace``)
rather than installed, and a script's own folder (``benchmarks/``) is what Python puts on
``sys.path``, not the checkout. A benchmark that imports pinxfer imports this module first; an
installed pinxfer still wins.
"""

from __future__ import annotations

import importlib.util
import os
import sys

if importlib.util.find_spec("pinxfer") is None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
