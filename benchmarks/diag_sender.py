"""Where a prefetch step's time goes on the caller's road with its C++ sender (issue 22):
each step split into next() and the synchronize after it, against the plain loop's
.to() and its synchronize, in one process, ways alternating pass by pass; and the
sender's own calls alone (take of a batch that has landed, submit), each timed right
after the gap. Patterns: back to back, after a 20 ms sleep, after a 20 ms GPU kernel the
host waits on. Median / minimum microseconds.

    python benchmarks/diag_sender.py [--sizes 4K,64K,1M] [--passes 6] [--json PATH] [--no-calls]
        [--trace]

A third way, "raw", makes the sender's calls of a step by hand, with no prefetch around them:
submit_batch_if_plain of the next batch (raw_submit), take_batch of this one (raw_take), the
synchronize (raw_sync), one batch ahead as prefetch's caller's road sends them. prefetch_step
minus raw_step is what prefetch adds to a step around those calls (prefetch_over_raw_us in
each row: its Python, and what else differs, such as the last batch's free inside next());
raw_free is the last batch's free, made before raw_step's timing. A fourth, "direct",
calls Prefetcher.__next__ (no generator: prefetch's iterator frees the last batch inside the
next step) and times the last batch's free (direct_free) apart from next() (direct_next).
raw, direct and pieces time only the steady steps, each of which submits a batch and takes
one (not the pass's first, nor its last, which submits nothing). A fifth, "pieces", makes
prefetch's own calls of a steady step on the sender road one by one
(the last batch's free, the capture check, the lock, the profiler check, the source's next
batch, the submit's C call and its Python, the take's C call, the lock's release, the
synchronize: pieces_<name>, PIECES; _CallerPass._sender_step without a profiler), so the
difference between direct_next and raw_submit + raw_take is found piece by piece; if the
pieces add up to less than direct_next, the rest is the calls between prefetch's functions.
--ways and --patterns choose what runs.

Each row also has the whole step (next() and the synchronize: prefetch_step, loop_step) and
step_ratio_median (the plain loop's median step over prefetch's; > 1: prefetch faster), and
the pass's start: from making the iterator (prefetch(), or the plain loop's generator) to
the first batch usable on the consumer's stream (prefetch_first, loop_first,
first_ratio_median), each pass made after the pattern's gap.

A sixth way, "owned", is prefetch with the sender's outputs made on the consumer's stream
(PINXFER_SENDER_OUTPUTS=consumer, set for its passes alone through the sender's diagnostic
_set_outputs, whatever the variable says): owned_step, owned_next, owned_sync,
owned_first, and owned_ratio_median (prefetch's median step over owned's; > 1: owned faster),
so that both settings are timed in one process, pass by pass. With --trace the jobs that made
their outputs at the submit are summarised apart (sender_owned_*).

The batch is bench_loop.py's ({"x", "y", "meta"} of the given total size).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import importlib

import pinxfer
from pinxfer import _ops

prefetch_mod = importlib.import_module("pinxfer.prefetch")  # pinxfer.prefetch is the function

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_loop import batch_layout, parse_sizes, size_label

GAP_S = 0.02
#: The pieces way's steps, in order (pieces_<name>: microseconds of each).
PIECES = (
    "free",
    "capture_check",
    "lock_and_item",
    "profiling_check",
    "fetch",
    "submit_c",
    "submit_py",
    "take_c",
    "release",
    "sync",
)
CHUNK_BYTES = int(pinxfer.transfer.DEFAULT_CHUNK_BYTES)  # prefetch's defaults
NUM_BUFFERS = int(pinxfer.transfer.DEFAULT_NUM_BUFFERS)


def make_batch(nbytes: int, i: int) -> dict:
    lay = batch_layout(nbytes)
    return {
        "x": torch.full((lay["x"] // 4,), float(i)),
        "y": torch.full((lay["y"] // 8,), i, dtype=torch.int64),
        "meta": [torch.tensor(i), torch.tensor(nbytes)],
    }


def stats(xs: list[float]) -> dict:
    """Median, minimum and mean in µs: bench_loop's prefetch rows are each pass's mean step,
    so the mean is what compares with them."""
    us = [x * 1e6 for x in xs]
    return {
        "median_us": statistics.median(us),
        "min_us": min(us),
        "mean_us": statistics.fmean(us),
        "n": len(us),
    }


def sender_calls(dev: torch.device, batch: dict, gap: Any, sync: Any, passes: int) -> dict:
    """The sender's calls alone, each right after the gap: take of a batch that has landed,
    submit, and a trivial Python call for scale."""
    sender = _ops.fast.batch_sender(dev)
    leaves = [batch["x"], batch["y"], *batch["meta"]]
    take_us, submit_us, noop_us = [], [], []
    ticket = sender.submit(leaves, 16 << 20, 4)
    for _ in range(passes * 4):
        time.sleep(0.05)  # the batch lands
        sync()
        if gap is not None:
            gap()
        t0 = time.perf_counter()
        got = sender.take(ticket)  # freed outside the timing, as a batch would be
        take_us.append(time.perf_counter() - t0)
        del got
        if gap is not None:
            gap()
        t0 = time.perf_counter()
        ticket = sender.submit(leaves, 16 << 20, 4)
        submit_us.append(time.perf_counter() - t0)
        if gap is not None:
            gap()
        t0 = time.perf_counter()
        _ops.eager()
        noop_us.append(time.perf_counter() - t0)
    sender.take(ticket)
    return {
        "sender_take_landed": stats(take_us),
        "sender_submit": stats(submit_us),
        "python_call_eager": stats(noop_us),
    }


def job_trace_stats(jobs: list[dict]) -> dict[str, Any]:
    """--trace: medians over the sender's jobs, microseconds: queued (submit to the worker's
    start), send (the worker's start to every copy queued), submit_to_take; the submit's
    parts: take_apart (the binding's walk of the batch and the job made), of which outputs
    (with PINXFER_SENDER_OUTPUTS=consumer: the batch's device memory made on the consumer's
    stream and the event after it), queue (the queue's lock, push and notify); the take's:
    take_wait (until the job is done), take_stream (the landing check, or the stream's wait),
    take_record (the results' stream uses); and for
    jobs with a pipelined leaf its first_dma / last_dma queued (from the worker's start);
    for jobs with packed small leaves, before_pack (the worker's start to the pack's: the
    leaves sent before it, e.g. the one sent apart), and the pack's own steps from its start:
    pack_output (its device output made), pack_staged (its bytes copied in), pack_queued
    (its DMA queued), pack_end (its views made). The raw way's raw_submit less take_apart
    and queue is the call's own cost (its dispatch, the ticket's Python object); raw_take
    less the take's parts likewise (and the batch rebuilt)."""
    if not jobs:
        return {}
    spans = {
        "queued": ("submitted_ns", "started_ns"),
        "send": ("started_ns", "sent_ns"),
        "submit_to_take": ("submitted_ns", "taken_ns"),
        "take_apart": ("entered_ns", "submitted_ns"),
        "queue": ("submitted_ns", "queued_ns"),
        "take_wait": ("take_entered_ns", "waited_ns"),
        "take_stream": ("waited_ns", "taken_ns"),
        "take_record": ("taken_ns", "recorded_ns"),
    }
    per: dict[str, list[float]] = {name: [] for name in spans}
    for j in jobs:
        for name, (start, end) in spans.items():
            per[name].append((j[end] - j[start]) / 1e9)
        if j.get("outputs_ns", 0) > 0:
            per.setdefault("outputs", []).append(j["outputs_ns"] / 1e9)
        b = j["block"]
        # The block is the job's last pipelined leaf: a batch whose second leaf is pipelined
        # too (diag's 64 MiB batch: its 1 MiB labels) would report that one's times.
        if b is not None and b["first_queued_us"] >= 0 and 2 * b["nbytes"] >= j["bytes"]:
            # The block's times are from its start, setup_us after its muster, which the
            # worker made after starting the job.
            start = (b["mustered_ns"] - j["started_ns"]) / 1e9 + b["setup_us"] / 1e6
            per.setdefault("first_dma", []).append(start + b["first_queued_us"] / 1e6)
            per.setdefault("last_dma", []).append(start + b["last_queued_us"] / 1e6)
        pack = j["pack"]
        if pack is not None:
            per.setdefault("before_pack", []).append((pack["entered_ns"] - j["started_ns"]) / 1e9)
            steps = {"output": "output_us", "staged": "staged_us", "queued": "queued_us"}
            steps["end"] = "total_us"
            for name, key in steps.items():
                if pack[key] >= 0:  # staged_us is -1 where copy threads packed
                    per.setdefault(f"pack_{name}", []).append(pack[key] / 1e6)
    out: dict[str, Any] = {f"sender_{k}": stats(v) for k, v in per.items()}
    out["sender_jobs"] = len(jobs)
    out["sender_landed_share"] = sum(j["landed"] for j in jobs) / len(jobs)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4K,64K,256K,1M")
    ap.add_argument("--passes", type=int, default=6)
    ap.add_argument("--batches", type=int, default=16)
    ap.add_argument("--json")
    ap.add_argument(
        "--ways",
        default="prefetch,loop,raw,direct,pieces",
        help="comma list of prefetch, loop, owned, raw, direct, pieces (prefetch and loop: the "
        "ratios; owned: prefetch with the sender's outputs on the consumer's stream)",
    )
    ap.add_argument("--patterns", default="b2b,sleep,gpu", help="comma list of b2b, sleep, gpu")
    ap.add_argument("--no-calls", action="store_true", help="skip the sender's calls alone")
    ap.add_argument(
        "--trace",
        action="store_true",
        help="trace the sender's jobs in the timed passes (BatchSender._job_traces): per job "
        "its wait in the queue, its send's host time, submit to take, and its pipelined "
        "leaf's first and last DMA queued",
    )
    args = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.init()
    sync = lambda: torch.cuda.current_stream(dev).synchronize()  # noqa: E731
    torch.cuda._sleep(1000)
    sync()
    cycles = 1 << 20
    while True:  # a kernel of about GAP_S
        t0 = time.perf_counter()
        torch.cuda._sleep(cycles)
        sync()
        if time.perf_counter() - t0 >= GAP_S / 2:
            cycles = int(cycles * GAP_S / (time.perf_counter() - t0))
            break
        cycles *= 2
    gaps = {
        "b2b": None,
        "sleep": lambda: time.sleep(GAP_S),
        "gpu": lambda: (torch.cuda._sleep(cycles), sync()),
    }
    result: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    for nbytes in parse_sizes(args.sizes):
        batches = [make_batch(nbytes, i) for i in range(args.batches)]
        for pattern, gap in gaps.items():
            if pattern not in args.patterns.split(","):
                continue
            split: dict[str, list[float]] = {
                k: []
                for k in (
                    "prefetch_step",
                    "loop_step",
                    "owned_step",
                    "prefetch_next",
                    "prefetch_sync",
                    "owned_next",
                    "owned_sync",
                    "owned_first",
                    "loop_to",
                    "loop_sync",
                    "prefetch_first",
                    "loop_first",
                    "raw_step",
                    "raw_submit",
                    "raw_take",
                    "raw_sync",
                    "raw_free",
                    "direct_step",
                    "direct_free",
                    "direct_next",
                    "direct_sync",
                    "pieces_step",
                    *(f"pieces_{name}" for name in PIECES),
                )
            }

            def record(way: str, names: tuple[str, ...], clock: list[float]) -> None:
                """A timed step: each interval of ``clock`` as <way>_<name>, the whole as
                <way>_step."""
                for name, t0, t1 in zip(names, clock, clock[1:]):
                    split[f"{way}_{name}"].append(t1 - t0)
                split[f"{way}_step"].append(clock[-1] - clock[0])

            def direct_pass() -> None:
                # prefetch through Prefetcher.__next__ (no generator frame holding the last
                # batch into the next step), the batch freed inside the step's timing.
                if gap is not None:
                    gap()
                it = pinxfer.prefetch(batches, device=dev)
                b = None
                for i in range(len(batches)):
                    if i and gap is not None:
                        gap()
                    clock = [time.perf_counter()]
                    b = None  # the last batch freed here, as the generator frees it
                    clock.append(time.perf_counter())
                    b = next(it)
                    clock.append(time.perf_counter())
                    sync()
                    clock.append(time.perf_counter())
                    if 0 < i < len(batches) - 1:  # steps that submit a batch and take one
                        record("direct", ("free", "next", "sync"), clock)
                    assert float(b["x"][0]) == float(i)
                del b
                it.close()

            def pieces_pass() -> None:
                # prefetch's steady step on the sender road taken apart: the calls that
                # _next_of and _CallerPass._sender_step make, without a profiler, for a batch
                # the sender took apart in C++ (_send_lease and _submit inlined, so their C
                # call is timed apart from their Python), one by one with a clock between
                # them (a copy of that path, for timing only: prefetch.py is the reference;
                # the first batch goes through next() as usual). The pass must stay on the
                # sender road and every batch be taken apart in C++: asserted. Step i takes
                # batch i and submits batch i + 1, so the last step's fetch ends the source:
                # the timed steps stop one short (batches 1 to n - 2).
                if gap is not None:
                    gap()
                pf = pinxfer.prefetch(batches, device=dev, producer="caller")
                b = next(pf)
                p = pf._pass
                assert isinstance(p, prefetch_mod._CallerPass) and p.sender is not None
                for i in range(1, len(batches) - 1):
                    if gap is not None:
                        gap()
                    clock = [time.perf_counter()]
                    b = None
                    clock.append(time.perf_counter())  # the last batch's free
                    prefetch_mod._refuse_under_capture(p.device)
                    clock.append(time.perf_counter())  # the capture check
                    assert p.consumer.acquire(blocking=False)
                    item, p.ahead = p.ahead, None
                    assert item[0] == prefetch_mod._SENT
                    sent = item[1]
                    clock.append(time.perf_counter())  # the lock, the item ahead
                    assert not torch.autograd._profiler_enabled() and not prefetch_mod.NVTX_TOOL
                    clock.append(time.perf_counter())  # the profiler check
                    assert p.source_batches is not None and p.sender_takes_apart
                    batch = next(p.source_batches)
                    clock.append(time.perf_counter())  # the source's next batch
                    ticket = p.sender.submit_batch_if_plain(
                        batch, p.to.chunk_bytes, p.to.num_buffers
                    )
                    clock.append(time.perf_counter())  # the submit's C call
                    assert ticket is not None, "the sender declined a plain batch"
                    sent_ahead = (batch, prefetch_mod._TAKEN_APART_IN_C, ticket, p.step)
                    p.ahead = (
                        prefetch_mod._SENT,
                        tuple.__new__(prefetch_mod._Sent, sent_ahead),
                        None,
                    )
                    p.step += 1
                    clock.append(time.perf_counter())  # the submit's Python
                    b = p.sender.take_batch(sent.ticket)
                    clock.append(time.perf_counter())  # the C call of the take
                    p.consumer.release()
                    clock.append(time.perf_counter())  # the lock's release
                    sync()
                    clock.append(time.perf_counter())
                    record("pieces", PIECES, clock)
                    assert float(b["x"][0]) == float(i)
                del b
                pf.close()

            def raw_pass() -> None:
                # The caller's road's step with nothing around the sender's calls: the first
                # batch submitted at the pass's start (prefetch sends it in next()).
                sender = _ops.fast.batch_sender(dev)
                if gap is not None:
                    gap()
                ticket = sender.submit_batch_if_plain(batches[0], CHUNK_BYTES, NUM_BUFFERS)
                b = None
                for i in range(len(batches)):
                    if i and gap is not None:
                        gap()
                    freed = time.perf_counter()
                    b = None  # the last batch freed (outside raw_step: raw_free)
                    clock = [time.perf_counter()]
                    steady = 0 < i < len(batches) - 1  # submits a batch and takes one
                    if steady:
                        split["raw_free"].append(clock[0] - freed)
                    ahead = None
                    if i + 1 < len(batches):
                        ahead = sender.submit_batch_if_plain(
                            batches[i + 1], CHUNK_BYTES, NUM_BUFFERS
                        )
                    clock.append(time.perf_counter())
                    b = sender.take_batch(ticket)
                    clock.append(time.perf_counter())
                    sync()
                    clock.append(time.perf_counter())
                    if steady:
                        record("raw", ("submit", "take", "sync"), clock)
                    assert float(b["x"][0]) == float(i)
                    ticket = ahead
                del b

            def run_pass(way: str) -> None:
                if way == "owned":  # prefetch, the sender's outputs on the consumer's stream
                    sender = _ops.fast.batch_sender(dev)
                    setting = sender.outputs
                    sender._set_outputs("consumer")
                    try:
                        run_pass_as(way)
                    finally:
                        sender._set_outputs(setting)
                else:
                    run_pass_as(way)

            def run_pass_as(way: str) -> None:
                if gap is not None:
                    gap()  # a pass starts after a step too (the first batch's row)
                t_start = time.perf_counter()
                it = (
                    iter(pinxfer.prefetch(batches, device=dev))
                    if way in ("prefetch", "owned")
                    else (
                        {
                            k: [t.to(dev, non_blocking=True) for t in v]
                            if isinstance(v, list)
                            else v.to(dev, non_blocking=True)
                            for k, v in b.items()
                        }
                        for b in batches
                    )
                )
                first, second = {
                    "prefetch": ("prefetch_next", "prefetch_sync"),
                    "owned": ("owned_next", "owned_sync"),
                    "loop": ("loop_to", "loop_sync"),
                }[way]
                whole = f"{way}_step"
                for i in range(len(batches)):
                    if i and gap is not None:
                        gap()
                    t0 = time.perf_counter()
                    b = next(it)
                    t1 = time.perf_counter()
                    sync()
                    t2 = time.perf_counter()
                    if i:  # steady state: after the first batch
                        split[first].append(t1 - t0)
                        split[second].append(t2 - t1)
                        split[whole].append(t2 - t0)
                    else:  # the pass's start: from making the iterator to the first batch
                        split[f"{way}_first"].append(t2 - t_start)
                    assert float(b["x"][0]) == float(i)
                    del b
                for _ in it:
                    pass

            ways = {
                "prefetch": lambda: run_pass("prefetch"),
                "loop": lambda: run_pass("loop"),
                "owned": lambda: run_pass("owned"),
                "raw": raw_pass,
                "direct": direct_pass,
                "pieces": pieces_pass,
            }
            names = [w for w in ways if w in args.ways.split(",")]
            for way in names:  # warm-up
                ways[way]()
            if args.trace:
                sender = _ops.fast.batch_sender(dev)
                _ops.fast._set_sender_tracing(True)
                taken_before = sender.taken
            for p in range(args.passes):
                k = p % len(names)
                for way in names[k:] + names[:k]:  # each way first in turn
                    ways[way]()
            row: dict[str, Any] = {k: stats(v) for k, v in split.items() if v}
            if args.trace:
                _ops.fast._set_sender_tracing(False)
                traced = sender._job_traces()  # the last ones (a ring): this row's jobs
                taken = min(sender.taken - taken_before, len(traced))
                jobs = traced[len(traced) - taken :]
                row.update(job_trace_stats([j for j in jobs if not j.get("outputs_ns")]))
                owned_jobs = job_trace_stats([j for j in jobs if j.get("outputs_ns")])
                row.update(
                    {f"sender_owned_{k[len('sender_') :]}": v for k, v in owned_jobs.items()}
                )

            def median_of(key: str) -> float:
                return row[key]["median_us"] if key in row else float("nan")

            row["step_ratio_median"] = median_of("loop_step") / median_of("prefetch_step")
            row["prefetch_over_raw_us"] = median_of("prefetch_step") - median_of("raw_step")
            row["first_ratio_median"] = median_of("loop_first") / median_of("prefetch_first")
            row["owned_ratio_median"] = median_of("prefetch_step") / median_of("owned_step")
            result[f"{size_label(nbytes)} {pattern}"] = row
            if not args.no_calls:
                row.update(sender_calls(dev, batches[0], gap, sync, args.passes))
            print(
                f"{size_label(nbytes):>6} {pattern:<5} "
                f"step loop/prefetch x{row['step_ratio_median']:.2f}  "
                f"first x{row['first_ratio_median']:.2f}  "
                f"prefetch over raw {row['prefetch_over_raw_us']:.1f} us  "
                + "  ".join(
                    f"{k} {v['median_us']:.0f}/{v['min_us']:.0f}"
                    for k, v in row.items()
                    if isinstance(v, dict)
                ),
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
