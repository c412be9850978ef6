"""Collectives of every communicator against closed-form values, at any world size.

Run: ``mpirun -np N python -m pytest --with-mpi -m mpi tests/comm/test_comm_mpi.py`` (N = 1..4).
Every test does all collective work first and asserts afterwards, so a failure on
one rank cannot leave the others waiting.
"""
import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

from ringnet.comm import (COMMUNICATORS, CpuStream, MpiTransport, RingCommunicator, create,
                          shard_bounds)

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
N, RANK = WORLD.Get_size(), WORLD.Get_rank()
DTYPES = (np.float16, np.float32, np.float64)
LENGTHS = sorted({0, 1, max(N - 1, 0), N + 1, 100003})
TOL = {np.float16: 2e-3, np.float32: 1e-6, np.float64: 1e-12}


@pytest.fixture(scope="module")
def transport():
    t = MpiTransport(WORLD)
    yield t
    t.close()


@pytest.fixture(scope="module")
def comms(transport):
    return {name: create(name, transport=transport) for name in COMMUNICATORS}


def pattern(length, dtype):
    """A position-dependent fill: misplaced chunks change the result."""
    return (np.arange(length) % 7 + 1).astype(dtype)


def closed_form(length, dtype, op, times=1):
    """Sum over ranks of (rank+1)*pattern is N(N+1)/2*pattern; mean is (N+1)/2*pattern."""
    factor = N * (N + 1) / 2 if op == "sum" else (N + 1) / 2
    if op == "sum":
        factor *= N ** (times - 1)  # a second sum multiplies the agreed value by N
    return factor * (np.arange(length) % 7 + 1)


def assert_close(actual, expected, dtype, what):
    np.testing.assert_allclose(actual.astype(np.float64), expected, rtol=TOL[dtype], atol=0,
                               err_msg=f"{what} on rank {RANK} of {N}")


@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("name", list(COMMUNICATORS))
def test_allreduce_twice_matches_closed_form(comms, name, length, dtype, op):
    buf = (RANK + 1) * pattern(length, dtype)
    comms[name].allreduce(buf, op=op)
    first = buf.copy()
    comms[name].allreduce(buf, op=op)  # same buffers again: no stale scratch state
    assert_close(first, closed_form(length, dtype, op), dtype, f"{name} allreduce #1")
    assert_close(buf, closed_form(length, dtype, op, times=2), dtype, f"{name} allreduce #2")


def uneven_bounds(length):
    """Rank 0 gets nothing, the last rank the most: like split-FC's uneven slices."""
    cuts = [0] + [length * (r * r) // (N * N) for r in range(1, N)] + [length]
    return [(cuts[r], cuts[r + 1]) for r in range(N)]


@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("length", LENGTHS)
def test_ring_reduce_scatter_then_allgather(comms, length, explicit):
    ring = comms["ring"]
    bounds = uneven_bounds(length) if explicit else None
    expected_bounds = bounds or shard_bounds(length, N)
    buf = (RANK + 1) * pattern(length, np.float64)
    ring.reduce_scatter(buf, op="sum", bounds=bounds)
    a, b = expected_bounds[RANK]
    shard = buf[a:b].copy()
    # all-gather alone: only this rank's own shard is meaningful before it
    gathered = np.full(length, -1.0)
    for r, (lo, hi) in enumerate(expected_bounds):
        if r == RANK:
            gathered[lo:hi] = 100 * (r + 1) + pattern(length, np.float64)[lo:hi]
    ring.allgather(gathered, bounds=bounds)
    reference = pattern(length, np.float64)
    assert_close(shard, closed_form(length, np.float64, "sum")[a:b], np.float64, "reduce_scatter shard")
    expected = np.concatenate([100 * (r + 1) + reference[lo:hi] for r, (lo, hi) in enumerate(expected_bounds)])
    assert_close(gathered, expected, np.float64, "allgather")


@pytest.mark.parametrize("name", ["tree", "master"])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_reduce_and_bcast_to_last_rank(comms, name, op):
    root = N - 1
    length = 1000 + N
    buf = (RANK + 1) * pattern(length, np.float32)
    sent = buf.copy()
    comms[name].reduce(buf, root=root, op=op)
    reduced = buf.copy()
    data = np.arange(length, dtype=np.float32) if RANK == root else np.zeros(length, np.float32)
    comms[name].bcast(data, root=root)
    if RANK == root:
        assert_close(reduced, closed_form(length, np.float32, op), np.float32, f"{name} reduce")
    else:   # the agreed post-condition: a non-root buffer is left as it was
        np.testing.assert_array_equal(reduced, sent, err_msg=f"{name} reduce changed rank {RANK}'s buffer")
    assert_close(data, np.arange(length), np.float32, f"{name} bcast")


@pytest.mark.parametrize("chunk_bytes,pipeline", [(4096, True), (4096, False), (1 << 20, True)])
def test_ring_chunked_matches_closed_form(transport, chunk_bytes, pipeline):
    ring = RingCommunicator(transport, chunk_bytes=chunk_bytes, pipeline=pipeline)
    buf = (RANK + 1) * pattern(100003, np.float32)
    ring.allreduce(buf, op="mean")
    assert_close(buf, closed_form(100003, np.float32, "mean"), np.float32, f"chunked ring {chunk_bytes}")


@pytest.mark.parametrize("name", list(COMMUNICATORS))
def test_stream_op_runs_beside_the_caller(comms, name):
    """A collective queued on a stream returns at once and runs while the caller works;
    queued operations run in order. The stream's first operation is slowed on purpose."""
    comm = comms[name]
    stream = comm.new_stream()
    gate = threading.Event()
    try:
        buf = (RANK + 1) * pattern(300007, np.float32)
        stream.submit(gate.wait, 60)               # holds the stream until the caller opens it
        handle = comm.allreduce(buf, op="sum", stream=stream)
        queued_behind = not handle.done()          # a submit that ran the op itself is done here
        untouched = np.array_equal(buf, (RANK + 1) * pattern(300007, np.float32))
        gate.set()
        second = comm.allreduce(buf, op="mean", stream=stream)  # queued ops run in order
        second.wait(timeout=120)
        done = handle.done() and second.done()
    finally:
        gate.set()
        stream.close()
    assert queued_behind and untouched, f"{name}: allreduce on a stream ran in the caller's thread"
    assert done
    # sum then mean: N(N+1)/2 * pattern, then unchanged by the mean of equal values
    assert_close(buf, closed_form(300007, np.float32, "sum"), np.float32, f"{name} on stream")


def _sub_communicators():
    """COMM_SELF, a Dup of the world, and a Split into even and odd ranks (sizes differ at odd N)."""
    return {"self": MPI.COMM_SELF, "dup": WORLD.Dup(), "split": WORLD.Split(RANK % 2, RANK)}


@pytest.mark.parametrize("kind", ["self", "dup", "split"])
def test_every_communicator_works_on_a_sub_communicator(kind):
    """``create(..., mpi_comm=sub)`` computes over ``sub``'s ranks only, in ``sub``'s numbering."""
    subs = _sub_communicators()
    sub = subs[kind]
    n, rank = sub.Get_size(), sub.Get_rank()
    length = 1000 + n
    results = {}
    try:
        for name in COMMUNICATORS:
            comm = create(name, transport="mpi", mpi_comm=sub)
            assert (comm.rank, comm.size) == (rank, n)
            buf = (rank + 1) * pattern(length, np.float64)
            comm.allreduce(buf, op="sum")
            results[name] = buf
        ring = create("ring", transport="mpi", mpi_comm=sub)
        shards = (rank + 1) * pattern(length, np.float64)
        ring.reduce_scatter(shards, op="mean")
        ring.allgather(shards)
        results["reduce_scatter+allgather"] = shards
        for name in ("tree", "master"):        # rooted at the sub-communicator's last rank
            comm = create(name, transport="mpi", mpi_comm=sub)
            buf = (rank + 1) * pattern(length, np.float64)
            comm.reduce(buf, root=n - 1, op="mean")
            comm.bcast(buf, root=n - 1)
            results[f"{name} reduce+bcast"] = buf
    finally:
        for other in subs.values():
            if other not in (MPI.COMM_SELF, MPI.COMM_WORLD):
                other.Free()
    expected = n * (n + 1) / 2 * pattern(length, np.float64)
    for name, buf in results.items():
        want = expected if name in COMMUNICATORS else expected / n   # the others take the mean
        np.testing.assert_allclose(buf, want, rtol=1e-12, atol=0,
                                   err_msg=f"{name} on {kind} (rank {rank} of {n})")


def test_two_streams_and_caller_do_not_mix_messages(comms):
    ring = comms["ring"]
    s1, s2 = ring.new_stream(), ring.new_stream()
    try:
        a = (RANK + 1) * pattern(50001, np.float64)
        b = (RANK + 1) * 2 * pattern(50001, np.float64)
        c = (RANK + 1) * 3 * pattern(50001, np.float64)
        ha = ring.allreduce(a, stream=s1)
        hb = ring.allreduce(b, stream=s2)
        ring.allreduce(c)
        ha.wait()
        hb.wait()
    finally:
        s1.close()
        s2.close()
    expected = closed_form(50001, np.float64, "sum")
    for factor, buf in ((1, a), (2, b), (3, c)):
        assert_close(buf, factor * expected, np.float64, f"concurrent all-reduce x{factor}")


def test_ring_of_large_sends_does_not_deadlock(transport):
    # 8 MiB is far above any eager limit: a blocking send-then-receive ring would hang.
    right, left = (RANK + 1) % N, (RANK - 1) % N
    out = np.full(1 << 20, RANK, np.float64)
    got = np.empty_like(out)
    transport.sendrecv(out, right, got, left)
    # every rank starts its send before it receives
    got2 = np.empty_like(out)
    pending = transport.isendrecv(out, right, None, None)
    transport.recv(got2, left)
    pending.wait()
    big = (RANK + 1) * pattern(1 << 21, np.float32)
    RingCommunicator(transport).allreduce(big)
    assert (got == left).all() and (got2 == left).all()
    assert_close(big, closed_form(1 << 21, np.float32, "sum"), np.float32, "8 MiB ring all-reduce")


@pytest.mark.parametrize("length", [N * 1000, 100003])
def test_byte_counters_match_ring_traffic(transport, length):
    ring = RingCommunicator(transport)
    buf = np.ones(length, np.float32)
    sent0, recv0 = transport.bytes_sent, transport.bytes_recv
    ring.reduce_scatter(buf)
    sent, received = transport.bytes_sent - sent0, transport.bytes_recv - recv0
    ring.allgather(buf)
    sent_ag, recv_ag = transport.bytes_sent - sent0 - sent, transport.bytes_recv - recv0 - received
    bounds = shard_bounds(length, N)
    size_of = [(b - a) * 4 for a, b in bounds]
    left = (RANK - 1) % N
    # reduce-scatter: every shard but my own leaves me; every shard but my left's arrives
    assert sent == (sum(size_of) - size_of[RANK] if N > 1 else 0)
    assert received == (sum(size_of) - size_of[left] if N > 1 else 0)
    if length % N == 0:
        assert sent == (N - 1) * length * 4 // N
    # all-gather: I forward every shard but my right neighbour's
    assert sent_ag == (sum(size_of) - size_of[(RANK + 1) % N] if N > 1 else 0)
    assert recv_ag == (sum(size_of) - size_of[RANK] if N > 1 else 0)


def test_stream_error_surfaces_at_wait(comms):
    stream = comms["ring"].new_stream()
    try:
        bad = stream.submit(lambda: 1 // 0)
        after = stream.submit(lambda: RANK + 41)
        with pytest.raises(ZeroDivisionError):
            bad.wait()
        value = after.wait()  # the stream keeps working after a failed op
    finally:
        stream.close()
    assert value == RANK + 41
    assert isinstance(stream, CpuStream)


@pytest.mark.skipif(N < 2, reason="a wait for a peer needs two ranks")
def test_the_wait_account_counts_the_training_thread_s_waits_and_those_that_slept(transport):
    """``wait_account`` (train's ``wait_cpu_s``, ``waits``, ``waits_slept``): rank 0 waits for
    rank 1, which sends 40 ms late; with a spin of 5 ms that wait polls out its spin and
    sleeps, and its CPU is at most what it spun plus its sleeping polls, far below its
    wall time. A wait for a late peer with a spin longer than the delay does not sleep. A
    wait on a stream's thread is not the training thread's and is not counted."""
    late_s, buf = 0.04, np.zeros(256, np.float32)
    spin = transport.spin_s

    def late_send(send):
        time.sleep(late_s)
        send(np.ones(256, np.float32), 0)
    try:
        for spin_s, slept in ((0.005, 1), (5.0, 0)):
            transport.spin_s = spin_s
            WORLD.Barrier()
            before = transport.wait_account.totals()
            if RANK == 1:
                late_send(transport.send)
            elif RANK == 0:
                t0 = time.perf_counter()
                transport.recv(buf, 1)
                wall = time.perf_counter() - t0
            cpu, waits, sleeps = (b - a for a, b in zip(before, transport.wait_account.totals()))
            if RANK == 0:
                assert (waits, sleeps) == (1, slept) and wall >= 0.9 * late_s
                assert 0 < cpu <= wall
                if slept:       # a 5 ms spin, then polls that sleep
                    assert cpu < wall / 2, (cpu, wall)
        # the same on a stream that polls (its own tag, the same on both ranks; a driven
        # stream's waits sleep on its training thread): not counted
        transport.spin_s = 0.005
        tagged = transport.new_stream()
        tagged.close()
        stream = CpuStream(tagged.tag, progress="poll")
        try:
            WORLD.Barrier()
            before = transport.wait_account.totals()
            if RANK == 1:
                stream.submit(late_send, lambda a, p: transport.send(a, p)).wait()
            elif RANK == 0:
                stream.submit(transport.recv, buf, 1).wait()
            assert transport.wait_account.totals() == before
        finally:
            stream.close()
    finally:
        transport.spin_s = spin
        WORLD.Barrier()
