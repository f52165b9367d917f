"""What cudaEventQuery answers for an event from earlier use whose latest record was taken by
a capture (issue 23's free/capture race, session 48: what a freed block waited for before
record_use_event asked the stream again after the record). pinxfer's events come from a free
list, so the event has a completed record from before. On an H100 (torch 2.11) the query
after the capture raised cudaErrorInvalidValue
(results/h100/logs/captured_event_query_2026-12-06_s48.txt).

    python benchmarks/diag_captured_event.py
"""

import torch

side = torch.cuda.Stream()
dev = torch.zeros(1 << 20, device="cuda")
e = torch.cuda.Event()
e.record(side)  # an earlier use: created and recorded outside any capture
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.stream(side):
    torch.cuda._sleep(4_000_000_000)  # ~2 s of work queued on `side` before the capture
    g.capture_begin(capture_error_mode="relaxed")  # (torch.cuda.graph would synchronize first)
    dev.add_(1)
    e.record(side)  # the free's record, taken by the capture
    g.capture_end()
print("side busy (work queued before the capture):", not side.query())
print("query of the event after the capture:", e.query())
torch.cuda.synchronize()
print("after synchronize:", e.query())
