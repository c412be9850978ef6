"""CommunicatorBase: what every communicator shares (shards, streams, scratch, checks)."""
import numpy as np

from ringnet.backend import get_array_module, is_gpu_array
from ringnet.comm.stream import current_tag
from ringnet.shards import shard_bounds

__all__ = ["CommunicatorBase", "RootedCommunicator", "shard_bounds", "OPS"]

OPS = ("sum", "mean")
_DTYPES = (np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64,
           np.uint8, np.uint16, np.uint32, np.uint64)


class CommunicatorBase:
    """A parallel structure over a transport: rank, size, streams and argument checks."""

    name = "base"

    def __init__(self, transport="auto", mpi_comm=None):
        from ringnet.comm import make_transport  # noqa: WPS433 - avoids an import cycle
        if isinstance(transport, str):
            transport = make_transport(transport, mpi_comm=mpi_comm)
        self.transport = transport
        self.rank = transport.rank
        self.size = transport.size
        self._scratch = {}

    def __repr__(self):
        return f"{type(self).__name__}(rank={self.rank}, size={self.size}, transport={self.transport.name})"

    def shard_bounds(self, length):
        """Return (start, stop) per rank: contiguous, as even as possible."""
        return shard_bounds(length, self.size)

    def new_stream(self):
        """Return a new stream for this communicator's transport."""
        return self.transport.new_stream()

    # -- helpers for the collectives ---------------------------------------------------
    def _launch(self, fn, args, stream):
        """Run ``fn(*args)`` now (blocking) or queue it on ``stream`` (returns a Handle)."""
        if stream is not None:
            return stream.submit(fn, *args)
        fn(*args)
        if is_gpu_array(args[0]):
            self.transport.finish(f"{self.name} collective")
        return None

    def _scratch_for(self, buf, length, slot=0):
        """Return a reusable buffer of ``length`` elements like ``buf`` (``slot``: which of several)."""
        # Keyed by stream tag: a blocking call and a stream call may run at once.
        key = (current_tag(), is_gpu_array(buf), buf.dtype.str, slot)
        scratch = self._scratch.get(key)
        if scratch is None or scratch.size < length:
            xp = get_array_module(buf)
            scratch = self._scratch[key] = xp.empty(max(length, 1), buf.dtype)
        return scratch[:length]

    def _check(self, buf, op="sum", root=None):
        if getattr(buf, "ndim", None) != 1 or not buf.flags.c_contiguous:
            raise ValueError("buffer must be a flat (1-D) C-contiguous NumPy/CuPy array, "
                             f"got {type(buf).__name__} with shape {getattr(buf, 'shape', None)}")
        if buf.dtype.type not in _DTYPES:
            raise ValueError(f"unsupported dtype {buf.dtype}: use float16/32/64 or an integer type")
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}: choose sum or mean")
        if op == "mean" and buf.dtype.kind != "f":
            raise ValueError(f"op 'mean' needs a floating dtype, got {buf.dtype}")
        if root is not None and not (isinstance(root, (int, np.integer)) and 0 <= root < self.size):
            raise ValueError(f"root {root!r} is not a rank of this {self.size}-rank communicator")

    def _divide(self, part):
        """Turn a sum into a mean in place."""
        if self.size > 1 and part.size:
            get_array_module(part).divide(part, part.dtype.type(self.size), out=part)

    def _add_from(self, part, scratch):
        get_array_module(part).add(part, scratch, out=part)


class RootedCommunicator(CommunicatorBase):
    """Collectives through one root: subclasses define ``_reduce`` and ``_bcast``."""

    def reduce(self, buf, root: int = 0, op: str = "sum", stream=None):
        """Combine every rank's ``buf`` into ``root``'s ``buf``; every other rank's ``buf`` is
        left unchanged (as MPI's reduce leaves a send buffer). Returns a Handle on a stream."""
        self._check(buf, op, root)
        return self._launch(self._reduce, (buf, root, op), stream)

    def bcast(self, buf, root: int = 0, stream=None):
        """Copy ``root``'s ``buf`` into every rank's ``buf`` (same length everywhere).

        Returns None, or a Handle when queued on ``stream``.
        """
        self._check(buf, root=root)
        return self._launch(self._bcast, (buf, root), stream)

    def allreduce(self, buf, op: str = "sum", stream=None):
        """Reduce to rank 0, then broadcast from it: every rank's ``buf`` holds the result.

        Returns None, or a Handle when queued on ``stream``.
        """
        self._check(buf, op)
        return self._launch(self._allreduce, (buf, op), stream)

    def _reduce(self, buf, root, op):
        raise NotImplementedError

    def _bcast(self, buf, root):
        raise NotImplementedError

    def _allreduce(self, buf, op):
        self._reduce(buf, 0, op)
        self._bcast(buf, 0)
