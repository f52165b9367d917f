"""The stress report: one dict per mode (the shape of benchmarks/results/*/stress.json), the
summary line printed per mode, the machine, and the JSON file (written after each mode, so
the modes before a crash survive it)."""

from __future__ import annotations

import json
import os
import platform
import socket

import torch

import pinxfer
from tests.stress.env import Env
from tests.stress.stats import Stats


def mode_report(
    total: Stats,
    *,
    failures: list[str],
    wall: float,
    threads: int,
    installed: bool,
    table: list,
    skipped: dict[str, str],
    leftover: list,
    pool: dict,
    released: int,
    fatal: str | None,
) -> dict:
    secs = max(wall, 1e-9)
    ops = {k: dict(v) for k, v in sorted(total.ops.items())}
    return {
        "ok": not failures,
        "failures": failures,
        "seconds": round(wall, 2),
        "threads": threads,
        "installed": installed,
        "transfers": total.transfers,
        "calls": total.calls,
        "transfers_per_s": round(total.transfers / secs, 1),
        "bytes_checked": total.bytes_checked,
        "gb_checked": round(total.bytes_checked / 1e9, 3),
        "gb_moved": round(total.bytes_moved / 1e9, 3),
        "gb_moved_per_s": round(total.bytes_moved / 1e9 / secs, 3),
        "bad_bytes": total.bad_bytes,
        "bad_checks": total.bad_checks,
        "injected_bytes": total.injected,
        "errors": total.errors,
        "contract_errors": total.contract_errors,
        # The operations drawn in this mode, by weight, and what each did (calls,
        # transfers, bytes moved, bytes checked, bad bytes, errors).
        "op_table": {
            op.name: {"weight": op.weight, "checks_bytes": op.checks_bytes} for op in table
        },
        "ops": ops,
        "skipped_ops": skipped,
        "mismatches": total.mismatches,
        "error_samples": total.error_samples,
        "contract_samples": total.contract_samples,
        "leftover_prefetch_threads": leftover,
        "pool": pool,
        "empty_cache_released_bytes": released,
        "fatal": fatal,
    }


def summary_line(mode: str, r: dict, min_transfers: int) -> str:
    status = "OK" if r["ok"] else "FAIL (" + "; ".join(r["failures"]) + ")"
    skipped = f", skipped {sorted(r['skipped_ops'])}" if r["skipped_ops"] else ""
    return (
        f"stress {mode}: {status} | transfers {r['transfers']} (min {min_transfers}), "
        f"calls {r['calls']}, {r['seconds']} s, {r['transfers_per_s']} transfers/s, "
        f"{r['gb_checked']} GB checked, {r['gb_moved']} GB moved, "
        f"bad_bytes {r['bad_bytes']}, errors {r['errors']}, "
        f"contract {r['contract_errors']}{skipped}"
    )


def ops_table(r: dict) -> str:
    """Per operation: calls, transfers, MB moved and checked, bad bytes, errors."""
    lines = [
        f"  {'op':24} {'calls':>7} {'transfers':>9} {'MB moved':>10} {'MB checked':>10} "
        f"{'bad':>5} {'errors':>6}"
    ]
    for name, d in r["ops"].items():
        lines.append(
            f"  {name:24} {d['calls']:7} {d['transfers']:9} {d['bytes'] / 1e6:10.1f} "
            f"{d['bytes_checked'] / 1e6:10.1f} {d['bad_bytes']:5} {d['errors']:6}"
        )
    return "\n".join(lines)


def machine_info(env: Env) -> dict:
    info = {
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "pinxfer": getattr(pinxfer, "__version__", "?"),
        "pinxfer_build": list(pinxfer.build_info()),
        "cpus": os.cpu_count(),
        "device": str(env.device),
    }
    if env.cuda:
        props = torch.cuda.get_device_properties(env.device)
        info["device_name"] = torch.cuda.get_device_name(env.device)
        info["device_memory_gib"] = round(props.total_memory / 2**30, 1)
    return info


def write_json(path: str | None, report: dict) -> None:
    if not path:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(tmp, path)
