"""Plain-text output shared by ``pinxfer bench`` and ``pinxfer doctor``."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units; whole bytes below 1 KiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def format_table(rows: list[tuple[str, ...]], right: set[int] | None = None) -> list[str]:
    """Plain aligned text: a header row, a rule, the rows. Columns in `right` are right-aligned."""
    right = right or set()
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def fmt(r: tuple[str, ...]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        ).rstrip()

    return [fmt(rows[0]), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows[1:]]
