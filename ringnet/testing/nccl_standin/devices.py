"""The stand-in's CUDA: devices (and the rule that a rank uses one), streams and events.

Every stream runs what is enqueued on it on a thread of its own; see
:mod:`ringnet.testing.nccl_standin`.
"""
import collections
import itertools
import sys
import threading
import types

from mpi4py import MPI

from ringnet.testing.nccl_standin.common import (DEVICE_COUNT, NcclError, NcclRuleError, thread_state, state_lock,
                                               default_timeout_s)
from ringnet.testing.nccl_standin.memory import hide, publish, show_writes, made_on

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
    with state_lock:
        return list(_violations)


def clear_violations():
    """Forget the recorded rule breaks (for tests that provoke one on purpose)."""
    with state_lock:
        del _violations[:]


def current_device():
    return getattr(thread_state, "device", 0)


def _thread_name():
    return threading.current_thread().name


def _use(device, what):
    """Note that ``what`` uses ``device``; return the message of a rule it breaks, or None."""
    global _rank_device
    with state_lock:
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
    current = current_device()
    problem = _use(current, what)
    if problem is None and device is not None and device != current:
        problem = (f"{what} on thread {_thread_name()!r}: the object belongs to device {device}, "
                   f"the thread's current device is {current}")
    return problem


def check_use(what, device=None):
    """Raise (and remember) when the rank failed before or ``what`` breaks the device rules."""
    with state_lock:
        if _violations:
            raise NcclRuleError(_violations[0])
    problem = _breaks(what, device)
    if problem is not None:
        with state_lock:
            _violations.append(problem)
        raise NcclRuleError(problem)


def _note(what, device):
    """Remember a rule break where raising is not possible (an object being destroyed)."""
    if getattr(thread_state, "internal", False) or sys.is_finalizing():
        return
    problem = _breaks(what, device)
    if problem is not None:
        with state_lock:
            _violations.append(problem)


class _HostPointer(int):
    """A host address that keeps the array it points into alive (``owner``)."""


def host_pointer(array):
    """Return ``array``'s address for the NCCL calls, holding the array while it is tracked.
    A buffer made on another device than the rank's (a model built before the rank bound
    its device: on device 0) is refused, as NCCL cannot use it from the rank's GPU."""
    ptr = _HostPointer(array.ctypes.data)
    device = made_on(int(ptr))
    if device is not None and _rank_device is not None and device != _rank_device:
        raise NcclRuleError(
            f"a buffer at {int(ptr):#x} was made on device {device}, but this rank's device is "
            f"{_rank_device} (bind the rank's device before building the model or "
            "its buffers)")
    ptr.owner = array
    return ptr


class Device:
    """A stand-in CUDA device: ``Device()`` is the thread's current one."""

    def __init__(self, device=None):
        self.id = current_device() if device is None else int(device)
        if not 0 <= self.id < DEVICE_COUNT:
            raise NcclError(f"no stand-in device {self.id} (there are {DEVICE_COUNT})")
        self._previous = []

    def use(self):
        """Make this device current on the calling thread."""
        thread_state.device = self.id
        check_use(f"cudaSetDevice({self.id})")

    def __enter__(self):
        self._previous.append(current_device())
        self.use()
        return self

    def __exit__(self, *exc):
        thread_state.device = self._previous.pop()

    def synchronize(self):
        """Wait for every stream of this device; the host is then ordered after all of it."""
        check_use("cudaDeviceSynchronize", self.id)
        with state_lock:
            queues = [q for q in _queues if q.device == self.id]
        for queue in queues:
            position = queue.enqueued
            queue.wait_for(position, "cudaDeviceSynchronize")
            publish(queue, position)


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
        with state_lock:
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
        thread_state.device = self.device
        thread_state.internal = True
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
        with state_lock:
            _queues.discard(self)

    def wait_for(self, position, what):
        """Block until the stream ran everything up to ``position`` (a deadline bounds it)."""
        limit = default_timeout_s()
        with self.cond:
            if not self.cond.wait_for(lambda: self.executed >= position, limit):
                raise NcclError(f"{what}: stream {self.name} did not get there within {limit:g} s")

    def stop(self):
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
            started = self.thread is not None
        if not started:
            with state_lock:
                _queues.discard(self)


def _null(device):
    """The null stream of ``device`` (pointer 0, one per device)."""
    with state_lock:
        stream = _nulls.get(device)
        if stream is None:
            stream = _nulls[device] = Stream._make(device, null=True)
        return stream


_nulls = {}


class Stream:
    """A stand-in CUDA stream of the current device (see the module docstring)."""

    def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
        check_use("cudaStreamCreate")
        self._init(current_device(), null)

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
            with state_lock:
                _ptrs[self.ptr] = self._queue

    def __repr__(self):
        return f"<stand-in stream {self._queue.name} of device {self.device_id}>"

    # -- the thread's current stream --------------------------------------------------
    def use(self):
        check_use("cudaStreamUse", self.device_id)
        _streams()[self.device_id] = self
        return self

    def __enter__(self):
        check_use("cudaStreamUse", self.device_id)
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
        check_use("cudaEventRecord", self.device_id)
        if event is None:
            event = Event()
        event._record(self._queue)
        return event

    def wait_event(self, event):
        """Order this stream's later work after ``event``.

        The host code of the calling thread stands for that work, so the call returns once
        the event has completed, and the writes ordered before it are visible from then on.
        """
        check_use("cudaStreamWaitEvent", self.device_id)
        check_use("cudaStreamWaitEvent", event.device)
        queue, position = event._queue, event._position
        if queue is not None and queue is not self._queue:
            queue.wait_for(position, f"a wait on an event of stream {queue.name}")
            publish(queue, position)
        show_writes(self._queue)

    def synchronize(self):
        """Block until everything enqueued here ran; the host is then ordered after it."""
        check_use("cudaStreamSynchronize", self.device_id)
        position = self._queue.enqueued
        self._queue.wait_for(position, "cudaStreamSynchronize")
        publish(self._queue, position)

    @property
    def done(self):
        check_use("cudaStreamQuery", self.device_id)
        return self._queue.executed >= self._queue.enqueued

    # -- stand-in only: where host code stands for kernels ---------------------------------
    def host_work(self):
        """The calling thread's next host code stands for kernels queued here: block until
        the stream ran what is enqueued and show its results to that code."""
        check_use("stand-in host work", self.device_id)
        position = self._queue.enqueued
        self._queue.wait_for(position, "host work after the stream's operations")
        show_writes(self._queue, position)

    def hand_off(self):
        """This stream's work goes to another thread through the event recorded next: its
        results so far turn to poison for every reader not ordered after that event."""
        check_use("stand-in hand-off", self.device_id)
        hide(self._queue)

    def __del__(self):
        if getattr(self, "null", True):
            return
        _note("cudaStreamDestroy", self.device_id)
        with state_lock:
            _ptrs.pop(self.ptr, None)
        self._queue.stop()


def _streams():
    streams = getattr(thread_state, "streams", None)
    if streams is None:
        streams = thread_state.streams = {}
    return streams


def get_current_stream(device_id=-1):
    """Return the calling thread's current stream of its current device (the null stream
    by default)."""
    check_use("cudaGetCurrentStream")
    device = current_device()
    return _streams().get(device) or _null(device)


def queue_of(stream_ptr, device):
    if int(stream_ptr) == 0:
        return _null(device)._queue
    with state_lock:
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
        check_use("cudaEventCreate")
        self.device = current_device()
        self._queue = None
        self._position = 0

    def _record(self, queue):
        if queue.device != self.device:
            check_use("cudaEventRecord", queue.device)
        self._queue, self._position = queue, queue.enqueued

    def record(self, stream=None):
        """Record this event on ``stream`` (the current stream by default)."""
        (stream if stream is not None else get_current_stream()).record(self)

    @property
    def done(self):
        """True once the stream ran what came before the record (a query orders nothing)."""
        check_use("cudaEventQuery", self.device)
        return self._queue is None or self._queue.executed >= self._position

    def synchronize(self):
        """Block until the event completed; the host is then ordered after it."""
        check_use("cudaEventSynchronize", self.device)
        if self._queue is not None:
            self._queue.wait_for(self._position, "cudaEventSynchronize")
            publish(self._queue, self._position)

    def host_work(self):
        """The calling thread's next host code stands for kernels queued behind this event
        on its stream: block until the stream got here and show its results up to here."""
        check_use("stand-in host work", self.device)
        if self._queue is not None:
            self._queue.wait_for(self._position, "host work after an operation")
            show_writes(self._queue, self._position)

    def __del__(self):
        if hasattr(self, "device"):         # not when the constructor itself failed
            _note("cudaEventDestroy", self.device)


cuda = types.SimpleNamespace(Device=Device, Stream=Stream, Event=Event, runtime=runtime,
                             get_current_stream=get_current_stream)
