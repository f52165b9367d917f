"""The ``pinxfer`` command (also ``python -m pinxfer``): ``bench`` and ``doctor``.

``pinxfer bench`` measures, on this machine and side by side with plain torch:

========== ================= ===================================================
section    op                torch vs pinxfer
========== ================= ===================================================
copy       h2d_pageable      ``t.to(dev)`` (torch only: the pageable baseline)
copy       h2d_pinned        from ``t.pin_memory()`` / from ``pinxfer.empty``
copy       d2h_pageable      ``g.to("cpu")`` (torch only)
copy       d2h_pinned        into ``torch.empty(pin_memory=True)`` / into ``pinxfer.empty``
pin        pin_cold          ``t.pin_memory()`` / ``pinxfer.pin_memory(t)``, caches emptied first
pin        pin_warm          the same with a cached block of that size
pin        host_copy         ``dst.copy_(src)`` pageable to pageable (torch only: host ceiling)
to_device  h2d               ``t.to(dev)`` / ``pinxfer.to_device(t)`` from pageable memory
to_device  h2d_pin_then_copy ``t.pin_memory().to(dev, non_blocking=True)`` (torch only)
to_device  d2h               ``g.to("cpu")`` / ``pinxfer.to_host(g).wait()``
prefetch   loop              copy + matmul per step: plain loop (torch) / ``pinxfer.prefetch``
                             (pinxfer) / the slower of copy-alone and compute-alone (ideal)
========== ================= ===================================================

Each figure is the median of ``--repeats`` timed runs after one warm-up (cold
pinning has no warm-up: every run starts from emptied caches). GPU sections are
skipped, with the reason, when no CUDA device is usable; so are sections whose
pinxfer API is missing from this build.

JSON written by ``pinxfer bench --json FILE``::

    {"device": str | null,          # torch.cuda.get_device_name(), null without a GPU
     "torch": str, "pinxfer": str,  # versions
     "date": str,                   # ISO 8601, local time with offset
     "results": [{"section": str, "op": str,
                  "impl": "torch" | "pinxfer" | "ideal",   # "ideal" only in section prefetch
                  "bytes": int,     # bytes moved per run
                  "seconds": float, # median seconds per run
                  "gbps": float}],  # bytes / seconds / 1e9
     "ratios": [{"section": str, "op": str, "bytes": int,
                 "torch_seconds": float, "pinxfer_seconds": float,
                 "speedup": float}],  # torch_seconds / pinxfer_seconds (> 1: pinxfer faster)
     "skipped": [{"section": str, "reason": str}]}

``pinxfer doctor`` prints the GPU topology, PCIe links, memlock limit, huge page
settings and pinxfer's settings, with actionable warnings; its JSON shape is in
pinxfer/cli/doctor.py.

The command line is a package of its own: ``import pinxfer`` never imports it,
and it uses only pinxfer's public API and its byte-size parser.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pinxfer._ops import parse_byte_size as parse_bytes

DEFAULT_SIZES = "1MiB,4MiB,16MiB,64MiB,256MiB,1GiB"
SECTIONS = ("copy", "pin", "to_device", "prefetch")


def _sizes(text: str) -> list[int]:
    try:
        sizes = [parse_bytes(s) for s in text.split(",") if s.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if not sizes or any(s <= 0 for s in sizes):
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of positive sizes, got {text!r}"
        )
    return sorted(set(sizes))


def _sections(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [n for n in names if n not in SECTIONS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown section(s) {bad or text!r}: choose from {','.join(SECTIONS)}"
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pinxfer",
        description="Measure and diagnose host<->GPU transfers (pinxfer).",
    )
    sub = parser.add_subparsers(dest="command", metavar="{bench,doctor}")
    sub.required = True

    b = sub.add_parser(
        "bench",
        help="measure transfers: torch vs pinxfer, side by side",
        description="Measure H2D/D2H, pinning, to_device and prefetch overlap on "
        "this machine, torch and pinxfer side by side.",
    )
    b.add_argument(
        "--sizes",
        type=_sizes,
        default=_sizes(DEFAULT_SIZES),
        help=f"comma-separated tensor sizes (default {DEFAULT_SIZES})",
    )
    b.add_argument(
        "--sections",
        type=_sections,
        default=list(SECTIONS),
        help=f"which sections to run (default all: {','.join(SECTIONS)})",
    )
    b.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed runs per point; the median is kept (default 3)",
    )
    b.add_argument("--device", default=None, help="CUDA device (default: the current one)")
    b.add_argument(
        "--prefetch-steps", type=int, default=16, help="steps of the prefetch loop (default 16)"
    )
    b.add_argument(
        "--prefetch-batch",
        type=parse_bytes,
        default="64MiB",
        help="bytes per batch in the prefetch loop (default 64MiB)",
    )
    b.add_argument(
        "--json", metavar="FILE", help="write the results as JSON ('-': stdout, table to stderr)"
    )
    b.add_argument("--plot", metavar="FILE.png", help="plot bandwidth vs size (needs matplotlib)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument(
        "--from-json",
        metavar="FILE",
        help="measure nothing: print the table (and --plot) of a saved --json file",
    )

    d = sub.add_parser(
        "doctor",
        help="check this machine's transfer setup",
        description="Report GPUs (NUMA node, CPUs, PCIe link), memlock, huge pages "
        "and pinxfer settings, with actionable warnings.",
    )
    d.add_argument(
        "--json",
        metavar="FILE",
        nargs="?",
        const="-",
        help="also write the report as JSON to FILE (no FILE: JSON alone on stdout)",
    )
    # Roots of the trees doctor reads; for tests with fixture trees.
    d.add_argument("--sysfs-root", default=None, help=argparse.SUPPRESS)
    d.add_argument("--proc-root", default="/proc", help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pinxfer`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    # Each command imports only its own module: doctor does not pay for the bench.
    if args.command == "bench":
        from pinxfer.cli import bench

        return bench.main(args)
    from pinxfer.cli import doctor

    return doctor.main(args)


if __name__ == "__main__":
    sys.exit(main())
