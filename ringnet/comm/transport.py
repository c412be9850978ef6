"""Transport interface: how bytes move between two ranks, and the transfer timeout."""
import os
import threading

import numpy as np

from ringnet.backend import cupy, gpu_available, is_gpu_array
from ringnet.comm.stream import CpuStream, GpuStream

__all__ = ["Transport", "CommTimeoutError", "default_timeout"]


class CommTimeoutError(RuntimeError):
    """A transfer did not complete within the transport's timeout."""


def default_timeout():
    """Return the transfer timeout in seconds: ``RINGNET_COMM_TIMEOUT`` or 300."""
    value = os.environ.get("RINGNET_COMM_TIMEOUT", "")
    try:
        return float(value) if value else 300.0
    except ValueError:
        raise ValueError(f"RINGNET_COMM_TIMEOUT={value!r} is not a number of seconds") from None


def describe(what, send_peer, recv_peer, nbytes):
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
    """

    name = "base"

    def __init__(self, mpi_comm, timeout_s=None):
        self.mpi_comm = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.timeout_s = default_timeout() if timeout_s is None else float(timeout_s)
        self.bytes_sent = 0
        self.bytes_recv = 0
        self._count_lock = threading.Lock()
        self._next_tag = 1

    # -- to implement -----------------------------------------------------------------
    def isendrecv(self, send_array, send_peer, recv_array, recv_peer):
        """Start a paired transfer (either side may be None); return an object with wait()."""
        raise NotImplementedError

    def allreduce_native(self, buf, op="sum"):
        """Allreduce ``buf`` in place with the library's own collective (for comparison)."""
        raise NotImplementedError

    # -- shared -----------------------------------------------------------------------
    def send(self, array, peer, stream=None):
        """Send ``array`` to rank ``peer``."""
        if stream is not None:
            return stream.submit(self.send, array, peer)
        self.isendrecv(array, peer, None, None).wait()
        self._complete(describe("send", peer, None, array.nbytes))
        return None

    def recv(self, out_array, peer, stream=None):
        """Receive from rank ``peer`` into ``out_array``."""
        if stream is not None:
            return stream.submit(self.recv, out_array, peer)
        self.isendrecv(None, None, out_array, peer).wait()
        self._complete(describe("recv", None, peer, out_array.nbytes))
        return None

    def sendrecv(self, send_array, send_peer, recv_array, recv_peer, stream=None):
        """Send to ``send_peer`` and receive from ``recv_peer`` at once (deadlock-free)."""
        if stream is not None:
            return stream.submit(self.sendrecv, send_array, send_peer, recv_array, recv_peer)
        self.isendrecv(send_array, send_peer, recv_array, recv_peer).wait()
        nbytes = max(getattr(send_array, "nbytes", 0), getattr(recv_array, "nbytes", 0))
        self._complete(describe("sendrecv", send_peer, recv_peer, nbytes))
        return None

    def _complete(self, what):
        """Return once the transfer just waited for has completed (GPU transports: on the device)."""

    def new_stream(self):
        """Return a new stream (CUDA-backed where a GPU is usable, a thread otherwise)."""
        # Tags come from a per-transport counter: every rank creates its streams in
        # the same order, so a stream's messages match only the same stream's.
        tag, self._next_tag = self._next_tag, self._next_tag + 1
        if self.uses_gpu():
            return GpuStream(tag)
        return CpuStream(tag)

    def uses_gpu(self):
        """Return True when this transport's streams are CUDA streams."""
        return gpu_available()

    def finish(self, what="stream"):
        """Wait for the work this thread queued on its current CUDA stream."""
        if cupy is not None and gpu_available():
            cupy.cuda.get_current_stream().synchronize()

    def barrier(self):
        """Block until every rank arrived."""
        self.mpi_comm.Barrier()

    def _count(self, sent, received):
        with self._count_lock:
            self.bytes_sent += sent
            self.bytes_recv += received

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

    def close(self):
        """Release library resources (the MPI communicator duplicate)."""
