"""The claim/steal/close protocol of to_device's single-block path (csrc/transfer/piece_claims.h),
on the CPU.

A pageable source of 256 KiB - 64 MiB is staged into one pinned block by the caller and the
node's copy workers; the caller steals the pieces of a worker the scheduler has parked, and
returns only once no worker can read the source again (session 32: a parked worker read a
source freed right after to_device returned). That protocol has no CUDA in it, so it runs
here with real copy threads and host copies in place of the DMAs, and under TSan and ASan
by scripts/sanitize.sh: every round frees its source as soon as the caller let it go, so a
late read is a heap-use-after-free there, and a counted failure everywhere. Each round checks
every byte sent (from the block, or from the caller's spare for a stolen piece) and that every
piece ended done or stolen.
"""

from __future__ import annotations

import pytest

import pinxfer


def _self_test(seed, helpers, rounds, stall_us, fail_every=0):
    helper_pieces, stolen, waited_rounds = pinxfer._C._piece_claims_self_test(
        seed, helpers, rounds, stall_us, fail_every
    )
    return helper_pieces, stolen, waited_rounds


@pytest.mark.parametrize("helpers", [1, 3, 8])
def test_parked_helpers_are_stolen_from_and_waited_for(helpers):
    # A helper parks 20 ms after about one claim in four: far longer than the caller's
    # patience (twice its own time a piece, at least 20 us) and its whole share, under TSan
    # too, so the caller steals those pieces and then waits at close for the parked helper
    # that still reads the source. (Parked 300 us, a TSan build's slow copies outlasted the
    # park: the helper was copying, not parked, when its piece was stolen, and no close
    # waited in 40 rounds with one helper.)
    helper_pieces, stolen, waited_rounds = _self_test(7, helpers, 20, 20_000)
    assert helper_pieces > 0, "no helper staged a piece: the protocol ran on the caller alone"
    assert stolen > 0, "no piece was stolen although helpers parked 300 us"
    assert waited_rounds > 0, "close_source never waited for a parked reader"


@pytest.mark.parametrize("seed", range(3))
def test_helpers_running_free_share_the_pieces(seed):
    # No stall: whatever the scheduler does (the self-test raises on a byte sent wrong, a piece
    # left unfinal or a read after close), with steals only where a helper was descheduled.
    _self_test(seed, 4, 60, 0)


def test_caller_alone_stages_every_piece():
    helper_pieces, stolen, waited_rounds = _self_test(11, 0, 20, 0)
    assert (helper_pieces, stolen, waited_rounds) == (0, 0, 0)


@pytest.mark.parametrize("fail_every", [1, 3])
def test_error_after_the_first_piece_closes_the_source(fail_every):
    # A round that fails after the caller's first piece closes the pieces still free and waits
    # for the helpers inside one; its source is freed right after, as the op's caller may.
    _self_test(5, 4, 30, 200, fail_every)


def test_self_test_arguments_are_checked():
    with pytest.raises(ValueError, match=r"0\.\.16 helpers"):
        pinxfer._C._piece_claims_self_test(0, 17, 1, 0)
    with pytest.raises(ValueError, match=r"1\.\.100000 rounds"):
        pinxfer._C._piece_claims_self_test(0, 1, 0, 0)
