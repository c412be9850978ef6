"""Overlap of communication with computation, in one process.

* delay-0 buckets: a bucket's exchange starts while the backward of earlier layers still
  runs (a recorded order of events, with a fake communicator), and the bucketed update
  is bit-identical to the unbucketed one;
* driven progress: a CPU stream's thread sleeps on a transfer and never tests it
  again itself; the thread that waits (or the training thread's ``progress``) completes it.
"""
import threading
import time

import numpy as np
import pytest

from ringnet.comm.stream import CpuStream, progress_all
from ringnet.models import build_model
from ringnet.optim import SGD, LRPolicy
from ringnet.parallel.plans import ShardedPlan, backward_buckets
from ringnet.parallel.ring import RingStrategy
from ringnet.parallel.tree import TreeStrategy

WAIT_S = 30.0       # generous: the machine is shared


class _RecordingComm:
    """A one-rank stand-in for a communicator: collectives only record that they ran."""
    rank, size = 0, 1
    transport = None

    def __init__(self):
        self.log = []
        self.lock = threading.Lock()
        self.reduced = threading.Condition(self.lock)

    def shard_bounds(self, length):
        return [(0, length)]

    def new_stream(self):
        return CpuStream(tag=1)

    def _record(self, what, buf):
        with self.lock:
            self.log.append((what, buf.size))
            self.reduced.notify_all()

    def reduce_scatter(self, buf, op="sum", bounds=None):
        self._record("reduce", buf)

    def allgather(self, buf, bounds=None):
        self._record("distribute", buf)

    def reduce(self, buf, root=0, op="sum"):
        self._record("reduce", buf)

    def bcast(self, buf, root=0):
        self._record("distribute", buf)


def _batch(model, n=4, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, *model.input_shape)), rng.integers(0, model.num_classes, n)


def _optimizer(n):
    return SGD(n, LRPolicy("fixed", 0.05), momentum=0.9, weight_decay=5e-4, dtype="float64")


def test_backward_buckets_follow_layers_last_first():
    model = build_model("cifar10_quick", dtype="float64")
    offsets = model.param_offsets()
    buckets = backward_buckets(model, len(model.layers), 256 * 1024)
    # contiguous, covering, from the end of the buffer to its start
    assert buckets[0][1] == model.num_params and buckets[-1][0] == 0
    assert all(buckets[i][0] == buckets[i + 1][1] for i in range(len(buckets) - 1))
    assert len(buckets) >= 3
    # each bucket starts at a layer's first parameter, and is ready after that layer's backward
    names = [name for name, _ in model.layers]
    for lo, _, layer in buckets:
        assert offsets[f"{names[layer]}.weight"][0] == lo
    # one bucket per parameter layer at a tiny size; none at size 0 or where one would hold all
    per_layer = backward_buckets(model, len(model.layers), 1)
    assert len(per_layer) == len({n.split(".")[0] for n in offsets})
    assert backward_buckets(model, len(model.layers), 0) == []
    assert backward_buckets(model, len(model.layers), model.params.nbytes) == []
    assert backward_buckets(model, 1, 1) == []       # the first layer alone


@pytest.mark.parametrize("strategy_class", [RingStrategy, TreeStrategy])
def test_a_bucket_is_exchanged_while_the_first_layers_still_run_backward(strategy_class):
    """The first layer's backward waits until the exchange of the last layers' bucket
    started: if exchanges started only after the backward, it would wait in vain."""
    model = build_model("cifar10_quick", dtype="float64", seed=1)
    comm = _RecordingComm()
    strategy = strategy_class(model, _optimizer, None, comm, delay=0, bucket_size=256 * 1024)
    assert len(strategy.buckets) >= 3
    first_lo, first_hi, _ = strategy.buckets[0]
    first_layer = model.layers[0][1]
    backward = first_layer.backward

    def first_layer_backward(d):
        with comm.lock:
            comm.reduced.wait_for(lambda: ("reduce", first_hi - first_lo) in comm.log, WAIT_S)
            comm.log.append(("backward of the first layer", None))
        return backward(d)
    first_layer.backward = first_layer_backward
    try:
        strategy.step(*_batch(model), 0)
    finally:
        strategy.close()
    log = comm.log
    assert ("backward of the first layer", None) in log
    first_exchange = log.index(("reduce", first_hi - first_lo))
    assert first_exchange < log.index(("backward of the first layer", None)), \
        f"the first bucket's exchange started only after the backward: {log}"
    # every bucket was exchanged exactly once, last layers first
    sizes = [hi - lo for lo, hi, _ in strategy.buckets]
    assert [n for what, n in log if what == "reduce"] == sizes
    assert [n for what, n in log if what == "distribute"] == sizes


@pytest.mark.parametrize("strategy_class", [RingStrategy, TreeStrategy])
def test_bucketed_update_is_bit_identical_to_the_whole_update(strategy_class):
    """Each bucket updates its slice of the weights and of the momentum: the same bits."""
    results = []
    for bucket_size in (0, 1, 64 * 1024):
        model = build_model("cifar10_quick", dtype="float64", seed=2)
        strategy = strategy_class(model, _optimizer, None, _RecordingComm(), delay=0,
                                  bucket_size=bucket_size)
        for it in range(3):
            strategy.step(*_batch(model, seed=it), it)
        strategy.close()
        results.append((len(strategy.buckets), model.params.copy(),
                        strategy.optimizer.v.copy()))
    (n0, w0, v0), (n1, w1, v1), (n2, w2, v2) = results
    assert n0 == 0 and n1 == 5 and 1 < n2 < n1
    assert np.abs(w0 - build_model("cifar10_quick", dtype="float64", seed=2).params).max() > 0
    for w, v in ((w1, v1), (w2, v2)):
        assert np.array_equal(w, w0) and np.array_equal(v, v0)


def test_sharded_part_keeps_every_elements_owner():
    class Comm:
        rank, size = 1, 3

        def shard_bounds(self, n):
            return [(0, 4), (4, 7), (7, 10)]
    plan = ShardedPlan(Comm(), 10)
    part = plan.part(3, 8)
    assert part.bounds == [(0, 1), (1, 4), (4, 5)]
    assert part.owned == slice(1, 4)
    assert plan.part(8, 10).bounds == [(0, 0), (0, 0), (0, 2)]
    assert plan.part(8, 10).owned == slice(0, 0)


def test_a_driven_stream_sleeps_on_a_transfer_until_another_thread_sees_it_done():
    stream = CpuStream(tag=7, progress="driven")
    calls = []
    done = threading.Event()

    def test():
        calls.append(threading.current_thread().name)
        return done.is_set()
    try:
        handle = stream.submit(stream.wait_transfer, test, None, WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while stream._test is None and time.monotonic() < deadline:
            time.sleep(0.001)
        progress_all()                              # not done yet: the thread keeps sleeping
        time.sleep(0.05)
        assert not handle.done() and calls, "progress did not test the transfer"
        done.set()
        assert handle.wait(WAIT_S) is True          # the waiter drives the last test
        assert calls and set(calls) == {threading.main_thread().name}, \
            f"the stream's own thread tested its transfer: {calls}"
        # nobody drives: the transfer's deadline expires on the stream's thread
        assert stream.submit(stream.wait_transfer, lambda: False, None, 0.05).wait(WAIT_S) is False
    finally:
        stream.close()


def test_a_polling_stream_tests_on_its_own_thread():
    """The contrast of the test above (and what makes it able to fail)."""
    from ringnet.comm.mpi_transport import MpiTransport
    from mpi4py import MPI
    for mode, own_thread in (("poll", True), ("driven", False)):
        transport = MpiTransport(MPI.COMM_SELF, device="cpu")
        threads = []
        real_test = transport._test

        def test(requests, real_test=real_test):
            threads.append(threading.current_thread().name)
            return real_test(requests)
        transport._test = test
        stream = CpuStream(tag=3, progress=mode)
        send = np.arange(1 << 20, dtype=np.float64)
        recv = np.zeros_like(send)
        try:
            # 8 MiB: the send cannot complete before its receive is posted, 0.1 s later
            handle = stream.submit(transport.send, send, 0)
            deadline = time.monotonic() + WAIT_S
            while not threads and time.monotonic() < deadline:     # the send is posted
                time.sleep(0.001)
            time.sleep(0.1)
            transport.mpi_comm.Recv(recv, source=0, tag=stream.tag)
            handle.wait(WAIT_S)
        finally:
            stream.close()
            transport.close()
        assert np.array_equal(send, recv)
        later = threads[1:]     # the first test is the transport's own check on posting
        assert later, f"{mode}: the transfer completed on the first test"
        on_stream = any(name.startswith("ringnet-comm") for name in later)
        assert on_stream == own_thread, f"{mode}: tests ran on {set(later)}"


def test_bench_overlap_prints_a_row_per_variant():
    """A shortened run of the documented command (2 steps, 1 round, three variants)."""
    from conftest import ENV
    import subprocess
    import sys
    cmd = [sys.executable, "-m", "ringnet.bench", "overlap", "--model", "lenet", "--steps", "2",
           "--repeats", "1", "--modes", "ring,tree",
           "--variants", "0:driven:0,0:driven:default,1:poll:default,1:driven:default"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] in
            (["single"], ["ring"], ["tree"])]
    assert [r[:2] for r in rows] == [["single", "0"]] + [[m, d] for m in ("ring", "tree")
                                                        for d in ("0", "0", "1", "1")]
    assert "load average" in proc.stdout
    # delay-1 rows carry the ratio to the default delay-0 row of their mode
    assert all(float(r[-1]) > 0 for r in rows if r[1] == "1")
    bad = subprocess.run(cmd[:4] + ["--variants", "2:spin:x"], capture_output=True, text=True,
                         env=ENV, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("ringnet: error: --variants")
    assert "Traceback" not in bad.stderr


@pytest.mark.parametrize("bucket_size", [0, 256 * 1024])
@pytest.mark.parametrize("delay", [0, 1])
def test_the_engine_takes_a_stream_where_the_model_prices_the_stream_s_cpu(delay, bucket_size):
    """The exchange engine runs the exchange on a stream at delay 1 and in delay-0 buckets,
    else on the training thread: ``exchange_on_stream``, the rule the performance model's
    ``transfer_cpu_s`` prices the transfers' CPU by; for the code's own bucket size the
    model's buckets are the engine's."""
    from ringnet.parallel.plans import exchange_on_stream
    from ringnet.perfmodel import sends
    from ringnet.perfmodel.codefacts import facts, code_facts
    model = build_model("cifar10_quick", dtype="float64", seed=3)
    strategy = RingStrategy(model, _optimizer, None, _RecordingComm(), delay=delay,
                            bucket_size=bucket_size)
    try:
        on_stream = strategy.engine.stream is not None
        assert on_stream == exchange_on_stream(delay, strategy.buckets)
        assert on_stream == bool(delay or bucket_size)
        with facts(dict(code_facts(), bucket_bytes=bucket_size)):
            _, _, buckets = sends.step(model, "ring", 4, 64, delay)
        assert [(lo, hi) for lo, hi, _ in buckets] == \
            [(lo, hi) for lo, hi, _ in strategy.buckets]
    finally:
        strategy.close()
