"""Per-rank timelines of a training run as one Chrome trace event file (``--trace PATH``).

Open the file in https://ui.perfetto.dev or chrome://tracing: one process per rank, one
lane per thread (the training thread and each communication stream), one box per timed
span. Every span ringnet times (see :mod:`ringnet.stats`) becomes a complete event::

    {"name": "forward conv1", "cat": "forward", "ph": "X", "pid": RANK, "tid": LANE,
     "ts": MICROSECONDS, "dur": MICROSECONDS, "args": {...}}

``cat`` is the span's kind (``step``, ``data``, ``compute``, ``forward``, ``backward``,
``loss``, ``update``, ``wait``, ``comm``, ``transfer``, ...); ``args`` hold what the span
was given (a transfer's ``peer`` and ``bytes``, a step's number). ``ts`` counts on rank 0's
clock from a barrier all ranks pass when tracing starts. Each rank's clock is tied to rank
0's by ping-pong when tracing starts and again when it ends (:func:`align_clocks`; a drift
between the two, as between nodes, is interpolated, and both ends of every span are mapped,
so spans nested on a rank stay nested in the file), so lanes of different ranks line up to
within half the shortest round trip, microseconds on one node; ``otherData.clock_alignment``
gives each rank's offset and that bound, and ``otherData.origin_s`` is ts 0 as rank 0's
``time.perf_counter()`` reading (CLOCK_MONOTONIC on Linux, one clock for every process of a
host: a program beside the run places its own events on the timeline with it). Spans are
host time: over NCCL on a GPU a ``transfer`` span covers the enqueueing of the send and
receive (``"enqueued": true``), the transfer itself runs later on the CUDA stream; the
statistics time GPU compute and update with CUDA events instead (see :mod:`ringnet.stats`).
Each rank collects its events in memory; at the end rank 0 gathers them and writes the file
atomically.
"""
import contextlib
import dataclasses
import json
import math
import os
import threading
import time

import numpy as np

from ringnet import stats
from ringnet.errors import UsageError
from ringnet.progress import write_json
from ringnet.control import agree, comm_timeout, stall_error

__all__ = ["Tracer", "load", "check_trace_path", "active", "recording", "span", "timed", "align_clocks"]

recording = 0                       # Tracers recording now (read it, never set it)
_NULL = contextlib.nullcontext()


def active():
    """Return True while a Tracer records (fine-grained spans are skipped otherwise)."""
    return recording > 0


def span(name, **args):
    """A :func:`ringnet.stats.span` while a Tracer records, else a no-op context.

    For spans too frequent to time in every run (one per layer, one per transfer):
    the no-op costs a function call, a timed span several microseconds.
    """
    return stats.span(name, **args) if recording else _NULL


def timed(batches, name="data", totals=None):
    """Yield the items of ``batches``, each fetch inside a ``name`` span while tracing.

    ``totals``: a dict whose ``totals[name]`` gains each fetch's wall time (the training
    loop's ``data_s``), so the summary and the trace's spans time the same interval.
    """
    iterator = iter(batches)
    while True:
        t0 = time.perf_counter()
        with span(name):
            item = next(iterator, _NULL)
        if totals is not None:
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - t0
        if item is _NULL:
            return
        yield item


def check_trace_path(path, example="trace.json"):
    """Raise SetupError unless the trace file ``path`` (or another file the run writes at
    its end, named like ``example``) can be created (missing folders are made).

    The message starts with ``path``; the command line adds the flag that gave it.
    """
    from ringnet.errors import SetupError
    existing = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(existing):          # the first folder that exists must be writable
        parent = os.path.dirname(existing)
        if parent == existing or os.path.exists(existing):
            raise SetupError(f"{path}: {existing} is not a folder")
        existing = parent
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SetupError(f"{path}: folder {existing} is not writable")
    if os.path.isdir(path):
        raise SetupError(f"{path} is a folder; give a file name such as {example}")


def _display_name(name, args):
    """Name shown on the box: the kind plus what it was about (layer, op, peers)."""
    detail = args.get("layer") or args.get("phase") or args.get("op")
    if detail and detail != name:
        name = f"{name} {detail}"
    for key in ("to", "from"):
        if args.get(key) is not None:
            name = f"{name} {key} {args[key]}"
    return name


# Ping-pongs per rank when the clocks are tied together, and their tag (not agree()'s).
CLOCK_SAMPLES = 16
_CLOCK_TAG = 0x5243
_CLOCK_SPIN_S = 0.001


@dataclasses.dataclass(frozen=True)
class ClockSync:
    """One rank's clock against rank 0's: ``offset`` (this clock minus rank 0's, seconds) as
    read at ``at`` (this clock), good to ``error`` (half the round trip it was read in);
    ``origin``: the value rank 0 passed to :func:`align_clocks`."""
    at: float
    offset: float
    error: float
    origin: float = None


def _await(request, peer, start, timeout):
    """Wait for ``request``: yielding polls for a moment (a round trip is being timed), then
    sleeps; StallError naming ``peer`` ``timeout`` s after ``start``."""
    spin_until = time.perf_counter() + _CLOCK_SPIN_S
    pause = 1e-5
    while not request.Test():
        now = time.perf_counter()
        if now - start > timeout:
            raise stall_error([peer], "trace clock alignment", timeout)
        if now < spin_until:
            os.sched_yield()
        else:
            time.sleep(pause)
            pause = min(1e-3, 2 * pause)


def align_clocks(world, origin=None, samples=CLOCK_SAMPLES, clock=time.perf_counter,
                 timeout=None):
    """Return this rank's :class:`ClockSync` against rank 0 (collective over ``world``).

    Every other rank sends rank 0 ``samples`` pings in turn; rank 0 answers each with its
    ``clock``'s reading (and ``origin``, which every rank gets back). A rank keeps the
    answer with the shortest round trip and takes it as read at that trip's midpoint
    (Cristian's method), so its offset is off by at most half that round trip. Raises
    StallError when rank 0 or a peer does not answer within ``timeout`` (default: the
    communication deadline, ``RINGNET_COMM_TIMEOUT``).
    """
    if world is None or world.Get_size() == 1:
        return ClockSync(clock(), 0.0, 0.0, origin)
    if timeout is None:
        try:
            timeout = comm_timeout()
        except UsageError:      # reported where the deadline is read for training
            timeout = 300.0
    rank, size = world.Get_rank(), world.Get_size()
    start = time.perf_counter()
    if rank == 0:
        ping, pong = np.empty(1), np.empty(2)
        for peer in range(1, size):
            for _ in range(samples):
                _await(world.Irecv(ping, source=peer, tag=_CLOCK_TAG), peer, start, timeout)
                pong[:] = clock(), (math.nan if origin is None else origin)
                _await(world.Isend(pong, dest=peer, tag=_CLOCK_TAG), peer, start, timeout)
        return ClockSync(clock(), 0.0, 0.0, origin)
    ping, pong = np.zeros(1), np.empty(2)
    best = None
    for _ in range(samples):
        recv = world.Irecv(pong, source=0, tag=_CLOCK_TAG)
        t1 = clock()
        send = world.Isend(ping, dest=0, tag=_CLOCK_TAG)
        _await(recv, 0, start, timeout)
        t2 = clock()
        _await(send, 0, start, timeout)
        if best is None or t2 - t1 < 2 * best.error:
            best = ClockSync((t1 + t2) / 2, (t1 + t2) / 2 - float(pong[0]), (t2 - t1) / 2,
                             None if math.isnan(pong[1]) else float(pong[1]))
    return best


def drift(first, last):
    """Return how fast this clock's offset from rank 0's changes between two
    :class:`ClockSync` readings (seconds per second; 0 where both are the same)."""
    return (last.offset - first.offset) / (last.at - first.at) if last.at != first.at else 0.0


def on_reference_clock(t, first, last):
    """Return local time ``t`` on rank 0's clock, the offset interpolated linearly between
    two :class:`ClockSync` readings (``first`` alone where both are the same)."""
    return t - (first.offset + drift(first, last) * (t - first.at))


class Tracer:
    """Collect this rank's spans from :func:`ringnet.stats.subscribe` until :meth:`close`.

    Creating and closing a Tracer are collective over ``world`` (a barrier, a gather).
    """

    def __init__(self, world, path):
        self.world, self.path = world, path
        self.rank = world.Get_rank()
        self._events = []
        self._lock = threading.Lock()
        self._lanes = {}                      # thread id -> (lane number, thread name)
        agree(world, None)                 # a barrier under the deadline
        # every rank's spans are placed on rank 0's clock, counted from rank 0's t0
        self._syncs = [align_clocks(world, origin=time.perf_counter())]
        self.t0 = self._syncs[0].origin
        self._unsubscribe = stats.subscribe(self._record)
        global recording
        recording += 1

    def _record(self, event):
        with self._lock:
            lane = self._lanes.get(event.thread_id)
            if lane is None:
                lane = self._lanes[event.thread_id] = (len(self._lanes), event.thread)
            self._events.append((event.name, lane[0], event.start, event.duration, event.args))

    def events(self):
        """Return this rank's Chrome trace events (metadata first)."""
        with self._lock:
            recorded, lanes = list(self._events), dict(self._lanes)
        out = [{"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0,
                "args": {"name": f"rank {self.rank}"}},
               {"name": "process_sort_index", "ph": "M", "pid": self.rank, "tid": 0,
                "args": {"sort_index": self.rank}}]
        for lane, thread in lanes.values():
            label = "training" if thread == "MainThread" else thread
            out.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": lane,
                        "args": {"name": label}})
            out.append({"name": "thread_sort_index", "ph": "M", "pid": self.rank, "tid": lane,
                        "args": {"sort_index": 0 if thread == "MainThread" else lane + 1}})
        for name, lane, start, duration, args in recorded:
            ts, dur = self._placed(start, duration)
            out.append({"name": _display_name(name, args), "cat": name, "ph": "X",
                        "pid": self.rank, "tid": lane, "ts": ts, "dur": dur,
                        "args": {k: _plain(v) for k, v in args.items()}})
        return out

    def _placed(self, start, duration):
        """A span's ``ts`` and ``dur`` (us) on rank 0's clock: both of its ends mapped, so a
        span that lies within another on this rank lies within it in the trace whatever
        drift the alignments measured (mapping the start alone moves a span's end by the
        drift times its start, and a short one could cross its parent's end); ``dur`` is
        the rounded end less the rounded start."""
        begin = round((self._on_rank0(start) - self.t0) * 1e6, 3)
        end = round((self._on_rank0(start + duration) - self.t0) * 1e6, 3)
        return begin, round(end - begin, 3)

    def _on_rank0(self, t):
        return on_reference_clock(t, self._syncs[0], self._syncs[-1])

    def clock_alignment(self):
        """This rank's offset from rank 0 (us), the bound on its error (us), and the drift
        between the two alignments (parts per million)."""
        a, b = self._syncs[0], self._syncs[-1]
        return {"rank": self.rank, "offset_us": round(a.offset * 1e6, 3),
                "error_us": round(max(a.error, b.error) * 1e6, 3),
                "drift_ppm": round(drift(a, b) * 1e6, 3)}

    def stop(self):
        """Stop collecting (idempotent; not collective)."""
        global recording
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
            recording -= 1

    def close(self, metadata=None):
        """Stop collecting; rank 0 gathers every rank's events and writes the file (collective)."""
        self.stop()
        if len(self._syncs) == 1:
            self._syncs.append(align_clocks(self.world))
        gathered = agree(self.world, (self.events(), self.clock_alignment()),
                         root=0)                            # under the deadline
        if self.rank != 0:
            return None
        events = [e for rank_events, _ in gathered for e in rank_events]
        other = {k: _plain(v) for k, v in (metadata or {}).items()}
        other["clock_alignment"] = [alignment for _, alignment in gathered]
        other["origin_s"] = self.t0
        document = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}
        write_json(self.path, document, "trace", separators=(",", ":"))
        return self.path


def _plain(value):
    """Return ``value`` as something json can write (NumPy scalars become Python numbers)."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError):
            pass
    return str(value)


def load(path):
    """Return the events of a trace file: a list of dicts (``traceEvents``)."""
    with open(path) as f:
        return json.load(f)["traceEvents"]
