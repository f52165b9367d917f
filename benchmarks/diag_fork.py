"""What a fork() costs with pinned memory held (review of session 43, a suspicion to settle).

pinxfer's pool segments are anonymous private mappings registered with cudaHostRegister.
On Linux 5.8 and later a fork copies the anonymous pages that are pinned for DMA into the
child at once (the parent keeps the pinned pages), where other pages are shared
copy-on-write. If CUDA's registration pins them that way, every DataLoader worker fork
would copy the whole pool. torch's pinned memory (cudaHostAlloc) is a mapping of the
driver's, which a fork may treat differently.

For each size the script holds one pinned tensor made by one of three ways (pinxfer.empty,
torch's pin_memory, a plain pageable tensor as the baseline), its pages touched, and times
fork() -> the child writes its private dirty memory and exits -> waitpid, ROUNDS times.
That memory right after the fork says whether the pages were copied (they are the child's
own: the size shows there) or shared copy-on-write (they read as shared), and the fork's
time says what the copy cost.

    python benchmarks/diag_fork.py [--sizes-gib 1,4] [--rounds 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import pinxfer

GiB = 1 << 30
HAS_CUDA = torch.cuda.is_available()


def _private_dirty_kib() -> int:
    """The process's private dirty pages: pages a fork copied into the child are private to
    it, where pages it shares copy-on-write with the parent read as Shared_Dirty."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Private_Dirty:"):
                return int(line.split()[1])
    return -1


def _fork_once() -> tuple[float, int]:
    """Seconds from fork() to the child's exit being reaped, and the child's private dirty
    memory (KiB) right after the fork."""
    r, w = os.pipe()
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.write(w, str(_private_dirty_kib()).encode())
        os._exit(0)
    os.close(w)
    rss = int(os.read(r, 64) or b"-1")
    os.close(r)
    os.waitpid(pid, 0)
    return time.perf_counter() - start, rss


def _held(way: str, nbytes: int) -> torch.Tensor:
    if way == "pinxfer":
        t = pinxfer.empty(nbytes, dtype=torch.uint8)
    elif way == "torch_pinned":
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    else:
        t = torch.empty(nbytes, dtype=torch.uint8)
    t.fill_(1)  # every page present
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-gib", default="1,4")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    baseline_rss = _fork_once()[1]
    for size_gib in [float(s) for s in args.sizes_gib.split(",")]:
        nbytes = int(size_gib * GiB)
        ways = ("pageable", "torch_pinned", "pinxfer") if HAS_CUDA else ("pageable", "pinxfer")
        for way in ways:
            t = _held(way, nbytes)
            times, rss = [], []
            for _ in range(args.rounds):
                seconds, child_rss = _fork_once()
                times.append(seconds * 1e3)
                rss.append(child_rss)
            row = {
                "way": way,
                "size_gib": size_gib,
                "fork_ms_median": statistics.median(times),
                "fork_ms_min": min(times),
                "child_private_mib_median": statistics.median(rss) / 1024,
                "child_private_mib_without_it": baseline_rss / 1024,
                "lock_kind": pinxfer.lock_kind(t) if way == "pinxfer" else None,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            del t
            pinxfer.empty_cache()
            if HAS_CUDA:
                torch._C._host_emptyCache()
    device = torch.cuda.get_device_name(0) if HAS_CUDA else "cpu (pool mlocked)"
    result = {"device": device, "kernel": os.uname().release, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
