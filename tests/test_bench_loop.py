"""benchmarks/bench_loop.py --self-test: its statistics, verdicts and table on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from .conftest import benchmark_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_loop_self_test():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_loop.py"), "--self-test"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "bench_loop self-test OK" in proc.stdout
    assert "== loop table" in proc.stdout


def _loop_run(xp: float, verdict: str = "MISS") -> dict:
    """A bench_loop result of one row (to_device, 8 MiB back to back) and a torch row."""
    return {
        "rows": [
            {
                "size": "8MiB",
                "bytes": 8 << 20,
                "pattern": "b2b",
                "way": "to_device",
                "ratio_torch": {"median": 2 * xp, "min": 2 * xp},
                "ratio_pinned": {"median": xp, "min": xp},
                "verdict": verdict,
            },
            {"size": "8MiB", "bytes": 8 << 20, "pattern": "b2b", "way": "torch_to"},
        ],
        "small_rows": [],
    }


def _compare_loop(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "compare_loop.py"), *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_compare_loop_counts_the_rounds_a_change_moved_a_row(tmp_path):
    """benchmarks/compare_loop.py over rounds of before/after runs: per cell the medians
    of the rounds and in how many the after run was higher; a combined session file gives
    the same table; an odd number of runs is refused."""
    runs = [_loop_run(0.70), _loop_run(0.74), _loop_run(0.72), _loop_run(0.71, "PASS")]
    paths = []
    for i, run in enumerate(runs):
        paths.append(str(tmp_path / f"run{i}.json"))
        with open(paths[-1], "w") as f:
            json.dump(run, f)
    proc = _compare_loop(paths)
    assert proc.returncode == 0, proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| 8MiB | b2b"))
    # xt: before 1.40 and 1.44 -> median 1.42; after 1.48 and 1.42 -> 1.45; higher in round 1 only
    assert "| 1.42→1.45 1/2 | 0.71→0.72 1/2 |" in row
    assert "rows meeting every target: 0 -> 0, 0 -> 1 of 1" in proc.stdout
    every = "cells higher after in every round: {}; lower in every round: {} (of 2 cells that"
    assert every.format(0, 0) in proc.stdout
    # A tie is neither higher nor lower (it once counted as lower in every round).
    tied = [str(tmp_path / "run0.json")] * 4
    assert every.format(0, 0) in _compare_loop(tied).stdout
    assert "WARNING" not in proc.stdout
    # A run judged by session 45's method (the batch against the batch pinned) beside one
    # judged by the earlier one: said at the top.
    newer = _loop_run(0.72)
    newer["rows"][0]["ratio_pinned_one_tensor"] = {"median": 0.7, "min": 0.7}
    with open(tmp_path / "newer.json", "w") as f:
        json.dump(newer, f)
    mixed = _compare_loop([paths[0], str(tmp_path / "newer.json")])
    assert "WARNING: these runs were judged by different methods" in mixed.stdout

    session = {
        "runs": {"old": {"r1": runs[0], "r2": runs[2]}, "new": {"r1": runs[1], "r2": runs[3]}}
    }
    with open(tmp_path / "session.json", "w") as f:
        json.dump(session, f)
    proc2 = _compare_loop(
        ["--session", str(tmp_path / "session.json"), "--before", "old", "--after", "new"]
    )
    assert proc2.returncode == 0, proc2.stderr
    assert proc2.stdout == proc.stdout

    odd = _compare_loop(paths[:3])
    assert odd.returncode != 0 and "even number of files" in odd.stderr
    missing = _compare_loop(
        ["--session", str(tmp_path / "session.json"), "--before", "old", "--after", "x"]
    )
    assert missing.returncode != 0 and "no variant 'x'" in missing.stderr


def test_compare_loop_side_by_side_puts_whole_runs_in_each_cell(tmp_path):
    """--side-by-side: one figure per run in every cell, in the order given, the ways each run
    missed, the passing rows per run and each small-call row across the runs; fewer than two
    runs, or a session file, are refused."""
    runs = [_loop_run(0.70), _loop_run(0.74), _loop_run(0.81, "PASS")]
    for run, (ours, verdict) in zip(
        runs, [("2.9 us", "MISS"), ("1.4 us", "MISS"), ("1.0 us", "PASS")]
    ):
        run["small_rows"] = [
            {
                "name": "empty",
                "target": "<= torch",
                "ours_text": ours,
                "ref_text": "1.1 us",
                "verdict": verdict,
            }
        ]
    paths = []
    for i, run in enumerate(runs):
        paths.append(str(tmp_path / f"run{i}.json"))
        with open(paths[-1], "w") as f:
            json.dump(run, f)
    proc = _compare_loop(["--side-by-side", *paths])
    assert proc.returncode == 0, proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| 8MiB | b2b"))
    assert "| 1.40 / 1.48 / 1.62 | 0.70 / 0.74 / 0.81 |" in row
    assert row.endswith("| td / td / none |")
    assert "rows meeting every target: 0 / 0 / 1 of 1" in proc.stdout
    assert (
        "- empty (<= torch): 2.9 us (torch 1.1 us) MISS / 1.4 us (torch 1.1 us) MISS / "
        in proc.stdout
    )
    one = _compare_loop(["--side-by-side", paths[0]])
    assert one.returncode != 0 and "two or more run files" in one.stderr


def _timeline_run(wall: float, offer_at: float) -> dict:
    """A diag_chunk_timeline result of one size: pinxfer's auto-staged calls and the whole
    pinned copy, back to back and after a sleep."""
    px = {
        "wall_us": wall,
        "at_alloc_us": 20.0,
        "at_offered_us": offer_at,
        "at_first_dma_us": 60.0,
        "dma_wait_us": 10.0,
        "busy_gbps": 45.0,
        "spans": 5.0,
    }
    summary = {
        "b2b/px_auto": px,
        "b2b/pinned_whole": {"wall_us": 170.0},
        "sleep/px_auto": dict(px, wall_us=2 * wall),
        "sleep/pinned_whole": {"wall_us": 300.0},
    }
    return {"sizes": {"8MiB": {"summary": summary}}}


def test_compare_timeline_counts_the_rounds_a_change_moved_a_step(tmp_path):
    """benchmarks/compare_timeline.py: per size and pattern the medians over rounds of the
    pinned ratio and the host steps, with the rounds where after was higher; the session
    file gives the same table, and an unknown variant is named."""
    runs = {"old": {"r1": _timeline_run(340, 40), "r2": _timeline_run(300, 38)}}
    runs["new"] = {"r1": _timeline_run(320, 22), "r2": _timeline_run(310, 21)}
    session = tmp_path / "session.json"
    session.write_text(json.dumps({"runs": runs}))
    script = os.path.join(ROOT, "benchmarks", "compare_timeline.py")

    def run(argv: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, script, *argv], capture_output=True, text=True, timeout=60
        )

    proc = run(["--session", str(session), "--before", "old", "--after", "new"])
    assert proc.returncode == 0, proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| 8MiB | b2b"))
    # x pinned: 170/340 and 170/300 -> median 0.53; 170/320 and 170/310 -> 0.54, higher in r1.
    # wall 320 -> 315, higher in r2 only; offer (offered - alloc) 19 -> 1.5, never higher.
    assert row.startswith("| 8MiB | b2b | 0.53→0.54 1/2 | 320→315 1/2 | 19.0→1.5 0/2 | 60→60 0/2")
    assert "| 8MiB | sleep | 0.47→0.48 1/2 | 640→630 1/2 |" in proc.stdout

    files = []
    for name, variant in (("b1", "old"), ("a1", "new"), ("b2", "old"), ("a2", "new")):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(runs[variant]["r" + name[1]]))
        files.append(str(path))
    assert run(files).stdout == proc.stdout

    missing = run(["--session", str(session), "--before", "old", "--after", "x"])
    assert missing.returncode != 0 and "compare_timeline: no variant 'x'" in missing.stderr


def test_diag_midsize_report_reads_every_field_its_measure_writes():
    """benchmarks/diag_midsize.py's report runs only after GPU work, so a field it reads that
    measure() does not write (or writes differently) costs a device run: this feeds it a
    cell shaped as measure() builds one, on the CPU."""
    diag_midsize = benchmark_module("diag_midsize")

    def way(us: float) -> dict:
        return {"median_us": us, "min_us": us - 5, "call_median_us": us - 20}

    trace = {
        "own_done_us": 80.0,
        "first_helper_us": 12.0,
        "helper_pieces": 90,
        "pieces": 104,
        "stolen": 0,
        "on_torch_team": True,
        "total_us": 70.0,
        "first_queued_us": 20.0,
        "setup_us": 15.0,
    }

    def calls_after(walls, afters):
        return [
            {"wall_us": w, "call_us": w - 30, "after": a, "preempted": 0, "pool_misses": 0}
            | {"trace": trace}
            for w, a in zip(walls, afters, strict=True)
        ]

    calls = calls_after((250.0, 600.0), (None, "torch_pin"))
    cell = {
        "to_device": way(250.0),
        "torch_pin": way(90.0),
        "pin_memory": way(110.0),
        "to_device_calls": calls,
        "to_device_batch_calls": calls_after(
            (140.0, 160.0, 70.0), ("torch_pin", "torch_pin", None)
        ),
        "pin_memory_calls": [{"wall_us": 110.0, "preempted": 0, "copy_us": 78.0}],
        "same_block_share": {"pin_memory": 1.0, "torch_pin": 1.0},
        "slow_calls": 1,
        "slow_preempted": 0,
        "slow_stolen": 0,
        "slow_missed": 0,
    }
    text = diag_midsize.report("default", {"8MiB": cell})
    assert "to_device 250/245 (call 230)" in text
    assert "pin_memory (t.pin_memory 90 us)" in text and "copy_us 78.0" in text
    assert "slow 1/2" in text and text.count("slow call:") == 1
    # The batch's calls grouped by the way timed before each: the median of each group.
    assert "after torch_pin" in text and " 150 (n 2; call 120, leaf total 70" in text
    assert "after None" in text and " 70 (n 1;" in text
    only = {k: v for k, v in cell.items() if k not in ("torch_pin", "pin_memory")}
    only["pin_memory_calls"] = []  # the pinxfer_only variant: to_device alone
    assert "to_device 250/245" in diag_midsize.report("pinxfer_only", {"8MiB": only})


def test_diag_write_target_times_each_target_and_reports_where_it_lies():
    """benchmarks/diag_write_target.py on the CPU, with a pageable tensor standing in for
    torch's pinned block (which needs CUDA): every target is copied into in each round, its
    bytes are the source's after it, and the report reads every field measure() writes (the
    ratio against torch_pinned, the address modulo 4 KiB and 2 MiB, the mapping's pages)."""
    import torch

    import pinxfer

    diag = benchmark_module("diag_write_target")
    numel = 1 << 16  # 256 KiB of float32
    base = torch.randn(numel + diag.PAGE // 4)
    src = diag.offset_view(base, 64, numel)
    assert src.data_ptr() - base.data_ptr() == 64 and src.numel() == numel
    dsts = {
        "torch_pinned": torch.empty(numel),
        "pool": pinxfer.empty(numel),
        "pool_off2k": diag.offset_view(pinxfer.empty(numel + diag.PAGE // 4), 2048, numel),
    }
    times = diag.time_copies(src, dsts, rounds=4)
    assert {k: len(v) for k, v in times.items()} == dict.fromkeys(dsts, 4)
    for dst in dsts.values():
        assert torch.equal(dst, src)
    ways = diag.summarize(times, src.nbytes)
    assert ways["torch_pinned"]["torch_pinned_over_this"] == 1.0
    places = {k: diag.place(v) for k, v in dsts.items()}
    assert places["pool_off2k"]["mod_4k"] == dsts["pool_off2k"].data_ptr() % diag.PAGE
    assert "KernelPageSize" in places["pool"]  # the mapping was found in /proc/self/smaps
    cell = {"ways": ways, "source": diag.place(src), "targets": places}
    text = diag.report({"256KiB src+64": cell})
    assert text.splitlines()[0].startswith("256KiB src+64  (source mod 4K ")
    assert all(name in text for name in dsts) and "x1.00" in text


def test_diag_small_route_packs_the_batch_bytes_in_leaf_order():
    """benchmarks/diag_small_route.py's packed_pageable / packed_pinned ways send one buffer
    that stands for the batch: its bytes must be exactly the leaves', in the batch's order."""
    import torch

    route = benchmark_module("diag_small_route")
    make_batch = benchmark_module("diag_batch").make_batch
    for nbytes in (4096, 65536, 1 << 20):
        batch = make_batch(nbytes)
        packed = route.packed_bytes(batch)
        leaves = [batch["x"], batch["y"], *batch["meta"]]
        assert packed.dtype == torch.uint8 and packed.numel() == sum(t.nbytes for t in leaves)
        at = 0
        for leaf in leaves:
            part = packed[at : at + leaf.nbytes].view(leaf.dtype).reshape(leaf.shape)
            assert torch.equal(part, leaf)
            at += leaf.nbytes


def test_diag_step_python_runs_prefetchs_steady_step_with_a_stand_in_sender():
    """benchmarks/diag_step_python.py drives a caller's-road pass in its steady state with a
    stand-in sender (no GPU): the pass hands out the source's batches in order (measure()
    checks the first sixteen), and the report's figures are consistent with each other.
    The capture check is put back as it was."""
    import torch

    diag = benchmark_module("diag_step_python")
    capture = (torch._C._cuda_isCurrentStreamCapturing, torch.cuda.is_current_stream_capturing)
    result = diag.measure(steps=2000, rounds=2)
    assert (torch._C._cuda_isCurrentStreamCapturing, torch.cuda.is_current_stream_capturing) == (
        capture
    )
    assert result["step_us"] > result["calls_us"] > 0
    assert result["python_us"] == result["step_us"] - result["calls_us"]
    assert result["capture_check"] in ("stand-in (no CUDA)", "torch's")


def test_diag_sender_job_trace_stats_split_a_send_at_its_pack():
    """diag_sender.py --trace's summary of BatchSender._job_traces: each span from its two
    times, and for a job whose small leaves went packed, the time before the pack (a leaf
    sent apart) and the pack's own steps; a pack staged by copy threads (staged_us -1) has
    no pack_staged sample; the outputs made at a submit ("consumer" outputs) are reported
    for the jobs that made them. Jobs as the binding returns them, made up here (no GPU)."""
    diag = benchmark_module("diag_sender")
    job = {
        **dict.fromkeys(("entered_ns", "submitted_ns", "queued_ns"), 0),
        "started_ns": 1_000,
        "sent_ns": 71_000,
        **dict.fromkeys(("take_entered_ns", "waited_ns", "taken_ns", "recorded_ns"), 80_000),
        "bytes": 262_144,
        "landed": True,
        "block": None,
    }
    pack = {"entered_ns": 51_000, "output_us": 2.0, "staged_us": 3.0, "queued_us": 6.0}
    jobs = [
        {**job, "pack": {**pack, "total_us": 8.0}},
        {**job, "pack": {**pack, "staged_us": -1.0, "total_us": 8.0}},
        {**job, "pack": None, "outputs_ns": 4_000},
    ]
    out = diag.job_trace_stats(jobs)
    assert out["sender_outputs"]["median_us"] == 4.0 and out["sender_outputs"]["n"] == 1
    assert out["sender_send"]["median_us"] == 70.0 and out["sender_send"]["n"] == 3
    assert out["sender_before_pack"]["median_us"] == 50.0 and out["sender_before_pack"]["n"] == 2
    assert out["sender_pack_staged"]["n"] == 1
    assert out["sender_pack_end"]["median_us"] == 8.0
    assert out["sender_jobs"] == 3 and out["sender_landed_share"] == 1.0
