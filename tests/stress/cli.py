"""The command line of the stress (``python3 -m tests.stress``, scripts/stress_gpu.py):
arguments, the watchdog, the modes one after the other in this process, the report.

Exit status: 0 if every mode passed; 1 otherwise (or a hang past --watchdog seconds, after
every thread's stack is dumped); 2 if no GPU is usable and --cpu was not given. A crash
kills the process (run with ``python3 -X faulthandler``)."""

from __future__ import annotations

import argparse

import torch

import pinxfer
from tests.stress import __doc__ as PACKAGE_DOC
from tests.stress.contract import start_watchdog, stop_watchdog
from tests.stress.env import Env
from tests.stress.mode import MODES, ModeArgs, run_mode
from tests.stress.report import machine_info, ops_table, summary_line, write_json
from tests.stress.tensors import MiB


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python3 -m tests.stress",
        description=PACKAGE_DOC.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--mode", choices=["plain", "install", "both"], default="both")
    p.add_argument("--seconds", type=float, default=60.0, help="run time per mode (default 60)")
    p.add_argument("--threads", type=int, default=3, help="stress threads per mode (>= 3)")
    p.add_argument(
        "--min-transfers",
        type=int,
        default=1000,
        help="fail a mode that checked fewer tensors (default 1000)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", help="write the report here")
    p.add_argument(
        "--large-frac",
        type=float,
        default=0.02,
        help="fraction of tensors of 16-64 MiB (default 0.02)",
    )
    p.add_argument(
        "--medium-frac",
        type=float,
        default=0.08,
        help="fraction of tensors of 1-16 MiB (default 0.08)",
    )
    p.add_argument(
        "--inject-faults",
        type=float,
        default=0.0,
        metavar="P",
        help="corrupt one byte in a fraction P of checks (checker sanity: the run "
        "must then fail with bad_bytes == injected_bytes)",
    )
    p.add_argument(
        "--watchdog",
        type=float,
        default=0.0,
        help="seconds before a hung run dumps all stacks and exits 1 "
        "(default: modes x (seconds + 90) + 120)",
    )
    p.add_argument(
        "--cpu",
        action="store_true",
        help="run on the CPU even where a GPU is usable: the operations that need "
        "one are skipped, the others are checked on the host",
    )
    p.add_argument(
        "--max-bytes",
        type=int,
        default=None,
        help="largest tensor (default 64 MiB on a GPU, 8 MiB on the CPU)",
    )
    args = p.parse_args(argv)
    if args.threads < 3:
        p.error("--threads must be >= 3")
    return args


def make_env(args: argparse.Namespace) -> Env | None:
    """The device to stress, or None (with a message) when a GPU was needed and none is."""
    if args.cpu:
        return Env(
            torch.device("cpu"), inject=args.inject_faults, max_bytes=args.max_bytes or 8 * MiB
        )
    reason = pinxfer.cuda_unavailable_reason()
    if reason is not None:
        print(f"stress: no usable GPU: {reason}. (--cpu runs the CPU part.)")
        return None
    return Env(
        torch.device("cuda", torch.cuda.current_device()),
        inject=args.inject_faults,
        max_bytes=args.max_bytes or 64 * MiB,
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    env = make_env(args)
    if env is None:
        return 2
    modes = list(MODES) if args.mode == "both" else [args.mode]
    start_watchdog(args.watchdog or len(modes) * (args.seconds + 90) + 120)
    note = env.probe()
    report = {
        "ok": False,
        "complete": False,
        "machine": machine_info(env),
        "args": vars(args),
        "modes": {},
        "probe_note": note,
    }
    print(
        f"stress: {report['machine'].get('device_name', env.device)} "
        f"torch {torch.__version__}, "
        f"modes {modes}, {args.seconds} s each, {args.threads} threads, seed {args.seed}"
        + (f" ({note})" if note else ""),
        flush=True,
    )
    mode_args = ModeArgs(
        threads=args.threads,
        seconds=args.seconds,
        seed=args.seed,
        large_frac=args.large_frac,
        medium_frac=args.medium_frac,
        min_transfers=args.min_transfers,
    )
    for mode in modes:
        r = run_mode(env, mode, mode_args, MODES.index(mode))
        report["modes"][mode] = r
        print(summary_line(mode, r, args.min_transfers), flush=True)
        print(ops_table(r), flush=True)
        write_json(args.json, report)  # partial results survive a crash in a later mode
    stop_watchdog()
    report["ok"] = all(r["ok"] for r in report["modes"].values())
    report["complete"] = True
    if args.inject_faults > 0:
        injected = sum(r["injected_bytes"] for r in report["modes"].values())
        counted = sum(r["bad_bytes"] for r in report["modes"].values())
        print(
            f"stress: injected {injected} one-byte faults, counted {counted} bad bytes "
            f"({'checker OK' if injected == counted and injected else 'CHECKER PROBLEM'})"
        )
        report["checker_ok"] = bool(injected == counted and injected)
    write_json(args.json, report)
    print("STRESS " + ("PASSED" if report["ok"] else "FAILED"), flush=True)
    return 0 if report["ok"] else 1
