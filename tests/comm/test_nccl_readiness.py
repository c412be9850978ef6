"""NcclTransport ready for a node with several GPUs, checked through the strict stand-in.

Run: ``mpirun -np N python -m pytest --with-mpi -m mpi tests/comm/test_nccl_readiness.py`` (N = 1..4).

The stand-in (:mod:`ringnet.testing.nccl_standin`) puts world rank r on GPU ``1 + r % 7``,
runs every stream on a thread of its own and reads a write as poison until an event
orders the reader after it. Against it:

* every thread the transport makes CUDA calls on (the caller's, each stream's, the
  watchdog's) is on the rank's device, and a watchdog or a stream thread that is not
  fails the rank;
* the event waits that order a stream's work are there: a handle that skips its wait
  reads poison, a stream operation that skips the submitter's event raises where it
  reads the submitter's buffer;
* NCCL calls on the transport's communicators launch in submission order on every rank,
  and a rank that launched otherwise would be found;
* every communicator is warm after set-up, and one that is not fails the next call;
* a host wait blocks on an event and keeps the deadline: a peer that never answers ends
  the job at ``timeout_s`` with the operation named.
"""
import gc
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

from ringnet.comm import NcclTransport, create
from ringnet.testing import nccl_standin as nccl
from ringnet.comm import nccl_transport
from conftest import launcher_free_env

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
N, RANK = WORLD.Get_size(), WORLD.Get_rank()


@pytest.fixture(autouse=True)
def _no_rule_broken():
    """No test may leave a device rule broken (those that break one on purpose clear it).
    Cycles holding streams or events are collected on this thread, on the rank's device."""
    gc.collect()
    yield
    gc.collect()
    broken = nccl.violations()
    nccl.clear_violations()
    assert not broken, broken


def _transport():
    return NcclTransport(WORLD, timeout_s=30, nccl="standin")


def _gathered(length):
    """What an all-gather of rank r's shard filled with r + 1 gives (every rank the same)."""
    bounds = [(length * r // N, length * (r + 1) // N) for r in range(N)]
    out = np.zeros(length, np.float32)
    for r, (a, b) in enumerate(bounds):
        out[a:b] = r + 1
    return out, bounds


def _mine(length, bounds):
    buf = np.zeros(length, np.float32)
    a, b = bounds[RANK]
    buf[a:b] = RANK + 1
    return buf


def _wait_for_a_violation():
    """Wait (60 s at most) for a rule break recorded on another thread; return them all."""
    for _ in range(6000):
        found = nccl.violations()
        if found:
            return found
        time.sleep(0.01)
    return nccl.violations()


# -- devices -----------------------------------------------------------------------------------
def test_every_thread_of_the_transport_is_on_the_ranks_device():
    transport = _transport()
    device = transport.device_id
    assert device == nccl.device_for(RANK) != 0
    comm = create("ring", transport=transport)
    stream = comm.new_stream()
    try:
        assert stream.submit(lambda: nccl.Device().id).wait() == device
        length = 3 * N + 1
        expected, bounds = _gathered(length)
        on_stream, off_stream = _mine(length, bounds), _mine(length, bounds)
        comm.allgather(on_stream, bounds=bounds, stream=stream).wait()
        comm.allgather(off_stream, bounds=bounds)
        # the watchdog has queried and dropped the events of these operations on its thread
        watchdog = transport._watchdog
        for _ in range(6000):
            with watchdog._lock:
                if not watchdog._pending:
                    break
            time.sleep(0.01)
        assert not watchdog._pending
    finally:
        stream.close()
        transport.close()
    np.testing.assert_array_equal(on_stream, expected)
    np.testing.assert_array_equal(off_stream, expected)
    assert nccl.violations() == []


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_watchdog_off_the_ranks_device_fails_the_rank(monkeypatch):
    monkeypatch.setattr(NcclTransport, "_bind", lambda self: None)
    transport = _transport()                    # its set-up leaves events for the watchdog
    try:
        found = _wait_for_a_violation()
        assert found and "on thread 'ringnet-nccl-watchdog' uses device 0" in found[0], found
        with pytest.raises(nccl.NcclRuleError, match="ringnet-nccl-watchdog"):
            nccl.get_current_stream()
    finally:
        nccl.clear_violations()
        transport.close()


def test_a_stream_thread_off_the_ranks_device_fails_at_its_first_call(monkeypatch):
    transport = _transport()
    monkeypatch.setattr(nccl_transport.NcclStream, "_enter", lambda self: None)
    try:
        with pytest.raises(nccl.NcclRuleError, match="on thread 'ringnet-nccl-1' uses device 0"):
            transport.new_stream()
    finally:
        nccl.clear_violations()
        transport.close()


# -- event waits ---------------------------------------------------------------------------------
def _skip_the_event_wait(self, timeout=None):
    """``_NcclHandle.wait`` without its ``wait_event``: the defect this must catch."""
    if not self._event.wait(timeout):
        raise TimeoutError
    if self._error is not None:
        raise self._error
    return self._value


@pytest.mark.parametrize("skip", [False, True])
def test_a_handle_that_skips_its_event_wait_reads_poison(monkeypatch, skip):
    if N == 1:
        pytest.skip("one rank gathers nothing")
    transport = _transport()
    comm = create("ring", transport=transport)
    stream = comm.new_stream()
    length = 4 * N + 3
    expected, bounds = _gathered(length)
    buf = _mine(length, bounds)
    try:
        if skip:
            monkeypatch.setattr(nccl_transport._NcclHandle, "wait", _skip_the_event_wait)
        comm.allgather(buf, bounds=bounds, stream=stream).wait()
        seen = buf.copy()
        monkeypatch.undo()
        stream.cuda_stream.synchronize()        # a host synchronize orders everything
    finally:
        stream.close()
        transport.close()
    np.testing.assert_array_equal(buf, expected)     # the data was there all along
    a, b = bounds[RANK]
    others = np.r_[0:a, b:length]
    if skip:
        assert np.isnan(seen[others]).all() and np.array_equal(seen[a:b], expected[a:b])
    else:
        np.testing.assert_array_equal(seen, expected)


def _run_without_the_submit_wait(self, fn, args, after=None):
    """``NcclStream._run`` without its ``wait_event``: the defect this must catch."""
    _, ticket = after
    with self.transport._order.turn(ticket, "stream op"):
        with self.cuda_stream:
            value = fn(*args)
            self.cuda_stream.hand_off()
            done = self.cuda_stream.record()
    return value, done


@pytest.mark.parametrize("skip", [False, True])
def test_a_stream_op_that_skips_the_submitters_event_raises(monkeypatch, skip):
    """The caller receives into a buffer (not waited for) and hands it to a stream that
    forwards it: only the event recorded at submit orders the forward after the receive."""
    if N == 1:
        pytest.skip("one rank sends nothing")
    transport = _transport()
    stream = transport.new_stream()
    right, left = (RANK + 1) % N, (RANK - 1) % N
    mine = np.full(6, RANK + 1.0)
    got, forwarded = np.zeros(6), np.zeros(6)
    if skip:
        monkeypatch.setattr(nccl_transport.NcclStream, "_run", _run_without_the_submit_wait)
    try:
        arriving = transport.isendrecv(mine, right, got, left)     # not waited for
        handle = transport.sendrecv(got, right, forwarded, left, stream=stream)
        if skip:
            with pytest.raises(nccl.NcclRuleError, match="reads bytes that recv from rank "
                               rf"{left} of 6 x dtype 8 on stream null .* before an event"):
                handle.wait()
            nccl.get_current_stream().synchronize()     # the caller's own transfer is done
            return
        handle.wait()
        arriving.wait()
    finally:
        monkeypatch.undo()
        stream.close()
        if skip:
            transport.abort()
        transport.close()
    np.testing.assert_array_equal(got, np.full(6, left + 1.0))
    np.testing.assert_array_equal(forwarded, np.full(6, (RANK - 2) % N + 1.0))


def test_bench_comm_over_nccl_is_right_for_every_algorithm(monkeypatch, capsys):
    """The multi-GPU stage's ``bench comm --transport nccl``, through the stand-in: every
    algorithm's all-reduce equals N(N+1)/2 on every rank, also on a buffer reused across
    algorithms."""
    from ringnet.bench import comm as bench
    monkeypatch.setenv("RINGNET_NCCL", "standin")
    bench.main(["--transport", "nccl", "--algos", "ring,tree,master,auto,native",
                "--sizes", "8,4K,256K", "--iters", "2", "--warmup", "1", "--json"])
    lines = capsys.readouterr().out.strip().splitlines()
    if RANK != 0:
        return
    rows = __import__("json").loads(lines[-1])["rows"]
    assert len(rows) == 15 and all(row["ok"] for row in rows), rows


# -- launch order --------------------------------------------------------------------------------
def test_launches_come_in_submission_order():
    """A turn taken later waits for the earlier one to end, whichever thread runs first."""
    order = nccl_transport._LaunchOrder(timeout_s=30)
    with order.lock:
        early = order.take()
    log, go = [], threading.Event()

    def stream_op():
        with order.turn(early, "early"):
            log.append("early starts")
            go.wait(30)
            log.append("early ends")

    def later_call():
        with order.turn(what="later"):
            log.append("later")
    late = threading.Thread(target=later_call)
    late.start()                    # takes the next ticket before the early one runs
    late.join(0.5)
    first = threading.Thread(target=stream_op)
    first.start()
    go.set()
    first.join(30)
    late.join(30)
    assert log == ["early starts", "early ends", "later"]


def test_a_stream_op_submitted_first_launches_first_on_every_rank():
    """Rank 0's stream starts its all-gather late; the caller's own all-gather, submitted
    after it, still launches after it there as everywhere (the stand-in compares the ranks'
    launch orders and raises where they differ)."""
    if N == 1:
        pytest.skip("one rank sends nothing")
    transport = _transport()
    comm = create("ring", transport=transport)
    stream = comm.new_stream()
    length = 2 * N + 1
    expected, bounds = _gathered(length)
    first, second = _mine(length, bounds), _mine(length, bounds)
    go, launched = threading.Event(), threading.Event()

    def late_allgather():
        go.wait(30)
        comm.allgather(first, bounds=bounds)
        launched.set()
    if RANK == 0:
        threading.Timer(1.0, go.set).start()
    else:
        go.set()
    try:
        handle = stream.submit(late_allgather)
        if RANK != 0:
            launched.wait(30)
        comm.allgather(second, bounds=bounds)
        handle.wait()
    finally:
        stream.close()
        transport.close()
    np.testing.assert_array_equal(first, expected)
    np.testing.assert_array_equal(second, expected)


# -- warm-up -------------------------------------------------------------------------------------
def test_every_communicator_is_warm_after_set_up():
    transport = _transport()
    streams = [transport.new_stream(), transport.new_stream()]
    try:
        assert len(transport._comms) == 3
        assert all(not comm._cold for comm in transport._comms.values())
    finally:
        for stream in streams:
            stream.close()
        transport.close()


def test_a_stream_without_warm_up_fails_the_next_call(monkeypatch):
    if N == 1:
        pytest.skip("one rank connects nothing")
    transport = _transport()
    monkeypatch.setattr(NcclTransport, "_warm_up", lambda self, what: None)
    stream = transport.new_stream()
    buf = np.ones(5)
    try:
        with pytest.raises(nccl.NcclRuleError, match="is not warmed up"):
            create("ring", transport=transport).allreduce(buf)
    finally:
        stream.close()
        transport.abort()
        transport.close()


# -- waits and their deadline -------------------------------------------------------------------
@pytest.mark.parametrize("call, what", [("transport.recv(np.zeros(2), 1)",
                                          "recv from rank 1 of 16 bytes"),
                                         ("transport.allreduce_native(np.zeros(2))",
                                          "allreduce  of 16 bytes")])
def test_a_peer_that_never_answers_ends_the_job_at_the_deadline(tmp_path, call, what):
    """Rank 0 waits (on an event) for an operation rank 1 never joins: at the deadline the
    wait raises CommTimeoutError, and the watchdog names the operation, aborts NCCL and
    ends the job, whatever the caller does next."""
    import shutil
    if RANK != 0:
        pytest.skip("rank 0 runs the job")
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not on PATH")
    script = tmp_path / "job.py"
    script.write_text(
        "import time\n"
        "import numpy as np\n"
        "from mpi4py import MPI\n"
        "from ringnet.comm import CommTimeoutError, NcclTransport\n"
        "transport = NcclTransport(MPI.COMM_WORLD, timeout_s=2, nccl='standin')\n"
        "if MPI.COMM_WORLD.Get_rank() == 0:\n"
        "    try:\n"
        f"        {call}\n"
        "    except CommTimeoutError as exc:\n"
        "        print(f'caught: {exc}', flush=True)\n"
        "    else:\n"
        "        print('the receive returned', flush=True)\n"
        "time.sleep(120)   # the watchdog ends the job meanwhile\n")
    # A job the watchdog did not end would sleep past the subprocess limit and fail here.
    run = subprocess.run(["mpirun", "-np", "2", sys.executable, str(script)], capture_output=True,
                         text=True, timeout=100, env=launcher_free_env("RINGNET_"))
    output = run.stdout + run.stderr
    assert run.returncode != 0 and "the receive returned" not in output, output
    assert f"caught: {what} did not complete within 2 s" in output, output
    assert (f"[rank 0] ringnet: error: {what} over NCCL did not complete within 2 s; aborting "
            "the NCCL communicators") in output, output
