"""control.agree on the MPI world: every rank's value in rank order; with ``root``, a
gather (only the root gets the list). Reference: the values each rank is known to send."""
import pytest
from mpi4py import MPI

from ringnet.control import agree


@pytest.mark.mpi
def test_exchange_returns_every_value_in_rank_order_and_gathers_to_a_root():
    comm = MPI.COMM_WORLD.Dup()
    try:
        rank, size = comm.Get_rank(), comm.Get_size()
        value = {"rank": rank, "payload": list(range(rank * 1000))}    # sizes differ by rank
        expected = [{"rank": r, "payload": list(range(r * 1000))} for r in range(size)]
        assert agree(comm, value, phase="test", timeout=120) == expected
        for root in range(size):
            got = agree(comm, value, phase=f"gather to {root}", timeout=120, root=root)
            assert got == (expected if rank == root else None), (root, rank)
        assert agree(comm, rank, phase="after", timeout=120) == list(range(size))
    finally:
        comm.Free()
