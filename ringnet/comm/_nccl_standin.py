"""A strict stand-in for CuPy's CUDA runtime and ``cupy.cuda.nccl``, on host memory over MPI.

It lets CI run ringnet's NCCL path (:class:`~ringnet.comm.NcclTransport`: its streams,
events, launch order and watchdog) without a GPU, and turns what real CUDA and NCCL would
turn into a context on the wrong GPU, a hang or wrong data into an error on the rank that
sees it. It is never picked silently: the transport uses it only with
``RINGNET_NCCL=standin`` or ``NcclTransport(nccl="standin")``.

**The surface.** ``cuda`` mirrors the part of ``cupy.cuda`` the transport uses:
``Device(id)`` (``.id``, ``.use()``, a ``with`` block, ``.synchronize()``),
``Stream(non_blocking=...)`` (``.ptr``, ``.record()``, ``.wait_event()``,
``.synchronize()``, ``.done``, a ``with`` block), ``Event(block=..., disable_timing=...)``
(``.record()``, ``.done``, ``.synchronize()``), ``get_current_stream()`` and
``runtime.getDeviceCount()`` / ``runtime.deviceGetPCIBusId()``. The NCCL part is
``get_unique_id``, ``NcclCommunicator(size, unique_id, rank)`` with ``send``/``recv(ptr,
count, dtype, peer, stream)``, ``allReduce``, ``abort``, ``destroy``,
``check_async_error``, and the thread's ``groupStart``/``groupEnd``. Buffers are NumPy
arrays: pointers are host addresses (:func:`host_pointer` also keeps the array alive while
the stand-in tracks what was written into it), "device memory" is host memory and
"kernels" are the NumPy code the calling thread runs.

**Devices.** The stand-in machine has :data:`DEVICE_COUNT` GPUs. The first device a
process uses (selects, or makes a stream, event or communicator on) is its device;
:func:`bind` selects world rank r's, ``1 + r % 7``, so that device 0, where CUDA puts a
thread that never selected one, is no rank's. From then on every CUDA or NCCL call,
including destroying an event or a stream, on a thread whose current device is another
one fails: it raises :class:`NcclRuleError` there, and the rank stays failed (every later
call on any thread raises the same, as a CUDA context error sticks) so that a call on a
background thread is seen by the training thread too (:func:`violations`,
:func:`clear_violations`).

**Streams and events.** Every stream has a thread of its own standing for the GPU: the
NCCL operations enqueued on it run there, one after the other, when the stream reaches
them; ``groupEnd`` only enqueues. An event recorded on a stream completes when the stream
has run everything enqueued before the record. What an operation writes (a receive, an
all-reduce's result) stays out of reach until something orders the reader after it:

* bytes an operation is going to write or has written may be read or written by an NCCL
  operation of another stream only after an event orders that stream after the writer
  (``wait_event``, or a host ``synchronize``); otherwise it raises;
* once run, a written buffer holds *poison* (0xFF bytes: NaN in every float type) until
  a reader is ordered after it: the host code of the thread that issued the operation
  when it waits on it (:meth:`Event.host_work`, :meth:`Stream.host_work`: host code
  stands for the kernels a GPU would queue behind it on the same stream), a thread whose
  stream waited on an event recorded after it (``wait_event`` returns once the event
  completed: the caller's host code comes next), or a host ``synchronize``;
* where a stream's thread hands its work to other threads (:meth:`Stream.hand_off`; the
  transport calls it at the end of each operation of a stream) the results not yet
  ordered for anyone turn to poison again, until a reader is ordered after the event
  recorded next; the stream's own later operations still see them.

So a missing event wait reads NaN, or raises where NCCL reads the bytes, on every run.
A query (``Event.done``) reports completion but orders nothing. Host code writing memory
is not seen (the stand-in tracks what NCCL writes, and leaves bytes that host code
changed since to that code).

**NCCL's rules.** Each raises :class:`NcclRuleError` on the rank that sees it:

* two threads inside one communicator at once (a thread is inside from its first
  operation in an open group until ``groupEnd``), or one communicator used from a second
  thread at all (its operations are then ordered across ranks only by timing);
* ranks whose operations on one communicator differ: every message carries the
  sender's per-peer sequence number, kind, peer, count, dtype (and for collectives the
  communicator-wide collective number and reduction op), compared on receipt;
* operations on two communicators of one device launched in different orders by two
  ranks (the receiver compares the device-wide launch numbers of the operations it
  receives from one peer; NCCL kernels of one device can then wait on each other);
* an operation launched while another communicator of the device is not warmed up: a
  communicator is warm once it has sent to and received from every peer and run one
  collective (NCCL connects ranks and allocates device memory at first use, which can
  deadlock with kernels already running); a communicator made while another of the
  device has operations in flight;
* unbalanced ``groupStart``/``groupEnd``, one group on two streams; any use after
  ``abort`` or ``destroy``; ``destroy`` with operations in flight;
* a send and its matching receive of different sizes or dtypes.

A send completes only once its receive has started (synchronous MPI send), as an NCCL
send does. An operation whose peer never posts the match fails after
``RINGNET_COMM_TIMEOUT`` seconds (or the communicator's ``timeout_s``) instead of hanging:
the error is asynchronous, as in NCCL (``check_async_error`` raises it; the stream goes
on, so waits on it end); any later launch on that communicator raises it.
"""
import collections
import ctypes
import itertools
import os
import secrets
import sys
import threading
import time
import types

import numpy as np
from mpi4py import MPI

__all__ = ["available", "HOST_MEMORY", "NcclError", "NcclRuleError", "NcclCommunicator",
           "get_unique_id", "get_version", "groupStart", "groupEnd", "cuda", "Device",
           "Stream", "Event", "get_current_stream", "runtime", "DEVICE_COUNT", "bind",
           "device_for", "host_pointer", "violations", "clear_violations"]

available = True
HOST_MEMORY = True      # buffers are host pointers; what tells the transport it is the stand-in

NCCL_INT8 = NCCL_CHAR = 0
NCCL_UINT8 = 1
NCCL_INT32 = NCCL_INT = 2
NCCL_UINT32 = 3
NCCL_INT64 = 4
NCCL_UINT64 = 5
NCCL_FLOAT16 = NCCL_HALF = 6
NCCL_FLOAT32 = NCCL_FLOAT = 7
NCCL_FLOAT64 = NCCL_DOUBLE = 8
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN = 0, 1, 2, 3

_NUMPY = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64,
          6: np.float16, 7: np.float32, 8: np.float64}
_REDUCE = {NCCL_SUM: np.add, NCCL_PROD: np.multiply, NCCL_MAX: np.maximum, NCCL_MIN: np.minimum}
_UNIQUE_ID_BYTES = 128
_JOIN_TAG, _MEMBERS_TAG = 32101, 32102          # rendezvous on COMM_WORLD
_HEADER_TAG, _PAYLOAD_TAG = 1, 2                # on each communicator's private MPI group
_SEND, _RECV, _ALLREDUCE = 1, 2, 3
_KINDS = {_SEND: "send", _RECV: "recv", _ALLREDUCE: "allReduce"}
# header: kind, sender rank, receiver rank, per-pair sequence, count, dtype, collective no.,
# op, the sender's device-wide launch number
_HEADER_LEN = 9
POISON = 0xFF
DEVICE_COUNT = 8
# How many operations received from one peer each launch-order comparison looks back on.
_ORDER_WINDOW = 2048


class NcclError(RuntimeError):
    """An NCCL call failed (a peer that never answered, a bad argument)."""


class NcclRuleError(NcclError):
    """A call that real CUDA or NCCL would turn into a wrong context, a hang or corrupt data."""


def get_version():
    """Return 0: no NCCL library behind this module."""
    return 0


def _timeout():
    value = os.environ.get("RINGNET_COMM_TIMEOUT", "")
    try:
        return float(value) if value else 300.0
    except ValueError:
        return 300.0


# One lock over the shared state of this process's stand-in GPU: devices, streams, the
# writes in flight and the launch-order records (executing streams take it briefly).
_lock = threading.RLock()
_local = threading.local()


# -- devices ---------------------------------------------------------------------------
_rank_device = None         # the device this process uses (the first it touched)
_violations = []            # sticky: what made this rank fail


def device_for(world_rank):
    """Return the stand-in device of world rank ``world_rank``: never device 0."""
    return 1 + world_rank % (DEVICE_COUNT - 1)


def bind():
    """Make this process's device current on the calling thread (the first call picks world
    rank r's, :func:`device_for`); return its id."""
    device = _rank_device if _rank_device is not None else device_for(MPI.COMM_WORLD.Get_rank())
    Device(device).use()
    return device


def violations():
    """Return the device rule breaks this process has seen (the rank fails while any stays)."""
    with _lock:
        return list(_violations)


def clear_violations():
    """Forget the recorded rule breaks (for tests that provoke one on purpose)."""
    with _lock:
        del _violations[:]


def _current():
    return getattr(_local, "device", 0)


def _thread_name():
    return threading.current_thread().name


def _use(device, what):
    """Note that ``what`` uses ``device``; return the message of a rule it breaks, or None."""
    global _rank_device
    with _lock:
        if _rank_device is None:
            _rank_device = device
            return None
        if device != _rank_device:
            return (f"{what} on thread {_thread_name()!r} uses device {device}, but this rank's "
                    f"device is {_rank_device} (CUDA makes a context on every device a thread "
                    "calls into: select the rank's device on every thread that touches CUDA)")
    return None


def _breaks(what, device=None):
    """Return why ``what`` on this thread breaks the device rules (None when it does not)."""
    current = _current()
    problem = _use(current, what)
    if problem is None and device is not None and device != current:
        problem = (f"{what} on thread {_thread_name()!r}: the object belongs to device {device}, "
                   f"the thread's current device is {current}")
    return problem


def _check(what, device=None):
    """Raise (and remember) when the rank failed before or ``what`` breaks the device rules."""
    with _lock:
        if _violations:
            raise NcclRuleError(_violations[0])
    problem = _breaks(what, device)
    if problem is not None:
        with _lock:
            _violations.append(problem)
        raise NcclRuleError(problem)


def _note(what, device):
    """Remember a rule break where raising is not possible (an object being destroyed)."""
    if getattr(_local, "internal", False) or sys.is_finalizing():
        return
    problem = _breaks(what, device)
    if problem is not None:
        with _lock:
            _violations.append(problem)


class Device:
    """A stand-in CUDA device: ``Device()`` is the thread's current one."""

    def __init__(self, device=None):
        self.id = _current() if device is None else int(device)
        if not 0 <= self.id < DEVICE_COUNT:
            raise NcclError(f"no stand-in device {self.id} (there are {DEVICE_COUNT})")
        self._previous = []

    def use(self):
        """Make this device current on the calling thread."""
        _local.device = self.id
        _check(f"cudaSetDevice({self.id})")

    def __enter__(self):
        self._previous.append(_current())
        self.use()
        return self

    def __exit__(self, *exc):
        _local.device = self._previous.pop()

    def synchronize(self):
        """Wait for every stream of this device; the host is then ordered after all of it."""
        _check("cudaDeviceSynchronize", self.id)
        with _lock:
            queues = [q for q in _queues if q.device == self.id]
        for queue in queues:
            position = queue.enqueued
            queue.wait_for(position, "cudaDeviceSynchronize")
            _publish(queue, position)


class _Runtime:
    """``cupy.cuda.runtime``'s calls that the transport makes."""

    @staticmethod
    def getDeviceCount():
        return DEVICE_COUNT

    @staticmethod
    def deviceGetPCIBusId(device):
        return f"0000:{0x10 + int(device):02x}:00.0"


runtime = _Runtime()


# -- streams and events ------------------------------------------------------------------
_queues = set()             # the device side of every live stream
_ptrs = {}                  # stream pointer -> its queue (0: the null stream of a device)
_next_ptr = itertools.count(0x1000, 0x10)


class _Queue:
    """The device side of one stream: what was enqueued runs on its own thread, in order."""

    def __init__(self, device, name):
        self.device, self.name = device, name
        self.cond = threading.Condition()
        self.items = collections.deque()
        self.enqueued = self.executed = 0
        self.thread = None
        self.stopping = False
        with _lock:
            _queues.add(self)

    def put(self, run):
        """Enqueue ``run()``; return its position (it has run once ``executed`` reaches it)."""
        with self.cond:
            self.items.append(run)
            self.enqueued += 1
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, daemon=True,
                                               name=f"standin-gpu{self.device}-{self.name}")
                self.thread.start()
            self.cond.notify_all()
            return self.enqueued

    def _loop(self):
        _local.device = self.device
        _local.internal = True
        while True:
            with self.cond:
                while not self.items and not self.stopping:
                    self.cond.wait()
                if not self.items:
                    break
                run = self.items[0]
            run()       # records its own errors: the stream goes on
            with self.cond:
                self.items.popleft()
                self.executed += 1
                self.cond.notify_all()
        with _lock:
            _queues.discard(self)

    def wait_for(self, position, what):
        """Block until the stream ran everything up to ``position`` (a deadline bounds it)."""
        limit = _timeout()
        with self.cond:
            if not self.cond.wait_for(lambda: self.executed >= position, limit):
                raise NcclError(f"{what}: stream {self.name} did not get there within {limit:g} s")

    def stop(self):
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
            started = self.thread is not None
        if not started:
            with _lock:
                _queues.discard(self)


def _null(device):
    """The null stream of ``device`` (pointer 0, one per device)."""
    with _lock:
        stream = _nulls.get(device)
        if stream is None:
            stream = _nulls[device] = Stream._make(device, null=True)
        return stream


_nulls = {}


class Stream:
    """A stand-in CUDA stream of the current device (see the module docstring)."""

    def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
        _check("cudaStreamCreate")
        self._init(_current(), null)

    @classmethod
    def _make(cls, device, null):
        stream = cls.__new__(cls)
        stream._init(device, null)
        return stream

    def _init(self, device, null):
        self.device_id = device
        self.null = bool(null)
        self.ptr = 0 if null else next(_next_ptr)
        self._queue = _Queue(device, "null" if null else f"stream{self.ptr:#x}")
        self._entered = []
        if not null:
            with _lock:
                _ptrs[self.ptr] = self._queue

    def __repr__(self):
        return f"<stand-in stream {self._queue.name} of device {self.device_id}>"

    # -- the thread's current stream --------------------------------------------------
    def use(self):
        _check("cudaStreamUse", self.device_id)
        _streams()[self.device_id] = self
        return self

    def __enter__(self):
        _check("cudaStreamUse", self.device_id)
        self._entered.append(_streams().get(self.device_id))
        _streams()[self.device_id] = self
        return self

    def __exit__(self, *exc):
        previous = self._entered.pop()
        if previous is None:
            _streams().pop(self.device_id, None)
        else:
            _streams()[self.device_id] = previous

    # -- events and waits ---------------------------------------------------------------
    def record(self, event=None):
        """Record ``event`` (a new one by default) here; return it."""
        _check("cudaEventRecord", self.device_id)
        if event is None:
            event = Event()
        event._record(self._queue)
        return event

    def wait_event(self, event):
        """Order this stream's later work after ``event``.

        The host code of the calling thread stands for that work, so the call returns once
        the event has completed, and the writes ordered before it are visible from then on.
        """
        _check("cudaStreamWaitEvent", self.device_id)
        _check("cudaStreamWaitEvent", event.device)
        queue, position = event._queue, event._position
        if queue is not None and queue is not self._queue:
            queue.wait_for(position, f"a wait on an event of stream {queue.name}")
            _publish(queue, position)
        _show(self._queue)

    def synchronize(self):
        """Block until everything enqueued here ran; the host is then ordered after it."""
        _check("cudaStreamSynchronize", self.device_id)
        position = self._queue.enqueued
        self._queue.wait_for(position, "cudaStreamSynchronize")
        _publish(self._queue, position)

    @property
    def done(self):
        _check("cudaStreamQuery", self.device_id)
        return self._queue.executed >= self._queue.enqueued

    # -- stand-in only: where host code stands for kernels ---------------------------------
    def host_work(self):
        """The calling thread's next host code stands for kernels queued here: block until
        the stream ran what is enqueued and show its results to that code."""
        _check("stand-in host work", self.device_id)
        position = self._queue.enqueued
        self._queue.wait_for(position, "host work after the stream's operations")
        _show(self._queue, position)

    def hand_off(self):
        """This stream's work goes to another thread through the event recorded next: its
        results so far turn to poison for every reader not ordered after that event."""
        _check("stand-in hand-off", self.device_id)
        _hide(self._queue)

    def __del__(self):
        if getattr(self, "null", True):
            return
        _note("cudaStreamDestroy", self.device_id)
        with _lock:
            _ptrs.pop(self.ptr, None)
        self._queue.stop()


def _streams():
    streams = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = {}
    return streams


def get_current_stream(device_id=-1):
    """Return the calling thread's current stream of its current device (the null stream
    by default)."""
    _check("cudaGetCurrentStream")
    device = _current()
    return _streams().get(device) or _null(device)


def _queue_of(stream_ptr, device):
    if int(stream_ptr) == 0:
        return _null(device)._queue
    with _lock:
        queue = _ptrs.get(int(stream_ptr))
    if queue is None:
        raise NcclError(f"stream pointer {int(stream_ptr):#x} names no live stand-in stream")
    if queue.device != device:
        raise NcclRuleError(f"an NCCL operation of a communicator of device {device} enqueued on "
                            f"stream {queue.name} of device {queue.device}")
    return queue


class Event:
    """A stand-in CUDA event of the current device."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        _check("cudaEventCreate")
        self.device = _current()
        self._queue = None
        self._position = 0

    def _record(self, queue):
        if queue.device != self.device:
            _check("cudaEventRecord", queue.device)
        self._queue, self._position = queue, queue.enqueued

    def record(self, stream=None):
        """Record this event on ``stream`` (the current stream by default)."""
        (stream if stream is not None else get_current_stream()).record(self)

    @property
    def done(self):
        """True once the stream ran what came before the record (a query orders nothing)."""
        _check("cudaEventQuery", self.device)
        return self._queue is None or self._queue.executed >= self._position

    def synchronize(self):
        """Block until the event completed; the host is then ordered after it."""
        _check("cudaEventSynchronize", self.device)
        if self._queue is not None:
            self._queue.wait_for(self._position, "cudaEventSynchronize")
            _publish(self._queue, self._position)

    def host_work(self):
        """The calling thread's next host code stands for kernels queued behind this event
        on its stream: block until the stream got here and show its results up to here."""
        _check("stand-in host work", self.device)
        if self._queue is not None:
            self._queue.wait_for(self._position, "host work after an operation")
            _show(self._queue, self._position)

    def __del__(self):
        if hasattr(self, "device"):         # not when the constructor itself failed
            _note("cudaEventDestroy", self.device)


cuda = types.SimpleNamespace(Device=Device, Stream=Stream, Event=Event, runtime=runtime,
                             get_current_stream=get_current_stream)


# -- memory: what NCCL writes, and who may see it -------------------------------------------
class _HostPointer(int):
    """A host address that keeps the array it points into alive (``owner``)."""


def host_pointer(array):
    """Return ``array``'s address for the NCCL calls, holding the array while it is tracked."""
    ptr = _HostPointer(array.ctypes.data)
    ptr.owner = array
    return ptr


class _Write:
    """Bytes [lo, hi) that an operation on ``queue`` writes: ``pending`` (enqueued),
    ``hidden`` (ran; memory holds poison, ``staged`` the bytes) or ``shown`` (ran; memory
    holds the bytes for the stream's own thread)."""

    __slots__ = ("queue", "comm", "lo", "hi", "seq", "staged", "state", "owner", "what")

    def __init__(self, queue, comm, lo, hi, owner, what):
        self.queue, self.comm, self.lo, self.hi = queue, comm, lo, hi
        self.owner, self.what = owner, what
        self.seq = None
        self.staged = None
        self.state = "pending"


_writes = []        # writes nobody has been ordered after yet


def _memory(lo, hi):
    if hi <= lo:
        return np.empty(0, np.uint8)
    return np.frombuffer((ctypes.c_char * (hi - lo)).from_address(lo), dtype=np.uint8)


def _show(queue, upto=None):
    """Give ``queue``'s results (up to position ``upto``) to the host code that follows."""
    with _lock:
        for write in list(_writes):
            if write.queue is queue and write.state == "hidden" and (upto is None or write.seq <= upto):
                memory = _memory(write.lo, write.hi)
                if np.all(memory == POISON):
                    memory[...] = write.staged
                    write.state = "shown"
                else:       # written meanwhile by code not ordered after it: not NCCL's bytes
                    _writes.remove(write)


def _hide(queue):
    with _lock:
        for write in list(_writes):
            if write.queue is queue and write.state == "shown":
                memory = _memory(write.lo, write.hi)
                if np.array_equal(memory, write.staged):
                    memory[...] = POISON
                    write.state = "hidden"
                else:       # the stream's own host code changed them: no longer NCCL's bytes
                    _writes.remove(write)


def _publish(queue, position):
    """Everything ``queue`` wrote up to ``position`` is visible to every reader from now on."""
    with _lock:
        for write in list(_writes):
            if write.queue is queue and write.state != "pending" and write.seq <= position:
                _release(write)


def _release(write):
    if write.state == "hidden":
        memory = _memory(write.lo, write.hi)
        if np.all(memory == POISON):
            memory[...] = write.staged
    _writes.remove(write)


def _overlaps(lo, hi, skip=None):
    return [w for w in _writes if w is not skip and w.lo < hi and lo < w.hi]


def _unordered(op, write, reads):
    verb = "reads" if reads else "writes"
    tense = "is going to write" if write.state == "pending" else "wrote"
    return NcclRuleError(
        f"{op.describe()} on stream {op.queue.name} {verb} bytes that {write.what} on stream "
        f"{write.queue.name} {tense}, before an event orders it after that operation (a "
        "wait_event on an event recorded after it, or a synchronize): on a GPU the two race")


def _outgoing(op, ptr, count):
    """Return a copy of what ``op`` sends from ``ptr``, as the stream sees it; raise when
    another stream's write to those bytes is not ordered before it."""
    itemsize = np.dtype(_NUMPY[op.dtype]).itemsize
    lo, hi = int(ptr), int(ptr) + count * itemsize
    with _lock:
        data = _memory(lo, hi).copy()
        for write in _overlaps(lo, hi):
            if write.queue is not op.queue:
                raise _unordered(op, write, reads=True)
            if write.state == "pending":        # comes later on this stream: memory is right
                continue
            memory = _memory(write.lo, write.hi)
            if write.state == "hidden" and np.all(memory == POISON):
                # ran earlier on this stream and hidden from other threads: its bytes
                a, b = max(lo, write.lo), min(hi, write.hi)
                data[a - lo:b - lo] = write.staged[a - write.lo:b - write.lo]
            elif not np.array_equal(memory, write.staged):
                _writes.remove(write)           # host code of this stream wrote there since
    return data.view(_NUMPY[op.dtype])


def _land(op, ptr, payload):
    """Store what ``op`` received (or computed) at ``ptr``: tracked writes go to poison."""
    raw = np.ascontiguousarray(payload).view(np.uint8).reshape(-1)
    lo, hi = int(ptr), int(ptr) + raw.size
    write = op.write
    with _lock:
        if write is None:
            _memory(lo, hi)[...] = raw
            return
        for other in _overlaps(lo, hi, skip=write):
            if other.queue is not op.queue:
                raise _unordered(op, other, reads=False)
            if other.state != "pending":        # an earlier write of this stream: overwritten
                _trim(other, lo, hi)
        _memory(lo, hi)[...] = POISON
        write.staged = raw.copy()
        write.state = "hidden"


def _trim(write, lo, hi):
    """Drop [lo, hi) from ``write`` (keeping what lies on either side)."""
    _writes.remove(write)
    for a, b in ((write.lo, min(write.hi, lo)), (max(write.lo, hi), write.hi)):
        if b > a:
            part = _Write(write.queue, write.comm, a, b, write.owner, write.what)
            part.seq, part.state = write.seq, write.state
            part.staged = write.staged[a - write.lo:b - write.lo].copy()
            _writes.append(part)


# -- groups (per thread, as in NCCL) -------------------------------------------------------
def _group():
    state = _local
    if not hasattr(state, "depth"):
        state.depth, state.ops = 0, []
    return state


def groupStart():
    """Open a group on this thread: operations until the matching groupEnd launch together."""
    _check("ncclGroupStart")
    _group().depth += 1


def groupEnd():
    """Close this thread's group; the outermost groupEnd enqueues the queued operations."""
    _check("ncclGroupEnd")
    state = _group()
    if state.depth == 0:
        raise NcclRuleError("groupEnd without a matching groupStart on this thread")
    state.depth -= 1
    if state.depth == 0:
        ops, state.ops = state.ops, []
        comms = list(dict.fromkeys(op.comm for op in ops))
        try:
            if ops:
                _launch(ops)
        finally:
            for comm in comms:
                comm._leave()


class _Op:
    __slots__ = ("comm", "kind", "ptr", "count", "dtype", "peer", "op", "seq", "queue",
                 "owner", "write", "device_seq")

    def __init__(self, comm, kind, ptr, count, dtype, peer, op=None):
        self.comm, self.kind, self.ptr, self.count = comm, kind, ptr, count
        self.dtype, self.peer, self.op, self.seq = dtype, peer, op, None
        self.queue = self.write = self.device_seq = None
        self.owner = None

    def describe(self):
        if self.kind == _ALLREDUCE:
            return f"allReduce of {self.count} x dtype {self.dtype}"
        where = "to" if self.kind == _SEND else "from"
        return f"{_KINDS[self.kind]} {where} rank {self.peer} of {self.count} x dtype {self.dtype}"

    def output(self):
        """The address this operation writes, or None."""
        if self.kind == _RECV:
            return self.ptr
        return self.ptr[1] if self.kind == _ALLREDUCE else None


_device_launches = collections.Counter()     # device -> NCCL launches so far


def _launch(ops):
    """Enqueue one group on its stream, numbering it in this device's launch order."""
    queues = list(dict.fromkeys(op.queue for op in ops))
    if len(queues) > 1:
        raise NcclRuleError("one NCCL group on two streams: the stand-in runs a group on one stream")
    queue = queues[0]
    comms = list(dict.fromkeys(op.comm for op in ops))
    with _lock:
        _device_launches[queue.device] += 1
        device_seq = _device_launches[queue.device]
        turns = {}
        for comm in comms:
            turns[comm] = comm._launched
            comm._launched += 1
        writes = []
        for op in ops:
            op.device_seq = device_seq
            op.comm._number(op)
            out = op.output()
            if out is not None and op.owner is not None and op.count:
                nbytes = op.count * np.dtype(_NUMPY[op.dtype]).itemsize
                op.write = _Write(queue, op.comm, int(out), int(out) + nbytes, op.owner,
                                  op.describe())
                writes.append(op.write)
                _writes.append(op.write)
        position = queue.put(lambda: _execute(ops, turns))
        for write in writes:
            write.seq = position


def _execute(ops, turns):
    """Run one group on its stream's thread: post every send, then match every receive."""
    comms = list(turns)
    try:
        for comm in comms:
            comm._await_turn(turns[comm])
        pending, receives, inputs = [], [], {}
        for op in ops:
            if op.kind == _SEND:
                data = inputs[id(op)] = _outgoing(op, op.ptr, op.count)
                pending += op.comm._post_send(op, op.peer, op.seq, data)
            elif op.kind == _RECV:
                receives.append((op, op.peer, op.seq))
            else:   # allReduce: exchange with every peer, combine in rank order
                data = inputs[id(op)] = _outgoing(op, op.ptr[0], op.count)
                for peer in range(op.comm._size):
                    if peer != op.comm._rank:
                        sent, received = op.seq[peer]
                        pending += op.comm._post_send(op, peer, sent, data)
                        receives.append((op, peer, received))
        got = {}
        for op, peer, seq in receives:
            got[(id(op), peer)] = op.comm._receive(op, peer, seq)
        for comm in comms:
            comm._wait(pending, "sends of this group", receives=False)
        for op in ops:
            if op.kind == _RECV:
                _land(op, op.ptr, got[(id(op), op.peer)])
            elif op.kind == _ALLREDUCE:
                _land(op, op.ptr[1], op.comm._combine(op, inputs[id(op)], got))
    except BaseException as exc:  # noqa: BLE001 - asynchronous: kept for check_async_error
        error = exc if isinstance(exc, NcclError) else NcclError(f"{type(exc).__name__}: {exc}")
        for comm in comms:
            comm._fail(error)
        with _lock:
            for op in ops:
                if op.write is not None and op.write in _writes:
                    _writes.remove(op.write)
    finally:
        for comm in comms:
            comm._ran_one()


# -- launch order across the communicators of one device -------------------------------------
_order_pairs = {}       # (device, peer world rank) -> recent (mine, theirs, comm, what)


def _check_launch_order(comm, op, peer_world, theirs):
    """Compare the device-wide launch number of ``op`` and of its peer's match with those of
    the other communicators' operations met with that peer."""
    mine = op.device_seq
    with _lock:
        pairs = _order_pairs.setdefault((comm._device, peer_world),
                                        collections.deque(maxlen=_ORDER_WINDOW))
        for m, t, other, what in pairs:
            if other is not comm and m != mine and t != theirs and (m < mine) != (t < theirs):
                me = MPI.COMM_WORLD.Get_rank()
                first, second = ((what, other), (op.describe(), comm)) if m < mine \
                    else ((op.describe(), comm), (what, other))
                raise NcclRuleError(
                    f"operations on two communicators of device {comm._device} are launched in "
                    f"different orders: rank {me} launched {first[0]} ({first[1].name}) before "
                    f"{second[0]} ({second[1].name}), rank {peer_world} their matches the other "
                    "way round; NCCL kernels of one device can then wait on each other for ever "
                    "(launch them in one order on every rank)")
        pairs.append((mine, theirs, comm, op.describe()))


# -- communicators ---------------------------------------------------------------------------
_live = []                  # communicators not destroyed or aborted, in creation order
_created = itertools.count(1)


def get_unique_id():
    """Return a 128-entry tuple naming a new communicator (its creator's rank is its root)."""
    raw = MPI.COMM_WORLD.Get_rank().to_bytes(4, "little") + secrets.token_bytes(16)
    return tuple(raw + bytes(_UNIQUE_ID_BYTES - len(raw)))


class NcclCommunicator:
    """A communicator of ``ndev`` ranks; all of them call this with the same unique id."""

    def __init__(self, ndev, commId, rank):
        if not (isinstance(ndev, int) and ndev >= 1 and isinstance(rank, int) and 0 <= rank < ndev):
            raise NcclError(f"NcclCommunicator: rank {rank!r} is not in [0, {ndev!r})")
        raw = bytes(b % 256 for b in commId)
        if len(raw) != _UNIQUE_ID_BYTES:
            raise NcclError(f"NcclCommunicator: unique id of {len(raw)} bytes, expected 128")
        _check("ncclCommInitRank")
        self._device = _current()
        self.name = f"communicator #{next(_created)}"
        with _lock:
            for other in _live:
                if other._device == self._device and other._launched > other._ran:
                    raise NcclRuleError(
                        f"{self.name} made while {other.name} of device {self._device} has "
                        f"{other._launched - other._ran} operation(s) in flight: making a "
                        "communicator allocates device memory, which can deadlock with NCCL "
                        "kernels running (synchronize the device first)")
        self._size, self._rank = ndev, rank
        self.timeout_s = _timeout()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._inside = None         # thread now inside an operation or an open group
        self._owner = None          # thread that issued the first operation
        self._state = "ok"
        self._error = None          # the asynchronous error, once one happened
        self._sent = [0] * ndev     # per-peer sequence numbers
        self._received = [0] * ndev
        self._collectives = 0
        self._launched = self._ran = 0
        # What its first use would still connect: p2p with every peer and the collectives.
        self._cold = {(kind, peer) for kind in ("send", "recv") for peer in range(ndev)
                      if peer != rank}
        if ndev > 1:
            self._cold.add(("collective", None))
        self._comm, self._world = self._join(raw)
        with _lock:
            _live.append(self)

    # -- set-up: find the other members through the unique id's root, make an MPI group --
    def _join(self, raw):
        world = MPI.COMM_WORLD
        root = int.from_bytes(raw[:4], "little")
        me = world.Get_rank()
        if self._size == 1:
            return MPI.COMM_SELF.Dup(), [me]
        token = np.frombuffer(raw[4:20], dtype=np.uint8)
        if me == root:
            members = {self._rank: me}
            start = time.perf_counter()
            while len(members) < self._size:
                status = MPI.Status()
                if not world.Iprobe(MPI.ANY_SOURCE, _JOIN_TAG, status):
                    if time.perf_counter() - start > self.timeout_s:
                        missing = sorted(set(range(self._size)) - set(members))
                        raise NcclError(f"NcclCommunicator init: rank(s) {missing} did not join "
                                        f"within {self.timeout_s:g} s")
                    time.sleep(1e-3)
                    continue
                info = np.empty(19, np.int64)
                world.Recv(info, source=status.Get_source(), tag=_JOIN_TAG)
                if not np.array_equal(info[3:].astype(np.uint8), token) or info[1] != self._size:
                    raise NcclRuleError(f"NcclCommunicator init: world rank {info[2]} joined with "
                                        f"another unique id or size ({info[1]} ranks)")
                if int(info[0]) in members:
                    raise NcclRuleError(f"NcclCommunicator init: rank {info[0]} joined twice")
                members[int(info[0])] = int(info[2])
            order = np.array([members[r] for r in range(self._size)], np.int64)
            for r in range(self._size):
                if order[r] != me:
                    world.Send(order, dest=int(order[r]), tag=_MEMBERS_TAG)
        else:
            info = np.concatenate([[self._rank, self._size, me], token]).astype(np.int64)
            world.Send(info, dest=root, tag=_JOIN_TAG)
            order = np.empty(self._size, np.int64)
            request = world.Irecv(order, source=root, tag=_MEMBERS_TAG)
            start = time.perf_counter()
            while not request.Test():
                if time.perf_counter() - start > self.timeout_s:
                    raise NcclError(f"NcclCommunicator init: root (world rank {root}) did not answer "
                                    f"within {self.timeout_s:g} s")
                time.sleep(1e-3)
        everyone = world.Get_group()
        group = everyone.Incl([int(r) for r in order])
        try:
            return world.Create_group(group, tag=_MEMBERS_TAG), [int(r) for r in order]
        finally:
            group.Free()
            everyone.Free()

    # -- the rules -----------------------------------------------------------------------
    def _usable(self, what):
        if self._state != "ok":
            raise NcclRuleError(f"{what} on a communicator after {self._state}")

    def _claim(self, what):
        """Check the thread rules for an operation issued now by this thread."""
        self._usable(what)
        if self._error is not None:
            raise NcclError(f"{what} on {self.name}, which failed before: {self._error}")
        me = threading.current_thread()
        with self._lock:
            if self._inside is not None and self._inside is not me:
                raise NcclRuleError(f"two threads inside one communicator at once: {what} from "
                                    f"thread {me.name!r} while thread {self._inside.name!r} is "
                                    "inside it")
            if self._owner is None:
                self._owner = me
            elif self._owner is not me:
                raise NcclRuleError(f"communicator used from two threads: {what} from thread "
                                    f"{me.name!r}, earlier operations from {self._owner.name!r} "
                                    "(their order across ranks is left to timing)")
            self._inside = me

    def _leave(self):
        with self._lock:
            self._inside = None

    def _check_warm(self, op):
        """Refuse ``op`` while another communicator of this device is cold; note what it warms."""
        with _lock:
            for other in _live:
                if other is not self and other._device == self._device and other._cold:
                    missing = ", ".join(
                        "run a collective" if kind == "collective"
                        else f"{kind} {'to' if kind == 'send' else 'from'} rank {peer}"
                        for kind, peer in sorted(other._cold, key=str))
                    raise NcclRuleError(
                        f"{op.describe()} on {self.name} while {other.name} of device "
                        f"{self._device} is not warmed up (it has yet to {missing}): its first "
                        "use connects ranks and allocates device memory, which can deadlock "
                        "with NCCL kernels running; use every communicator once, with every "
                        "peer and one collective, when it is made")
            if op.kind == _ALLREDUCE:
                self._cold.discard(("collective", None))
            else:
                self._cold.discard(("send" if op.kind == _SEND else "recv", op.peer))

    def _queue(self, op, stream):
        what = op.describe()
        _check(f"nccl {what}", self._device)
        op.queue = _queue_of(stream, self._device)
        self._claim(what)
        try:
            self._check_warm(op)
        except BaseException:
            self._leave()
            raise
        state = _group()
        if state.depth:
            state.ops.append(op)        # inside until groupEnd
            return
        try:
            _launch([op])
        finally:
            self._leave()

    def _number(self, op):
        if op.kind == _SEND:
            op.seq = self._sent[op.peer]
            self._sent[op.peer] += 1
        elif op.kind == _RECV:
            op.seq = self._received[op.peer]
            self._received[op.peer] += 1
        else:
            op.seq = {}
            for peer in range(self._size):
                if peer != self._rank:
                    op.seq[peer] = (self._sent[peer], self._received[peer])
                    self._sent[peer] += 1
                    self._received[peer] += 1
            op.op = (op.op, self._collectives)
            self._collectives += 1

    # -- on the stream's thread ----------------------------------------------------------
    def _await_turn(self, turn):
        """Operations of one communicator run in launch order, whatever streams they are on."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._ran >= turn, self.timeout_s):
                raise NcclError(f"{self.name}: operation no. {turn} waited {self.timeout_s:g} s "
                                "for the one launched before it")

    def _ran_one(self):
        with self._cond:
            self._ran += 1
            self._cond.notify_all()
            idle = self._ran >= self._launched
        if idle and self._state != "ok":
            self._free()

    def _fail(self, error):
        if self._error is None:
            self._error = error

    def _header(self, op, peer, seq):
        red, number = op.op if op.kind == _ALLREDUCE else (-1, -1)
        return np.array([op.kind, self._rank, peer, seq, op.count, op.dtype, number, red,
                         op.device_seq], np.int64)

    def _post_send(self, op, peer, seq, data):
        header = self._header(op, peer, seq)
        requests = [self._comm.Isend(header, dest=peer, tag=_HEADER_TAG)]
        if op.count:
            # Synchronous send: completes only when the receive has started, as in NCCL.
            requests.append(self._comm.Issend(data, dest=peer, tag=_PAYLOAD_TAG))
        return requests

    def _receive(self, op, peer, seq):
        """Take the next message from ``peer``, check it matches ``op``; return its payload."""
        header = np.empty(_HEADER_LEN, np.int64)
        self._wait([self._comm.Irecv(header, source=peer, tag=_HEADER_TAG)], op.describe())
        kind, sender, receiver, their_seq, count, dtype, number, red, launched = (int(v) for v in header)
        expected_kind = _SEND if op.kind == _RECV else op.kind
        mine = (f"rank {self._rank}'s {op.describe()} (its operation no. {seq} with rank {peer})")
        theirs = (f"rank {sender}'s {_KINDS.get(kind, kind)} of {count} x dtype {dtype} "
                  f"(its operation no. {their_seq} with rank {receiver})")
        problem = None
        if kind != expected_kind or receiver != self._rank or their_seq != seq:
            problem = f"operation order differs between ranks: {mine} met {theirs}"
        elif op.kind == _ALLREDUCE and (number, red) != op.op[::-1]:
            problem = (f"operation order differs between ranks: {mine} (collective no. "
                       f"{op.op[1]}, op {op.op[0]}) met {theirs} (collective no. {number}, op {red})")
        elif count != op.count or dtype != op.dtype:
            problem = f"send and receive sizes differ: {mine} met {theirs}"
        if problem is not None:
            if count and dtype in _NUMPY:   # take the message, so the sender is not left hanging
                scratch = np.empty(count, _NUMPY[dtype])
                self._wait([self._comm.Irecv(scratch, source=peer, tag=_PAYLOAD_TAG)], op.describe())
            raise NcclRuleError(problem)
        payload = np.empty(op.count, _NUMPY[op.dtype])
        if count:
            self._wait([self._comm.Irecv(payload, source=peer, tag=_PAYLOAD_TAG)], op.describe())
        _check_launch_order(self, op, self._world[peer], launched)
        return payload

    def _wait(self, requests, what, receives=True):
        requests = [r for r in requests if r != MPI.REQUEST_NULL]
        start = time.perf_counter()
        while not MPI.Request.Testall(requests):
            if self._state != "ok":
                if receives:
                    self._cancel(requests)
                raise NcclError(f"{what}: communicator {self._state} while the operation ran")
            if time.perf_counter() - start > self.timeout_s:
                if receives:
                    self._cancel(requests)
                raise NcclError(f"rank {self._rank}: {what} did not complete within "
                                f"{self.timeout_s:g} s (real NCCL would hang here: the peer "
                                "never posted the matching operation)")
            time.sleep(2e-4)

    @staticmethod
    def _cancel(requests):
        """Withdraw receives that will never match, so nothing writes the buffers later."""
        for request in requests:
            try:
                request.Cancel()
                request.Test()
            except MPI.Exception:
                pass

    def _combine(self, op, data, got):
        reduce = _REDUCE[op.op[0]]
        total = None
        for peer in range(self._size):     # rank order: the same float result on every rank
            part = data if peer == self._rank else got[(id(op), peer)]
            total = part.copy() if total is None else reduce(total, part)
        return total if total is not None else np.empty(0, _NUMPY[op.dtype])

    # -- the NCCL surface ----------------------------------------------------------------
    def _check_args(self, count, datatype, peer=None):
        if not (isinstance(count, (int, np.integer)) and count >= 0):
            raise NcclError(f"count must be a non-negative integer, got {count!r}")
        if datatype not in _NUMPY:
            raise NcclError(f"unknown NCCL datatype {datatype!r}")
        if peer is not None and not (isinstance(peer, (int, np.integer)) and 0 <= peer < self._size):
            raise NcclError(f"peer {peer!r} is not a rank of this {self._size}-rank communicator")

    def send(self, sendbuf, count, datatype, peer, stream):
        """Send ``count`` elements at host address ``sendbuf`` to ``peer`` on ``stream``."""
        self._check_args(count, datatype, peer)
        op = _Op(self, _SEND, int(sendbuf), int(count), datatype, int(peer))
        op.owner = getattr(sendbuf, "owner", None)
        self._queue(op, stream)

    def recv(self, recvbuf, count, datatype, peer, stream):
        """Receive ``count`` elements from ``peer`` into host address ``recvbuf`` on ``stream``."""
        self._check_args(count, datatype, peer)
        op = _Op(self, _RECV, int(recvbuf), int(count), datatype, int(peer))
        op.owner = getattr(recvbuf, "owner", None)
        self._queue(op, stream)

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        """Reduce ``count`` elements over all ranks into ``recvbuf`` (in rank order)."""
        self._check_args(count, datatype)
        if op not in _REDUCE:
            raise NcclError(f"unknown NCCL reduction op {op!r}")
        operation = _Op(self, _ALLREDUCE, (int(sendbuf), int(recvbuf)), int(count), datatype,
                        None, op)
        operation.owner = getattr(recvbuf, "owner", None)
        self._queue(operation, stream)

    def rank_id(self):
        self._usable("rank_id")
        return self._rank

    def size(self):
        self._usable("size")
        return self._size

    def device_id(self):
        self._usable("device_id")
        return self._device

    def check_async_error(self):
        """Raise the asynchronous error of an operation that failed on its stream, if any."""
        _check("ncclCommGetAsyncError", self._device)
        self._usable("check_async_error")
        if self._error is not None:
            raise self._error

    def abort(self):
        """Abort: operations in flight fail (their streams go on), any later use raises."""
        _check("ncclCommAbort", self._device)
        self._usable("abort")
        if _group().depth and any(op.comm is self for op in _group().ops):
            raise NcclRuleError("abort inside an open group holding this communicator's operations")
        self._state = "abort"
        self._retire()

    def destroy(self):
        """Free the communicator; it must be idle (no thread inside, no open group, nothing in
        flight)."""
        _check("ncclCommDestroy", self._device)
        self._usable("destroy")
        if self._inside is not None:
            raise NcclRuleError(f"destroy while thread {self._inside.name!r} is inside the communicator")
        if _group().depth and any(op.comm is self for op in _group().ops):
            raise NcclRuleError("destroy inside an open group holding this communicator's operations")
        if self._launched > self._ran:
            raise NcclRuleError(f"destroy of {self.name} with {self._launched - self._ran} "
                                "operation(s) in flight: synchronize their streams first")
        self._state = "destroy"
        self._retire()

    def _retire(self):
        with _lock:
            if self in _live:
                _live.remove(self)
            for write in [w for w in _writes if w.comm is self and w.state != "pending"]:
                _release(write)
        with self._cond:
            idle = self._ran >= self._launched
        if idle:
            self._free()

    def _free(self):
        with self._cond:
            comm, self._comm = self._comm, None
        if comm is not None:
            comm.Free()
