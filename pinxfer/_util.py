"""The byte-size parser: one for the library and the command line."""
from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40,
          "tib": 1 << 40}


# TODO(parse_byte_size op): C++ reads PINXFER_MAX_PINNED_BYTES with its own parser
# (parse_byte_size in csrc); once the op `parse_byte_size(str) -> int` lands, this becomes
# its wrapper in pinxfer/_ops.py and the regex below goes, so both sides accept the same text.
def parse_bytes(text: str) -> int:
    """'512MiB' -> 536870912. Units are binary; K/M/G/T and KB/MB/GB/TB mean the same."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read a byte size from {text!r}: expected a number with an optional unit "
            "(B, KiB, MiB, GiB, TiB), e.g. '8GiB'"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
