"""Step statistics filled by timed spans, and a hook that lets a tracer see every span.

Code that does timed work wraps it in a span; the span's name says which total it
adds to, so no caller does ``perf_counter`` arithmetic itself::

    with strategy.stats.span("compute", phase="conv_forward"):
        ...

=================  ==============================================================
span name          adds its duration to
=================  ==============================================================
``step``           ``step_times`` (one entry, bounded: see below) and ``steps`` (+1)
``compute``        ``compute_s``: forward, backward, loss on the training thread; on
                   the CPU also ``compute_cpu_s``, the thread's CPU time in them
``update``         ``update_s``: the optimizer step (any thread)
``comm``           ``comm_total_s``: communication that may run hidden on a stream
``wait``           ``comm_wait_s``: the training thread blocked on communication
                   that runs on a stream
``exposed_comm``   ``comm_total_s`` and ``comm_wait_s``: a blocking collective on
                   the training thread (all of its time is exposed)
=================  ==============================================================

``step_times`` holds every step's time up to ``STEP_SAMPLES`` steps; past that, the first
``STEP_WARMUP`` steps and a uniform sample (reservoir sampling, seeded) of the rest, so a
run of millions of steps keeps the same few hundred KB and its median step time stays
an estimate within a percent or so.

Spans of one kind must not nest (their time would count twice); spans of different
kinds may. Totals are updated under a lock: the training thread and the stream
threads fill the same :class:`StepStats`.

**On a GPU** (``StepStats(gpu=cupy)``) the host does not wait for the device to time a
span: ``compute`` and ``update`` spans record a CUDA event on the thread's current
stream at their start and end, and their duration is the device time between the two
(``cupy.cuda.get_elapsed_time``), added to the totals once the end event has completed
(checked without blocking at every ``step`` span's end; :meth:`StepStats.resolve`
waits for the rest). The host enqueues ahead and synchronizes only where it reads a
value (the loss, a buffer MPI sends). Host-side spans (``step``, ``wait``, ``comm``,
``exposed_comm``) keep their wall-clock durations. Listeners get the host times of
every span (when it was enqueued, on the GPU).

**Tracing hook.** ``subscribe(listener)`` registers ``listener(event)``, called once
for every span that ends, on the thread that ran it, after the totals were updated
and outside the lock. ``event`` is a :class:`SpanEvent` with ``name`` (the span name),
``thread`` (the thread's name, e.g. ``MainThread`` or ``ringnet-comm-1``),
``thread_id`` (``threading.get_ident()``), ``start`` (``time.perf_counter()`` seconds),
``duration`` (seconds) and ``args`` (the keyword arguments given to ``span``, e.g.
``phase``, ``op``, ``peer``, ``bytes``). A Chrome trace event is then
``{"name": e.name, "ph": "X", "tid": e.thread_id, "ts": 1e6 * e.start,
"dur": 1e6 * e.duration, "args": e.args}``. Listeners must be thread-safe and quick;
an exception in a listener propagates to the code that ran the span.
``subscribe`` returns a function that unsubscribes. The module-level :func:`span`
times code that has no statistics of its own (a communicator's transfers): its
events reach the listeners only.
"""
import math
import random
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from ringnet.backend import get_array_module, is_gpu_array, to_numpy
from ringnet.errors import DivergedError

__all__ = ["StepStats", "SpanEvent", "span", "subscribe", "SPAN_FIELDS", "DEVICE_SPANS",
           "LossReads", "GPU_LOSS_EVERY"]

GPU_LOSS_EVERY = 50     # on a GPU the training losses are read every 50 steps (and at epoch ends)

# span name -> the StepStats totals it adds its duration to
SPAN_FIELDS = {
    "step": (),
    "compute": ("compute_s",),
    "update": ("update_s",),
    "comm": ("comm_total_s",),
    "wait": ("comm_wait_s",),
    "exposed_comm": ("comm_total_s", "comm_wait_s"),
}
# spans whose work is queued on the device: timed with CUDA events when StepStats has a GPU
DEVICE_SPANS = frozenset({"compute", "update"})


class SpanEvent(NamedTuple):
    """One finished span, as a listener receives it (see the module docstring)."""
    name: str
    thread: str
    thread_id: int
    start: float
    duration: float
    args: dict


_listeners = []
_listeners_lock = threading.Lock()


def subscribe(listener: Callable[[SpanEvent], None]) -> Callable[[], None]:
    """Call ``listener(event)`` for every span that ends from now on; return the unsubscribe function."""
    with _listeners_lock:
        _listeners.append(listener)

    def unsubscribe():
        with _listeners_lock:
            if listener in _listeners:
                _listeners.remove(listener)
    return unsubscribe


def _publish(name, start, duration, args):
    listeners = _listeners
    if listeners:
        thread = threading.current_thread()
        event = SpanEvent(name, thread.name, threading.get_ident(), start, duration, args)
        for listener in list(listeners):
            listener(event)


@contextmanager
def span(name: str, **args):
    """Time the ``with`` body and tell the listeners; fills no statistics."""
    start = time.perf_counter()
    try:
        yield
    finally:
        _publish(name, start, time.perf_counter() - start, args)


STEP_SAMPLES = 8192     # step times kept in full; beyond, a uniform sample of this size
STEP_WARMUP = 2         # the first steps (compilation, first touches) are always kept


def keep_sample(samples, value, seen, rng, limit=STEP_SAMPLES, fixed=STEP_WARMUP):
    """Add the ``seen``-th value (0-based) to ``samples``, a list bounded by ``limit``: the
    first ``fixed`` values stay, the others are a uniform reservoir sample of the rest."""
    if len(samples) < limit:
        samples.append(value)
        return
    j = rng.randrange(seen - fixed + 1)
    if j < limit - fixed:
        samples[fixed + j] = value


@dataclass
class StepStats:
    """Per-rank time totals of a training run, filled by :meth:`span`.

    ``gpu``: the CuPy module when the run's arrays live on a GPU (device spans are then
    timed with CUDA events, see the module docstring), else None.
    """
    steps: int = 0
    compute_s: float = 0.0
    compute_cpu_s: float = 0.0  # CPU time of the training thread in its compute spans (CPU only)
    comm_wait_s: float = 0.0    # time the training thread was blocked on communication
    comm_total_s: float = 0.0   # time communication took, hidden or not
    update_s: float = 0.0
    step_times: list = field(default_factory=list)
    gpu: object = field(default=None, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _pending: list = field(default_factory=list, repr=False, compare=False)
    _rng: random.Random = field(default_factory=lambda: random.Random(0), repr=False,
                                compare=False)

    @contextmanager
    def span(self, name: str, **args):
        """Time the ``with`` body, add it to the totals of ``name`` (see SPAN_FIELDS), tell the listeners."""
        fields = SPAN_FIELDS.get(name)
        if fields is None:
            raise ValueError(f"unknown statistics span {name!r}; known: {', '.join(SPAN_FIELDS)}")
        events = None
        if self.gpu is not None and name in DEVICE_SPANS:
            events = (self.gpu.cuda.Event(), self.gpu.cuda.Event())
            events[0].record()                  # on this thread's current stream
        cpu = time.thread_time() if name == "compute" and events is None else None
        start = time.perf_counter()
        try:
            yield
        finally:
            duration = time.perf_counter() - start
            if cpu is not None:
                cpu = time.thread_time() - cpu
            if events is not None:
                events[1].record()
            with self._lock:
                if events is not None:
                    self._pending.append((fields, events))
                else:
                    for name_ in fields:
                        setattr(self, name_, getattr(self, name_) + duration)
                if cpu is not None:
                    self.compute_cpu_s += cpu
                if name == "step":
                    keep_sample(self.step_times, duration, self.steps, self._rng)
                    self.steps += 1
            if name == "step" and self._pending:
                self.resolve(wait=False)
            _publish(name, start, duration, args)

    def resolve(self, wait: bool = True) -> None:
        """Add the device time of finished GPU spans to the totals (all of them when ``wait``)."""
        with self._lock:
            pending, self._pending = self._pending, []
        later = []
        for fields, (begin, end) in pending:
            if not wait and not end.done:
                later.append((fields, (begin, end)))
                continue
            end.synchronize()
            seconds = self.gpu.cuda.get_elapsed_time(begin, end) / 1000.0
            with self._lock:
                for name_ in fields:
                    setattr(self, name_, getattr(self, name_) + seconds)
        if later:
            with self._lock:
                self._pending[:0] = later

    def overlap(self) -> float:
        """Return the fraction of communication time hidden behind computation (0 without communication)."""
        self.resolve()
        with self._lock:
            total, wait = self.comm_total_s, self.comm_wait_s
        if total <= 0:
            return 0.0
        # Waiting includes a stream's start-up, so it can exceed the transfer time by a hair.
        return float(min(1.0, max(0.0, (total - wait) / total)))


class LossReads:
    """The training losses of the steps not read on the host yet.

    A GPU step leaves its loss on the device (reading it would make the host wait for the
    GPU inside every step); :meth:`add` keeps it and, once ``every`` steps are pending,
    :meth:`read` fetches all of them at once (one stack, one copy, one wait). On the CPU
    the losses are Python numbers and ``every`` is 1: each is read in its own step. The
    divergence check is made at the read: the first non-finite loss raises DivergedError
    naming its step and, when several were read together, their range. ``spe``: steps per
    epoch (for the message), ``lr``: the learning rate it suggests lowering.
    """

    def __init__(self, every, spe, lr):
        self.every, self.spe, self.lr = max(1, int(every)), int(spe), float(lr)
        self.pending = []       # [(step, loss)], in step order

    def add(self, step, loss):
        """Keep step ``step``'s ``loss``; return :meth:`read` when ``every`` are pending, else []."""
        self.pending.append((step, loss))
        return self.read() if len(self.pending) >= self.every else []

    def read(self):
        """Return [(step, loss as a float)] of every pending step, in order, and forget them."""
        if not self.pending:
            return []
        steps = [s for s, _ in self.pending]
        values = [v for _, v in self.pending]
        self.pending = []
        if is_gpu_array(values[0]):
            values = to_numpy(get_array_module(values[0]).stack(values)).tolist()
        values = [float(v) for v in values]
        for step, value in zip(steps, values):
            if not math.isfinite(value):
                read = f"; losses of steps {steps[0]}-{steps[-1]} read together" \
                    if len(steps) > 1 else ""
                raise DivergedError(f"loss is {value} at step {step} (epoch {step // self.spe + 1}"
                                    f"{read}): training diverged; try a lower --lr (now {self.lr:g})")
        return list(zip(steps, values))
