"""ringnet.stats: spans fill the right totals, under a lock, and reach subscribed listeners.

The clock is replaced by a counter, so every duration is known exactly.
"""
import threading
import time

import pytest

from ringnet import stats as stats_module
from ringnet.stats import SPAN_FIELDS, StepStats, span, subscribe


class _Tick(float):
    """A clock reading whose differences force a thread switch when added to a total:
    an update that is not under the lock then loses other threads' additions."""

    def __sub__(self, other):
        return _Tick(float(self) - float(other))

    def __radd__(self, other):
        time.sleep(1e-4)            # let another thread run between read and write
        return float(other) + float(self)


@pytest.fixture
def clock(monkeypatch):
    """Each perf_counter() call from the test advances by exactly 1 s.

    ``time.perf_counter`` is the process's clock: threads left by earlier tests in the
    same worker read it too. Only the test's own thread and the threads it starts see
    the counter; threads alive before the test keep the real clock, so their reads
    cannot move the test's durations."""
    state = {"now": 0.0}
    real = time.perf_counter
    before = {t.ident for t in threading.enumerate()} - {threading.get_ident()}

    def tick():
        if threading.get_ident() in before:
            return real()
        state["now"] += 1.0
        return _Tick(state["now"])
    monkeypatch.setattr(stats_module.time, "perf_counter", tick)
    return state


def test_each_span_adds_to_its_totals(clock):
    st = StepStats()
    with st.span("step"):
        with st.span("compute"):
            pass
        with st.span("exposed_comm"):
            pass
    with st.span("comm"):
        pass
    with st.span("wait"):
        pass
    with st.span("update"):
        pass
    assert st.compute_s == 1 and st.update_s == 1
    assert st.comm_total_s == 2          # exposed_comm + comm
    assert st.comm_wait_s == 2           # exposed_comm + wait
    assert st.steps == 1 and st.step_times == [5.0]   # 5 clock reads inside the step span
    assert st.overlap() == 0.0           # wait == total: nothing hidden
    assert set(SPAN_FIELDS) == {"step", "compute", "update", "comm", "wait", "exposed_comm"}


@pytest.fixture
def reader():
    """A thread that reads the clock without pause, started before the test's clock."""
    stop = threading.Event()
    reads = [0]

    def read():
        while not stop.is_set():
            time.perf_counter()
            reads[0] += 1
            time.sleep(0)
    t = threading.Thread(target=read, daemon=True)
    t.start()
    yield reads
    stop.set()
    t.join()


def test_a_thread_older_than_the_test_does_not_move_its_clock(reader, clock):
    st = StepStats()
    for _ in range(200):
        with st.span("step"):
            with st.span("compute"):
                time.sleep(0)
    assert reader[0] > 0
    assert st.step_times == [3.0] * 200 and st.compute_s == 200


def test_unknown_span_name_is_refused():
    with pytest.raises(ValueError, match="unknown statistics span 'computee'"):
        with StepStats().span("computee"):
            pass


def test_overlap_is_hidden_fraction(clock):
    st = StepStats()
    for _ in range(3):
        with st.span("comm"):
            pass
    with st.span("wait"):
        pass
    assert st.overlap() == pytest.approx(2 / 3)


def test_spans_from_many_threads_lose_no_time(clock):
    st = StepStats()
    threads, per_thread = 4, 30
    durations = []
    unsubscribe = subscribe(lambda event: durations.append(event.duration))

    def work():
        for _ in range(per_thread):
            with st.span("comm"):
                pass
    pool = [threading.Thread(target=work) for _ in range(threads)]
    try:
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    finally:
        unsubscribe()
    assert len(durations) == threads * per_thread
    assert st.comm_total_s == sum(durations), "a concurrent update was lost"


def test_listener_sees_every_span_with_thread_and_args(clock):
    seen = []
    unsubscribe = subscribe(seen.append)
    try:
        st = StepStats()
        with st.span("compute", phase="conv_forward"):
            pass

        def other():
            with span("send", peer=1, bytes=64):
                pass
        t = threading.Thread(target=other, name="ringnet-comm-7")
        t.start()
        t.join()
    finally:
        unsubscribe()
    with st.span("compute"):
        pass                             # after unsubscribing: not seen
    assert [(e.name, e.thread, e.args) for e in seen] == [
        ("compute", threading.current_thread().name, {"phase": "conv_forward"}),
        ("send", "ringnet-comm-7", {"peer": 1, "bytes": 64})]
    assert seen[0].duration == 1.0 and seen[0].start == 1.0
    assert seen[1].thread_id != seen[0].thread_id


def test_a_delay1_ring_step_reports_its_phases_and_the_stream_thread():
    """What a tracer receives from training: the step, its compute, and the exchange's
    communication and update on the communication stream's thread."""
    import numpy as np
    from mpi4py import MPI

    from ringnet.comm import create
    from ringnet.models import build_model
    from ringnet.optim import SGD, LRPolicy
    from ringnet.parallel.ring import RingStrategy

    model = build_model("digits", dtype="float64", seed=0)
    ring = create("ring", transport="mpi", mpi_comm=MPI.COMM_SELF)
    strategy = RingStrategy(model, lambda n: SGD(n, LRPolicy("fixed", 0.01), dtype="float64"),
                            MPI.COMM_SELF, ring, delay=1)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(4, 1, 8, 8)), rng.integers(0, 10, 4)
    seen = []
    unsubscribe = subscribe(seen.append)
    try:
        for it in range(2):
            strategy.step(x, y, it)
        strategy.drain()
    finally:
        unsubscribe()
        strategy.close()
    main = threading.current_thread().name
    names = {(e.name, e.thread == main) for e in seen}
    assert {("step", True), ("compute", True), ("comm", False), ("update", False)} <= names, names
    comm = [e for e in seen if e.name == "comm"]
    assert {e.args["op"] for e in comm} == {"reduce", "distribute"}
    assert all(e.args["bytes"] == model.num_params * 8 for e in comm)
    assert strategy.stats.steps == 2 and len(strategy.stats.step_times) == 2


class _FakeCuda:
    """The part of ``cupy.cuda`` GPU spans use: events on a device clock the test moves."""

    def __init__(self):
        self.device_now = 0.0           # ms
        self.finished = True            # whether recorded events have completed
        self.waits = 0                  # Event.synchronize calls (host waits)
        cuda = self

        class Event:
            def record(self, stream=None):
                self.at = cuda.device_now

            @property
            def done(self):
                return cuda.finished

            def synchronize(self):
                cuda.waits += 1
        self.Event = Event

    def get_elapsed_time(self, start, end):
        return end.at - start.at


class _FakeCupy:
    def __init__(self):
        self.cuda = _FakeCuda()


def test_gpu_spans_take_device_time_from_events_without_waiting_in_the_step(clock):
    """compute/update on a GPU: the event interval, added once the end event is done;
    host spans keep the host clock; the step never waits for the device."""
    gpu = _FakeCupy()
    st = StepStats(gpu=gpu)
    gpu.cuda.finished = False                   # the device lags the host
    with st.span("step"):
        with st.span("compute"):
            gpu.cuda.device_now += 250.0        # 0.25 s of kernels between the two events
        with st.span("update"):
            gpu.cuda.device_now += 40.0
        with st.span("wait"):
            pass
    assert gpu.cuda.waits == 0                  # nothing blocked the host
    assert st.compute_s == 0 and st.update_s == 0, "device spans counted before they finished"
    assert st.comm_wait_s == 1                  # a host span: one clock tick
    assert st.steps == 1
    gpu.cuda.finished = True
    with st.span("step"):                       # the next step's end collects finished spans
        pass
    assert st.compute_s == pytest.approx(0.25) and st.update_s == pytest.approx(0.04)
    assert gpu.cuda.waits == 2
    gpu.cuda.finished = False
    with st.span("compute"):
        gpu.cuda.device_now += 10.0
    st.resolve()                                # the end of a run waits for the rest
    assert st.compute_s == pytest.approx(0.26)


def test_cpu_spans_record_no_events(clock):
    st = StepStats()
    with st.span("compute"):
        pass
    assert st.compute_s == 1 and not st._pending


def test_step_times_stay_bounded_and_keep_the_median():
    """A long run keeps at most STEP_SAMPLES step times: the warm-up steps and a uniform
    sample of the rest, whose median is within a percent of the true one."""
    import random
    import statistics
    from ringnet import stats
    st = StepStats()
    rng = random.Random(7)
    every = [rng.lognormvariate(-5, 0.3) for _ in range(200_000)]
    every[:2] = [3.0, 2.0]                      # slow first steps
    for value in every:
        stats.keep_sample(st.step_times, value, st.steps, st._rng)
        st.steps += 1
    assert len(st.step_times) == stats.STEP_SAMPLES and st.steps == len(every)
    assert st.step_times[:2] == [3.0, 2.0]
    true = statistics.median(every[2:])
    assert abs(statistics.median(st.step_times[2:]) / true - 1) < 0.01
    # below the bound every time is kept, in order
    short = StepStats()
    for i, value in enumerate(every[:100]):
        stats.keep_sample(short.step_times, value, i, short._rng)
    assert short.step_times == every[:100]


def test_compute_spans_count_the_thread_s_cpu_time_not_its_waits():
    """``compute_cpu_s`` is the training thread's CPU time in its compute spans: a span that
    sleeps adds its wall time to ``compute_s`` and next to nothing to it, one that computes
    adds what it computed; other spans add nothing to it."""
    st = StepStats()
    with st.span("compute"):
        time.sleep(0.05)
    assert st.compute_s >= 0.05 and st.compute_cpu_s < 0.01
    start = time.thread_time()
    with st.span("compute"):
        while time.thread_time() - start < 0.03:
            pass
    assert 0.03 <= st.compute_cpu_s <= st.compute_s
    before = st.compute_cpu_s
    with st.span("update"):
        while time.thread_time() - start < 0.05:
            pass
    assert st.compute_cpu_s == before
