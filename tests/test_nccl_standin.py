"""The strict NCCL stand-in: each NCCL rule it enforces, and ringnet's NCCL path run through it.

Run: ``mpirun -np N python -m pytest --with-mpi -m mpi tests/test_nccl_standin.py`` (N = 1..4).

* the rules: two threads inside one communicator, a second thread at all, operation
  order that differs between ranks, send/recv sizes that differ, unbalanced groups,
  use after abort/destroy, a lone send and recv in opposite orders (a hang in NCCL)
  each raise on a rank that sees them;
* data: send/recv and allReduce against closed-form values;
* ``NcclTransport`` over the stand-in: every communicator's collectives (blocking and on
  streams, several streams at once) against closed-form values, the README's stream
  example, and every training mode (ring/tree/master at delay 0 and 1, split-fc at delay
  0 and 1, with and without its activation stream) bit-identical to the same run over
  ``MpiTransport``, which ``test_parallel_mpi.py`` and ``test_split_fc_mpi.py`` check
  against ``single`` and the delay-1 recurrence.
"""
import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

from ringnet.comm import COMMUNICATORS, MpiTransport, NcclTransport, create
from ringnet.comm import _nccl_standin as nccl

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
N, RANK = WORLD.Get_size(), WORLD.Get_rank()
F32 = nccl.NCCL_FLOAT32


def _communicator(mpi_comm=WORLD, timeout_s=10.0):
    """A fresh stand-in communicator over ``mpi_comm`` (unique id from its rank 0)."""
    uid = mpi_comm.bcast(nccl.get_unique_id() if mpi_comm.Get_rank() == 0 else None, root=0)
    comm = nccl.NcclCommunicator(mpi_comm.Get_size(), uid, mpi_comm.Get_rank())
    comm.timeout_s = timeout_s
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


def _outcome(fn):
    try:
        fn()
    except nccl.NcclError as exc:
        return type(exc).__name__, str(exc)
    return None, ""


# -- the rules ------------------------------------------------------------------------------
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


def test_abort_fails_an_operation_in_flight_on_another_thread():
    comm = _communicator(MPI.COMM_SELF)
    buf = np.zeros(4, np.float32)
    errors = []

    def wait_forever():   # a receive from itself that nobody sends
        try:
            comm.recv(buf.ctypes.data, 4, F32, 0, 0)
        except nccl.NcclError as exc:
            errors.append(str(exc))
    thread = threading.Thread(target=wait_forever)
    thread.start()
    while comm._inside is None:
        time.sleep(1e-3)
    comm.abort()
    thread.join(10)
    assert errors and "abort" in errors[0]


def test_second_thread_raises():
    comm = _communicator(MPI.COMM_SELF)
    a, b = np.arange(4, dtype=np.float32), np.zeros(4, np.float32)

    def self_sendrecv():
        nccl.groupStart()
        comm.send(a.ctypes.data, 4, F32, 0, 0)
        comm.recv(b.ctypes.data, 4, F32, 0, 0)
        nccl.groupEnd()
    self_sendrecv()
    np.testing.assert_array_equal(b, a)
    errors = []
    thread = threading.Thread(target=lambda: errors.append(_outcome(self_sendrecv)))
    thread.start()
    thread.join(10)
    assert errors[0][0] == "NcclRuleError" and "used from two threads" in errors[0][1]


def test_two_threads_inside_at_once_raises():
    comm = _communicator(MPI.COMM_SELF)
    buf = np.zeros(4, np.float32)
    thread = threading.Thread(target=lambda: _outcome(
        lambda: comm.recv(buf.ctypes.data, 4, F32, 0, 0)))   # waits: nobody sends
    thread.start()
    while comm._inside is None:
        time.sleep(1e-3)
    with pytest.raises(nccl.NcclRuleError, match="two threads inside one communicator at once"):
        comm.send(buf.ctypes.data, 4, F32, 0, 0)
    comm.abort()
    thread.join(10)


def test_sizes_that_differ_raise_on_the_receiver():
    sub, comm = _pair()
    if comm is None:
        pytest.skip("needs ranks 0 and 1")
    buf = np.zeros(12, np.float32)
    if RANK == 0:
        kind, message = _outcome(lambda: comm.send(buf.ctypes.data, 10, F32, 1, 0))
    else:
        kind, message = _outcome(lambda: comm.recv(buf.ctypes.data, 12, F32, 0, 0))
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
                                                        nccl.NCCL_SUM, 0))
    else:
        kind, message = _outcome(lambda: comm.recv(buf.ctypes.data, 4, F32, 0, 0))
    sub.Free()
    if RANK == 0:
        assert kind == "NcclError" and "would hang" in message, message
    else:
        assert kind == "NcclRuleError" and "order differs" in message, message


def test_lone_send_and_recv_in_opposite_orders_hang_and_raise():
    sub, comm = _pair()
    if comm is None:
        pytest.skip("needs ranks 0 and 1")
    out, got = np.ones(4, np.float32), np.zeros(4, np.float32)
    peer = 1 - RANK
    comm.timeout_s = 1.5
    # Both send first, outside a group: NCCL sends wait for their receive, so both hang.
    kind, message = _outcome(lambda: comm.send(out.ctypes.data, 4, F32, peer, 0))
    sub.Barrier()       # both have given up before either takes the other's message
    comm.timeout_s = 60.0
    comm.recv(got.ctypes.data, 4, F32, peer, 0)     # the late match: both sends complete
    sub.Free()
    assert kind == "NcclError" and "would hang" in message, message
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
