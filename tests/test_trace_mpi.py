"""The trace's clock alignment (ringnet.trace.align_clocks) on the MPI world: each rank's
clock is given a known offset from rank 0's (and a known drift), and the alignment must
give it back within its own error bound; a rank 0 that never answers is a StallError."""
import time

import pytest
from mpi4py import MPI

from ringnet.errors import StallError
from ringnet.trace import ClockSync, align_clocks, on_reference_clock

WORLD = MPI.COMM_WORLD
# Communicators of these tests stay allocated: a freed one's context id is reused by the
# next, which could then receive a stalled test's unanswered ping.
_KEPT = []


def _comm():
    comm = WORLD.Dup()
    _KEPT.append(comm)
    return comm


@pytest.mark.mpi
def test_a_known_offset_is_found_within_the_bound_it_reports():
    comm, rank = _comm(), WORLD.Get_rank()
    skew = 1000.0 * rank - 7.25 * (rank % 2)          # seconds ahead of rank 0's clock

    def clock():
        return time.perf_counter() + skew
    sync = align_clocks(comm, origin=123.5 if rank == 0 else None, clock=clock, timeout=60)
    assert sync.origin == 123.5                          # rank 0's origin reaches every rank
    assert 0 <= sync.error < 0.05
    assert abs(sync.offset - skew) <= sync.error + 1e-6, (sync, skew)
    if rank == 0:
        assert sync.offset == 0.0 and sync.error == 0.0


@pytest.mark.mpi
def test_a_drift_between_two_alignments_is_interpolated():
    comm, rank = _comm(), WORLD.Get_rank()
    rate = 1 + 1e-3 * rank                               # this clock runs fast by 1000 ppm per rank
    base = time.perf_counter()
    WORLD.Barrier()

    def clock():
        return base + (time.perf_counter() - base) * rate + rank
    first = align_clocks(comm, clock=clock, timeout=60)
    time.sleep(0.2)
    last = align_clocks(comm, clock=clock, timeout=60)
    # a moment half-way, read on this clock, placed on rank 0's (the true clock)
    true_mid = base + 0.5 * ((first.at - rank - base) / rate + (last.at - rank - base) / rate)
    local_mid = base + (true_mid - base) * rate + rank
    placed = on_reference_clock(local_mid, first, last)
    assert abs(placed - true_mid) <= first.error + last.error + 1e-6, (placed, true_mid)


def test_one_reading_alone_is_a_constant_offset():
    only = ClockSync(at=5.0, offset=2.0, error=0.0)
    assert on_reference_clock(9.0, only, only) == 7.0
    assert align_clocks(None, origin=3.0).offset == 0.0


@pytest.mark.mpi(min_size=2)
def test_a_rank_0_that_never_answers_is_a_stall_naming_it():
    comm, rank = _comm(), WORLD.Get_rank()
    if rank != 0:
        with pytest.raises(StallError, match=r"rank 0 did not arrive at trace clock alignment"):
            align_clocks(comm, timeout=0.5)
    WORLD.Barrier()
