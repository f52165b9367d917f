"""Why small calls are bimodal between processes: for one build, the raw op, the
Python wrapper and a torch-only baseline in the same process, with the CPU the main
thread ran on and the process's thread count (a slow process that is slow at torch's
own calls too is placement noise, not pinxfer).

    python scripts/small_call_probe.py ROOT    # prints one JSON line
"""

import json
import os
import statistics
import sys
import time

sys.path.insert(0, sys.argv[1])
import torch

import pinxfer


def us(fn, calls=5000, reps=5):
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    return round(statistics.median(out), 2)


def cpu_now():
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


ops = torch.ops.pinxfer
x64 = torch.randn(16384)
torch.cuda.init()
r = {"root": sys.argv[1], "cpu_start": cpu_now()}
r["torch_empty_cpu"] = us(lambda: torch.empty(16384))
r["torch_clone_64k"] = us(lambda: x64.clone())
r["fast_empty"] = us(lambda: pinxfer._ops.fast.empty_if_eager((16384,), torch.float32, None))
r["op_empty"] = us(lambda: ops.empty([16384], torch.float32, None))
r["py_empty"] = us(lambda: pinxfer.empty(16384))
r["py_pin_memory_64k"] = us(lambda: pinxfer.pin_memory(x64))
r["torch_empty_pinned"] = us(lambda: torch.empty(16384, pin_memory=True))
r["threads"] = len(os.listdir("/proc/self/task"))
r["cpu_end"] = cpu_now()
print(json.dumps(r), flush=True)
