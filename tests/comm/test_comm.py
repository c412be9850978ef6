"""Single-process checks of ringnet.comm: argument errors, shards, timeout, streams, bench parsing."""
import numpy as np
import pytest
from mpi4py import MPI

from ringnet.bench.comm import bus_bandwidth, parse_sizes
from ringnet.comm import (CommTimeoutError, CpuStream, MpiTransport, RingCommunicator, create,
                          make_transport, shard_bounds)
from ringnet.errors import UsageError


@pytest.fixture
def transport():
    t = MpiTransport(MPI.COMM_SELF, timeout_s=0.3)
    yield t
    t.close()


def test_unknown_names_raise_value_error(transport):
    with pytest.raises(ValueError, match="bogus"):
        create("bogus", transport=transport)
    with pytest.raises(ValueError, match="bogus"):
        make_transport("bogus", mpi_comm=MPI.COMM_SELF)


def test_a_communicator_takes_a_transport_not_its_name():
    """Transports are made by name in the factory only (create, make_transport)."""
    with pytest.raises(TypeError, match="make_transport"):
        RingCommunicator("mpi")


@pytest.mark.parametrize("length,size", [(0, 3), (2, 4), (10, 4), (100003, 3), (7, 1)])
def test_shard_bounds_contiguous_and_balanced(length, size):
    bounds = shard_bounds(length, size)
    lengths = [b - a for a, b in bounds]
    assert bounds[0][0] == 0 and bounds[-1][1] == length
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(size - 1))
    # closed form: the first length % size shards hold one element more
    assert lengths == [length // size + (1 if r < length % size else 0) for r in range(size)]


def test_bad_buffers_and_arguments_are_refused(transport):
    ring = create("ring", transport=transport)
    tree = create("tree", transport=transport)
    with pytest.raises(ValueError, match="flat"):
        ring.allreduce(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="flat"):
        ring.allreduce(np.zeros(10, np.float32)[::2])
    with pytest.raises(ValueError, match="op"):
        ring.allreduce(np.zeros(3, np.float32), op="max")
    with pytest.raises(ValueError, match="mean"):
        ring.allreduce(np.zeros(3, np.int32), op="mean")
    with pytest.raises(ValueError, match="bounds"):
        ring.reduce_scatter(np.zeros(5), bounds=[(0, 4)])
    with pytest.raises(ValueError, match="root"):
        tree.reduce(np.zeros(3), root=1)
    with pytest.raises(ValueError, match="chunk_bytes"):
        RingCommunicator(transport, chunk_bytes=0)
    with pytest.raises(ValueError, match="peer"):
        transport.send(np.zeros(3), 5)


def test_transfer_timeout_names_operation_peer_and_size(transport):
    # A receive nobody sends to: it must fail after ~timeout_s, not hang.
    out = np.empty(1024, np.float32)
    with pytest.raises(CommTimeoutError, match=r"recv from rank 0 of 4096 bytes did not complete within 0.3 s"):
        transport.recv(out, 0)


def test_a_wait_counts_its_deadline_from_the_start_it_is_given():
    """auto's lean wait polls on its own first and hands the transport the moment it began:
    the deadline runs from then, not from the hand-over."""
    import time
    t = MpiTransport(MPI.COMM_SELF, timeout_s=30)
    request = t.mpi_comm.Irecv(np.empty(4, np.float64), 0, 7)     # nothing is ever sent
    begun = time.perf_counter()
    try:
        with pytest.raises(CommTimeoutError,
                           match="^all-reduce from rank 0 of 32 bytes did not complete within 30 s$"):
            t._wait([request], ("all-reduce", None, 0, 32), start=begun - 31)
        assert time.perf_counter() - begun < 15      # at once, not after 30 s
    finally:
        t.close()


def test_transfer_timeout_on_stream_surfaces_at_wait(transport):
    stream = transport.new_stream()
    try:
        handle = transport.recv(np.empty(8, np.float64), 0, stream=stream)
        with pytest.raises(CommTimeoutError, match="of 64 bytes"):
            handle.wait()
    finally:
        stream.close()


def test_single_rank_collectives_are_identity(transport):
    # With one rank, sum and mean over ranks leave the buffer as it was.
    x = np.arange(11, dtype=np.float32)
    for name in ("ring", "tree", "master"):
        buf = x.copy()
        create(name, transport=transport).allreduce(buf, op="mean")
        np.testing.assert_array_equal(buf, x)
    assert transport.bytes_sent == 0 and transport.bytes_recv == 0


def test_stream_runs_in_submission_order():
    order = []
    with CpuStream() as stream:
        handles = [stream.submit(order.append, i) for i in range(50)]
        stream.synchronize()
    assert order == list(range(50))
    assert all(h.done() for h in handles)


def test_timeout_env_variable(monkeypatch):
    monkeypatch.setenv("RINGNET_COMM_TIMEOUT", "12.5")
    t = MpiTransport(MPI.COMM_SELF)
    assert t.timeout_s == 12.5
    t.close()
    monkeypatch.setenv("RINGNET_COMM_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="RINGNET_COMM_TIMEOUT"):
        MpiTransport(MPI.COMM_SELF)


def test_bench_sizes_and_bus_bandwidth():
    assert parse_sizes("8,1K,1M") == [8, 1024, 1 << 20]
    assert parse_sizes("1K:8K") == [1024, 2048, 4096, 8192]
    with pytest.raises(UsageError):
        parse_sizes("lots")
    # closed form: 4 ranks move 2*3/4 of the buffer per link
    assert bus_bandwidth(2.0, 4) == pytest.approx(3.0)


def test_auto_switch_point_is_the_alpha_beta_crossover():
    """At N = 2 one exchange of the whole buffer (rd: alpha + n beta + n gamma) against two
    of half of it (ring: 2 alpha + n beta + n gamma / 2) cross at n = 2 alpha / gamma
    (among auto's own algorithms, as on a stream)."""
    from ringnet.comm.cost import ALGORITHMS, choose, cost, thresholds
    alpha, beta, gamma = 20e-6, 0.3e-9, 0.1e-9
    crossover = 2 * alpha / gamma
    switches = thresholds(2, candidates=ALGORITHMS, alpha=alpha, beta=beta, gamma=gamma)
    assert [a for _, a in switches] == ["rd", "rhd"]      # rhd = ring's cost at N = 2: first wins ties
    assert abs(switches[1][0] - crossover) <= 1
    # only messages count: the fewest messages win at every N; only bytes: the fewest bytes
    for n, fewest in ((2, "rd"), (3, "direct"), (4, "rd"), (5, "rd"), (8, "rd")):
        assert choose(1 << 20, n, ALGORITHMS, alpha=1, beta=0, gamma=0) == fewest
        assert choose(1 << 20, n, ALGORITHMS, alpha=0, beta=1, gamma=1) in ("ring", "rhd")
    # at N = 3 halving-doubling pays the fold in full: the ring moves fewer bytes in as many rounds
    assert cost("ring", 1 << 20, 3) < cost("rhd", 1 << 20, 3)


@pytest.mark.parametrize("oversubscribed", [False, True])
@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_native_is_chosen_exactly_where_its_modelled_cost_is_lowest(n, oversubscribed):
    """Over sizes from 1 B to 64 MiB: native where the model prices MPI's call below every
    algorithm of ours, never where one of ours is cheaper (ties: ours); without it among
    the candidates (on a stream) the choice is the cheapest of ours."""
    from ringnet.comm.cost import ALGORITHMS, CHOICES, choose, constants, cost
    c = constants(oversubscribed)
    for nbytes in [1 << k for k in range(27)] + [3 * (1 << k) for k in range(25)]:
        ours = min(cost(a, nbytes, n, **c) for a in ALGORITHMS)
        native = cost("native", nbytes, n, **c)
        picked = choose(nbytes, n, CHOICES, **c)
        assert (picked == "native") == (native < ours), (nbytes, n, picked, native, ours)
        assert cost(picked, nbytes, n, **c) == min(native, ours)
        assert choose(nbytes, n, ALGORITHMS, **c) == choose(nbytes, n, ALGORITHMS, alpha=c["alpha"])


def test_native_switch_points_where_they_were_measured():
    """The measured picture on 2 cores: at N = 2 MPI's call up to 8 B (its own quicker
    path), the lean rd from there to ~12 KB, MPI's call in the middle, halving-doubling
    from ~1.9 MB; 3 and 4 ranks crowding 2 cores: MPI's call from 1 B, the ring from ~570 KB
    (N = 3), rhd from ~5 MB (N = 4)."""
    from ringnet.comm.cost import constants, thresholds
    quiet, crowded = constants(False), constants(True)
    switches = thresholds(2, 64 << 20, **quiet)
    assert [a for _, a in switches] == ["native", "rd", "native", "rhd"]
    assert switches[1][0] == 9
    assert 8 << 10 < switches[2][0] <= 16 << 10 and 1 << 20 < switches[3][0] <= 2 << 20
    switches = thresholds(3, 64 << 20, **crowded)
    assert [a for _, a in switches] == ["native", "ring"] and 512 << 10 < switches[1][0] <= 1 << 20
    switches = thresholds(4, 64 << 20, **crowded)
    assert [a for _, a in switches] == ["native", "rhd"] and 4 << 20 < switches[1][0] <= 8 << 20


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_across_nodes_mpis_own_call_takes_the_small_messages(n):
    """Where the ranks span nodes, native below NATIVE_ACROSS_NODES_BELOW whatever the model
    prices (measured: ours lost there on 3 nodes), the model's choice from it up; on a
    stream (native no candidate) the model's choice everywhere; one node: as before."""
    from ringnet.comm.cost import (ALGORITHMS, CHOICES, NATIVE_ACROSS_NODES_BELOW, choose,
                                   constants, thresholds)
    c = constants(False)
    limit = NATIVE_ACROSS_NODES_BELOW
    for nbytes in [1 << k for k in range(27)] + [limit - 1, limit, limit + 1]:
        model = choose(nbytes, n, CHOICES, **c)
        assert choose(nbytes, n, CHOICES, 1, **c) == model
        assert choose(nbytes, n, CHOICES, 2, **c) == ("native" if nbytes < limit else model)
        assert choose(nbytes, n, ALGORITHMS, 4, **c) == choose(nbytes, n, ALGORITHMS, **c)
    switches = thresholds(n, 64 << 20, CHOICES, 2, **c)
    assert switches[0] == (1, "native")
    assert all(b >= limit for b, a in switches[1:]), switches


def test_auto_knows_its_ranks_span_nodes():
    """AutoCommunicator reads the node count from its transport's layout and chooses by it."""
    from ringnet.comm import AutoCommunicator
    transport = make_transport("mpi", mpi_comm=MPI.COMM_SELF, device="cpu")
    one = AutoCommunicator(transport)
    assert one.nodes == 1
    transport.layout = _two_nodes(transport.layout)
    comm = AutoCommunicator(transport)
    assert comm.nodes == 2
    if comm.native_ok:
        assert comm.choose(64 << 10) == "native"
        assert dict(comm.thresholds(4 << 20))[1] == "native"


def _two_nodes(layout):
    """``layout`` as if its ranks were spread over two nodes (only ``nodes`` is read)."""
    class TwoNodes:
        nodes = 2

        def __getattr__(self, name):
            return getattr(layout, name)
    return TwoNodes()


def test_fit_native_recovers_its_constants():
    from ringnet.comm.cost import cost, fit_native
    alpha, beta = 7e-6, 0.4e-9
    samples = [(b, n, cost("native", b, n, native_alpha=alpha, native_beta=beta))
               for n in (2, 3, 4) for b in (8, 4096, 1 << 20, 16 << 20)]
    fitted = fit_native(samples)
    assert fitted == pytest.approx((alpha, beta), rel=1e-6)


NATIVE_ALONE = """
import sys, time
import numpy as np
from mpi4py import MPI
from ringnet.comm import AutoCommunicator, MpiTransport
how = sys.argv[1]
transport = MpiTransport(MPI.COMM_WORLD, timeout_s=0.5)
comm = AutoCommunicator(transport, algorithm="native" if how == "native" else None)
buf = np.ones(3, np.float32)
comm.allreduce(buf)                              # every rank: a planned size
comm.allreduce(buf)                              # again: the array auto looks for first
if MPI.COMM_WORLD.Get_rank() == 0:
    print("first", comm._native_buf is buf, comm.last_algorithm, flush=True)
    if how == "transport":
        transport.allreduce_native(np.ones(3, np.float32))
    else:                                        # hot: the same array; else a new one
        comm.allreduce(buf if how == "hot" else np.ones(3, np.float32))
    print("returned", comm.last_algorithm, flush=True)
else:
    time.sleep(30)
"""


@pytest.mark.parametrize("how", ["native", "auto", "hot", "transport"])
def test_native_past_its_deadline_ends_the_job_naming_the_call(tmp_path, how):
    """MPI's blocking all-reduce cannot be taken back: rank 0 alone in it, past the
    transport's 0.5 s deadline, ends the whole job (long before the peer's 30 s sleep) with
    one line naming the call and its size, on each path that makes the call: the planned
    size (forced native; ``auto`` at 3 ranks on 2 cores picks native), the array auto
    looks for first (``hot``) and the transport's own call."""
    import shutil
    import subprocess
    import sys
    import time
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not on PATH")
    script = tmp_path / "alone.py"
    script.write_text(NATIVE_ALONE)
    from conftest import launcher_free_env
    start = time.perf_counter()
    proc = subprocess.run(["mpirun", "-np", "3", sys.executable, str(script), how],
                          capture_output=True, text=True, timeout=120, env=launcher_free_env())
    elapsed = time.perf_counter() - start
    assert "first True native" in proc.stdout, (proc.stdout, proc.stderr)
    assert proc.returncode != 0 and "returned" not in proc.stdout, (proc.stdout, proc.stderr)
    assert "all-reduce (MPI_Allreduce) of 12 bytes did not complete within 0.5 s" in proc.stderr, \
        proc.stderr
    assert elapsed < 25, elapsed


class _Sleeper:
    """Stands in for a native call site: ``call`` blocks in C (time.sleep) on its watched line."""

    def __init__(self, timeout_s):
        import types
        self.transport = types.SimpleNamespace(timeout_s=timeout_s)

    def call(self, buf, seconds):
        import time
        time.sleep(seconds)


def test_native_watch_ends_only_a_call_past_its_deadline(monkeypatch):
    """NativeWatch's looks: a thread inside a watched call is seen with its size; the same
    call is ended only once the transport's timeout passed since it was first seen, never
    before; a later call (another frame) starts its own count; lines elsewhere are not watched."""
    import threading
    import time
    from ringnet.comm.mpi_transport import NativeWatch
    ended = []
    monkeypatch.setattr(NativeWatch, "expire", staticmethod(lambda *what: ended.append(what)))
    monkeypatch.setattr(NativeWatch, "_sites", dict(NativeWatch._sites))
    NativeWatch.site(_Sleeper.call, "sleep")
    owner = _Sleeper(timeout_s=0.5)
    buf = np.ones(6, np.float32)
    calls = threading.Thread(target=lambda: [owner.call(buf, 0.6) for _ in range(2)])
    calls.start()
    try:
        seen = {}
        for _ in range(200):                         # until the thread is in its first call
            seen = NativeWatch.look({}, 0.0)
            if calls.ident in seen:
                break
            time.sleep(0.005)
        first = seen[calls.ident]
        assert first[1:] == (0.0, owner.transport, 24)
        seen = NativeWatch.look(seen, 0.49)          # inside, not yet past 0.5 s
        assert ended == [] and seen[calls.ident][0] is first[0]
        seen = NativeWatch.look(seen, 0.51)
        assert ended == [(24, 0.5)]
        while True:                                  # until the second call: a new frame
            later = NativeWatch.look({}, 10.0)
            if calls.ident in later and later[calls.ident][0] is not first[0]:
                break
            time.sleep(0.01)
        seen = NativeWatch.look(seen, 10.4)          # seen last in the first call, 10 s ago
        assert ended == [(24, 0.5)] and seen[calls.ident][1] == 10.4
        seen = NativeWatch.look(seen, 10.8)
        assert ended == [(24, 0.5)] and seen[calls.ident][1] == 10.4
        assert threading.get_ident() not in seen     # this thread waits elsewhere: not watched
    finally:
        calls.join()


def test_native_watch_knows_every_line_that_calls_mpi_allreduce():
    """Every place ringnet calls the blocking MPI_Allreduce is a watched line, and a site
    that does not load the named callable is refused."""
    import inspect
    from ringnet.comm import _lean
    from ringnet.comm.auto import AutoCommunicator
    from ringnet.comm.mpi_transport import MpiTransport, NativeWatch
    for function, call in ((AutoCommunicator.allreduce, "self._native_call(_IN_PLACE, buf)"),
                           (_lean.LeanPath.quick_native, "self.mpi_allreduce(_IN_PLACE, buf)"),
                           (MpiTransport.allreduce_native, "self.mpi_comm.Allreduce(MPI.IN_PLACE,")):
        lines, first = inspect.getsourcelines(function)
        calls = {first + k for k, line in enumerate(lines) if call in line}
        assert calls and NativeWatch._sites[function.__code__] == calls, function.__qualname__
    with pytest.raises(ValueError, match="does not load"):
        NativeWatch.site(_Sleeper.call, "Allreduce")


def test_auto_refuses_unknown_algorithms(transport):
    with pytest.raises(ValueError, match="bogus"):
        create("auto", transport=transport, algorithm="bogus")
    buf = np.arange(5.0)
    create("auto", transport=transport).allreduce(buf)      # one rank: nothing moves
    np.testing.assert_array_equal(buf, np.arange(5.0))


def test_bench_comm_repetitions_and_targets():
    from ringnet.bench.comm import repetitions, target
    assert repetitions(8) == 64 and repetitions(64 << 10) == 4 and repetitions(64 << 20) == 1
    assert target(8) == target(512 << 10) == target(64 << 20) == 0.9


def test_bench_comm_fit_command_of_docs_comm():
    """docs/comm.md's refit command, shortened: every row ok, a fit with positive constants."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    command = "python -m ringnet.bench comm --algos auto,native,direct,rd,rhd,ring --fit"
    assert command in " ".join((root / "docs" / "comm.md").read_text().split())
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    proc = subprocess.run(["mpirun", "-np", "2", sys.executable, *command.split()[1:],
                           "--sizes", "8,64K,1M", "--iters", "2", "--json"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert all(row["ok"] for row in result["rows"])
    assert {row["algo"] for row in result["rows"]} == {"auto", "native", "direct", "rd", "rhd", "ring"}
    assert [row["picked"] for row in result["rows"] if row["algo"] == "auto"] == \
        [create_choice(nbytes, result["constants"]) for nbytes in (8, 64 << 10, 1 << 20)]
    from ringnet.comm.cost import constants
    assert result["constants"] == constants(result["oversubscribed"])
    fit = result["fit"]
    assert fit["alpha"] >= 0 and fit["beta"] >= 0 and fit["gamma"] >= 0 and fit["switches"]


def create_choice(nbytes, constants):
    from ringnet.comm.cost import choose
    return choose(nbytes, 2, **constants)


def test_lean_spins_yield_early_where_ranks_outnumber_cores(monkeypatch):
    """auto polls LEAN_SPINS times while each rank on the node has a core (the affinity,
    or the machine's cores for a rank bound to one), OVERSUBSCRIBED_SPINS times where the
    launcher put more."""
    from ringnet import placement as topology
    assert topology.lean_spins(ranks_here=2, cores=2) == topology.LEAN_SPINS
    assert topology.lean_spins(ranks_here=1, cores=16) == topology.LEAN_SPINS
    assert topology.lean_spins(ranks_here=3, cores=2) == topology.OVERSUBSCRIBED_SPINS
    assert topology.OVERSUBSCRIBED_SPINS < topology.LEAN_SPINS
    # the ranks from the launcher's environment, the cores from the affinity
    import os
    cores = len(os.sched_getaffinity(0))
    for var in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE",
                "PMI_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MPI_LOCALNRANKS", str(cores + 1))
    assert topology.lean_spins() == topology.OVERSUBSCRIBED_SPINS
    monkeypatch.setenv("MPI_LOCALNRANKS", str(cores))
    assert topology.lean_spins() == topology.LEAN_SPINS
    # a rank bound to one core (each rank to its own): the machine's cores count
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setenv("MPI_LOCALNRANKS", "4")
    assert topology.node_cores() == 16 and topology.lean_spins() == topology.LEAN_SPINS
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert topology.lean_spins() == topology.OVERSUBSCRIBED_SPINS
    # unbound ranks in a 2-core cpuset of a 16-core machine share those 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert topology.node_cores() == 2 and topology.lean_spins() == topology.OVERSUBSCRIBED_SPINS


@pytest.mark.parametrize("n", range(1, 10))
def test_schedules_pair_every_send_with_its_receive(n):
    """auto's two paths and the ring take their rounds from ringnet.comm.schedules: in every
    round what a rank sends to a peer is what that peer receives from it, the fold's core
    ends with disjoint blocks covering the buffer, and every rank sums in rank order."""
    from ringnet.comm.schedules import (Fold, direct_peers, direct_slot, eager_cuts, ring_steps,
                                        step_pieces, sum_in_rank_order)
    length = 1001
    for r in range(n):
        for k, (to, source) in enumerate(direct_peers(r, n)):
            assert direct_peers(to, n)[k][1] == r and direct_slot(r, source, n) == k
        reduce, gather = ring_steps(r, n)
        right = ring_steps((r + 1) % n, n)
        assert [out for out, _ in reduce] == [into for _, into in right[0]]
        assert [out for out, _ in gather] == [into for _, into in right[1]]
    folds = [Fold(r, n) for r in range(n)]
    core = [f for f in folds if f.role == "core" or f.role == "take"]
    assert len(core) == folds[0].p and sorted(f.me for f in core) == list(range(folds[0].p))
    for f in folds:
        if f.role == "give":
            assert folds[f.rank + 1].role == "take"
            continue
        for step, partner in enumerate(f.doubling_partners()):
            assert folds[partner].doubling_partners()[step] == f.rank
        for step, (partner, kept, given) in enumerate(f.halving_steps(length)):
            theirs = folds[partner].halving_steps(length)[step]
            assert theirs[0] == f.rank and theirs[1] == given and theirs[2] == kept
    owned = sorted(f.halving_steps(length)[-1][1] for f in core) if n > 1 else [(0, length)]
    assert owned[0][0] == 0 and owned[-1][1] == length
    assert all(a[1] == b[0] for a, b in zip(owned, owned[1:]))
    # the rank-order sum: the same bits whichever rank's buffer is summed into
    parts = [np.random.default_rng(k).standard_normal(7).astype(np.float32) for k in range(n)]
    sums = []
    for r in range(n):
        buf = parts[r].copy()
        if n > 1:
            sum_in_rank_order(np, buf, lambda q: buf if q == r else parts[q], n, r,
                              lambda: np.empty(7, np.float32))
        sums.append(buf)
    assert all(np.array_equal(s.view(np.uint32), sums[0].view(np.uint32)) for s in sums)
    # pieces cover a step in order; the eager band cuts a message in two halves
    assert step_pieces(10, 4) == [(0, 10)] and step_pieces(0, 4, 8) == [(0, 0)]
    assert step_pieces(10, 4, 12) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert eager_cuts(2500, 4) == [(0, 1250), (1250, 2500)] and eager_cuts(100, 4) == [(0, 100)]


LATE_PEER = """
import gc, sys, time
import numpy as np
from mpi4py import MPI
from ringnet.comm.mpi_transport import MpiTransport
from ringnet.comm.transport import CommTimeoutError
n = int(sys.argv[1])
transport = MpiTransport(MPI.COMM_WORLD, timeout_s=1.0)
if MPI.COMM_WORLD.Get_rank() == 0:
    for i in range(3):
        send, recv = np.ones(n, np.float32), np.zeros(n, np.float32)
        try:
            transport.sendrecv(send, 1, recv, 1)
        except CommTimeoutError:
            print("timed out", flush=True)
        except MPI.Exception:
            print("late message refused", flush=True)
        del send, recv
        gc.collect()
        reused = [np.full(n, 7, np.float32) for _ in range(4)]
    time.sleep(2)
    print("alive", flush=True)
else:
    time.sleep(1.5)                     # rank 0 has given up its transfer by now
    late = [transport.mpi_comm.Isend(np.ones(2 * n, np.float32), dest=0, tag=0) for _ in range(3)]
    time.sleep(3)
"""


@pytest.mark.parametrize("n", [1000, 1 << 20])
def test_a_timed_out_transfer_never_crashes_the_process(tmp_path, n):
    """A peer that answers after the deadline, with messages of another size: rank 0's
    transfer times out and the late messages are refused, but the process lives on (MPICH
    crashed when a timed-out send was cancelled, or when a receive whose buffer Python had
    freed was written)."""
    import shutil
    import subprocess
    import sys
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not on PATH")
    script = tmp_path / "late.py"
    script.write_text(LATE_PEER)
    from conftest import launcher_free_env
    proc = subprocess.run(["mpirun", "-np", "2", sys.executable, str(script), str(n)],
                          capture_output=True, text=True, timeout=120, env=launcher_free_env())
    output = proc.stdout + proc.stderr
    assert "Segmentation fault" not in output and proc.returncode not in (-11, 11, 139), output
    assert output.count("timed out") >= 1 and "alive" in output, output


def test_pipeline_pieces_are_the_alpha_beta_optimum_within_their_bounds():
    """sqrt(n alpha / beta) with alpha / beta = 1e5 B: 647,634 B for 4 MiB, 2,590,537 B for
    64 MiB; below 256 KiB and above 4 MiB the bounds; the pieces cover the buffer."""
    from ringnet.comm import cost
    from ringnet.comm.base import pipeline_pieces
    assert cost.pipeline_piece_bytes(4 << 20) == 647634
    assert cost.pipeline_piece_bytes(64 << 20) == 2590537
    assert cost.pipeline_piece_bytes(100_000) == 256 << 10
    assert cost.pipeline_piece_bytes(1 << 30) == 4 << 20
    length = (4 << 20) // 4
    pieces = pipeline_pieces(length, 4)
    assert pieces[0] == (0, 647634 // 4) and pieces[-1][1] == length
    assert all(a == b for (_, b), (a, _) in zip(pieces, pieces[1:]))
