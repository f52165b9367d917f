"""Randomized multi-threaded stress of pinxfer; every byte of every result is checked.

For each mode (``plain``: pinxfer as a library; ``install``: after ``pinxfer.install()``,
with ``uninstall()`` at the end) ``--threads`` Python threads (>= 3), each with its own CUDA
stream current and a side stream, draw a random mix of operations (ops/, weights in
ops.OPS):

* transfers (ops/transfers.py): ``to_device`` of one tensor (pageable, pool-pinned or
  torch-pinned; contiguous, shaped, 0-d, empty, offset, transposed, stepped, expanded or
  permuted views; sizes log-uniform from 1 B to 64 MiB, mostly small, a fraction of 1-16 MiB
  and 16-64 MiB, and the staging boundaries; 9 dtypes; sometimes small ``chunk_bytes`` and
  ``non_blocking=False``), of nested batches, and ``to_host(...).wait()``;
* prefetch (ops/prefetch.py) over lists of batches, left early, closed, deleted, collected;
* pinning (ops/pinning.py): ``pin_memory`` of tensors and batches, ``pin_``/``unpin_`` of
  user memory, installed also ``Tensor.pin_memory()``;
* the allocator (ops/allocator.py): pool blocks kept alive across other operations, pinned
  tensors freed while a copy still reads or writes them, installed also torch's pinned
  paths (``torch.empty(pin_memory=True)``, ``.item()``, ``copy_(non_blocking=True)`` then
  ``del``), and the cache's maintenance calls;
* graphs (ops/graphs.py): CUDA graph capture and replay of pinned copies.

Without a GPU the operations that need one are not drawn (the report lists them under
``skipped_ops``); the pool, pin_memory, pin_, prefetch (pinning in its thread) and the
threads still run, with every byte checked on the host.

How values are checked: sources.py (expected values from a random buffer per thread),
checker.py (raw bytes compared on the device, summaries fetched in groups). Counts per mode
and per operation (calls, transfers, bytes moved and checked, bad bytes, errors, contract
violations) are in the JSON report (report.py); a mode passes with no bad byte, no error, no
contract violation (contract.py) and at least ``--min-transfers`` transfers.

Run it:
    python3 -X faulthandler -m tests.stress --mode both --seconds 90 --json stress.json
    python3 -m tests.stress --cpu --seconds 10          # without a GPU
    python3 -m tests.stress --seconds 20 --inject-faults 0.01   # the checker must count them
    PINXFER_STRESS_SECONDS=20 python3 -m pytest -q -m stress tests   # each mode in a child
"""
