"""Two bench_loop.py results side by side: each row's ratios before -> after, as Markdown.

Ratios are same-process speed ratios (> 1: pinxfer faster): "xt" against torch's best way of
the same size and gap, "xp" against the pinned copy; medians. Compare runs of one call (one
machine): after an idle gap the platform's wake-up differs between machines by up to 2x, and
the ratios carry it less than the microseconds do.

    python benchmarks/compare_loop.py BEFORE.json AFTER.json [--title TEXT]
"""

from __future__ import annotations

import argparse
import json

WAYS = [  # (way in the JSON, column, with an xp column too)
    ("to_device", "to_device", True),
    ("to_device_batch", "batch", False),
    ("prefetch_steady", "prefetch", True),
    ("pin_memory", "pin_memory", False),
]


def _rows(path: str) -> dict:
    with open(path) as f:
        data = json.load(f)
    return data, {(r["size"], r["pattern"], r["way"]): r for r in data["rows"]}


def _ratio(row: dict | None, key: str) -> str:
    value = row and row.get(key)
    return f"{value['median']:.2f}" if value else "-"


def table(before_path: str, after_path: str, title: str) -> str:
    before, b = _rows(before_path)
    after, a = _rows(after_path)
    head = ["size", "gap"]
    for _, col, xp in WAYS:
        head += [f"{col} xt"] + ([f"{col} xp"] if xp else [])
    out = [f"{title}: median ratios, before -> after", "", "| " + " | ".join(head) + " |"]
    out.append("|" + "---|" * len(head))
    gaps = {"b2b": 0, "sleep": 1, "gpu": 2}
    order = sorted(
        {(r["bytes"], gaps.get(r["pattern"], 3), r["size"], r["pattern"]) for r in after["rows"]}
    )
    for _, _, size, pattern in order:
        cells = [size, pattern]
        for way, _, xp in WAYS:
            rb, ra = b.get((size, pattern, way)), a.get((size, pattern, way))
            cells.append(f"{_ratio(rb, 'ratio_torch')}→{_ratio(ra, 'ratio_torch')}")
            if xp:
                cells.append(f"{_ratio(rb, 'ratio_pinned')}→{_ratio(ra, 'ratio_pinned')}")
        out.append("| " + " | ".join(cells) + " |")
    passed = [sum(r.get("verdict") == "PASS" for r in d["rows"]) for d in (before, after)]
    judged = sum(r.get("verdict") is not None for r in after["rows"])  # torch's rows have none
    out += ["", f"rows meeting every target: {passed[0]} -> {passed[1]} of {judged}"]
    for sb, sa in zip(before.get("small_rows", []), after.get("small_rows", [])):
        out.append(
            f"- {sa['name']} ({sa['target']}): {sb['ours_text']} (torch {sb['ref_text']}) -> "
            f"{sa['ours_text']} (torch {sa['ref_text']}); {sb['verdict']} -> {sa['verdict']}"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--title", default="bench_loop")
    args = ap.parse_args()
    print(table(args.before, args.after, args.title))


if __name__ == "__main__":
    main()
