"""diag_chunk_timeline.py results side by side: a single-block to_device's steps before -> after.

For each size and pattern (back to back, after a sleep) of the staging mode given (default
"auto"), the medians over rounds of each run's per-call medians:

  x pinned     the whole pinned copy's call over pinxfer's (> 1: pinxfer faster)
  wall         the call and its synchronize, µs
  offer        the helpers' job posted: from the staging block to the offer (the caller's
               wake-ups), µs
  first DMA    the first DMA span queued, µs from the Python call
  waits        the time the DMA engine had nothing queued, µs
  busy GB/s    the engine's rate while it had work waiting
  spans        the DMAs the chunks went in

and, over several rounds, in how many the after run's figure was the higher ("2/3"). As with
compare_loop.py, a change shown by one round only has not been shown: the same build moves
these figures by 5-10% from one process to the next.

    python benchmarks/compare_timeline.py BEFORE.json AFTER.json [B2.json A2.json ...]
    python benchmarks/compare_timeline.py --session FILE --before NAME --after NAME
        (FILE: {"runs": {variant: {round: diag_chunk_timeline JSON}}}, as
        results/<kind>/chunk_timeline_*_s18_*.json)
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_loop import add_pair_arguments, pairs_from_arguments, rounds_cell, table_head

PATTERNS = ("b2b", "sleep")


def figures(mode: str) -> list[tuple[str, str, Callable[[dict, str], float | None]]]:
    """(column, format, the figure from a size's summary and a pattern)."""

    def ours(summary: dict, pattern: str) -> dict:
        return summary.get(f"{pattern}/px_{mode}", {})

    def field(name: str) -> Callable[[dict, str], float | None]:
        return lambda s, p: ours(s, p).get(name)

    def pinned_ratio(s: dict, p: str) -> float | None:
        wall, pinned = ours(s, p).get("wall_us"), s.get(f"{p}/pinned_whole", {}).get("wall_us")
        return pinned / wall if wall and pinned else None

    def offer(s: dict, p: str) -> float | None:
        offered, allocated = ours(s, p).get("at_offered_us"), ours(s, p).get("at_alloc_us")
        return None if offered is None or allocated is None else offered - allocated

    return [
        ("x pinned", ".2f", pinned_ratio),
        ("wall", ".0f", field("wall_us")),
        ("offer", ".1f", offer),
        ("first DMA", ".0f", field("at_first_dma_us")),
        ("waits", ".0f", field("dma_wait_us")),
        ("busy GB/s", ".1f", field("busy_gbps")),
        ("spans", ".1f", field("spans")),
    ]


def rounds_table(pairs: list[tuple[dict, dict]], mode: str = "auto") -> str:
    rounds = len(pairs)
    cols = figures(mode)
    head = ["size", "gap"] + [name for name, _, _ in cols]
    out = table_head(f"diag_chunk_timeline ({mode} staging): before -> after", rounds, head)
    for size in pairs[-1][1]["sizes"]:  # in the order the run measured them (its --sizes)
        for pattern in PATTERNS:
            cells = [size, pattern]
            for _, fmt, figure in cols:
                got = [
                    (
                        figure(before["sizes"][size]["summary"], pattern),
                        figure(after["sizes"][size]["summary"], pattern),
                    )
                    for before, after in pairs
                    if size in before["sizes"] and size in after["sizes"]
                ]
                cells.append(rounds_cell(got, fmt, rounds)[0])
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_arguments(ap, "diag_chunk_timeline runs")
    ap.add_argument("--mode", default="auto", help="the staging mode's rows (auto, nt, movsb)")
    args = ap.parse_args(argv)
    print(rounds_table(pairs_from_arguments(ap, args, "compare_timeline"), args.mode))


if __name__ == "__main__":
    main()
