"""Transport interface: how bytes move between two ranks, and the transfer timeout."""
import threading
from typing import Optional

import numpy as np

from ringnet.backend import cupy, gpu_available, is_gpu_array
from ringnet.comm.stream import CpuStream, GpuStream, Handle
from ringnet.control import default_timeout  # noqa: F401 - the transports' timeout, re-exported

__all__ = ["Transport", "CommTimeoutError", "default_timeout", "WaitAccount"]


class WaitAccount:
    """What the training thread's waits for transfers cost it: ``cpu_s``, its CPU time in
    the waits that did not find their transfer done (from that first look on); ``waits``,
    those waits; ``slept``, those of them that polled out their spin and went on to sleep
    between polls (a peer held up longer than the spin: on a node held to a CPU quota, a
    peer whose quota ran out). Only the training thread adds to it (no lock)."""
    __slots__ = ("cpu_s", "waits", "slept")

    def __init__(self):
        self.cpu_s, self.waits, self.slept = 0.0, 0, 0

    def add(self, cpu_s, slept):
        """Count one wait that took ``cpu_s`` of CPU and slept or not."""
        self.cpu_s += cpu_s
        self.waits += 1
        self.slept += bool(slept)

    def totals(self):
        """(cpu_s, waits, slept) so far."""
        return self.cpu_s, self.waits, self.slept


class CommTimeoutError(RuntimeError):
    """A transfer did not complete within the transport's timeout."""


def describe(what: str, send_peer: Optional[int], recv_peer: Optional[int], nbytes: int) -> str:
    """Return 'sendrecv to rank 3 / from rank 1 of N bytes' for error messages."""
    parts = []
    if send_peer is not None:
        parts.append(f"to rank {send_peer}")
    if recv_peer is not None:
        parts.append(f"from rank {recv_peer}")
    return f"{what} {' / '.join(parts)} of {nbytes} bytes"


class Transport:
    """Point-to-point transfers between the ranks of one MPI communicator.

    Subclasses implement :meth:`isendrecv`; ``send``/``recv``/``sendrecv`` are built
    on it. With ``stream`` given, each call is queued on that stream and returns a
    :class:`~ringnet.comm.stream.Handle`; without, it blocks until done.

    Messages are matched per stream: a send queued on a rank's k-th stream pairs
    with the receive queued on its peer's k-th stream (every rank creates its
    streams in the same order), and calls off any stream pair with each other.

    ``mpi_comm``: the mpi4py communicator whose ranks this transport connects;
    ``timeout_s``: seconds a transfer may take before :class:`CommTimeoutError` (None:
    :func:`default_timeout`). Arrays are C-contiguous NumPy arrays, or CuPy arrays on a
    GPU transport; a peer is a rank of ``mpi_comm``. ``bytes_sent``/``bytes_recv`` count
    what this rank moved.
    """

    name = "base"

    def __init__(self, mpi_comm, timeout_s: Optional[float] = None):
        self.mpi_comm = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.timeout_s = default_timeout() if timeout_s is None else float(timeout_s)
        self._sent = self._received = 0
        self.short_moved = 0    # auto's short path: bytes sent and received, one thread only
        self._count_lock = threading.Lock()
        self._next_tag = 1
        # the training thread's waits (the MPI transport's; the others' wait elsewhere)
        self.wait_account = WaitAccount()

    # -- to implement -----------------------------------------------------------------
    def isendrecv(self, send_array, send_peer: Optional[int], recv_array,
                  recv_peer: Optional[int]):
        """Start sending ``send_array`` to ``send_peer`` and receiving ``recv_array`` from
        ``recv_peer`` (either pair may be None); return a request whose ``wait()`` returns
        once both finished, or raises :class:`CommTimeoutError` past ``timeout_s``."""
        raise NotImplementedError

    def allreduce_native(self, buf, op: str = "sum") -> None:
        """Sum ``buf`` over the ranks in place with the library's own collective (MPI's
        Allreduce, ncclAllReduce), the reference the communicators are measured against;
        ``op``: "sum"."""
        raise NotImplementedError

    # -- shared -----------------------------------------------------------------------
    def send(self, array, peer: int, stream=None) -> Optional[Handle]:
        """Send ``array`` to rank ``peer``.

        Returns None once sent, or the :class:`Handle` of the send queued on ``stream``.
        """
        return self._transfer("send", array, peer, None, None, stream)

    def recv(self, out_array, peer: int, stream=None) -> Optional[Handle]:
        """Receive from rank ``peer`` into ``out_array`` (the length the peer sends).

        Returns None once received, or the :class:`Handle` of the receive queued on ``stream``.
        """
        return self._transfer("recv", None, None, out_array, peer, stream)

    def sendrecv(self, send_array, send_peer: int, recv_array, recv_peer: int,
                 stream=None) -> Optional[Handle]:
        """Send ``send_array`` to ``send_peer`` and receive ``recv_array`` from ``recv_peer``
        at once (deadlock-free in a ring).

        Returns None once both are done, or the :class:`Handle` queued on ``stream``.
        """
        return self._transfer("sendrecv", send_array, send_peer, recv_array, recv_peer, stream)

    def _transfer(self, what, send_array, send_peer, recv_array, recv_peer, stream):
        """Run one paired transfer now (None) or queue it on ``stream`` (its Handle)."""
        if stream is not None:
            return stream.submit(self._transfer, what, send_array, send_peer, recv_array,
                                 recv_peer, None)
        self.isendrecv(send_array, send_peer, recv_array, recv_peer).wait()
        nbytes = max(getattr(send_array, "nbytes", 0), getattr(recv_array, "nbytes", 0))
        self._complete(describe(what, send_peer, recv_peer, nbytes))
        return None

    def _complete(self, what: str) -> None:
        """Return once the transfer just waited for has completed (GPU transports: on the device)."""

    def new_stream(self) -> CpuStream:
        """Return a new stream: a :class:`GpuStream` where this transport uses the GPU, a
        :class:`CpuStream` otherwise. Collective in order: every rank creates its streams
        in the same order, so that the k-th streams of two ranks exchange messages."""
        # Tags come from a per-transport counter: every rank creates its streams in
        # the same order, so a stream's messages match only the same stream's.
        tag, self._next_tag = self._next_tag, self._next_tag + 1
        if self.uses_gpu():
            return GpuStream(tag)
        return CpuStream(tag)

    def uses_gpu(self) -> bool:
        """Return True when this transport's streams are CUDA streams."""
        return gpu_available()

    def finish(self, what: str = "stream") -> None:
        """Wait for the work this thread queued on its current CUDA stream (``what`` names
        it in a timeout message; nothing to wait for on the CPU)."""
        if cupy is not None and gpu_available():
            cupy.cuda.get_current_stream().synchronize()

    def barrier(self) -> None:
        """Block until every rank arrived."""
        self.mpi_comm.Barrier()

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sent."""
        return self._sent + self.short_moved

    @property
    def bytes_recv(self) -> int:
        """Bytes this rank received."""
        return self._received + self.short_moved

    def _count(self, sent, received):
        with self._count_lock:
            self._sent += sent
            self._received += received

    def _check_peer(self, peer, role):
        if not (isinstance(peer, (int, np.integer)) and 0 <= peer < self.size):
            raise ValueError(f"{role} peer {peer!r} is not a rank of this {self.size}-rank transport")

    @staticmethod
    def _check_array(array, role):
        if not getattr(array, "flags", None) or not array.flags.c_contiguous:
            raise ValueError(f"{role} buffer must be a C-contiguous NumPy/CuPy array")

    def _check_pair(self, send_array, send_peer, recv_array, recv_peer):
        if send_array is not None:
            self._check_array(send_array, "send")
            self._check_peer(send_peer, "send")
        if recv_array is not None:
            self._check_array(recv_array, "receive")
            self._check_peer(recv_peer, "receive")
        if send_array is not None and recv_array is not None \
                and is_gpu_array(send_array) != is_gpu_array(recv_array):
            raise ValueError("send and receive buffers must both be on the host or both on the GPU")

    def close(self) -> None:
        """Release library resources (the MPI communicator duplicate)."""
