"""The strict stand-in of CUDA and NCCL: each rule it enforces, and ringnet's NCCL path run through it.

Run: ``mpirun -np N python -m pytest --with-mpi -m mpi tests/comm/test_nccl_standin.py`` (N = 1..4).

* the NCCL rules: two threads inside one communicator, a second thread at all, operation
  order that differs between ranks, send/recv sizes that differ, unbalanced groups,
  use after abort/destroy, destroy with operations in flight, a lone send and recv in
  opposite orders (a hang in NCCL) each fail on a rank that sees them;
* devices, streams and events: a call on a thread whose current device is not the rank's
  (an event destroyed there included) fails and the rank stays failed; an operation runs
  when its stream reaches it; what it writes reads as poison until an event orders the
  reader after it, and an NCCL read of it from another stream before that raises; two
  communicators launched in different orders by two ranks, and an operation while
  another communicator is not warmed up, raise;
* data: send/recv and allReduce against closed-form values;
* ``NcclTransport`` over the stand-in: every communicator's collectives (blocking and on
  streams, several streams at once) against closed-form values, the README's stream
  example, and every training mode (ring/tree/master at delay 0 and 1, split-fc at delay
  0 and 1, with and without its activation stream) bit-identical to the same run over
  ``MpiTransport``, which ``test_parallel_mpi.py`` and ``test_split_fc_mpi.py`` check
  against ``single`` and the delay-1 recurrence.
"""
import gc
import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

from ringnet.comm import COMMUNICATORS, MpiTransport, NcclTransport, create
from ringnet.testing import nccl_standin as nccl

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
N, RANK = WORLD.Get_size(), WORLD.Get_rank()
F32 = nccl.NCCL_FLOAT32
_made = []


@pytest.fixture(autouse=True)
def _rank_device():
    """This rank's stand-in device on the main thread (as a transport selects it); every
    communicator a test made is aborted after it, and no device rule may stay broken.

    Streams and events caught in reference cycles (an error's traceback holds the frame
    that holds them) are collected here, on a thread on the rank's device: collected by
    chance on a thread just starting, before it selects its device, they would fail the
    rank (as CuPy's would make a context on GPU 0).
    """
    gc.collect()
    nccl.bind()
    yield
    while _made:
        comm = _made.pop()
        if comm._state == "ok":
            comm.abort()
    gc.collect()
    broken = nccl.violations()
    nccl.clear_violations()
    assert not broken, broken


def _communicator(mpi_comm=WORLD, timeout_s=10.0):
    """A fresh stand-in communicator over ``mpi_comm`` (unique id from its rank 0)."""
    uid = mpi_comm.bcast(nccl.get_unique_id() if mpi_comm.Get_rank() == 0 else None, root=0)
    comm = nccl.NcclCommunicator(mpi_comm.Get_size(), uid, mpi_comm.Get_rank())
    comm.timeout_s = timeout_s
    _made.append(comm)
    return comm


def _pair(short_on=()):
    """A 2-rank sub-communicator of world ranks 0 and 1 (None on the others and at N=1).

    Ranks in ``short_on`` get a 1.5 s deadline (they are expected to hit it), the other 60 s.
    """
    sub = WORLD.Split(0 if RANK < 2 else MPI.UNDEFINED, RANK)
    if sub == MPI.COMM_NULL or sub.Get_size() < 2:
        if sub != MPI.COMM_NULL:
            sub.Free()
        return None, None
    return sub, _communicator(sub, timeout_s=1.5 if RANK in short_on else 60.0)


def _sync():
    """Wait for the calling thread's current stream (the null stream here)."""
    nccl.get_current_stream().synchronize()


def _outcome(fn, comm):
    """Run ``fn`` (it enqueues), wait for its stream; return (error kind, message) or (None, "")."""
    try:
        fn()
        _sync()
        comm.check_async_error()
    except nccl.NcclError as exc:
        return type(exc).__name__, str(exc)
    return None, ""


def _sendrecv(comm, out, got, peer, stream=0):
    nccl.groupStart()
    comm.send(nccl.host_pointer(out), out.size, F32, peer, stream)
    comm.recv(nccl.host_pointer(got), got.size, F32, peer, stream)
    nccl.groupEnd()


def _warm(comm, peers):
    """Use ``comm`` once with every peer and in one allReduce, and wait (as the transport does)."""
    one, got = np.ones(1, np.float32), np.zeros(1, np.float32)
    for peer in peers:
        _sendrecv(comm, one, got, peer)
    comm.allReduce(nccl.host_pointer(one), nccl.host_pointer(one), 1, F32, nccl.NCCL_SUM, 0)
    _sync()


# -- the NCCL rules ---------------------------------------------------------------------------
def test_group_end_without_start_raises():
    with pytest.raises(nccl.NcclRuleError, match="groupEnd without"):
        nccl.groupEnd()


def test_use_after_abort_and_destroy_raises():
    comm = _communicator(MPI.COMM_SELF)
    buf = np.zeros(4, np.float32)
    comm.abort()
    with pytest.raises(nccl.NcclRuleError, match="after abort"):
        comm.send(buf.ctypes.data, 4, F32, 0, 0)
    other = _communicator(MPI.COMM_SELF)
    other.destroy()
    with pytest.raises(nccl.NcclRuleError, match="after destroy"):
        other.check_async_error()


def test_abort_fails_an_operation_in_flight_and_its_stream_goes_on():
    comm = _communicator(MPI.COMM_SELF)
    buf = np.zeros(4, np.float32)
    comm.recv(buf.ctypes.data, 4, F32, 0, 0)    # a receive from itself that nobody sends
    comm.abort()
    _sync()                                     # the null stream got past the failed receive
    assert comm._error is not None and "abort" in str(comm._error)


def test_destroy_with_an_operation_in_flight_raises():
    comm = _communicator(MPI.COMM_SELF)
    buf = np.zeros(4, np.float32)
    comm.recv(buf.ctypes.data, 4, F32, 0, 0)    # waits on its stream: nobody sends
    with pytest.raises(nccl.NcclRuleError, match="in flight"):
        comm.destroy()


def test_second_thread_raises():
    comm = _communicator(MPI.COMM_SELF)
    a, b = np.arange(4, dtype=np.float32), np.zeros(4, np.float32)

    def self_sendrecv():
        nccl.groupStart()
        comm.send(a.ctypes.data, 4, F32, 0, 0)
        comm.recv(b.ctypes.data, 4, F32, 0, 0)
        nccl.groupEnd()
    assert _outcome(self_sendrecv, comm) == (None, "")
    np.testing.assert_array_equal(b, a)
    errors = []

    def other_thread():
        nccl.bind()
        errors.append(_outcome(self_sendrecv, comm))
    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join(10)
    assert errors[0][0] == "NcclRuleError" and "used from two threads" in errors[0][1]


def test_two_threads_inside_at_once_raises():
    comm = _communicator(MPI.COMM_SELF)
    a, b = np.arange(4, dtype=np.float32), np.zeros(4, np.float32)
    inside, leave = threading.Event(), threading.Event()

    def first():            # inside the communicator from its first grouped call to groupEnd
        nccl.bind()
        nccl.groupStart()
        comm.send(a.ctypes.data, 4, F32, 0, 0)
        inside.set()
        leave.wait(30)
        comm.recv(b.ctypes.data, 4, F32, 0, 0)
        nccl.groupEnd()
        _sync()
    thread = threading.Thread(target=first)
    thread.start()
    assert inside.wait(30)
    try:
        with pytest.raises(nccl.NcclRuleError, match="two threads inside one communicator at once"):
            comm.send(a.ctypes.data, 4, F32, 0, 0)
    finally:
        leave.set()
        thread.join(30)
    np.testing.assert_array_equal(b, a)


def test_sizes_that_differ_raise_on_the_receiver():
    sub, comm = _pair()
    if comm is None:
        pytest.skip("needs ranks 0 and 1")
    buf = np.zeros(12, np.float32)
    if RANK == 0:
        kind, message = _outcome(lambda: comm.send(buf.ctypes.data, 10, F32, 1, 0), comm)
    else:
        kind, message = _outcome(lambda: comm.recv(buf.ctypes.data, 12, F32, 0, 0), comm)
    sub.Free()
    if RANK == 0:
        assert kind is None, message        # the receiver drained the message
    else:
        assert kind == "NcclRuleError" and "sizes differ" in message, message


def test_operation_order_that_differs_raises():
    sub, comm = _pair(short_on=(0,))
    if comm is None:
        pytest.skip("needs ranks 0 and 1")
    buf = np.ones(4, np.float32)
    if RANK == 0:
        kind, message = _outcome(lambda: comm.allReduce(buf.ctypes.data, buf.ctypes.data, 4, F32,
                                                        nccl.NCCL_SUM, 0), comm)
    else:
        kind, message = _outcome(lambda: comm.recv(buf.ctypes.data, 4, F32, 0, 0), comm)
    sub.Free()
    if RANK == 0:
        assert kind == "NcclError" and "would hang" in message, message
    else:
        assert kind == "NcclRuleError" and "order differs" in message, message


def test_lone_send_and_recv_in_opposite_orders_hang_and_raise():
    sub, comm = _pair()
    if comm is None:
        pytest.skip("needs ranks 0 and 1")
    out = np.arange(4, dtype=np.float32) + RANK
    peer = 1 - RANK
    comm.timeout_s = 1.5
    # Both send first, outside a group: NCCL sends wait for their receive, so both hang.
    kind, message = _outcome(lambda: comm.send(out.ctypes.data, 4, F32, peer, 0), comm)
    sub.Barrier()       # both have given up before either takes the other's message
    # The sends are still posted, as in NCCL: take them, so nothing stays in flight.
    header, got = np.empty(nccl.HEADER_LEN, np.int64), np.zeros(4, np.float32)
    comm._comm.Recv(header, source=peer, tag=nccl.HEADER_TAG)
    comm._comm.Recv(got, source=peer, tag=nccl.PAYLOAD_TAG)
    sub.Barrier()
    sub.Free()
    assert kind == "NcclError" and "would hang" in message, message
    np.testing.assert_array_equal(got, np.arange(4) + peer)


# -- devices, streams and events -----------------------------------------------------------------
def _on_a_new_thread(fn):
    """Run ``fn`` on a new thread that selects no device; return what it raised (or None)."""
    caught = []

    def run():
        try:
            fn()
        except nccl.NcclError as exc:
            caught.append(exc)
    thread = threading.Thread(target=run, name="no-device")
    thread.start()
    thread.join(30)
    return caught[0] if caught else None


def test_a_thread_on_another_device_fails_and_the_rank_stays_failed():
    assert nccl.Device().id == nccl.device_for(RANK) != 0
    error = _on_a_new_thread(nccl.get_current_stream)
    assert isinstance(error, nccl.NcclRuleError), error
    assert f"uses device 0, but this rank's device is {nccl.device_for(RANK)}" in str(error)
    assert "'no-device'" in str(error)
    # A context on GPU 0 stays made: every later call, on any thread, fails the same way.
    with pytest.raises(nccl.NcclRuleError, match="'no-device' uses device 0"):
        nccl.Event()
    assert len(nccl.violations()) == 1
    nccl.clear_violations()
    nccl.Event()                                # this thread is on the rank's device
    assert _on_a_new_thread(lambda: nccl.Device(nccl.device_for(RANK)).use()) is None


def test_an_event_destroyed_off_the_ranks_device_fails_the_rank():
    events = [nccl.get_current_stream().record()]
    assert _on_a_new_thread(events.clear) is None   # the last reference goes on that thread
    broken = nccl.violations()
    assert len(broken) == 1 and "cudaEventDestroy on thread 'no-device' uses device 0" in broken[0]
    with pytest.raises(nccl.NcclRuleError, match="cudaEventDestroy"):
        nccl.get_current_stream()
    nccl.clear_violations()


def test_selecting_a_second_device_fails():
    other = nccl.device_for(RANK) % (nccl.DEVICE_COUNT - 1) + 1
    error = _on_a_new_thread(lambda: nccl.Device(other).use())
    assert isinstance(error, nccl.NcclRuleError) and f"uses device {other}" in str(error)
    nccl.clear_violations()


def test_an_operation_runs_when_its_stream_reaches_it():
    sub, pair = _pair()
    if pair is None:
        pytest.skip("needs ranks 0 and 1")
    _warm(pair, [1 - RANK])
    a = np.arange(5, dtype=np.float32)
    if RANK == 1:
        sub.Barrier()                               # rank 0 has looked at its stream
        pair.send(nccl.host_pointer(a), 5, F32, 0, 0)
        _sync()
    else:
        local = _communicator(MPI.COMM_SELF)
        stream = nccl.Stream(non_blocking=True)
        b, d = np.full(5, -1, np.float32), np.full(5, -1, np.float32)
        pair.recv(nccl.host_pointer(b), 5, F32, 1, stream.ptr)     # rank 1 has not sent yet
        _sendrecv(local, a, d, 0, stream.ptr)       # needs nobody, but comes after it
        behind = stream.record()
        assert not behind.done
        assert np.array_equal(b, np.full(5, -1)) and np.array_equal(d, np.full(5, -1))
        sub.Barrier()
        behind.synchronize()
        np.testing.assert_array_equal(b, a)
        np.testing.assert_array_equal(d, a)
    sub.Free()


def test_a_write_is_poison_until_an_event_orders_the_reader():
    comm = _communicator(MPI.COMM_SELF)
    stream = nccl.Stream(non_blocking=True)
    a, b = np.arange(1, 6, dtype=np.float32), np.zeros(5, np.float32)
    _sendrecv(comm, a, b, 0, stream.ptr)
    done = stream.record()
    while not done.done:            # the GPU ran it; a query orders nothing
        time.sleep(1e-3)
    assert np.isnan(b).all()
    nccl.get_current_stream().wait_event(done)      # now this thread is ordered after it
    np.testing.assert_array_equal(b, a)
    # The issuing thread's host code sees its stream's results; after a hand-off (another
    # thread takes the work over) only a reader ordered after the next event does.
    c = np.zeros(5, np.float32)
    with stream:
        _sendrecv(comm, a, c, 0, stream.ptr)
        stream.record().host_work()
        np.testing.assert_array_equal(c, a)
        stream.hand_off()
        handed = stream.record()
    assert np.isnan(c).all()
    handed.synchronize()
    np.testing.assert_array_equal(c, a)


def test_a_stream_sends_what_its_own_host_code_wrote_over_a_receive():
    comm = _communicator(MPI.COMM_SELF)
    stream = nccl.Stream(non_blocking=True)
    a = np.arange(1, 4, dtype=np.float32)
    b, c, d = np.zeros(3, np.float32), np.zeros(3, np.float32), np.zeros(3, np.float32)
    with stream:
        _sendrecv(comm, a, b, 0, stream.ptr)
        stream.record().host_work()
        b *= 10                                     # a kernel of this stream, after the receive
        _sendrecv(comm, b, c, 0, stream.ptr)
        stream.record().host_work()
        np.testing.assert_array_equal(c, 10 * a)    # the host's bytes, not the receive's
        stream.hand_off()                           # c's receive: poison for other threads
        assert np.isnan(c).all()
        _sendrecv(comm, c, d, 0, stream.ptr)        # the stream itself still sends its bytes
        stream.record().host_work()
    np.testing.assert_array_equal(d, 10 * a)


def test_an_nccl_read_of_another_streams_write_before_an_event_raises():
    first, second = _communicator(MPI.COMM_SELF), _communicator(MPI.COMM_SELF)
    writer, reader = nccl.Stream(non_blocking=True), nccl.Stream(non_blocking=True)
    a, b, c = np.arange(1, 4, dtype=np.float32), np.zeros(3, np.float32), np.zeros(3, np.float32)
    _sendrecv(first, a, b, 0, writer.ptr)           # writes b on one stream
    _sendrecv(second, b, c, 0, reader.ptr)          # reads b on another, unordered
    reader.synchronize()
    writer.synchronize()
    with pytest.raises(nccl.NcclRuleError, match="reads bytes that recv from rank 0 of 3 x "
                                                  "dtype 7 on stream .* (wrote|is going to write), "
                                                  "before an event"):
        second.check_async_error()
    other = _communicator(MPI.COMM_SELF)            # the same, ordered by an event: no error
    _sendrecv(first, a, b, 0, writer.ptr)
    with reader:
        reader.wait_event(writer.record())
        _sendrecv(other, b, c, 0, reader.ptr)
    reader.synchronize()
    other.check_async_error()
    np.testing.assert_array_equal(c, a)


def test_two_communicators_launched_in_different_orders_raise():
    sub, first = _pair()
    if first is None:
        pytest.skip("needs ranks 0 and 1")
    peer = 1 - RANK
    _warm(first, [peer])
    second = _communicator(sub, timeout_s=60.0)
    _warm(second, [peer])
    streams = {first: nccl.Stream(non_blocking=True), second: nccl.Stream(non_blocking=True)}
    bufs = {c: (np.ones(4, np.float32), np.zeros(4, np.float32)) for c in streams}
    order = [first, second] if RANK == 0 else [second, first]
    for comm in order:
        _sendrecv(comm, *bufs[comm], peer, streams[comm].ptr)
    for stream in streams.values():
        stream.synchronize()
    errors = []
    for comm in order:
        try:
            comm.check_async_error()
        except nccl.NcclRuleError as exc:
            errors.append(str(exc))
    sub.Free()
    assert errors and "launched in different orders" in errors[0], errors


def test_an_operation_while_another_communicator_is_cold_raises():
    sub, first = _pair()
    if first is None:
        pytest.skip("needs ranks 0 and 1")
    peer = 1 - RANK
    _warm(first, [peer])
    second = _communicator(sub, timeout_s=60.0)
    out, got = np.ones(2, np.float32), np.zeros(2, np.float32)
    with pytest.raises(nccl.NcclRuleError, match=r"while communicator #\d+ of device \d+ is not "
                                                  r"warmed up \(it has yet to run a collective, "
                                                  r"recv from rank \d, send to rank \d\)"):
        _sendrecv(first, out, got, peer)
    nccl.groupEnd()                                 # the group the refused send was in
    _warm(second, [peer])
    _sendrecv(first, out, got, peer)                # both warm: fine
    _sync()
    sub.Free()
    np.testing.assert_array_equal(got, out)


# -- data -----------------------------------------------------------------------------------
def test_grouped_ring_exchange_and_allreduce_match_closed_form():
    comm = _communicator()
    out = np.full(5, RANK + 1, np.float64)
    got = np.zeros(5, np.float64)
    nccl.groupStart()
    comm.send(out.ctypes.data, 5, nccl.NCCL_FLOAT64, (RANK + 1) % N, 0)
    comm.recv(got.ctypes.data, 5, nccl.NCCL_FLOAT64, (RANK - 1) % N, 0)
    nccl.groupEnd()
    total = np.arange(7, dtype=np.float32) * (RANK + 1)
    comm.allReduce(total.ctypes.data, total.ctypes.data, 7, F32, nccl.NCCL_SUM, 0)
    _sync()
    comm.destroy()
    np.testing.assert_array_equal(got, np.full(5, (RANK - 1) % N + 1))
    np.testing.assert_array_equal(total, np.arange(7) * N * (N + 1) / 2)


# -- NcclTransport through the stand-in --------------------------------------------------------
@pytest.fixture(scope="module")
def transport():
    t = NcclTransport(WORLD, timeout_s=30, nccl="standin")
    yield t
    t.close()


def _expected(length, times=1):
    return N * (N + 1) / 2 * N ** (times - 1) * (np.arange(length) % 7 + 1)


@pytest.mark.parametrize("name", list(COMMUNICATORS))
@pytest.mark.parametrize("length", sorted({0, 1, N + 1, 10007}))
def test_every_communicator_through_the_standin(transport, name, length):
    comm = create(name, transport=transport)
    fill = (RANK + 1) * (np.arange(length) % 7 + 1)
    blocking = fill.astype(np.float32)
    comm.allreduce(blocking)
    streams = [comm.new_stream(), comm.new_stream()]
    on_streams = [fill.astype(np.float64), fill.astype(np.float32)]
    try:
        # two streams and the calling thread communicate at the same time
        handles = [comm.allreduce(buf, op="mean", stream=s) for buf, s in zip(on_streams, streams)]
        again = blocking.copy()
        comm.allreduce(again)
        for handle in handles:
            handle.wait()
    finally:
        for s in streams:
            s.close()
    np.testing.assert_allclose(blocking, _expected(length), rtol=1e-6, err_msg=f"{name} sum")
    np.testing.assert_allclose(again, _expected(length, 2), rtol=1e-6, err_msg=f"{name} twice")
    for buf in on_streams:
        np.testing.assert_allclose(buf, _expected(length) / N, rtol=1e-6, err_msg=f"{name} mean")


def test_blocking_transport_calls_and_native_allreduce(transport):
    out = np.full(3, RANK, np.int64)
    got = np.empty(3, np.int64)
    transport.sendrecv(out, (RANK + 1) % N, got, (RANK - 1) % N)
    total = np.full(4, RANK + 1.0)
    transport.allreduce_native(total)
    np.testing.assert_array_equal(got, np.full(3, (RANK - 1) % N))
    np.testing.assert_array_equal(total, np.full(4, N * (N + 1) / 2))


def test_readme_stream_example_through_the_standin(monkeypatch):
    monkeypatch.setenv("RINGNET_NCCL", "standin")
    from ringnet import comm
    ring = comm.create("ring", transport="nccl", device="cpu")
    buf = np.full(1 << 12, MPI.COMM_WORLD.rank + 1.0, dtype=np.float32)
    ring.allreduce(buf, op="sum")
    stream = ring.new_stream()
    handle = ring.allreduce(buf, op="mean", stream=stream)
    handle.wait()
    stream.close()
    ring.transport.close()
    np.testing.assert_allclose(buf, np.full(1 << 12, N * (N + 1) / 2))


# -- every training mode ------------------------------------------------------------------------
BASE = dict(model="digits", dataset="digits", batch_size=12, steps=4, dtype="float64", lr=0.05,
            seed=3, progress=False, quiet=True, eval_every_epoch=False, device="cpu")


def _trained(transport, mode, delay):
    from ringnet.backend import to_numpy
    from ringnet.config import TrainConfig
    from ringnet.train import train
    result = train(TrainConfig(mode=mode, delay=delay, transport=transport, **BASE), world=WORLD)
    params = np.array(to_numpy(result.strategy.eval_model().params))
    result.strategy.close()
    result.strategy.transport.close()
    return params, result.summary["transport"]


@pytest.mark.parametrize("mode, delay", [("ring", 0), ("ring", 1), ("tree", 0), ("tree", 1),
                                         ("master", 0), ("master", 1), ("split-fc", 0),
                                         ("split-fc", 1)])
def test_training_mode_through_the_standin_equals_mpi(monkeypatch, mode, delay):
    if N == 1:
        pytest.skip("one rank sends nothing: run at N = 2, 3, 4")
    reference, _ = _trained("mpi", mode, delay)
    monkeypatch.setenv("RINGNET_NCCL", "standin")
    params, used = _trained("nccl", mode, delay)
    assert used == "nccl"
    np.testing.assert_array_equal(params, reference, err_msg=f"{mode} delay {delay}")


@pytest.mark.parametrize("delay", [0, 1])
def test_split_fc_activation_stream_through_the_standin(delay):
    if N == 1:
        pytest.skip("one rank sends nothing: run at N = 2, 3, 4")
    from ringnet.backend import to_numpy
    from ringnet.models import build_model
    from ringnet.optim import SGD, LRPolicy
    from ringnet.parallel.split_fc import SplitFCStrategy
    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(12, 1, 8, 8)), rng.integers(0, 10, 12)) for _ in range(4)]
    b = 12 // N

    def run(transport):
        model = build_model("digits", dtype="float64", seed=3)
        strategy = SplitFCStrategy(model, lambda n: SGD(n, LRPolicy("fixed", 0.05), momentum=0.9,
                                                          dtype="float64"),
                                   WORLD, create("ring", transport=transport), delay=delay,
                                   overlap=True)
        for it, (x, y) in enumerate(batches):
            strategy.step(x[RANK * b:(RANK + 1) * b], y[RANK * b:(RANK + 1) * b], it)
        params = np.array(to_numpy(strategy.eval_model().params))
        strategy.close()
        transport.close()
        return params
    reference = run(MpiTransport(WORLD))
    params = run(NcclTransport(WORLD, timeout_s=30, nccl="standin"))
    np.testing.assert_array_equal(params, reference)


def test_a_buffer_made_before_the_rank_binds_its_device_is_refused():
    """A model built before ``bind`` lives on device 0 (where a thread that selected no
    device is): NCCL on the rank's device cannot use it, so the stand-in refuses it."""
    from ringnet.bench import budget
    from ringnet.models import build_model
    rec = budget.Recorder()
    early = []
    with budget.recording(rec):
        # a thread that never selected a device, as the training thread before bind
        thread = threading.Thread(target=lambda: early.append(build_model("digits", xp=rec)))
        thread.start()
        thread.join()
        device = nccl.bind()
        late = build_model("digits", xp=rec)
    with pytest.raises(nccl.NcclRuleError, match=f"made on device 0, but this rank's device "
                                                 f"is {device}"):
        nccl.host_pointer(early[0].params)
    assert int(nccl.host_pointer(late.params)) == late.params.ctypes.data
