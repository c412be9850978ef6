"""NcclTransport: GPU-to-GPU transfers with ``cupy.cuda.nccl``, one NCCL communicator per stream.

NCCL's rules, and how this transport keeps them:

* every rank issues a communicator's operations in the same order, and no two threads
  are inside one communicator at once: each stream owns its own NCCL communicator
  (unique id from rank 0, broadcast over MPI, created once in ``new_stream``), used only
  by that stream's thread; calls off any stream use the transport's own communicator;
* one GPU per rank: two ranks on one GPU (same node, same PCI bus id) are refused;
* every wait has a deadline (``timeout_s``, default ``RINGNET_COMM_TIMEOUT``): a
  communicator's creation runs under a watchdog that ends the MPI job, and every
  operation enqueued on a CUDA stream is watched until it completes; past the deadline
  the communicators are aborted, the operation and peer are named, and the job ends.

``nccl`` picks the library: None reads ``RINGNET_NCCL`` (``standin`` selects the strict
host-memory stand-in in :mod:`ringnet.comm._nccl_standin`, which moves NumPy arrays and
lets CI check these rules without a GPU), ``"cupy"`` or ``"standin"`` pick explicitly.
"""
import collections
import os
import sys
import threading
import time
import warnings

from mpi4py import MPI

from ringnet import trace
from ringnet.backend import cupy, gpu_available, is_gpu_array
from ringnet.comm.stream import CpuStream, GpuStream, current_tag
from ringnet.comm.transport import CommTimeoutError, Transport, describe
from ringnet.errors import TransportUnavailable

__all__ = ["NcclTransport", "nccl_module", "NCCL_CHOICES", "NCCL_INSTALL"]

NCCL_CHOICES = ("cupy", "standin")
# How to get CuPy with NCCL (the extras of setup.cfg)
NCCL_INSTALL = 'pip install -e ".[gpu-cuda12]" or ".[gpu-cuda13]"'


def nccl_module(kind=None):
    """Return the NCCL module for ``kind`` (None: ``RINGNET_NCCL``, default cupy), or None if unloadable."""
    kind = kind or os.environ.get("RINGNET_NCCL", "") or "cupy"
    if kind not in NCCL_CHOICES:
        raise ValueError(f"RINGNET_NCCL={kind!r}: choose cupy or standin")
    if kind == "standin":
        from ringnet.comm import _nccl_standin  # noqa: WPS433
        return _nccl_standin
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
    """A paired NCCL transfer already ordered on the current CUDA stream."""

    __slots__ = ("transport",)

    def __init__(self, transport):
        self.transport = transport

    def wait(self):
        # Later work on the same stream runs after it: nothing to wait for on the host.
        # Completion is watched (deadline) by the transport's watchdog.
        self.transport.check_error()


class _HostCall:
    """A host-side NCCL call in progress (``done`` once it returned), for the watchdog."""

    __slots__ = ("done",)

    def __init__(self):
        self.done = False


class _Watchdog:
    """Watches CUDA events of enqueued NCCL operations; past the deadline calls ``expire(what)``.

    ``expire`` aborts the communicators and ends the job; a thread polls every ``poll_s``.
    """

    def __init__(self, timeout_s, expire, poll_s=0.05, clock=time.monotonic):
        self.timeout_s, self.expire, self.poll_s, self.clock = timeout_s, expire, poll_s, clock
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
        while not self._stop.wait(self.poll_s):
            what = self.check()
            if what is not None:
                self.expire(what)
                return

    def stop(self):
        self._stop.set()


class NcclTransport(Transport):
    """Transfers between GPUs with NCCL; every rank must own a distinct GPU."""

    name = "nccl"

    def __init__(self, mpi_comm=None, timeout_s=None, nccl=None):
        if nccl is None or isinstance(nccl, str):
            nccl = nccl_module(nccl)
        self.on_host = bool(getattr(nccl, "HOST_MEMORY", False))
        if not self.on_host and (nccl is None or not gpu_available()):
            raise TransportUnavailable("transport nccl needs a usable CUDA GPU and CuPy with "
                                       f"NCCL ({NCCL_INSTALL})",
                                       "no-nccl", transport=self.name)
        parent = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        super().__init__(parent.Dup(), timeout_s)
        self.nccl = nccl
        self._comms = {}
        self._watchdog = None
        self.device_id = None
        if not self.on_host:
            self.device_id = cupy.cuda.Device().id
            self._check_devices()
            self._watchdog = _Watchdog(self.timeout_s, self._expire)
        self._comms[0] = self._create("the transport's communicator")

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
                from ringnet.errors import abort  # noqa: WPS433
                abort(message)
        threading.Thread(target=watch, name="ringnet-nccl-init-watchdog", daemon=True).start()
        try:
            if self.on_host:
                comm = self.nccl.NcclCommunicator(self.size, uid, self.rank)
                comm.timeout_s = self.timeout_s
            else:
                # NCCL binds a communicator to the device current at its creation.
                with cupy.cuda.Device(self.device_id):
                    comm = self.nccl.NcclCommunicator(self.size, uid, self.rank)
        finally:
            done.set()
        return comm

    def _comm(self):
        """Return the communicator of the stream running on this thread (0: off-stream)."""
        tag = current_tag()
        comm = self._comms.get(tag)
        if comm is None:
            raise RuntimeError(f"stream {tag} has no NCCL communicator on this transport: make "
                               "streams with this transport's new_stream()")
        return comm

    def new_stream(self):
        """Return a new stream with its own NCCL communicator (collective: every rank calls it)."""
        tag, self._next_tag = self._next_tag, self._next_tag + 1
        self._comms[tag] = self._create(f"the communicator of stream {tag}")
        if self.on_host:
            return CpuStream(tag)
        return GpuStream(tag, self.device_id)

    def uses_gpu(self):
        return not self.on_host

    # -- transfers ---------------------------------------------------------------------
    def check_error(self):
        """Raise if NCCL reported an asynchronous error (e.g. a peer failed)."""
        for comm in list(self._comms.values()):
            check = getattr(comm, "check_async_error", None)
            if check is not None:
                check()

    def _args(self, array):
        ptr = array.ctypes.data if self.on_host else array.data.ptr
        dtype = _nccl_dtype(self.nccl, array.dtype)
        if dtype is None:
            return ptr, array.nbytes, self.nccl.NCCL_UINT8
        return ptr, array.size, dtype

    def _check_space(self, array):
        if array is None:
            return
        if self.on_host and is_gpu_array(array):
            raise ValueError("this transport nccl runs on the host stand-in: it moves NumPy arrays")
        if not self.on_host and not is_gpu_array(array):
            raise ValueError("transport nccl moves CuPy arrays only; use transport mpi for NumPy")

    def _stream_ptr(self):
        return 0 if self.on_host else cupy.cuda.get_current_stream().ptr

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
        stream = self._stream_ptr()
        op = "sendrecv" if send_bytes and recv_bytes else "send" if send_bytes else "recv"
        what = describe(op, send_peer if send_bytes else None, recv_peer if recv_bytes else None,
                        max(send_bytes, recv_bytes))
        # groupEnd can block on the host (NCCL connects a pair of ranks at first use).
        call = self._watch_call(f"{what} (NCCL group call)")
        # On a GPU the span covers the enqueueing (the transfer runs on the stream later);
        # the host stand-in completes the transfer inside it.
        with trace.span("transfer", op=op, to=send_peer if send_bytes else None,
                        sent=send_bytes, received=recv_bytes, enqueued=not self.on_host,
                        **{"from": recv_peer if recv_bytes else None}):
            # A lone send and a lone receive in opposite orders deadlock: group them.
            self.nccl.groupStart()
            try:
                if send_bytes:
                    ptr, count, dtype = self._args(send_array)
                    comm.send(ptr, count, dtype, send_peer, stream)
                if recv_bytes:
                    ptr, count, dtype = self._args(recv_array)
                    comm.recv(ptr, count, dtype, recv_peer, stream)
            finally:
                self.nccl.groupEnd()
                call.done = True
        self._count(send_bytes, recv_bytes)
        if self._watchdog is not None:
            self._watchdog.watch(cupy.cuda.get_current_stream().record(), what)
        return _Enqueued(self)

    def _watch_call(self, what):
        call = _HostCall()
        if self._watchdog is not None:
            self._watchdog.watch(call, what)
        return call

    def _complete(self, what):
        self.finish(what)

    def finish(self, what="stream"):
        """Wait for the current CUDA stream, raising CommTimeoutError past the deadline."""
        if self.on_host:
            return      # the stand-in completes every operation before returning
        event = cupy.cuda.get_current_stream().record()
        start = time.perf_counter()
        while not event.done:
            self.check_error()
            if time.perf_counter() - start > self.timeout_s:
                self.abort()
                raise CommTimeoutError(f"{what} did not complete within {self.timeout_s:g} s")
            time.sleep(1e-4)

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
        from ringnet.errors import abort  # noqa: WPS433
        print(f"[rank {self.rank}] ringnet: error: {what} over NCCL did not complete within "
              f"{self.timeout_s:g} s; aborting the NCCL communicators", file=sys.stderr, flush=True)
        self.abort()
        abort()

    def allreduce_native(self, buf, op="sum"):
        """ncclAllReduce in place on the current stream."""
        self._check_space(buf)
        ptr, count, dtype = self._args(buf)
        what = describe("allreduce", None, None, buf.nbytes)
        call = self._watch_call(what)
        try:
            self._comm().allReduce(ptr, ptr, count, dtype, self.nccl.NCCL_SUM, self._stream_ptr())
        finally:
            call.done = True
        self.finish(what)

    def close(self):
        if self._watchdog is not None:
            self._watchdog.stop()
        for comm in self._comms.values():
            comm.destroy()
        self._comms.clear()
        if self.mpi_comm is not None:
            self.mpi_comm.Free()
            self.mpi_comm = None
