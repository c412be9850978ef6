"""auto's algorithms and the pipelined rooted communicators against exact references.

Run: ``mpirun -np N python -m pytest --with-mpi -m mpi tests/comm/test_comm_auto_mpi.py`` (N = 1..4).
Integers in float64 make every sum exact, so results are compared with ``==``; random
floats are compared with MPI's own Allreduce within rounding, and across ranks bit for bit.
All collective work comes before the first assertion.
"""
import re

import numpy as np
import pytest
from mpi4py import MPI

from ringnet.comm import AutoCommunicator, CommTimeoutError, MpiTransport, NcclTransport, create
from ringnet.comm.cost import ALGORITHMS, CHOICES, choose, constants, thresholds

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
N, RANK = WORLD.Get_size(), WORLD.Get_rank()
LENGTHS = sorted({0, 1, max(N - 1, 1), N + 1, 7, 1001, 100003, (1 << 20) + 3})
# this rank is in recursive doubling's power-of-two core (the first 2(N - p) ranks fold)
RD_CORE = RANK >= 2 * (N - (1 << (N.bit_length() - 1)))


@pytest.fixture(scope="module")
def transport():
    t = MpiTransport(WORLD)
    yield t
    t.close()


def integers(length, rank, dtype=np.float64):
    """Rank-dependent integers: a shard in the wrong place changes the sum."""
    return ((np.arange(length) * 7 + 3 * rank * rank + 1) % 1013).astype(dtype)


def exact_sum(length, dtype=np.float64):
    return sum(integers(length, r, np.float64) for r in range(N)).astype(dtype)


def randoms(length, rank, dtype=np.float32):
    return np.random.default_rng(1000 + rank).standard_normal(length).astype(dtype)


def same_on_every_rank(buf):
    """True when every rank holds the same bits (rank 0's buffer, broadcast, compared)."""
    reference = buf.copy()
    WORLD.Bcast(reference, root=0)
    return WORLD.allreduce(int(np.array_equal(reference.view(np.uint8), buf.view(np.uint8))),
                           op=MPI.MIN) == 1


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("algorithm", CHOICES + ("auto",))
def test_every_algorithm_gives_the_exact_sum(transport, algorithm, length):
    comm = AutoCommunicator(transport, algorithm=None if algorithm == "auto" else algorithm)
    buf = integers(length, RANK)
    comm.allreduce(buf)
    again = integers(length, RANK, np.float32)
    comm.allreduce(again, op="mean")
    identical = same_on_every_rank(again)
    np.testing.assert_array_equal(buf, exact_sum(length), err_msg=f"{algorithm} rank {RANK}/{N}")
    np.testing.assert_allclose(again, exact_sum(length) / N, rtol=1e-6,
                               err_msg=f"{algorithm} mean rank {RANK}/{N}")
    assert identical, f"{algorithm}: ranks disagree on the mean"


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("algorithm", CHOICES)
def test_random_floats_match_mpi_and_agree_bitwise(transport, algorithm, dtype):
    length = 30011
    comm = AutoCommunicator(transport, algorithm=algorithm)
    buf = randoms(length, RANK, dtype)
    reference = buf.astype(np.float64)
    WORLD.Allreduce(MPI.IN_PLACE, reference)
    comm.allreduce(buf)
    identical = same_on_every_rank(buf)
    tol = {np.float16: 5e-3, np.float32: 1e-5, np.float64: 1e-12}[dtype]
    np.testing.assert_allclose(buf.astype(np.float64), reference, rtol=tol, atol=tol * N)
    assert identical, f"{algorithm} {np.dtype(dtype)}: ranks hold different bits"


def test_auto_uses_the_algorithm_its_model_picks(transport):
    """Across every switch point of the model at this N (and both sides of it)."""
    comm = create("auto", transport=transport)
    sizes = {8, 8 << 20}
    assert comm.native_ok
    assert comm.thresholds(64 << 20) == thresholds(N, 64 << 20, CHOICES, **comm.constants)
    for start, _ in comm.thresholds(64 << 20):
        sizes |= {max(8, start - 8), start + 8}
    used, results = {}, {}
    for nbytes in sorted(sizes):
        length = nbytes // 8
        buf = integers(length, RANK)
        comm.allreduce(buf)
        used[nbytes] = comm.last_algorithm
        results[nbytes] = np.array_equal(buf, exact_sum(length))
    expected = {nbytes: choose(nbytes // 8 * 8, N, **comm.constants) for nbytes in used}
    assert used == expected
    assert all(results.values()), results
    if N > 1:   # small messages go by the fewest messages (or MPI's), large ones by the fewest bytes
        assert used[8] in ("direct", "rd", "native") and used[8 << 20] in ("ring", "rhd"), used


@pytest.mark.skipif(N < 2, reason="one rank chooses nothing")
@pytest.mark.parametrize("crowded", [(), (0,), tuple(range(N))])
def test_ranks_agree_on_a_crowded_node_and_so_on_the_algorithm(monkeypatch, crowded):
    """Ranks in ``crowded`` see more ranks than cores on their node: if any does, every
    rank chooses with the crowded node's constants (a rank choosing alone would run another
    algorithm than its peers), and 400 KB then goes to MPI's own all-reduce on every rank
    (without a crowded rank too, but for the ring at N = 3)."""
    from ringnet import placement
    from ringnet.comm import cost
    monkeypatch.setattr(placement, "local_ranks_on_node", lambda: 4)
    monkeypatch.setattr(placement, "node_cores", lambda: 2 if RANK in crowded else 64)
    comm = AutoCommunicator(transport := MpiTransport(WORLD))
    agreed = WORLD.allgather((comm.oversubscribed, tuple(sorted(comm.constants.items()))))
    nbytes, ok = 400_000, None      # N = 2, 3, 4: above ALPHA's switch, below the other's
    if len(set(agreed)) == 1:
        buf = integers(nbytes // 8, RANK)
        comm.allreduce(buf)
        ok = np.array_equal(buf, exact_sum(nbytes // 8))
    picked = WORLD.allgather(comm.last_algorithm)
    transport.close()
    expected = (bool(crowded), tuple(sorted(constants(bool(crowded)).items())))
    assert agreed == [expected] * N
    assert dict(expected[1])["alpha"] == (cost.ALPHA_OVERSUBSCRIBED if crowded else cost.ALPHA)
    assert ok and picked == [choose(nbytes, N, **dict(expected[1]))] * N
    assert picked[0] == ("ring" if N == 3 and not crowded else "native"), picked


@pytest.mark.parametrize("chunk_bytes", [None, 4000, 8])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_lean_path_sums_as_the_transport_path(transport, algorithm, chunk_bytes):
    """Off a stream auto calls MPI directly; on a stream it goes through the transport's
    transfers. Both must give the same bits (same order of additions) and count the same
    bytes, in pieces too (``chunk_bytes``; 8 bytes: one float64 per piece)."""
    length = 30011 if chunk_bytes != 8 else 3 * N + 2
    comm = AutoCommunicator(transport, algorithm=algorithm, chunk_bytes=chunk_bytes)
    lean = randoms(length, RANK, np.float64)
    generic = lean.copy()
    exact = integers(length, RANK)
    before = transport.bytes_sent, transport.bytes_recv
    comm.allreduce(lean)
    lean_bytes = transport.bytes_sent - before[0], transport.bytes_recv - before[1]
    comm.allreduce(exact)
    stream = comm.new_stream()
    before = transport.bytes_sent, transport.bytes_recv
    comm.allreduce(generic, stream=stream).wait(timeout=120)
    generic_bytes = transport.bytes_sent - before[0], transport.bytes_recv - before[1]
    stream.close()
    identical = same_on_every_rank(lean)
    np.testing.assert_array_equal(exact, exact_sum(length), err_msg=f"{algorithm} {chunk_bytes}")
    np.testing.assert_array_equal(lean, generic, err_msg=f"{algorithm} {chunk_bytes} rank {RANK}")
    assert lean_bytes == generic_bytes
    assert identical


# 8 B to 240 KB in float64: one element, odd counts, the band where auto cuts a message in
# two around MPI's eager limit (1001 and 1500 elements: 8008 and 12000 B), its edges.
SHORT_LENGTHS = [1, 3, N + 1, 991, 992, 1001, 1500, 2047, 2048, 30011]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("algorithm", ["rd", "direct", "native", None])
def test_the_short_path_sums_as_the_transport_path(transport, algorithm, dtype):
    """auto's short path (a plan per size, looked up before anything else) against the
    stream's generic path: same bits, same byte counts, exact integer sums, a plan used
    wherever it applies (direct and native everywhere, rd on the ranks of its power-of-two
    core); native's generic path is the transport's MPI_Allreduce."""
    comm = AutoCommunicator(transport, algorithm=algorithm)
    results = []
    for length in SHORT_LENGTHS:
        first, second = randoms(length, RANK, dtype), randoms(length, RANK + 7, dtype)
        generic = [first.copy(), second.copy()]
        exact = integers(length, RANK, dtype)
        before = transport.bytes_sent, transport.bytes_recv
        comm.allreduce(first)          # builds the plan
        comm.allreduce(second)         # runs it from the front lookup
        short_bytes = transport.bytes_sent - before[0], transport.bytes_recv - before[1]
        planned = (first.nbytes in comm._lean.plans) if comm._lean is not None else None
        comm.allreduce(exact)
        used = comm.last_algorithm
        # the same algorithm through the transport: on a stream (native: off one, its
        # generic path being MPI's call itself)
        forced = comm if algorithm else AutoCommunicator(transport, algorithm=used)
        stream = forced.new_stream() if used != "native" else None
        before = transport.bytes_sent, transport.bytes_recv
        for buf in generic:
            if stream is None:
                transport.allreduce_native(buf)
            else:
                forced.allreduce(buf, stream=stream).wait(timeout=120)
        generic_bytes = transport.bytes_sent - before[0], transport.bytes_recv - before[1]
        if stream is not None:
            stream.close()
        results.append((length, used, planned, first, second, generic, exact,
                        short_bytes, generic_bytes, same_on_every_rank(second)))
    for length, used, planned, first, second, generic, exact, short, slow, same in results:
        where = f"{algorithm} {np.dtype(dtype)} length {length} rank {RANK}/{N}"
        np.testing.assert_array_equal(exact, exact_sum(length, dtype), err_msg=where)
        np.testing.assert_array_equal(first, generic[0], err_msg=where)
        np.testing.assert_array_equal(second, generic[1], err_msg=where)
        assert short == slow, where
        assert same, where
        if N > 1:
            assert planned == (used in ("direct", "native") or (used == "rd" and RD_CORE)), \
                (where, used)


# After a call rank 0 made alone its peers still hold that call's messages, unreceived.
# Freed, the communicator's context may go to one made later (MPICH reuses them), which
# would receive those messages as its own: such transports stay allocated instead.
_KEPT = []


def _keep_allocated(transport):
    _KEPT.append(transport)


def _timeout_message(comm, length):
    """All-reduce ``length`` ones with ``comm`` (its peers absent): the CommTimeoutError's text, or None."""
    try:
        comm.allreduce(np.ones(length, np.float32))
    except CommTimeoutError as caught:
        return str(caught)
    return None


def _assert_deadline_message(error, algorithm):
    assert error is not None, f"{algorithm}: no CommTimeoutError"
    assert re.fullmatch(r"all-reduce (to|from) rank \d.* of [1-9]\d* bytes did not complete "
                        r"within 0.5 s", error), error


@pytest.mark.skipif(N < 2, reason="needs a peer that does not answer")
@pytest.mark.parametrize("length", [1, 2500])
def test_the_short_path_keeps_the_transfer_deadline(length):
    """A planned size (first call on every rank), then rank 0 alone: CommTimeoutError.
    The calls every rank makes run under the default deadline (a loaded machine may
    deschedule a rank for longer than the short one); only the lone call has 0.5 s.
    The short path's own algorithm is forced (where auto would delegate to MPI's
    all-reduce the deadline ends the job: tests/comm/test_comm.py)."""
    transport = MpiTransport(WORLD)
    error, comm = None, AutoCommunicator(transport, algorithm="direct" if N & (N - 1) else "rd")
    try:
        comm.allreduce(np.ones(length, np.float32))
        planned = comm._lean.plans.get(4 * length) is not None
        WORLD.Barrier()
        if RANK == 0:
            transport.timeout_s = 0.5
            error = _timeout_message(comm, length)
        WORLD.Barrier()
    finally:
        _keep_allocated(transport)
    if RANK == 0:
        assert planned or comm.last_algorithm not in ("rd", "direct")
        _assert_deadline_message(error, comm.last_algorithm)


@pytest.mark.parametrize("length", [1, N + 1, 1001, 1500, 30011])
def test_bench_floor_row_sums_exactly(length):
    """bench comm's floor row (bare mpi4py, persistent requests per buffer): exact sums,
    same bits on every rank, a new array summed as itself."""
    from ringnet.bench.comm import Floor
    floor = Floor(WORLD)
    buf = integers(length, RANK)
    floor.allreduce(buf)
    again = randoms(length, RANK)
    floor.allreduce(again)
    identical = same_on_every_rank(again)
    # its requests were made for `again`: started again on new contents, then on `buf`
    again[...] = integers(length, RANK + 1)
    floor.allreduce(again)
    buf[...] = integers(length, RANK + 2)
    floor.allreduce(buf)
    floor.close()
    np.testing.assert_array_equal(again, sum(integers(length, r + 1) for r in range(N)))
    np.testing.assert_array_equal(buf, sum(integers(length, r + 2) for r in range(N)))
    assert identical


@pytest.mark.skipif(N < 2, reason="needs a peer that does not answer")
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_lean_path_keeps_the_transfer_deadline(algorithm):
    """Rank 0 all-reduces alone: it must raise CommTimeoutError after ~timeout_s, not hang."""
    transport = MpiTransport(WORLD, timeout_s=0.5)
    error = None
    try:
        if RANK == 0:
            error = _timeout_message(AutoCommunicator(transport, algorithm=algorithm), 1000)
        WORLD.Barrier()
    finally:
        _keep_allocated(transport)
    if RANK == 0:
        _assert_deadline_message(error, algorithm)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_auto_on_a_stream_and_a_sub_communicator(algorithm):
    sub = WORLD.Split(RANK % 2, RANK)
    try:
        n, rank = sub.Get_size(), sub.Get_rank()
        comm = create("auto", transport="mpi", mpi_comm=sub, device="cpu", algorithm=algorithm)
        stream = comm.new_stream()
        buf = integers(5003, rank)
        handle = comm.allreduce(buf, stream=stream)
        handle.wait(timeout=120)
        stream.close()
        comm.transport.close()
    finally:
        sub.Free()
    expected = sum(integers(5003, r) for r in range(n))
    np.testing.assert_array_equal(buf, expected)


@pytest.mark.parametrize("length", [0, 1, N + 1, 10007])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_through_the_nccl_standin(algorithm, length):
    transport = NcclTransport(WORLD, timeout_s=30, nccl="standin")
    try:
        comm = create("auto", transport=transport, algorithm=algorithm)
        buf = integers(length, RANK)
        comm.allreduce(buf)
        stream = comm.new_stream()
        on_stream = integers(length, RANK, np.float32)
        comm.allreduce(on_stream, op="mean", stream=stream).wait(timeout=120)
        stream.close()
    finally:
        transport.close()
    np.testing.assert_array_equal(buf, exact_sum(length))
    np.testing.assert_allclose(on_stream, exact_sum(length) / N, rtol=1e-6)


# -- tree and master: receives all posted, pieces pipelined, the same float sum -------------
def heap_sum(parts, v=0):
    """The tree's order: node v's partial is its own + first child's + second child's."""
    total = parts[v].copy()
    for child in (2 * v + 1, 2 * v + 2):
        if child < len(parts):
            total += heap_sum(parts, child)
    return total


def rank_order_sum(parts, root):
    """The master's order: root's own, then the workers root+1, root+2, ... (mod N)."""
    total = parts[root].copy()
    for i in range(1, len(parts)):
        total += parts[(root + i) % len(parts)]
    return total


@pytest.mark.parametrize("chunk_bytes", [None, 4096, 100000])
@pytest.mark.parametrize("name", ["tree", "master"])
def test_rooted_reduce_sums_in_its_fixed_order(transport, name, chunk_bytes):
    """Bit for bit the same float32 sum as the structure's own order, however pieces arrive."""
    root = N - 1
    length = 300007
    comm = create(name, transport=transport, chunk_bytes=chunk_bytes)
    buf = randoms(length, RANK)
    sent = buf.copy()
    comm.reduce(buf, root=root)
    reduced = buf.copy()
    comm.bcast(buf, root=root)
    everywhere = buf.copy()
    parts = [randoms(length, r) for r in range(N)]
    if name == "tree":       # heap positions count from the root
        expected = heap_sum([parts[(v + root) % N] for v in range(N)])
    else:
        expected = rank_order_sum(parts, root)
    if RANK == root:
        np.testing.assert_array_equal(reduced, expected, err_msg=f"{name} {chunk_bytes}")
    else:
        np.testing.assert_array_equal(reduced, sent, err_msg=f"{name} changed rank {RANK}'s buffer")
    np.testing.assert_array_equal(everywhere, expected, err_msg=f"{name} bcast {chunk_bytes}")


@pytest.mark.parametrize("length", [0, 1, N + 1, 1031])
@pytest.mark.parametrize("name", ["tree", "master"])
def test_rooted_pieces_of_one_element(transport, name, length):
    """Pieces down to one element (more pieces than elements per rank)."""
    comm = create(name, transport=transport, chunk_bytes=8)
    buf = integers(length, RANK)
    comm.allreduce(buf)
    np.testing.assert_array_equal(buf, exact_sum(length))


@pytest.mark.skipif(N < 2, reason="one rank all-reduces without messages (no short path)")
@pytest.mark.parametrize("algorithm", ["rd", "direct"])
def test_a_planned_size_keeps_its_plan_when_the_short_path_is_passed_by(algorithm):
    """op "mean" takes the checked path to a size that has a plan: the plan is reused (its
    scratch is not made again) and the mean is exact."""
    transport = MpiTransport(WORLD)
    try:
        comm = AutoCommunicator(transport, algorithm=algorithm)
        buf = np.full(6, float(RANK), np.float32)
        comm.allreduce(buf, op="mean")
        first = comm._lean.plans.get(buf.nbytes)
        buf = np.full(6, float(RANK), np.float32)
        comm.allreduce(buf, op="mean")
        again = comm._lean.plans.get(buf.nbytes)
    finally:
        transport.close()
    np.testing.assert_array_equal(buf, np.float32(sum(range(N)) / N))
    assert first is again


@pytest.mark.skipif(N < 2, reason="one rank all-reduces without messages (no short path)")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("algorithm", ["rd", "direct", None])
def test_persistent_requests_follow_the_buffer_they_were_bound_to(algorithm, dtype):
    """The short path binds persistent requests to an array used twice in a row: later calls
    with it start them, a call with another array (same size) must sum that array, not
    the bound one, and the bound one must still sum its new contents. Exact integer sums
    and the same byte counts as the plain path, at every size of the eager-limit band."""
    transport = MpiTransport(WORLD)
    results = []
    try:
        comm = AutoCommunicator(transport, algorithm=algorithm)
        for length in SHORT_LENGTHS:
            a, b = np.empty(length, dtype), np.empty(length, dtype)
            got, bound, counts = [], [], []
            for k, buf in enumerate([a, a, a, b, a, b, b, a]):
                buf[...] = integers(length, RANK + k, dtype)
                before = transport.bytes_sent
                comm.allreduce(buf)
                counts.append(transport.bytes_sent - before)
                got.append(buf.copy())
                plan = comm._lean.plans.get(buf.nbytes)
                bound.append(None if plan is None else plan[5].buf is buf)
            results.append((length, comm.last_algorithm, got, bound, counts))
    finally:
        transport.close()
    for length, used, got, bound, counts in results:
        where = f"{algorithm} {np.dtype(dtype)} length {length} rank {RANK}/{N}"
        for k, value in enumerate(got):
            expected = sum(integers(length, r + k, np.float64) for r in range(N)).astype(dtype)
            np.testing.assert_array_equal(value, expected, err_msg=f"{where} call {k}")
        assert len(set(counts)) == 1, (where, counts)
        if used == "direct" or (used == "rd" and RD_CORE):
            # bound from the second call with a; b binds on its second call in a row
            assert bound == [False, True, True, False, True, False, True, False], (where, bound)


@pytest.mark.skipif(N < 2, reason="needs a peer that does not answer")
@pytest.mark.parametrize("algorithm", ["rd", "direct"])
def test_bound_requests_keep_the_transfer_deadline_and_unbind(algorithm):
    """A buffer bound on every rank, then rank 0 alone: CommTimeoutError, and the plan no
    longer holds the requests whose transfer never ended."""
    transport = MpiTransport(WORLD)     # the lone call's 0.5 s deadline is set before it
    error, comm = None, AutoCommunicator(transport, algorithm=algorithm)
    buf = np.ones(5, np.float32)
    try:
        comm.allreduce(buf)
        comm.allreduce(buf)
        plan = comm._lean.plans.get(buf.nbytes)
        was_bound = plan is not None and plan[5].buf is buf
        WORLD.Barrier()
        if RANK == 0:
            transport.timeout_s = 0.5
            try:
                comm.allreduce(buf)
            except CommTimeoutError as caught:
                error = str(caught)
        WORLD.Barrier()
    finally:
        _keep_allocated(transport)
    if algorithm == "direct" or RD_CORE:
        assert was_bound
    if RANK == 0:
        _assert_deadline_message(error, algorithm)
        if algorithm == "direct" or RD_CORE:
            assert plan[5].buf is None and plan[5].requests is None


@pytest.mark.skipif(N < 2, reason="one rank all-reduces without messages (no short path)")
def test_persistent_requests_are_freed_before_mpi_finalizes_and_bind_again():
    """The exit hook frees every bound request; the plan binds again on later calls."""
    from ringnet.comm import _lean
    transport = MpiTransport(WORLD)
    try:
        comm = AutoCommunicator(transport, algorithm="direct")
        buf = np.ones(3, np.float64)
        comm.allreduce(buf)
        comm.allreduce(buf)
        state = comm._lean.plans[buf.nbytes][5]
        bound = state.buf is buf
        _lean.free_persistent()
        freed = state.buf is None and state.requests is None
        buf[...] = RANK
        comm.allreduce(buf)
        comm.allreduce(buf)
        again = state.buf is buf
    finally:
        transport.close()
    assert bound and freed and again
    np.testing.assert_array_equal(buf, 2 * N * sum(range(N)) / 2)


def test_bench_comm_checks_every_row_after_its_timed_calls_too():
    """bench comm's ok flag covers the calls after the first: a row whose first call is
    right and later ones wrong (as a stale bound request would be) is reported not ok."""
    from ringnet.bench.comm import Floor, _run_size
    transport = MpiTransport(WORLD)
    auto, floor = AutoCommunicator(transport), Floor(WORLD)

    class RightOnce:
        calls = 0

        def allreduce(self, buf):
            auto.allreduce(buf)
            self.calls += 1
            if self.calls > 1:
                buf += 1
    comms = {"auto": auto, "floor": floor, "stale": RightOnce()}
    try:
        results = _run_size(comms, transport, ["native", "auto", "floor", "stale"], np,
                            np.dtype(np.float32), 3, 2, 1)
    finally:
        floor.close()
        transport.close()
    assert {algo: ok for algo, (_, ok, *_) in results.items()} == \
        {"native": True, "auto": True, "floor": True, "stale": False}


# -- native: MPI's own all-reduce where the model prices it lower -------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_native_gives_the_other_algorithms_sums_and_numpys(transport, dtype):
    """Forced native against every algorithm of ours and a NumPy sum: exact integers equal
    everywhere, random floats within rounding of the float64 sum and of each algorithm,
    bit-identical on every rank; the same bits again for the same inputs (a fixed order)."""
    lengths = [1, N + 1, 1001, 30011, (1 << 18) + 3]
    native = AutoCommunicator(transport, algorithm="native")
    ours = {a: AutoCommunicator(transport, algorithm=a) for a in ALGORITHMS}
    results = []
    for length in lengths:
        exact = integers(length, RANK, dtype)
        native.allreduce(exact)
        floats, again = randoms(length, RANK, dtype), randoms(length, RANK, dtype)
        native.allreduce(floats)
        native.allreduce(again)
        others = {}
        for name, comm in ours.items():
            others[name] = randoms(length, RANK, dtype)
            comm.allreduce(others[name])
        results.append((length, exact, floats, again, others, same_on_every_rank(floats),
                        native.last_algorithm))
    reference = {length: sum(randoms(length, r, np.float64) for r in range(N)) for length in lengths}
    tol = {np.float32: 1e-5, np.float64: 1e-12}[dtype]
    for length, exact, floats, again, others, identical, used in results:
        where = f"{np.dtype(dtype)} length {length} rank {RANK}/{N}"
        assert used == "native", where
        np.testing.assert_array_equal(exact, exact_sum(length, dtype), err_msg=where)
        np.testing.assert_allclose(floats, reference[length], rtol=tol, atol=tol * N, err_msg=where)
        np.testing.assert_array_equal(floats.view(np.uint8), again.view(np.uint8), err_msg=where)
        for name, other in others.items():
            np.testing.assert_allclose(floats, other, rtol=tol, atol=tol * N, err_msg=f"{name} {where}")
        assert identical, where


@pytest.mark.skipif(N < 2, reason="one rank chooses nothing")
def test_native_runs_where_the_model_picks_it_and_never_on_a_stream(transport):
    """Off a stream auto runs (and names) native where the model prices it lowest, its own
    algorithm elsewhere; on a stream it chooses among its own only, and a forced native
    is refused there before anything is sent. Mean over native divides the sum."""
    comm = create("auto", transport=transport)
    sizes = [8, 1 << 10, 16 << 10, 64 << 10, 512 << 10, 1 << 20, 4 << 20, 16 << 20]
    off, on, sums = {}, {}, {}
    stream = comm.new_stream()
    for nbytes in sizes:
        buf = integers(nbytes // 8, RANK)
        comm.allreduce(buf, op="mean")
        off[nbytes] = comm.last_algorithm
        sums[nbytes] = np.array_equal(buf, exact_sum(nbytes // 8) / N)
        queued = integers(nbytes // 8, RANK)
        comm.allreduce(queued, stream=stream).wait(timeout=120)
        on[nbytes] = comm.last_algorithm
        sums[nbytes] &= np.array_equal(queued, exact_sum(nbytes // 8))
    forced = AutoCommunicator(transport, algorithm="native")
    with pytest.raises(ValueError, match="off a stream"):
        forced.allreduce(np.ones(4), stream=stream)
    stream.close()
    assert off == {b: choose(b, N, CHOICES, **comm.constants) for b in sizes}
    assert on == {b: choose(b, N, ALGORITHMS, **comm.constants) for b in sizes}
    assert "native" in off.values() and "native" not in on.values(), (off, on)
    assert all(sums.values()), sums


@pytest.mark.skipif(N < 2, reason="one rank all-reduces without messages (no short path)")
def test_native_has_a_plan_and_counts_no_bytes_of_its_own(transport):
    """A size auto delegates gets a short-path plan (looked up first, as rd's and direct's);
    MPI's own traffic is not in the transport's byte counters; the sums stay exact on the
    planned calls, through the checked path (op mean) too."""
    comm = AutoCommunicator(transport, algorithm="native")
    length = 777
    before = transport.bytes_sent, transport.bytes_recv
    got = []
    for k in range(3):
        buf = integers(length, RANK + k)
        comm.allreduce(buf)
        got.append(buf)
    mean = integers(length, RANK)
    comm.allreduce(mean, op="mean")
    moved = transport.bytes_sent - before[0], transport.bytes_recv - before[1]
    plan = comm._lean.plans.get(8 * length)
    assert plan is not None and plan[1] == "native"
    assert moved == (0, 0)
    for k, buf in enumerate(got):
        np.testing.assert_array_equal(buf, sum(integers(length, r + k) for r in range(N)))
    np.testing.assert_array_equal(mean, exact_sum(length) / N)


@pytest.mark.skipif(N < 2, reason="one rank all-reduces without messages (no short path)")
def test_the_array_native_ran_on_last_goes_straight_to_mpi_off_streams_only(transport):
    """The array native ran on last is summed by MPI_Allreduce straight away, exactly, on
    every later call with new contents; op mean and another array of that size take the
    checked path (the mean divides; the other array is looked for first from then on). On
    a stream's thread (a function queued on it calling ``allreduce``) that same array is
    summed by auto's own algorithm, and a forced native is refused there."""
    comm = create("auto", transport=transport)
    nbytes = next(b for b in (64 << 10, 8 << 10, 256 << 10) if comm.choose(b) == "native")
    length = nbytes // 8
    buf = integers(length, RANK)
    comm.allreduce(buf)
    found = [comm._native_buf is buf]
    got = []
    for k in (1, 2):
        buf[...] = integers(length, RANK + k)
        comm.allreduce(buf)
        got.append((k, buf.copy(), comm.last_algorithm))
    buf[...] = integers(length, RANK)
    comm.allreduce(buf, op="mean")
    mean = buf.copy()
    other = integers(length, RANK + 3)
    comm.allreduce(other)
    found.append(comm._native_buf is other)
    forced = AutoCommunicator(transport, algorithm="native")
    mine = integers(5, RANK)
    forced.allreduce(mine)
    found.append(forced._native_buf is mine)
    with comm.new_stream() as stream:
        other[...] = integers(length, RANK + 4)
        stream.submit(comm.allreduce, other).wait(timeout=120)
        on_stream = comm.last_algorithm
        refused = stream.submit(forced.allreduce, mine)
        with pytest.raises(ValueError, match="off a stream"):
            refused.wait(timeout=120)
    assert found == [True, True, True]
    for k, total, used in got:
        assert used == "native"
        np.testing.assert_array_equal(total, sum(integers(length, r + k) for r in range(N)))
    np.testing.assert_array_equal(mean, exact_sum(length) / N)
    assert on_stream == comm.choose(nbytes, on_stream=True) != "native"
    np.testing.assert_array_equal(other, sum(integers(length, r + 4) for r in range(N)))
