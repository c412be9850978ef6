"""NcclTransport: GPU-to-GPU transfers with ``cupy.cuda.nccl``, one NCCL communicator per stream.

NCCL's rules, and how this transport keeps them:

* every rank issues a communicator's operations in the same order, and no two threads
  are inside one communicator at once: each stream owns its own NCCL communicator
  (unique id from rank 0, broadcast over MPI, created once in ``new_stream``), used only
  by that stream's thread; calls off any stream use the transport's own communicator;
* operations on different communicators of one device are launched in one order on every
  rank: the order in which the rank's program submitted them (:class:`_LaunchOrder`). A
  stream's operation launches all of its NCCL calls in its turn, and a call off any
  stream waits for the turns submitted before it. A turn lasts as long as the host takes
  to enqueue the operation (its NCCL calls and kernels do not wait for the GPU), so the
  streams still overlap on the GPU;
* every communicator is used once when it is made (send and receive with every peer, one
  all-reduce), while nothing else runs on the device: NCCL connects ranks and allocates
  device memory at first use, which could otherwise happen under another communicator's
  running kernels;
* one GPU per rank: two ranks on one GPU (same node, same PCI bus id) are refused; every
  thread that makes CUDA calls for the transport (the caller's, each stream's, the
  watchdog's) has the rank's device current, so no rank makes a context on another GPU;
* every wait has a deadline (``timeout_s``, default ``RINGNET_COMM_TIMEOUT``): a
  communicator's creation runs under a watchdog that ends the MPI job, and every
  operation enqueued on a CUDA stream is watched until it completes; past the deadline
  the communicators are aborted, the operation and peer are named, and the job ends.
  A host wait blocks on a CUDA event (no polling); the watchdog bounds it.

``nccl`` picks the library: None reads ``RINGNET_NCCL`` (``standin`` selects the strict
stand-in of CUDA and NCCL in :mod:`ringnet.testing.nccl_standin`, which moves NumPy arrays
through this same code, streams, events and watchdog included, and lets CI check these
rules without a GPU), ``"cupy"`` or ``"standin"`` pick explicitly.
"""
import collections
import contextlib
import os
import sys
import threading
import time
import warnings
import weakref

import numpy as np
from mpi4py import MPI

from ringnet import trace
from ringnet.backend import cupy, gpu_available, is_gpu_array
from ringnet.comm.stream import CpuStream, Handle, current_stream, current_tag
from ringnet.comm.transport import CommTimeoutError, Transport, describe
from ringnet.errors import TransportUnavailable

__all__ = ["NcclTransport", "NcclStream", "nccl_module", "NCCL_CHOICES", "NCCL_INSTALL"]

NCCL_CHOICES = ("cupy", "standin")
# How to get CuPy with NCCL (the extras of setup.cfg)
NCCL_INSTALL = 'pip install -e ".[gpu-cuda12]" or ".[gpu-cuda13]"'


def nccl_module(kind=None):
    """Return the NCCL module for ``kind`` (None: ``RINGNET_NCCL``, default cupy), or None if unloadable."""
    kind = kind or os.environ.get("RINGNET_NCCL", "") or "cupy"
    if kind not in NCCL_CHOICES:
        raise ValueError(f"RINGNET_NCCL={kind!r}: choose cupy or standin")
    if kind == "standin":
        from ringnet.testing import nccl_standin  # noqa: WPS433  loaded only when asked for
        return nccl_standin
    if cupy is None:
        return None
    try:
        with warnings.catch_warnings():     # CuPy warns when libnccl is missing: None says it
            warnings.simplefilter("ignore")
            from cupy.cuda import nccl  # noqa: WPS433 - optional, loads libnccl
    except Exception:  # noqa: BLE001
        return None
    return nccl if getattr(nccl, "available", False) else None


def _nccl_dtype(nccl, dtype):
    """Map a NumPy dtype to NCCL's enum; None for types NCCL lacks (sent as bytes)."""
    names = {"float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
             "int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32",
             "uint32": "NCCL_UINT32", "int64": "NCCL_INT64", "uint64": "NCCL_UINT64"}
    name = names.get(str(dtype))
    return getattr(nccl, name, None) if name else None


class _Enqueued:
    """A paired NCCL transfer already ordered on the issuing thread's CUDA stream."""

    __slots__ = ("transport", "event")

    def __init__(self, transport, event=None):
        self.transport, self.event = transport, event

    def wait(self):
        # Later work on the same stream runs after it: nothing to wait for on the host.
        # On the stand-in the caller's next host code stands for that work, so it waits
        # there for the stream to get past the transfer. Completion is watched (deadline)
        # by the transport's watchdog.
        if self.event is not None:
            self.event.host_work()
        self.transport.check_error()


class _HostCall:
    """A host-side NCCL call in progress (``done`` once it returned), for the watchdog."""

    __slots__ = ("done",)

    def __init__(self):
        self.done = False


class _Watchdog:
    """Watches CUDA events of enqueued NCCL operations; past the deadline calls ``expire(what)``.

    ``expire`` aborts the communicators and ends the job; a thread polls every ``poll_s``.
    ``bind`` runs first on that thread: querying and destroying events are CUDA calls, made
    on the thread's current device, which must be the rank's.
    """

    def __init__(self, timeout_s, expire, poll_s=0.05, clock=time.monotonic, bind=None):
        self.timeout_s, self.expire, self.poll_s, self.clock = timeout_s, expire, poll_s, clock
        self.bind = bind
        self.failure = None         # what ended the thread early, raised by check_error
        self._pending = collections.deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ringnet-nccl-watchdog", daemon=True)
        self._thread.start()

    def watch(self, event, what):
        """Expect ``event`` (anything with ``.done``) to complete within the deadline."""
        with self._lock:
            self._pending.append((event, self.clock(), what))

    def check(self):
        """Drop completed events; return the description of an expired one, else None."""
        with self._lock:
            while self._pending and self._pending[0][0].done:
                self._pending.popleft()
            for event, start, what in self._pending:
                if not event.done and self.clock() - start > self.timeout_s:
                    return what
        return None

    def _loop(self):
        try:
            if self.bind is not None:
                self.bind()
            while not self._stop.wait(self.poll_s):
                what = self.check()
                if what is not None:
                    self.expire(what)
                    return
        except Exception as exc:  # noqa: BLE001 - a CUDA error querying an event
            # The device failed under the watchdog: keep the error for the rank's next call
            # (check_error raises it there) instead of a traceback from a dead thread.
            self.failure = exc

    def stop(self):
        """Stop the thread and forget the events (dropped here, on the caller's device)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            self._pending.clear()


class _LaunchOrder:
    """The order in which this rank launches NCCL calls on its device: submission order.

    NCCL requires operations on different communicators of one device to come in the same
    order on every rank; here they come in the order the rank's program submitted them,
    which every rank runs alike. A stream operation takes a ticket when it is submitted
    (:meth:`take`, with the queueing, under :attr:`lock`) and launches all of its NCCL calls
    in :meth:`turn`; a call made off any stream takes the next ticket when it is made.
    Calls inside a turn belong to it. A turn that does not come within ``timeout_s`` raises
    CommTimeoutError naming the one in progress.
    """

    def __init__(self, timeout_s):
        self.timeout_s = timeout_s
        self.lock = threading.Condition()
        self._issued = 0
        self._served = 0
        self._holder = None
        self._local = threading.local()

    def take(self):
        """Return the next ticket (hold :attr:`lock` so that it goes with the queueing)."""
        ticket, self._issued = self._issued, self._issued + 1
        return ticket

    @contextlib.contextmanager
    def turn(self, ticket=None, what="an NCCL call"):
        if getattr(self._local, "inside", False):
            yield
            return
        with self.lock:
            if ticket is None:
                ticket = self.take()
            if not self.lock.wait_for(lambda: self._served == ticket, self.timeout_s):
                holder = self._holder or "a stream operation not started yet"
                raise CommTimeoutError(f"{what} waited {self.timeout_s:g} s for its turn to "
                                       f"launch on the GPU behind {holder}")
            self._holder = what
        self._local.inside = True
        try:
            yield
        finally:
            self._local.inside = False
            with self.lock:
                self._served += 1
                self._holder = None
                self.lock.notify_all()


class _NcclHandle(Handle):
    """Completion of one operation on an :class:`NcclStream`."""

    __slots__ = ()

    def wait(self, timeout=None):
        """Wait until the operation is enqueued on its stream; re-raise its error here;
        return its value.

        The host waits only for the stream's thread to have enqueued the work (its NCCL
        calls do not wait for the GPU there); the calling thread's current CUDA stream
        then waits on the event recorded behind the work, so later kernels and copies on
        that stream (``asnumpy`` included) see its result while the host runs ahead.
        ``timeout``: seconds to wait on the host (None: no limit); past it, TimeoutError
        and the operation stays queued. Deadlines on the device work are the transport's
        watchdog's.
        """
        if not self._event.wait(timeout):
            raise TimeoutError(f"stream operation not enqueued within {timeout} s")
        if self._error is not None:
            raise self._error
        if self._cuda_event is not None:
            self._stream.cuda.get_current_stream().wait_event(self._cuda_event)
        return self._value

    def done(self):
        """True once the operation is enqueued and the GPU has run it (does not block)."""
        return self._event.is_set() and (self._cuda_event is None or self._cuda_event.done)


class NcclStream(CpuStream):
    """A CUDA stream with its own NCCL communicator, and the thread that enqueues on it.

    Made by :meth:`NcclTransport.new_stream`. The thread makes the rank's device current,
    waits (on the GPU) for the event recorded on the submitter's stream at ``submit``, runs
    the operation in its launch turn, then records the event that :meth:`_NcclHandle.wait`
    makes the waiter's stream wait on.
    """

    def __init__(self, tag, transport):
        self.transport = transport
        self.cuda = transport.cuda
        self.device_id = transport.device_id
        with self.cuda.Device(self.device_id):
            self.cuda_stream = self.cuda.Stream(non_blocking=True)
        super().__init__(tag, name="ringnet-nccl", progress="poll")

    def _enter(self):
        # The current device is per host thread: bind the rank's here too.
        self.cuda.Device(self.device_id).use()

    def submit(self, fn, *args):
        """Queue ``fn(*args)`` behind the earlier operations; return its handle.

        The operation waits on the GPU for what the calling thread's current stream has
        enqueued so far, so the caller need not synchronize before submitting a buffer it
        just wrote. Raises RuntimeError on a closed stream.
        """
        if self._closed:
            raise RuntimeError("submit on a closed stream")
        handle = _NcclHandle(self)
        order = self.transport._order
        with order.lock:
            after = self.cuda.get_current_stream().record()
            self._queue.put((handle, fn, args, (after, order.take())))
        return handle

    def _run(self, fn, args, after=None):
        event, ticket = after
        name = getattr(fn, "__name__", "operation")
        with self.transport._order.turn(ticket, f"stream {self.tag}'s {name}"):
            with self.cuda_stream:
                self.cuda_stream.wait_event(event)
                value = fn(*args)
                if self.transport.standin:
                    self.cuda_stream.hand_off()
                done = self.cuda_stream.record()
        return value, done


class NcclTransport(Transport):
    """Transfers between GPUs with NCCL; every rank must own a distinct GPU."""

    name = "nccl"

    def __init__(self, mpi_comm=None, timeout_s=None, nccl=None):
        if nccl is None or isinstance(nccl, str):
            nccl = nccl_module(nccl)
        self.standin = bool(getattr(nccl, "HOST_MEMORY", False))
        if not self.standin and (nccl is None or not gpu_available()):
            raise TransportUnavailable("transport nccl needs a usable CUDA GPU and CuPy with "
                                       f"NCCL ({NCCL_INSTALL})",
                                       "no-nccl", transport=self.name)
        parent = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        super().__init__(parent.Dup(), timeout_s)
        self.nccl = nccl
        self.cuda = nccl.cuda if self.standin else cupy.cuda
        self.xp = np if self.standin else cupy
        self._comms = {}
        self._expired = None        # what the watchdog found past the deadline
        self._streams = weakref.WeakSet()
        if self.standin:
            nccl.bind()     # as bind_gpu does on a GPU: this rank's device on this thread
        self.device_id = self.cuda.Device().id
        if not self.standin:     # the stand-in gives every rank of a node its own device
            self._check_devices()
        self._order = _LaunchOrder(self.timeout_s)
        self._watchdog = _Watchdog(self.timeout_s, self._expire, bind=self._bind)
        self._comms[0] = self._create("the transport's communicator")
        self._warm_up("the transport's communicator")

    def _bind(self):
        self.cuda.Device(self.device_id).use()

    def _check_devices(self):
        """Refuse two ranks on one GPU (same node, same PCI bus id): NCCL cannot run them."""
        from ringnet.backend import pci_bus_id  # noqa: WPS433
        places = self.mpi_comm.allgather((MPI.Get_processor_name(), pci_bus_id(self.device_id)))
        seen = {}
        for rank, place in enumerate(places):
            if place in seen:
                raise TransportUnavailable(f"ranks {seen[place]} and {rank} share GPU "
                                           f"{place[1]} on {place[0]}; NCCL needs one GPU per "
                                           "rank", "shared-gpu", transport=self.name)
            seen[place] = rank

    # -- communicators: one per stream, created collectively under a deadline ------------
    def _create(self, what):
        """Create one NCCL communicator over all ranks (collective); a watchdog bounds the wait."""
        uid = self.nccl.get_unique_id() if self.rank == 0 else None
        uid = self.mpi_comm.bcast(uid, root=0)
        done = threading.Event()
        message = (f"NCCL init of {what} did not complete within {self.timeout_s:g} s "
                   "(a rank did not join); aborting the job")

        def watch():
            if not done.wait(self.timeout_s):
                from ringnet.shutdown import abort  # noqa: WPS433
                abort(message)
        threading.Thread(target=watch, name="ringnet-nccl-init-watchdog", daemon=True).start()
        try:
            # NCCL binds a communicator to the device current at its creation.
            with self.cuda.Device(self.device_id):
                comm = self.nccl.NcclCommunicator(self.size, uid, self.rank)
            if self.standin:
                # Real NCCL waits for ever: the stand-in's own limit stays behind the
                # watchdog's deadline, so that the watchdog ends a hung job, as on a GPU.
                comm.timeout_s = 2 * self.timeout_s
        finally:
            done.set()
        return comm

    def _warm_up(self, what):
        """Use the calling thread's communicator once with every peer and in one all-reduce,
        and wait for it: NCCL connects ranks and allocates device memory at first use, so
        that happens here, while nothing else runs on the device. The values are checked."""
        comm = self._comm()
        xp, n, r = self.xp, self.size, self.rank
        stream = self.cuda.get_current_stream()
        with self._order.turn(what=f"the warm-up of {what}"):
            mine = xp.full(1, r + 1, dtype=xp.float32)
            got = xp.zeros(n, dtype=xp.float32)
            total = xp.ones(1, dtype=xp.float32)
            for k in range(1, n):
                self.nccl.groupStart()
                try:
                    comm.send(*self._args(mine), (r + k) % n, stream.ptr)
                    comm.recv(*self._args(got[k:k + 1]), (r - k) % n, stream.ptr)
                finally:
                    self.nccl.groupEnd()
            ptr, count, dtype = self._args(total)
            comm.allReduce(ptr, ptr, count, dtype, self.nccl.NCCL_SUM, stream.ptr)
        self._synchronize(stream, f"the warm-up of {what}")
        expected = np.array([0] + [(r - k) % n + 1 for k in range(1, n)], np.float32)
        if not (np.array_equal(self._host(got), expected) and self._host(total)[0] == n):
            raise RuntimeError(f"the warm-up of {what} over NCCL moved wrong values")

    def _host(self, array):
        return np.asarray(array) if self.standin else cupy.asnumpy(array)

    def _comm(self):
        """Return the communicator of the stream running on this thread (0: off-stream)."""
        tag = current_tag()
        comm = self._comms.get(tag)
        if comm is None:
            raise RuntimeError(f"stream {tag} has no NCCL communicator on this transport: make "
                               "streams with this transport's new_stream()")
        return comm

    def new_stream(self):
        """Return a new :class:`NcclStream` with its own NCCL communicator, warmed up
        (collective: every rank calls it, in the same order)."""
        tag, self._next_tag = self._next_tag, self._next_tag + 1
        self._quiesce()
        self._comms[tag] = self._create(f"the communicator of stream {tag}")
        stream = NcclStream(tag, self)
        self._streams.add(stream)
        stream.submit(self._warm_up, f"the communicator of stream {tag}").wait()
        return stream

    def _quiesce(self):
        """Wait until none of this rank's NCCL work is in flight, on the host or the GPU."""
        for stream in list(self._streams):
            if not stream._closed:
                stream.synchronize()
        self.cuda.Device(self.device_id).synchronize()

    def uses_gpu(self):
        return not self.standin

    # -- transfers ---------------------------------------------------------------------
    def check_error(self):
        """Raise if NCCL reported an asynchronous error (e.g. a peer failed),
        CommTimeoutError once the watchdog found an operation past the deadline, or the
        device error that stopped the watchdog."""
        if self._expired is not None:
            raise CommTimeoutError(f"{self._expired} did not complete within {self.timeout_s:g} s")
        if self._watchdog.failure is not None:
            raise self._watchdog.failure
        for comm in list(self._comms.values()):
            check = getattr(comm, "check_async_error", None)
            if check is not None:
                check()

    def _args(self, array):
        ptr = self.nccl.host_pointer(array) if self.standin else array.data.ptr
        dtype = _nccl_dtype(self.nccl, array.dtype)
        if dtype is None:
            return ptr, array.nbytes, self.nccl.NCCL_UINT8
        return ptr, array.size, dtype

    def _check_space(self, array):
        if array is None:
            return
        if self.standin and is_gpu_array(array):
            raise ValueError("this transport nccl runs on the host stand-in: it moves NumPy arrays")
        if not self.standin and not is_gpu_array(array):
            raise ValueError("transport nccl moves CuPy arrays only; use transport mpi for NumPy")

    def isendrecv(self, send_array, send_peer, recv_array, recv_peer):
        """Enqueue send and receive on the current CUDA stream inside one NCCL group."""
        self._check_pair(send_array, send_peer, recv_array, recv_peer)
        self._check_space(send_array)
        self._check_space(recv_array)
        send_bytes = 0 if send_array is None else send_array.nbytes
        recv_bytes = 0 if recv_array is None else recv_array.nbytes
        if not (send_bytes or recv_bytes):
            return _Enqueued(self)
        comm = self._comm()
        stream = self.cuda.get_current_stream()
        op = "sendrecv" if send_bytes and recv_bytes else "send" if send_bytes else "recv"
        what = describe(op, send_peer if send_bytes else None, recv_peer if recv_bytes else None,
                        max(send_bytes, recv_bytes))
        with self._order.turn(what=what):
            # groupEnd can block on the host (NCCL connects a pair of ranks at first use).
            call = self._watch_call(f"{what} (NCCL group call)")
            # The span covers the enqueueing (the transfer runs on the stream later).
            with trace.span("transfer", op=op, to=send_peer if send_bytes else None,
                            sent=send_bytes, received=recv_bytes, enqueued=not self.standin,
                            **{"from": recv_peer if recv_bytes else None}):
                # A lone send and a lone receive in opposite orders deadlock: group them.
                self.nccl.groupStart()
                try:
                    if send_bytes:
                        ptr, count, dtype = self._args(send_array)
                        comm.send(ptr, count, dtype, send_peer, stream.ptr)
                    if recv_bytes:
                        ptr, count, dtype = self._args(recv_array)
                        comm.recv(ptr, count, dtype, recv_peer, stream.ptr)
                finally:
                    self.nccl.groupEnd()
                    call.done = True
        self._count(send_bytes, recv_bytes)
        event = stream.record()
        self._watchdog.watch(event, what)
        return _Enqueued(self, event if self.standin else None)

    def _watch_call(self, what):
        call = _HostCall()
        self._watchdog.watch(call, what)
        return call

    def _complete(self, what):
        self.finish(what)

    def _on_own_stream(self):
        stream = current_stream()
        return isinstance(stream, NcclStream) and stream.transport is self

    def finish(self, what="stream"):
        """Make the work this thread queued on its current CUDA stream complete for the caller.

        Off the transport's streams the host blocks on an event recorded behind it (no
        polling) and raises NCCL's asynchronous error if there is one. The watchdog bounds
        the wait: past the deadline it aborts NCCL, which wakes the wait, the wait raises
        CommTimeoutError, and the watchdog ends the job. On one of its streams nothing
        waits: what comes next on that stream runs after the work, and the stream's handle
        orders its waiters after it.
        """
        stream = self.cuda.get_current_stream()
        if self._on_own_stream():
            if self.standin:
                stream.host_work()
            self.check_error()
            return
        self._synchronize(stream, what)

    def _synchronize(self, stream, what):
        """Block the host on an event recorded now on ``stream``; the watchdog bounds it."""
        event = self.cuda.Event(block=True, disable_timing=True)
        event.record(stream)
        self._watchdog.watch(event, what)
        event.synchronize()
        self.check_error()

    def abort(self):
        """Abort every NCCL communicator of this transport (operations in flight fail)."""
        for comm in list(self._comms.values()):
            try:
                comm.abort()
            except Exception:  # noqa: BLE001 - already aborted or never usable
                pass
        self._comms.clear()

    def _expire(self, what):
        """Watchdog: an enqueued operation is past the deadline; abort NCCL, then the job."""
        from ringnet.shutdown import abort  # noqa: WPS433
        # A thread waiting on the GPU wakes when the communicators are aborted: it raises
        # this instead of going on with what the operation never wrote.
        self._expired = what
        print(f"[rank {self.rank}] ringnet: error: {what} over NCCL did not complete within "
              f"{self.timeout_s:g} s; aborting the NCCL communicators", file=sys.stderr, flush=True)
        self.abort()
        abort()

    def allreduce_native(self, buf, op="sum"):
        """ncclAllReduce in place on the current stream."""
        self._check_space(buf)
        ptr, count, dtype = self._args(buf)
        what = describe("allreduce", None, None, buf.nbytes)
        stream = self.cuda.get_current_stream()
        with self._order.turn(what=what):
            call = self._watch_call(what)
            try:
                self._comm().allReduce(ptr, ptr, count, dtype, self.nccl.NCCL_SUM, stream.ptr)
            finally:
                call.done = True
        self.finish(what)

    def close(self):
        if self._comms:
            # Communicators are destroyed idle: let the device finish what was enqueued.
            self.cuda.Device(self.device_id).synchronize()
        self._watchdog.stop()
        for comm in self._comms.values():
            comm.destroy()
        self._comms.clear()
        if self.mpi_comm is not None:
            self.mpi_comm.Free()
            self.mpi_comm = None
