"""The job queue of prefetch's batch sender (csrc/runtime/serial_jobs.h), on the CPU.

The sender's jobs send on a GPU; the queue under them (worker threads taking jobs in order,
wait, settle, close) has no CUDA in it, so its protocol is run here with jobs that copy
random bytes, from several submitting threads at once, and under TSan and ASan by
scripts/sanitize.sh. Each job is checked when it is over: run at most once, a job dropped
(settled before it started, or left at close) never ran, a done job copied every byte, a
failed one failed with its own error; each consumer's jobs start in the order it submitted
them, and no more run at once than there are workers; a submit after close is refused.
"""

from __future__ import annotations

import pytest

import pinxfer


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("consumers", [1, 2, 4])
def test_serial_jobs_every_job_once_whole_or_dropped(consumers, workers):
    ran = sum(pinxfer._C._serial_jobs_self_test(seed, 300, consumers, workers) for seed in range(4))
    # Most jobs run: only settled ones not yet started and the last ones at close are not.
    assert ran > 4 * 300 * consumers // 2, ran


def test_serial_jobs_self_test_arguments_are_checked():
    with pytest.raises(ValueError, match=r"1\.\.16 consumers"):
        pinxfer._C._serial_jobs_self_test(0, 10, 17, 1)
    with pytest.raises(ValueError, match=r"1\.\.8 workers"):
        pinxfer._C._serial_jobs_self_test(0, 10, 1, 0)
