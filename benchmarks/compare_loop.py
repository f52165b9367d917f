"""bench_loop.py results side by side: each row's ratios before -> after, as Markdown.

Ratios are same-process speed ratios (> 1: pinxfer faster): "xt" against torch's best way of
the same size and gap, "xp" against the pinned copy; medians. Compare runs of one call (one
machine): after an idle gap the platform's wake-up differs between machines by up to 2x, and
the ratios carry it less than the microseconds do.

One pair of runs, or several rounds of pairs (each round a before and an after process of one
call, alternating): then each cell is the median over the rounds, before -> after, and in how
many rounds the after run's ratio was the higher ("3/3"). The same build differs by 0.05-0.1
from one process to the next at many rows, so a change that moves a row moves it in every
round; one that moves it in some rounds only has not been shown to move it.

    python benchmarks/compare_loop.py BEFORE.json AFTER.json [--title TEXT]
    python benchmarks/compare_loop.py B1.json A1.json B2.json A2.json ... [--title TEXT]
    python benchmarks/compare_loop.py --session FILE --before NAME --after NAME
        (FILE: {"runs": {variant: {round: bench_loop JSON}}}, as results/<kind>/loop_*_call*.json)
    python benchmarks/compare_loop.py --side-by-side RUN.json RUN.json [RUN.json ...]

--side-by-side puts whole runs next to each other, one figure per run in every cell ("a / b /
c"), with the rows each run missed and its small-call rows: the whole table of a closing note,
before and after, where "after" is several processes of one build (the processes' spread is
then in the table itself).
"""

from __future__ import annotations

import argparse
import json
import statistics

WAYS = [  # (way in the JSON, column, with an xp column too)
    ("to_device", "to_device", True),
    ("to_device_batch", "batch", False),
    ("prefetch_steady", "prefetch", True),
    ("pin_memory", "pin_memory", False),
]
GAPS = {"b2b": 0, "sleep": 1, "gpu": 2}


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _index(data: dict) -> dict:
    return {(r["size"], r["pattern"], r["way"]): r for r in data["rows"]}


def _median_ratio(row: dict | None, key: str) -> float | None:
    value = row and row.get(key)
    return value["median"] if value else None


def _header() -> list[str]:
    head = ["size", "gap"]
    for _, col, xp in WAYS:
        head += [f"{col} xt"] + ([f"{col} xp"] if xp else [])
    return head


def _row_order(data: dict) -> list[tuple[str, str]]:
    keys = {(r["bytes"], GAPS.get(r["pattern"], 3), r["size"], r["pattern"]) for r in data["rows"]}
    return [(size, pattern) for _, _, size, pattern in sorted(keys)]


def _ratio_cells() -> list[tuple[str, str]]:
    """(way, ratio key) of each figure column, in _header's order."""
    keys = ("ratio_torch", "ratio_pinned")
    return [(way, key) for way, _, xp in WAYS for key in (keys if xp else keys[:1])]


def _passed(data: dict) -> int:
    return sum(r.get("verdict") == "PASS" for r in data["rows"])


def _judged(data: dict) -> int:
    """Rows with a verdict (torch's rows have none)."""
    return sum(r.get("verdict") is not None for r in data["rows"])


def table_head(title: str, rounds: int, columns: list[str]) -> list[str]:
    """A rounds table's title (saying what "k/n" counts where there are rounds) and its
    Markdown header."""
    counted = f" (medians of {rounds} rounds; k/n: rounds where after is higher)"
    return [
        title + (counted if rounds > 1 else ""),
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]


def rounds_cell(
    got: list[tuple[float | None, float | None]], fmt: str, rounds: int
) -> tuple[str, int, int]:
    """One cell from each round's (before, after) figure: "b→a", the medians over the rounds
    that have both, and with more than one round "k/n" (n rounds, after higher in k).
    Returns (text, k, n); "-" where no round has both."""
    both = [(x, y) for x, y in got if x is not None and y is not None]
    if not both:
        return "-", 0, 0
    before = statistics.median(x for x, _ in both)
    after = statistics.median(y for _, y in both)
    higher = sum(y > x for x, y in both)
    text = f"{before:{fmt}}→{after:{fmt}}"
    if rounds > 1:
        text += f" {higher}/{len(both)}"
    return text, higher, len(both)


def _judges_the_batch_against_the_batch_pinned(run: dict) -> bool:
    """bench_loop since session 45: batch rows against the batch pinned (four DMAs), and
    torch_to_nb among torch's ways; such runs keep the old ratio as ratio_pinned_one_tensor."""
    return any("ratio_pinned_one_tensor" in row for row in run.get("rows", []))


def method_warnings(runs: list[dict]) -> list[str]:
    """A line saying the runs were judged by different methods, whose ratios differ for
    reasons other than the change compared; none where they agree."""
    methods = {_judges_the_batch_against_the_batch_pinned(run) for run in runs}
    if len(methods) < 2:
        return []
    return [
        "",
        "WARNING: these runs were judged by different methods (bench_loop before and since "
        "session 45: batch rows against one pinned tensor or the batch pinned, torch_to_nb "
        "among torch's ways or not); their x torch and x pinned ratios are not comparable "
        "one to one.",
    ]


def rounds_table(pairs: list[tuple[dict, dict]], title: str) -> str:
    """Rounds of (before, after) runs: per cell the medians over the rounds and, with more
    than one round, in how many the after run's ratio was the higher."""
    rounds = len(pairs)
    indexed = [(_index(b), _index(a)) for b, a in pairs]
    head = _header()
    out = table_head(f"{title}: median ratios, before -> after", rounds, head)
    out += method_warnings([run for pair in pairs for run in pair])
    higher_every = lower_every = cells_seen = 0
    for size, pattern in _row_order(pairs[-1][1]):
        cells = [size, pattern]
        for way, key in _ratio_cells():
            got = [
                (
                    _median_ratio(b.get((size, pattern, way)), key),
                    _median_ratio(a.get((size, pattern, way)), key),
                )
                for b, a in indexed
            ]
            cell, higher, seen = rounds_cell(got, ".2f", rounds)
            cells.append(cell)
            # "In every round" only where every round has both figures; a tie is neither.
            if rounds > 1 and seen == rounds:
                lower = sum(y < x for x, y in got if x is not None and y is not None)
                cells_seen += 1
                higher_every += higher == seen
                lower_every += lower == seen
        out.append("| " + " | ".join(cells) + " |")
    judged = _judged(pairs[-1][1])
    passed = ", ".join(f"{_passed(b)} -> {_passed(a)}" for b, a in pairs)
    out += ["", f"rows meeting every target: {passed} of {judged}"]
    if rounds > 1:
        out.append(
            f"cells higher after in every round: {higher_every}; lower in every round: "
            f"{lower_every} (of {cells_seen} cells that every round has)"
        )
    before, after = pairs[-1]
    for sb, sa in zip(before.get("small_rows", []), after.get("small_rows", [])):
        out.append(
            f"- {sa['name']} ({sa['target']}): {sb['ours_text']} (torch {sb['ref_text']}) -> "
            f"{sa['ours_text']} (torch {sa['ref_text']}); {sb['verdict']} -> {sa['verdict']}"
        )
    return "\n".join(out)


# Short names of the ways for the "missed" column, in the order bench_loop judges them.
MISSED_WAYS = [
    ("to_device", "td"),
    ("to_device_batch", "batch"),
    ("prefetch_steady", "pf"),
    ("prefetch_pass", "pass"),
    ("pin_memory", "pin"),
]


def side_by_side_table(runs: list[dict], title: str) -> str:
    """Whole runs side by side: each cell one median ratio per run ("a / b / c"), and per
    run the ways whose row missed a target; then each run's count of passing rows and its
    small-call rows."""
    indexed = [_index(run) for run in runs]
    columns = [*_header(), "missed (" + " / ".join(f"run {i + 1}" for i in range(len(runs))) + ")"]
    out = table_head(f"{title}: median ratios, run by run", 1, columns)
    out += method_warnings(runs)
    for size, pattern in _row_order(runs[-1]):
        cells = [size, pattern]
        for way, key in _ratio_cells():
            got = [_median_ratio(ix.get((size, pattern, way)), key) for ix in indexed]
            cells.append(" / ".join("-" if g is None else f"{g:.2f}" for g in got))
        missed = []
        for ix in indexed:
            names = [
                short
                for way, short in MISSED_WAYS
                if (ix.get((size, pattern, way)) or {}).get("verdict") == "MISS"
            ]
            missed.append(",".join(names) or "none")
        cells.append(" / ".join(missed))
        out.append("| " + " | ".join(cells) + " |")
    judged = _judged(runs[-1])
    out += [
        "",
        f"rows meeting every target: {' / '.join(str(_passed(r)) for r in runs)} of {judged}",
    ]
    by_name: dict[str, list[str]] = {}
    for run in runs:
        for row in run.get("small_rows", []):
            text = f"{row['ours_text']} (torch {row['ref_text']}) {row['verdict']}"
            by_name.setdefault(f"{row['name']} ({row['target']})", []).append(text)
    out += [f"- {name}: {' / '.join(texts)}" for name, texts in by_name.items()]
    return "\n".join(out)


def session_pairs(
    session: dict, before: str, after: str, tool: str = "compare_loop"
) -> list[tuple[dict, dict]]:
    """The rounds both variants of a combined results file ran, in round order."""
    runs = session["runs"]
    for name in (before, after):
        if name not in runs:
            raise SystemExit(f"{tool}: no variant {name!r} in the file; it has {sorted(runs)}")
    common = sorted(set(runs[before]) & set(runs[after]), key=_round_key)
    if not common:
        raise SystemExit(f"{tool}: variants {before!r} and {after!r} share no round")
    return [(runs[before][r], runs[after][r]) for r in common]


def _round_key(name: str) -> tuple:
    """Rounds in order: "r2" before "r10", "call6_r2" before "call7_r1"."""
    head, _, number = name.rpartition("r")
    return (head, int(number)) if number.isdigit() else (name, 0)


def add_pair_arguments(ap: argparse.ArgumentParser, what: str) -> None:
    """The ways to name the runs: files of before/after pairs, or a combined session file."""
    ap.add_argument("files", nargs="*", help="BEFORE AFTER, or rounds of BEFORE AFTER pairs")
    ap.add_argument("--session", help=f"a combined file of variants and rounds of {what}")
    ap.add_argument("--before", help="with --session: the before variant")
    ap.add_argument("--after", help="with --session: the after variant")


def pairs_from_arguments(
    ap: argparse.ArgumentParser, args: argparse.Namespace, tool: str
) -> list[tuple[dict, dict]]:
    """The (before, after) rounds the arguments of add_pair_arguments name."""
    if args.session:
        if args.files or not (args.before and args.after):
            ap.error("--session takes --before and --after, and no other files")
        return session_pairs(_load(args.session), args.before, args.after, tool)
    if len(args.files) < 2 or len(args.files) % 2:
        ap.error("give BEFORE AFTER, or pairs of them (an even number of files)")
    loaded = [_load(p) for p in args.files]
    return list(zip(loaded[::2], loaded[1::2]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_arguments(ap, "bench_loop runs")
    ap.add_argument("--title", default="bench_loop")
    ap.add_argument(
        "--side-by-side", action="store_true", help="the files as whole runs next to each other"
    )
    args = ap.parse_args(argv)
    if args.side_by_side:
        if args.session or len(args.files) < 2:
            ap.error("--side-by-side takes two or more run files, and no --session")
        print(side_by_side_table([_load(p) for p in args.files], args.title))
        return
    print(rounds_table(pairs_from_arguments(ap, args, "compare_loop"), args.title))


if __name__ == "__main__":
    main()
