"""MpiTransport: point-to-point transfers with mpi4py's buffer interface."""
import ctypes
import dis
import os
import sys
import threading
import time
import weakref

from mpi4py import MPI

from ringnet import trace
from ringnet.backend import cupy, is_gpu_array
from ringnet import placement as _nodes
from ringnet.comm.stream import (CpuStream, current_stream, current_tag, progress_all, progress_mode,
                                 progress_setting)
from ringnet.comm.transport import CommTimeoutError, Transport, describe

__all__ = ["MpiTransport", "mpi_cuda_aware", "wait_spin_s"]

# Polling: spin (yielding the core to other ranks with sched_yield) for SPIN_S, then
# sleep with a growing pause up to MAX_PAUSE_S. MPI progress only happens inside MPI
# calls, so long pauses would slow large transfers; spinning without yielding starves
# ranks that share a core (measured 5-20x slower with 4 ranks on 2 cores); a yielding
# spin measured as fast as MPI's own blocking Waitall.
SPIN_S = 0.05
MAX_PAUSE_S = 0.001
# A stream thread waits beside its own rank's computation: a long yielding spin there
# steals the core from that computation (a delay-1 exchange often waits most of a step
# for a slower peer), so it spins briefly and then sleeps.
STREAM_SPIN_S = 0.0005
STREAM_MAX_PAUSE_S = 0.0005
# Under a CPU quota smaller than the node's ranks (a container's CPU limit, SLURM's cgroup,
# hpc/cluster.sh --cpus-per-node), a yielding spin is not free: it spends the group's
# budget, the kernel then holds the waiting rank until its period ends (5 ms of every
# 10 at half a core) and the message it waited for is seen that late. The training thread
# there spins as briefly as a stream thread and then sleeps.
QUOTA_SPIN_S = STREAM_SPIN_S
# Past the spin a wait sleeps between polls, each pause this much longer than the one before
# (up to its MAX_PAUSE_S): a peer held for the rest of a quota's period (ms) is seen within
# a fraction of it, for a few tens of polls.
PAUSE_STEP_S = 1e-5
# Yielding polls between looks at the clock and the driven streams (auto's lean path has
# its own such loop, without even this function's entry: see ringnet.comm._lean).
YIELD_ROUNDS = 32
_YIELDS = range(YIELD_ROUNDS)


def wait_spin_s(quota, local_ranks):
    """How long the training thread's wait for a transfer spins before it sleeps: SPIN_S,
    or QUOTA_SPIN_S where a CPU ``quota`` (cores, :func:`ringnet.placement.cpu_quota`; None:
    none) is smaller than the ``local_ranks`` ranks of the node share."""
    if quota is not None and quota < local_ranks:
        return QUOTA_SPIN_S
    return SPIN_S


_MPI_OPS = {"sum": MPI.SUM}
_MPIX_GPU_SUPPORT_CUDA = 0      # MPICH's mpi.h


def _loaded_mpi_library():
    """Return the path of the MPI library this process loaded (Linux), or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                name = os.path.basename(path)
                if name.startswith(("libmpi.so", "libmpi_", "libmpich")) and ".so" in name:
                    return path
    except OSError:
        return None
    return None


def _query_library():
    """Ask the MPI library whether it accepts CUDA pointers: (True/False/None, how)."""
    query = getattr(MPI, "Query_cuda_support", None)       # mpi4py builds that wrap it
    if query is not None:
        try:
            return bool(query()), "MPI.Query_cuda_support"
        except Exception:  # noqa: BLE001
            pass
    path = _loaded_mpi_library()
    if path is None:
        return None, "no MPI library found to ask"
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None, f"cannot open {os.path.basename(path)}"
    if hasattr(lib, "MPIX_Query_cuda_support"):             # Open MPI, MVAPICH
        lib.MPIX_Query_cuda_support.restype = ctypes.c_int
        return bool(lib.MPIX_Query_cuda_support()), "MPIX_Query_cuda_support"
    if hasattr(lib, "MPIX_GPU_query_support"):              # MPICH >= 4
        supported = ctypes.c_int(0)
        lib.MPIX_GPU_query_support(ctypes.c_int(_MPIX_GPU_SUPPORT_CUDA), ctypes.byref(supported))
        return bool(supported.value), "MPIX_GPU_query_support"
    return None, f"{os.path.basename(path)} has no CUDA query"


def mpi_cuda_aware_setting():
    """Return ``RINGNET_CUDA_AWARE_MPI`` as True/False, or None when unset (ask the library)."""
    forced = os.environ.get("RINGNET_CUDA_AWARE_MPI", "")
    if forced in ("0", "1"):
        return forced == "1"
    if forced:
        raise ValueError(f"RINGNET_CUDA_AWARE_MPI={forced!r}: use 0 or 1")
    return None


def mpi_cuda_aware():
    """Return (True when the MPI library accepts CUDA device pointers, how that was decided).

    ``RINGNET_CUDA_AWARE_MPI=0/1`` decides; otherwise the library is asked: Open MPI's
    ``MPIX_Query_cuda_support``, MPICH's ``MPIX_GPU_query_support``. An MPI that cannot
    say counts as not CUDA-aware (GPU buffers are then staged through pinned host memory).
    """
    forced = mpi_cuda_aware_setting()
    if forced is not None:
        return forced, f"RINGNET_CUDA_AWARE_MPI={int(forced)}"
    answer, how = _query_library()
    return bool(answer), how


# Requests given up at their deadline, and their buffers (see MpiTransport._expire).
_EXPIRED = []


class NativeWatch:
    """The deadline of the blocking MPI_Allreduce, at no cost to the call.

    MPICH's non-blocking forms measured 0.5-0.9x the blocking call (MPI_Iallreduce polled,
    and MPI_Allreduce_init started on a buffer of its own, the caller's copied in and out,
    at 3 and 4 ranks on 2 cores), and there even marking each call for a watcher (two
    stores and a clock read, ~0.1 us) measured 5-10% slower: so the call blocks, marks
    nothing, and this watches it from outside. The line of each function that makes the
    call is registered (:meth:`site`: the lines that load the named callable). One daemon
    thread per process, started by :meth:`start`, looks every ``timeout_s / 8`` (0.01-1 s,
    the smallest of the transports that started it) at the frame every thread runs
    (``sys._current_frames``). A thread whose frame stands at a registered line is inside
    that call; the same frame object there at two looks more than the transport's
    ``timeout_s`` apart is one call that long (a later call is another frame: the watch
    holds the one it saw, so it cannot be reused), and the job ends with a line naming
    the call and its size (a collective cannot be taken back, so nothing could be raised
    instead). Such a call is never ended before its deadline, and at most two looks after.
    """

    _sites = {}             # code object -> lines that call MPI_Allreduce
    _transports = weakref.WeakSet()
    _thread = None
    _lock = threading.Lock()

    @classmethod
    def site(cls, function, name):
        """Watch the lines of ``function`` that load ``name`` (the MPI_Allreduce it calls);
        its frame must have ``self`` (a transport, or an object with ``transport``) and
        ``buf`` (the reduced array) as locals. Returns ``function``."""
        code = function.__code__
        lines, line = set(), None
        for instruction in dis.get_instructions(code):
            positions = getattr(instruction, "positions", None)       # Python 3.11+
            if positions is not None and positions.lineno is not None:
                line = positions.lineno
            elif isinstance(instruction.starts_line, int) and instruction.starts_line:
                line = instruction.starts_line
            if instruction.argval == name:
                lines.add(line)
        if not lines:
            raise ValueError(f"{function.__qualname__} does not load {name!r}")
        cls._sites[code] = frozenset(lines)
        return function

    @classmethod
    def start(cls, transport):
        """Watch ``transport``'s calls (its ``timeout_s``); start the thread once."""
        cls._transports.add(transport)
        if cls._thread is None:
            with cls._lock:
                if cls._thread is None:
                    thread = threading.Thread(target=cls._loop, name="ringnet-mpi-watchdog",
                                              daemon=True)
                    thread.start()
                    cls._thread = thread

    @classmethod
    def _loop(cls):
        seen = {}           # thread id -> (frame, first seen there, transport, nbytes)
        while True:
            timeouts = [t.timeout_s for t in list(cls._transports)]
            time.sleep(min(1.0, max(0.01, min(timeouts, default=8.0) / 8)))
            seen = cls.look(seen, time.perf_counter())

    @classmethod
    def look(cls, seen, now):
        """One look at every thread: ``seen`` (from the last look) updated; ends the job
        where a call is past its deadline."""
        looked = {}
        sites = cls._sites
        for ident, frame in sys._current_frames().items():
            lines = sites.get(frame.f_code)
            if lines is None or frame.f_lineno not in lines:
                continue
            before = seen.get(ident)
            if before is not None and before[0] is frame:
                looked[ident] = before
                _, since, transport, nbytes = before
                if now - since > transport.timeout_s:
                    cls.expire(nbytes, transport.timeout_s)
            else:
                owner, buf = frame.f_locals.get("self"), frame.f_locals.get("buf")
                transport = getattr(owner, "transport", owner)
                if hasattr(transport, "timeout_s"):
                    looked[ident] = (frame, now, transport, getattr(buf, "nbytes", 0))
        return looked

    @staticmethod
    def expire(nbytes, timeout_s):
        from ringnet.shutdown import abort  # noqa: WPS433
        abort(f"all-reduce (MPI_Allreduce) of {nbytes} bytes did not complete within "
              f"{timeout_s:g} s: a rank stopped answering; ending the job")


class _Pending:
    """Requests of one paired transfer; wait() polls them against the timeout."""

    __slots__ = ("transport", "requests", "what", "unstage", "sizes")

    def __init__(self, transport, requests, what, unstage, sizes=(0, 0)):
        self.transport, self.requests, self.what, self.unstage = transport, requests, what, unstage
        self.sizes = sizes

    def wait(self):
        kind, send_peer, recv_peer, _ = self.what
        with trace.span("transfer", op=kind, to=send_peer, sent=self.sizes[0],
                        received=self.sizes[1], **{"from": recv_peer}):
            # isendrecv posts the receive first
            self.transport._wait(self.requests, self.what,
                                 receives=self.requests[:1] if self.sizes[1] else ())
            if self.unstage is not None:
                device_out, host, slot = self.unstage
                # Host-staged receive: an asynchronous copy on the current stream; the pinned
                # buffer is reused only after the event recorded behind the copy.
                device_out.set(host)
                slot[1] = cupy.cuda.get_current_stream().record()
        return None


class MpiTransport(Transport):
    """Transfers over MPI: NumPy buffers directly, CuPy buffers direct or host-staged.

    ``layout``: the :class:`~ringnet.placement.NodeLayout` of ``mpi_comm`` when the caller
    has it (None: found here, collectively). ``nodes`` is its node count: CPU streams
    progress by ``RINGNET_CPU_PROGRESS`` resolved for it (``auto``: they poll when the
    ranks span nodes), and timeout messages name each peer's node.
    """

    name = "mpi"

    def __init__(self, mpi_comm=None, timeout_s=None, device=None, layout=None):
        if device not in (None, "cpu", "gpu"):
            raise ValueError(f"unknown device {device!r}: choose cpu or gpu")
        parent = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        self.layout = _nodes.layout(parent) if layout is None else layout
        self.nodes = self.layout.nodes
        # A private duplicate keeps ringnet's messages apart from the caller's own.
        super().__init__(parent.Dup(), timeout_s)
        # With only MPI_THREAD_SERIALIZED, the stream thread and the caller must not
        # be inside MPI at the same time: every MPI call then takes this lock.
        self._lock = threading.Lock() if MPI.Query_thread() < MPI.THREAD_MULTIPLE else None
        if self._lock is None:      # nothing to take around a test: MPI's own, no frame per poll
            self._test = MPI.Request.Testall
        # device None: GPU streams when a GPU is usable; "cpu" never touches CUDA.
        self.device = device
        self.cuda_aware, self.cuda_aware_how = (False, "device cpu") if device == "cpu" \
            else mpi_cuda_aware()
        self._host = {}
        self.quota = _nodes.cpu_quota()
        self.spin_s = wait_spin_s(self.quota, self.layout.local_size)

    @property
    def progress(self):
        """How this transport's CPU streams progress: ``RINGNET_CPU_PROGRESS`` resolved for
        :attr:`nodes` (driven, poll or block); ValueError for an unknown value."""
        return progress_mode(self.nodes)

    @property
    def progress_reason(self):
        """:attr:`progress` and why: 'poll (RINGNET_CPU_PROGRESS=auto: the ranks span 2 nodes)'."""
        mode = self.progress
        if progress_setting() != "auto":
            return f"{mode} (RINGNET_CPU_PROGRESS={mode})"
        where = f"the ranks span {self.nodes} nodes" if self.nodes > 1 else "the ranks share one node"
        return f"{mode} (RINGNET_CPU_PROGRESS=auto: {where})"

    @property
    def wait_reason(self):
        """How the training thread waits for a transfer, and why where it is not the
        default: 'waits sleep after 0.5 ms (CPU quota 0.5 cores for 1 rank on the node)'."""
        if self.spin_s == SPIN_S:
            return None
        ranks = self.layout.local_size
        return (f"waits sleep after {self.spin_s * 1e3:g} ms (CPU quota {self.quota:g} cores "
                f"for {ranks} rank{'s' if ranks > 1 else ''} on the node)")

    def new_stream(self):
        """A new stream (collective in order, as :meth:`Transport.new_stream`); a CPU
        stream progresses as :attr:`progress` says when it is made."""
        if self.uses_gpu():
            return super().new_stream()
        tag, self._next_tag = self._next_tag, self._next_tag + 1
        return CpuStream(tag, nodes=self.nodes)

    def uses_gpu(self):
        if self.device is not None:
            return self.device == "gpu"
        return False if cupy is None else super().uses_gpu()

    def _host_buffer(self, array, role):
        """Return this stream's pinned host buffer for staging ``array`` (reused per shape)."""
        key = (current_tag(), role, array.dtype.str, array.shape)
        slot = self._host.get(key)
        if slot is None:
            from cupyx import empty_pinned  # noqa: WPS433 - only with GPU buffers
            slot = self._host[key] = [empty_pinned(array.shape, array.dtype), None]
        if slot[1] is not None:     # a copy out of it may still run on the device
            slot[1].synchronize()
            slot[1] = None
        return slot

    def isendrecv(self, send_array, send_peer, recv_array, recv_peer):
        """Post Isend/Irecv for a paired transfer; zero-byte sides are skipped on both ends."""
        self._check_pair(send_array, send_peer, recv_array, recv_peer)
        send_bytes = 0 if send_array is None else send_array.nbytes
        recv_bytes = 0 if recv_array is None else recv_array.nbytes
        tag = current_tag()
        unstage = None
        send_buf, recv_buf = send_array, recv_array
        gpu = is_gpu_array(send_array) or is_gpu_array(recv_array)
        if gpu and not self.cuda_aware:
            if send_bytes:
                # Device-to-pinned copy on the current stream, then one wait for it.
                send_buf = self._host_buffer(send_array, "send")[0]
                send_array.get(out=send_buf, blocking=False)
            if recv_bytes:
                slot = self._host_buffer(recv_array, "recv")
                recv_buf = slot[0]
                unstage = (recv_array, recv_buf, slot)
        if gpu:
            # MPI knows no streams: what produced (or still reads) the buffers must be done.
            cupy.cuda.get_current_stream().synchronize()
        requests = []
        if self._lock is not None:
            self._lock.acquire()
        try:
            if recv_bytes:
                requests.append(self.mpi_comm.Irecv([recv_buf, MPI.BYTE], recv_peer, tag))
            if send_bytes:
                requests.append(self.mpi_comm.Isend([send_buf, MPI.BYTE], send_peer, tag))
        finally:
            if self._lock is not None:
                self._lock.release()
        self._count(send_bytes, recv_bytes)
        what = ("sendrecv" if send_bytes and recv_bytes else "send" if send_bytes else "recv",
                send_peer if send_bytes else None, recv_peer if recv_bytes else None,
                max(send_bytes, recv_bytes))
        return _Pending(self, requests, what, unstage, (send_bytes, recv_bytes))

    def _test(self, requests):
        if self._lock is None:
            return MPI.Request.Testall(requests)
        with self._lock:
            return MPI.Request.Testall(requests)

    def _wait(self, requests, what, start=None, receives=()):
        """Wait for ``requests``: polls that yield the core for :attr:`spin_s` (on a stream
        thread STREAM_SPIN_S), then sleeps between polls; CommTimeoutError (``what``
        describes the transfer) ``timeout_s`` after ``start`` (a ``time.perf_counter()``
        value; default: now). The clock and the driven streams are looked at every
        :data:`YIELD_ROUNDS` polls. ``receives``: those of ``requests`` that are receives
        (cancelled at the deadline, see :meth:`_expire`). The training thread's polling
        waits are counted in :attr:`wait_account`."""
        test = self._test
        if not requests or test(requests):
            return
        stream = current_stream()
        if stream is not None and stream.mode != "poll" and not (
                stream.mode == "block" and self._lock is not None):
            # the stream sleeps until its rank's training thread sees the transfer done
            if not stream.wait_transfer(lambda: self._test(requests),
                                        lambda: MPI.Request.Waitall(requests), self.timeout_s):
                self._expire(requests, what, receives)
            return
        start = time.perf_counter() if start is None else start
        if current_tag() != 0:
            self._poll(requests, what, receives, start, STREAM_SPIN_S, STREAM_MAX_PAUSE_S, False)
            return
        cpu = time.thread_time()
        slept = False
        try:
            slept = self._poll(requests, what, receives, start, self.spin_s, MAX_PAUSE_S, True)
        finally:
            self.wait_account.add(time.thread_time() - cpu, slept)

    def _poll(self, requests, what, receives, start, spin_s, max_pause_s, training):
        """:meth:`_wait`'s polls: yielding ones for ``spin_s``, then sleeping ones; on the
        ``training`` thread each poll also progresses the streams that sleep on transfers
        while it waits here. Returns whether it went on to sleep."""
        test = self._test
        while True:
            for _ in _YIELDS:
                os.sched_yield()
                if test(requests):
                    return False
            elapsed = time.perf_counter() - start
            if elapsed > self.timeout_s:
                self._expire(requests, what, receives)
            if training:
                progress_all()      # streams sleeping on transfers while this thread waits here
            if elapsed > spin_s:
                break
        pause = 0.0
        while not test(requests):
            if time.perf_counter() - start > self.timeout_s:
                self._expire(requests, what, receives)
            pause = self._sleep_poll(pause, max_pause_s, training)
        return True

    @staticmethod
    def _sleep_poll(pause, max_pause_s, training):
        """One of :meth:`_poll`'s sleeping polls past the spin (after its look at the
        requests): on the ``training`` thread it progresses the streams that sleep on
        transfers, then it sleeps the pause after ``pause`` (PAUSE_STEP_S longer, at most
        ``max_pause_s``) and returns it. (The performance model's calibration times it: its
        CPU is what a wait on a peer held up costs per poll.)"""
        if training:
            progress_all()
        pause = min(max_pause_s, pause + PAUSE_STEP_S)
        time.sleep(pause)
        return pause

    def _expire(self, requests, what, receives=()):
        """Give up ``requests`` at their deadline: cancel the ``receives`` among them (MPI can
        take back a receive that nothing matched yet; cancelling a send is deprecated and
        crashed MPICH here), keep them all, and raise CommTimeoutError."""
        for request in receives:
            try:
                request.Cancel()
            except MPI.Exception:
                pass
        # A request not cancelled (a send, or a receive already under way) still owns its
        # buffer: freeing the request, and with it the last reference to the buffer, would let
        # MPI write into memory Python has reused. Expired requests live until the process ends.
        _EXPIRED.extend(requests)
        raise CommTimeoutError(f"{self._describe(*what)} did not complete within {self.timeout_s:g} s")

    def _describe(self, kind, send_peer, recv_peer, nbytes):
        """:func:`describe` with each peer's node when the ranks span nodes."""
        text = describe(kind, send_peer, recv_peer, nbytes)
        if self.nodes < 2:
            return text
        for peer, role in ((send_peer, "to"), (recv_peer, "from")):
            if peer is not None:
                text = text.replace(f"{role} rank {peer}",
                                    f"{role} {_nodes.where(peer, self.layout)}", 1)
        return text

    def allreduce_native(self, buf, op="sum"):
        """MPI_Allreduce in place (the reference the ring is measured against), under the
        deadline of :class:`NativeWatch`: past ``timeout_s`` the job ends."""
        NativeWatch.start(self)
        if is_gpu_array(buf):
            cupy.cuda.get_current_stream().synchronize()
            if not self.cuda_aware:
                host = buf.get()
                self.mpi_comm.Allreduce(MPI.IN_PLACE, host, op=_MPI_OPS[op])
                buf.set(host)
                return
        self.mpi_comm.Allreduce(MPI.IN_PLACE, buf, op=_MPI_OPS[op])

    def close(self):
        if self.mpi_comm is not None and self.mpi_comm != MPI.COMM_NULL:
            self.mpi_comm.Free()
            self.mpi_comm = None


NativeWatch.site(MpiTransport.allreduce_native, "Allreduce")
