"""Waits under a CPU quota (ringnet.comm.mpi_transport.wait_spin_s): where the node's CFS
quota is smaller than its ranks (a container's CPU limit, SLURM's cgroup, ``hpc/cluster.sh
--cpus-per-node``), the training thread's wait for a transfer spins for QUOTA_SPIN_S, not
SPIN_S, and then sleeps: a yielding spin there spends the budget the node's compute needs,
and the kernel holds a rank whose budget is gone until its period ends. The run header says
so. The cluster's figures are in docs/scaling.md ("The model on the cluster")."""
import threading
import time
import types

import pytest
from mpi4py import MPI

from ringnet import comm as ringcomm, placement
from ringnet.comm import _lean
from ringnet.comm._lean import LeanPath
from ringnet.comm.mpi_transport import QUOTA_SPIN_S, SPIN_S, YIELD_ROUNDS, wait_spin_s


@pytest.mark.parametrize("quota, ranks, spin", [
    (None, 1, SPIN_S), (None, 8, SPIN_S),           # no quota: the default spin
    (0.5, 1, QUOTA_SPIN_S), (1.5, 2, QUOTA_SPIN_S),  # fewer cores than ranks
    (1.0, 1, SPIN_S), (4.0, 2, SPIN_S), (2.0, 2, SPIN_S),   # a core or more per rank
])
def test_the_wait_spins_briefly_where_the_quota_is_below_the_node_s_ranks(quota, ranks, spin):
    assert wait_spin_s(quota, ranks) == spin


def test_the_spin_under_a_quota_is_far_below_the_default():
    assert QUOTA_SPIN_S <= SPIN_S / 50


def _made(monkeypatch, quota):
    monkeypatch.setattr(placement, "cpu_quota", lambda: quota)
    return ringcomm.make_transport("mpi", MPI.COMM_SELF, device="cpu")


# One look at the clock, on the waiting thread's own clock (see _first_sleep).
TICK_S = 1e-5


def _first_sleep(monkeypatch, wait):
    """Call ``wait(end)`` with a transfer that completes 150 ms on; return the seconds from
    the call to its first sleep. The waiting thread runs on a clock of its own that moves
    TICK_S at each look (and by what it sleeps), not on the wall: a wall-clock figure
    counts whatever else the machine runs (a yield under load gives the core away for
    milliseconds), while the question here is when the wait's own logic first sleeps.
    Other threads (a watchdog an earlier test left running) keep the real clock."""
    sleeps, real_sleep, real_clock = [], time.sleep, time.perf_counter
    waiter = threading.get_ident()
    now = [0.0]

    def clock():
        if threading.get_ident() != waiter:
            return real_clock()
        now[0] += TICK_S
        return now[0]

    def sleep(seconds):
        if threading.get_ident() != waiter:
            return real_sleep(seconds)
        sleeps.append(now[0])
        now[0] += seconds
    monkeypatch.setattr(time, "perf_counter", clock)
    monkeypatch.setattr(_lean, "_perf_counter", clock)
    monkeypatch.setattr(time, "sleep", sleep)
    try:
        start = clock()
        wait(start + 0.15)
    finally:
        monkeypatch.setattr(time, "sleep", real_sleep)
        monkeypatch.setattr(time, "perf_counter", real_clock)
        monkeypatch.setattr(_lean, "_perf_counter", real_clock)
    assert sleeps, "the wait never slept"
    assert now[0] >= start + 0.15, "the wait returned before its transfer completed"
    return sleeps[0] - start


def _transport_wait(transport, done):
    """The transport's own wait."""
    transport._wait(["a request"], ("recv", None, 0, 4))


def _lean_wait(transport, done):
    """ringnet.comm._lean's wait loop (auto's all-reduce), which hands over to the
    transport's sleeping wait after the transport's spin, not after the module's SPIN_S."""
    lean = types.SimpleNamespace(spins=range(1), transport=transport)
    LeanPath.finish(lean, ["a request"], 0, 0, 4, test=done)


@pytest.mark.parametrize("waits", [_transport_wait, _lean_wait], ids=["transport", "lean"])
@pytest.mark.parametrize("quota", [None, 0.5])
def test_a_wait_under_a_quota_sleeps_where_the_default_spins(monkeypatch, quota, waits):
    # The default wait spins for SPIN_S (50 ms) before its first sleep; the one under a
    # quota spins for QUOTA_SPIN_S (0.5 ms).
    transport = _made(monkeypatch, quota)
    try:
        assert transport.spin_s == (SPIN_S if quota is None else QUOTA_SPIN_S)

        def wait(end):
            done = lambda requests: time.perf_counter() > end     # noqa: E731
            monkeypatch.setattr(transport, "_test", done)
            waits(transport, done)
        first = _first_sleep(monkeypatch, wait)
    finally:
        transport.close()
    # the clock is looked at every YIELD_ROUNDS polls: the first sleep comes within a
    # round of polls (each a look at `done`'s clock) after the spin ran out
    spin = SPIN_S if quota is None else QUOTA_SPIN_S
    assert spin <= first <= spin + 4 * (YIELD_ROUNDS + 4) * TICK_S, first


def test_the_run_header_says_how_waits_spin_under_a_quota(monkeypatch):
    transport = _made(monkeypatch, 0.5)
    try:
        text = transport.placement.describe()
    finally:
        transport.close()
    assert text == ("CPU, transport mpi (device cpu), waits sleep after 0.5 ms "
                    "(CPU quota 0.5 cores for 1 rank on the node)"), text
    transport = _made(monkeypatch, None)
    try:
        assert transport.placement.describe() == "CPU, transport mpi (device cpu)"
    finally:
        transport.close()
