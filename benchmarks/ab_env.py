"""Variants of one build, same machine, same call: a benchmark run in alternating fresh
processes, each variant with its own environment (an experiment switch, a PINXFER_* setting).

bench_ab.py compares two builds on a fixed set of measures; this compares settings of the
build in the checkout on any benchmark that writes a JSON file (bench_loop.py,
diag_chunk_timeline.py, ...). Rounds alternate the order (A B, B A, ...), because the same
build differs from one process to the next by more than many changes worth measuring.

    python benchmarks/ab_env.py --out session.json --rounds 3 \\
        --variant old:PINXFER_SPIN_US=100 --variant new:PINXFER_SPIN_US=400 \\
        -- python3 benchmarks/bench_loop.py --no-small --sizes 4K,1M --json {json}

The command's `{json}` is replaced by a file of the run's own; without it, `--json FILE` is
appended. After every run the whole session is written again to --out (atomically), as
{"what", "command", "variants", "runs": {variant: {"r<round>": the run's JSON}},
"failures": [...]}: a call cut short (the device's time limit) still leaves every run that
finished in one file, and the device returns only a few files. compare_loop.py --session OUT
--before A --after B reads it (so does compare_timeline.py for timeline runs).

A run that exits non-zero or writes no JSON is recorded under "failures" (variant, round,
exit code, the tail of its output) and the rounds go on; the driver exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Any

TAIL_CHARS = 2000


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """NAME or NAME:ENV=VALUE[,ENV=VALUE...] -> (name, environment)."""
    name, _, assignments = text.partition(":")
    if not name or "=" in name:
        raise ValueError(f"a variant is NAME[:ENV=VALUE,...], got {text!r}")
    env = {}
    for item in filter(None, assignments.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"variant {name!r}: expected ENV=VALUE, got {item!r}")
        env[key] = value
    return name, env


def round_order(names: list[str], round_number: int) -> list[str]:
    """Round 1 in the given order, round 2 reversed, and so on."""
    return list(names) if round_number % 2 == 1 else list(reversed(names))


def command_for(command: list[str], json_path: str) -> list[str]:
    if any("{json}" in word for word in command):
        return [word.replace("{json}", json_path) for word in command]
    return [*command, "--json", json_path]


def write_atomically(path: str, data: Any) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".ab_env_", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def run_session(args: argparse.Namespace, variants: dict[str, dict[str, str]]) -> int:
    session: dict[str, Any] = {
        "what": args.what,
        "command": shlex.join(args.command),
        "variants": variants,
        "runs": {name: {} for name in variants},
        "failures": [],
    }
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ab_env_") as scratch:
        for r in range(1, args.rounds + 1):
            for name in round_order(list(variants), r):
                json_path = os.path.join(scratch, f"{name}_r{r}.json")
                cmd = command_for(args.command, json_path)
                env = {**os.environ, **variants[name]}
                try:
                    proc = subprocess.run(
                        cmd, env=env, capture_output=True, text=True, timeout=args.timeout
                    )
                    rc, output = proc.returncode, proc.stdout + proc.stderr
                except subprocess.TimeoutExpired as e:
                    rc = "timeout"
                    output = f"{e.stdout or ''}{e.stderr or ''}"
                    if isinstance(output, bytes):
                        output = output.decode(errors="replace")
                data = None
                if rc == 0 and os.path.exists(json_path):
                    try:
                        with open(json_path) as f:
                            data = json.load(f)
                    except ValueError as e:  # a run cut while writing: a failure like others
                        output += f"\nab_env: its JSON did not parse: {e}"
                if data is None:
                    session["failures"].append(
                        {"variant": name, "round": r, "exit": rc, "tail": output[-TAIL_CHARS:]}
                    )
                else:
                    session["runs"][name][f"r{r}"] = data
                write_atomically(args.out, session)
                state = "ok" if data is not None else f"FAILED (exit {rc})"
                print(f"ab_env: {name} r{r} {state} at {time.monotonic() - t0:.0f} s", flush=True)
    return 1 if session["failures"] else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        usage="ab_env.py --out FILE --variant NAME[:ENV=V,...] ... [--rounds N] -- COMMAND...",
    )
    ap.add_argument("--out", required=True, help="the session file, rewritten after every run")
    ap.add_argument("--variant", action="append", required=True, help="NAME[:ENV=VALUE,...]")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run")
    ap.add_argument("--what", default="", help="a line saying what is compared (kept)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="after --: the benchmark to run")
    args = ap.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        ap.error("no command: give the benchmark after --")
    if len(args.variant) < 2:
        ap.error("give at least two --variant")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    try:
        variants = dict(parse_variant(v) for v in args.variant)
    except ValueError as e:
        ap.error(str(e))
    if len(variants) != len(args.variant):
        ap.error("two variants share a name")
    return run_session(args, variants)


if __name__ == "__main__":
    sys.exit(main())
