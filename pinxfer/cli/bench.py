"""``pinxfer bench``: torch and pinxfer side by side on this machine.

What each section and op measures, and the JSON shape, are documented in
pinxfer/cli/__init__.py. Timing: wall clock around the operation followed by
``torch.cuda.synchronize()``, so every figure is "until the bytes are there";
small sizes run several times inside one timed run so launch overhead does not
dominate. The median of ``--repeats`` runs is kept.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import pinxfer
from pinxfer.cli.table import format_bytes, format_table

MiB = 1 << 20
# Small transfers repeat inside a timed run until about this many bytes moved.
INNER_TARGET_BYTES = 64 * MiB
MAX_INNER = 16


@dataclass
class Result:
    section: str
    op: str
    impl: str  # "torch" | "pinxfer" | "ideal"
    bytes: int
    seconds: float
    gbps: float = 0.0
    note: str | None = None

    def __post_init__(self) -> None:
        self.gbps = self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class Report:
    device: str | None
    results: list[Result] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)

    def add(self, *args: Any, **kwargs: Any) -> None:
        self.results.append(Result(*args, **kwargs))

    def skip(self, section: str, reason: str) -> None:
        if not any(s["section"] == section and s["reason"] == reason for s in self.skipped):
            self.skipped.append({"section": section, "reason": reason})

    def ratios(self) -> list[dict[str, Any]]:
        by_key: dict[tuple, dict[str, Result]] = {}
        for r in self.results:
            by_key.setdefault((r.section, r.op, r.bytes), {})[r.impl] = r
        out = []
        for (section, op, nbytes), impls in by_key.items():
            if "torch" in impls and "pinxfer" in impls:
                t, p = impls["torch"].seconds, impls["pinxfer"].seconds
                out.append(
                    {
                        "section": section,
                        "op": op,
                        "bytes": nbytes,
                        "torch_seconds": t,
                        "pinxfer_seconds": p,
                        "speedup": t / p if p > 0 else float("inf"),
                    }
                )
        return out

    def to_json(self) -> dict[str, Any]:
        results = []
        for r in self.results:
            d = asdict(r)
            if d["note"] is None:
                del d["note"]
            results.append(d)
        return {
            "device": self.device,
            "torch": torch.__version__,
            "pinxfer": pinxfer.__version__,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "results": results,
            "ratios": self.ratios(),
            "skipped": self.skipped,
        }


# ---------------------------------------------------------------- progress


class _TextBar:
    """The progress bar when tqdm is not installed: one rewritten line on a
    terminal, one line per step otherwise."""

    def __init__(self, total: int, disable: bool) -> None:
        self.total, self.n, self.disable = total, 0, disable
        self.tty = sys.stderr.isatty()

    def set_postfix_str(self, text: str) -> None:
        if self.disable:
            return
        line = f"[{self.n + 1:>3}/{self.total}] {text}"
        if self.tty:
            sys.stderr.write("\r" + line.ljust(60))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        if self.tty and not self.disable:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _progress(total: int, disable: bool) -> Any:
    try:
        from tqdm import tqdm  # optional extra: pip install 'pinxfer[bench]'
    except ImportError:
        return _TextBar(total, disable)
    return tqdm(
        total=total,
        desc="pinxfer bench",
        unit="step",
        file=sys.stderr,
        disable=disable,
        dynamic_ncols=True,
    )


# ---------------------------------------------------------------- timing


def _median_seconds(
    fn: Callable[[], Any],
    repeats: int,
    sync: Callable[[], None],
    setup: Callable[[], None] | None = None,
    warmup: int = 1,
    inner: int = 1,
) -> float:
    """Median wall time of `fn` (called `inner` times per run) until `sync` returns."""
    for _ in range(warmup):
        if setup:
            setup()
        for _ in range(inner):
            fn()
        sync()
    times = []
    for _ in range(repeats):
        if setup:
            setup()
        sync()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def _inner(nbytes: int) -> int:
    return max(1, min(MAX_INNER, INNER_TARGET_BYTES // nbytes))


def _pageable(nbytes: int) -> torch.Tensor:
    t = torch.empty(nbytes, dtype=torch.uint8)
    t.fill_(1)  # touch every page: pageable memory as an application holds it
    return t


def _no_sync() -> None:
    pass


def _empty_torch_host_cache() -> None:
    with contextlib.suppress(AttributeError, RuntimeError):
        torch._C._host_emptyCache()


# ---------------------------------------------------------------- the bench


class Bench:
    def __init__(self, args: Any) -> None:
        self.args = args
        self.repeats = max(1, args.repeats)
        self.gpu_reason = pinxfer.cuda_unavailable_reason()
        self.dev: torch.device | None = None
        if self.gpu_reason is None:
            dev = torch.device(args.device) if args.device else torch.device("cuda")
            if dev.type != "cuda":
                raise SystemExit(
                    f"pinxfer bench: --device must be a CUDA device, got {args.device!r}"
                )
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(dev)  # pinxfer places staging memory by the current GPU
            self.dev = dev
        self.report = Report(device=torch.cuda.get_device_name(self.dev) if self.dev else None)
        self._src: dict[int, torch.Tensor] = {}

    # -- plumbing
    def sync(self) -> None:
        if self.dev is not None:
            torch.cuda.synchronize(self.dev)

    def src(self, nbytes: int) -> torch.Tensor:
        """The pageable source of this size (one at a time: the bench frees the previous)."""
        if nbytes not in self._src:
            self._src.clear()
            self._src[nbytes] = _pageable(nbytes)
        return self._src[nbytes]

    def release(self) -> None:
        self._src.clear()
        self.sync()
        pinxfer.empty_cache()
        if self.dev is not None:
            _empty_torch_host_cache()
            torch.cuda.empty_cache()

    def time(self, fn: Callable[[], Any], **kw: Any) -> float:
        return _median_seconds(
            fn, self.repeats, self.sync if self.dev is not None else _no_sync, **kw
        )

    # -- the plan: a list of (label, step) so the progress bar knows the total
    def plan(self) -> list[tuple[str, Callable[[], None]]]:
        steps: list[tuple[str, Callable[[], None]]] = []
        sections = self.args.sections
        sizes = self.args.sizes
        gpu_sections = [s for s in sections if s in ("copy", "to_device", "prefetch")]
        if self.gpu_reason is not None:
            for s in gpu_sections:
                self.report.skip(s, self.gpu_reason)
        for nbytes in sizes:
            label = format_bytes(nbytes)
            per_size: list[tuple[str, Callable[[], None]]] = []
            if "pin" in sections:
                per_size.append((f"pin {label}", lambda n=nbytes: self.pin(n)))
            if self.dev is not None and "copy" in sections:
                per_size.append((f"copy {label}", lambda n=nbytes: self.copy(n)))
            if self.dev is not None and "to_device" in sections:
                per_size.append((f"to_device {label}", lambda n=nbytes: self.to_device(n)))
            if per_size:  # free this size's buffers after its last step
                name, last = per_size[-1]
                per_size[-1] = (name, lambda last=last: (last(), self.release()))
            steps += per_size
        if self.dev is not None and "prefetch" in sections:
            steps.append(("prefetch overlap", lambda: (self.prefetch(), self.release())))
        return steps

    def run(self) -> Report:
        steps = self.plan()
        bar = _progress(len(steps), self.args.no_progress)
        try:
            for label, step in steps:
                bar.set_postfix_str(label)
                step()
                bar.update(1)
        finally:
            bar.close()
        return self.report

    # -- sections
    def pin(self, n: int) -> None:
        """Cold and warm pinning of a pageable tensor, and the host-copy ceiling."""
        src = self.src(n)
        held: list[Any] = []

        dst = torch.empty_like(src)
        dst.fill_(0)
        self.report.add(
            "pin", "host_copy", "torch", n, self.time(lambda: dst.copy_(src), inner=_inner(n))
        )

        if self.dev is None:
            self.report.skip(
                "pin", "torch rows: t.pin_memory() needs CUDA; " + str(self.gpu_reason)
            )
        else:

            def torch_cold() -> None:
                held.clear()
                _empty_torch_host_cache()

            self.report.add(
                "pin",
                "pin_cold",
                "torch",
                n,
                self.time(lambda: held.append(src.pin_memory()), setup=torch_cold, warmup=0),
            )
            self.report.add(
                "pin",
                "pin_warm",
                "torch",
                n,
                self.time(lambda: held.append(src.pin_memory()), setup=held.clear),
            )
            held.clear()
            _empty_torch_host_cache()

        pin_memory = getattr(pinxfer, "pin_memory", None)
        note = None
        if pin_memory is None:
            note = "pinxfer.pin_memory missing in this build: measured pinxfer.empty(n) + copy_"

            def pin_memory(t: torch.Tensor) -> torch.Tensor:
                return pinxfer.empty(t.numel(), dtype=t.dtype).copy_(t)

            self.report.skip(
                "pin",
                "pinxfer.pin_memory is not in this pinxfer build; "
                "its rows measure pinxfer.empty + copy_ instead",
            )

        def pinxfer_cold() -> None:
            held.clear()
            self.sync()  # blocks fenced on a stream return to the cache before it is emptied
            pinxfer.empty_cache()

        self.report.add(
            "pin",
            "pin_cold",
            "pinxfer",
            n,
            self.time(lambda: held.append(pin_memory(src)), setup=pinxfer_cold, warmup=0),
            note=note,
        )
        self.report.add(
            "pin",
            "pin_warm",
            "pinxfer",
            n,
            self.time(lambda: held.append(pin_memory(src)), setup=held.clear),
            note=note,
        )
        held.clear()

    def copy(self, n: int) -> None:
        """Raw H2D/D2H from pageable and pinned memory, torch's pinned vs the pool's."""
        dev, src, inner = self.dev, self.src(n), _inner(n)
        g = torch.empty(n, dtype=torch.uint8, device=dev)
        g.fill_(1)
        self.report.add(
            "copy", "h2d_pageable", "torch", n, self.time(lambda: src.to(dev), inner=inner)
        )
        self.report.add(
            "copy", "d2h_pageable", "torch", n, self.time(lambda: g.to("cpu"), inner=inner)
        )

        tp = src.pin_memory()
        self.report.add(
            "copy",
            "h2d_pinned",
            "torch",
            n,
            self.time(lambda: g.copy_(tp, non_blocking=True), inner=inner),
        )
        self.report.add(
            "copy",
            "d2h_pinned",
            "torch",
            n,
            self.time(lambda: tp.copy_(g, non_blocking=True), inner=inner),
        )

        pp = pinxfer.empty(n, dtype=torch.uint8)
        pp.copy_(src)
        self.report.add(
            "copy",
            "h2d_pinned",
            "pinxfer",
            n,
            self.time(lambda: g.copy_(pp, non_blocking=True), inner=inner),
        )
        self.report.add(
            "copy",
            "d2h_pinned",
            "pinxfer",
            n,
            self.time(lambda: pp.copy_(g, non_blocking=True), inner=inner),
        )

    def to_device(self, n: int) -> None:
        """What a user writes: t.to(dev) vs pinxfer.to_device(t); g.cpu() vs to_host."""
        dev, src, inner = self.dev, self.src(n), _inner(n)
        self.report.add("to_device", "h2d", "torch", n, self.time(lambda: src.to(dev), inner=inner))
        self.report.add(
            "to_device",
            "h2d_pin_then_copy",
            "torch",
            n,
            self.time(lambda: src.pin_memory().to(dev, non_blocking=True), inner=inner),
        )
        to_device = getattr(pinxfer, "to_device", None)
        if to_device is None:
            self.report.skip("to_device", "pinxfer.to_device is not in this pinxfer build")
        else:
            self.report.add(
                "to_device",
                "h2d",
                "pinxfer",
                n,
                self.time(lambda: to_device(src, device=dev), inner=inner),
            )

        g = torch.empty(n, dtype=torch.uint8, device=dev)
        g.fill_(1)
        self.report.add("to_device", "d2h", "torch", n, self.time(lambda: g.to("cpu"), inner=inner))
        to_host = getattr(pinxfer, "to_host", None)
        if to_host is None:
            self.report.skip("to_device", "pinxfer.to_host is not in this pinxfer build")
        else:
            self.report.add(
                "to_device", "d2h", "pinxfer", n, self.time(lambda: to_host(g).wait(), inner=inner)
            )

    def prefetch(self) -> None:
        """A training-like loop: copy a pageable batch, then matmuls on it.

        torch: ``x = b.to(dev); f(x)`` each step (copy and compute in series).
        pinxfer: ``for x in pinxfer.prefetch(batches): f(x)`` (next copy under this compute).
        ideal: the slower of copy alone (through prefetch) and compute alone.
        The matmul count per step is calibrated so compute takes about as long as
        torch's copy: where overlap matters most.
        """
        prefetch = getattr(pinxfer, "prefetch", None)
        if prefetch is None:
            self.report.skip("prefetch", "pinxfer.prefetch is not in this pinxfer build")
            return
        dev = self.dev
        steps = max(2, self.args.prefetch_steps)
        k = 4096
        rows = max(1, self.args.prefetch_batch // (4 * k))
        batch_bytes = rows * k * 4
        hosts = [torch.ones(rows, k) for _ in range(min(steps, 4))]
        batches = [hosts[i % len(hosts)] for i in range(steps)]
        w = torch.randn(k, k, device=dev) / k**0.5
        x_dev = hosts[0].to(dev)

        t_mm = _median_seconds(lambda: x_dev @ w, 3, self.sync)
        t_copy = _median_seconds(lambda: hosts[0].to(dev), 3, self.sync)
        n_mm = max(1, round(t_copy / t_mm))

        def f(x: torch.Tensor) -> torch.Tensor:
            for _ in range(n_mm):
                y = x @ w
            return y

        def loop_torch() -> None:
            for b in batches:
                f(b.to(dev))

        def loop_pinxfer() -> None:
            for x in prefetch(batches, device=dev, depth=2):
                f(x)

        def compute_alone() -> None:
            for _ in batches:
                f(x_dev)

        def copy_alone() -> None:
            for _ in prefetch(batches, device=dev, depth=2):
                pass

        total = steps * batch_bytes
        note = f"{steps} steps of {format_bytes(batch_bytes)} + {n_mm} matmul(s) {rows}x{k}x{k}"
        s_torch = self.time(loop_torch)
        s_pinxfer = self.time(loop_pinxfer)
        s_compute = self.time(compute_alone)
        s_copy = self.time(copy_alone)
        self.report.add("prefetch", "loop", "torch", total, s_torch, note=note)
        self.report.add("prefetch", "loop", "pinxfer", total, s_pinxfer, note=note)
        self.report.add("prefetch", "loop", "ideal", total, max(s_compute, s_copy), note=note)
        self.report.add("prefetch", "compute_alone", "torch", total, s_compute, note=note)
        self.report.add("prefetch", "copy_alone", "pinxfer", total, s_copy, note=note)


# ---------------------------------------------------------------- output


def pinned_limit_gbps(report: dict[str, Any]) -> float | None:
    """The best pinned H2D figure measured: the practical bus limit."""
    vals = [
        r["gbps"] for r in report["results"] if r["section"] == "copy" and r["op"] == "h2d_pinned"
    ]
    return max(vals) if vals else None


def render(report: dict[str, Any]) -> str:
    """The plain-text table: one row per (section, op, size), torch and pinxfer side by side."""
    rows: dict[tuple, dict[str, dict]] = {}
    for r in report["results"]:
        op = r["op"] if r["impl"] != "ideal" else r["op"] + " (ideal)"
        rows.setdefault((r["section"], op, r["bytes"]), {})[r["impl"]] = r
    table = [
        ("section", "op", "size", "torch ms", "torch GB/s", "pinxfer ms", "pinxfer GB/s", "speedup")
    ]
    for (section, op, nbytes), impls in rows.items():
        t = impls.get("torch")
        p = impls.get("pinxfer") or impls.get("ideal")
        speed = f"{t['seconds'] / p['seconds']:.2f}x" if t and p and "ideal" not in impls else ""
        table.append(
            (
                section,
                op,
                format_bytes(nbytes),
                f"{t['seconds'] * 1e3:.3f}" if t else "",
                f"{t['gbps']:.1f}" if t else "",
                f"{p['seconds'] * 1e3:.3f}" if p else "",
                f"{p['gbps']:.1f}" if p else "",
                speed,
            )
        )
    lines = [
        f"pinxfer {report['pinxfer']} bench, torch {report['torch']}, "
        f"device: {report['device'] or 'none'}, {report['date']}",
        "",
    ]
    if len(table) > 1:
        lines += format_table(table, right={2, 3, 4, 5, 6, 7})
    else:
        lines.append("(no results)")
    limit = pinned_limit_gbps(report)
    if limit:
        lines.append(f"\npinned H2D limit measured: {limit:.1f} GB/s")
    notes = sorted({r["note"] for r in report["results"] if r.get("note")})
    for note in notes:
        lines.append(f"note: {note}")
    if report["skipped"]:
        lines.append("\nskipped:")
        for s in report["skipped"]:
            lines.append(f"  {s['section']}: {s['reason']}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    """Bandwidth vs size: transfers (torch and pinxfer, pinned limit as a line) and pinning."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(section: str, op: str, impl: str) -> tuple[list[int], list[float]]:
        pts = sorted(
            (r["bytes"], r["gbps"])
            for r in report["results"]
            if (r["section"], r["op"], r["impl"]) == (section, op, impl)
        )
        return [b for b, _ in pts], [g for _, g in pts]

    transfer = [
        ("to_device", "h2d", "torch", "torch  t.to('cuda')", "tab:blue", "-"),
        ("to_device", "h2d", "pinxfer", "pinxfer  to_device(t)", "tab:orange", "-"),
        (
            "to_device",
            "h2d_pin_then_copy",
            "torch",
            "torch  t.pin_memory().to('cuda')",
            "tab:blue",
            ":",
        ),
        ("to_device", "d2h", "torch", "torch  g.cpu()", "tab:blue", "--"),
        ("to_device", "d2h", "pinxfer", "pinxfer  to_host(g)", "tab:orange", "--"),
    ]
    if not any(series(*s[:3])[0] for s in transfer):  # no to_device section: raw copies
        transfer = [
            ("copy", "h2d_pageable", "torch", "torch H2D pageable", "tab:blue", "-"),
            ("copy", "h2d_pinned", "pinxfer", "pinxfer H2D from pool", "tab:orange", "-"),
        ]
    pinning = [
        ("pin", "pin_cold", "torch", "torch  pin_memory() cold", "tab:blue", "--"),
        ("pin", "pin_warm", "torch", "torch  pin_memory() warm", "tab:blue", "-"),
        ("pin", "pin_cold", "pinxfer", "pinxfer  pin_memory() cold", "tab:orange", "--"),
        ("pin", "pin_warm", "pinxfer", "pinxfer  pin_memory() warm", "tab:orange", "-"),
        ("pin", "host_copy", "torch", "torch  dst.copy_(src), pageable", "tab:gray", ":"),
    ]
    panels = [
        (title, lines)
        for title, lines in (
            ("host <-> GPU transfer", transfer),
            ("pinning a pageable tensor", pinning),
        )
        if any(series(*s[:3])[0] for s in lines)
    ]
    if not panels:
        raise ValueError("nothing to plot: no transfer or pinning results")
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    limit = pinned_limit_gbps(report)
    for ax, (title, lines) in zip(axes[0], panels):
        for section, op, impl, label, color, style in lines:
            xs, ys = series(section, op, impl)
            if xs:
                ax.plot([x / MiB for x in xs], ys, style, color=color, marker="o", label=label)
        if limit and title.startswith("host"):
            ax.axhline(
                limit,
                color="black",
                linewidth=1,
                linestyle="-.",
                label=f"pinned limit {limit:.1f} GB/s",
            )
        ax.set_xscale("log", base=2)
        ticks = sorted(
            {r["bytes"] for r in report["results"] if r["section"] in ("copy", "pin", "to_device")}
        )
        if ticks:
            ax.set_xticks([t / MiB for t in ticks])
            ax.set_xticklabels([format_bytes(t).replace(".0 ", " ") for t in ticks])
            ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_xlabel("tensor size")
        ax.set_ylabel("GB/s")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"pinxfer {report['pinxfer']} / torch {report['torch']} on "
        f"{report['device'] or 'CPU only'} ({report['date'][:10]})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args: Any) -> int:
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(
                "pinxfer bench --plot needs matplotlib, which is not installed: "
                "`pip install matplotlib` (or `pip install 'pinxfer[bench]'`), "
                "or drop --plot.",
                file=sys.stderr,
            )
            return 2
    if args.from_json:  # re-render a saved run (e.g. plot here what a GPU machine measured)
        report = json.loads(Path(args.from_json).read_text())
    else:
        report = Bench(args).run().to_json()
    table_out = sys.stderr if args.json == "-" else sys.stdout
    print(render(report), file=table_out)
    if args.json and not args.from_json:
        text = json.dumps(report, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    if args.plot:
        plot(report, args.plot)
        print(f"plot written to {args.plot}", file=table_out)
    return 0
