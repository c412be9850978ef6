"""CommunicatorBase: what every communicator shares (shards, streams, scratch, checks).

Types in the signatures: ``Array`` is a flat C-contiguous NumPy array (or a CuPy array on
a GPU transport), ``Bounds`` one ``(start, stop)`` element range per rank, in rank order;
a collective given ``stream`` is queued there and returns its :class:`Handle`, without it
blocks and returns None.
"""
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from ringnet.backend import get_array_module, is_gpu_array
from ringnet.comm.cost import PIPELINE_MAX_BYTES, PIPELINE_MIN_BYTES, pipeline_piece_bytes
from ringnet.comm.stream import CpuStream, Handle, current_tag
from ringnet.shards import shard_bounds

__all__ = ["CommunicatorBase", "RootedCommunicator", "shard_bounds", "OPS", "pipeline_pieces",
           "PIPELINE_MIN_BYTES", "PIPELINE_MAX_BYTES", "Array", "Bounds", "DTYPES"]

Array = Any                               # numpy.ndarray or cupy.ndarray, flat and contiguous
Bounds = Sequence[Tuple[int, int]]

OPS = ("sum", "mean")
# Pipelining cuts a rooted transfer into pieces (their size: the alpha-beta optimum of
# :func:`ringnet.comm.cost.pipeline_piece_bytes`).


def pipeline_pieces(length: int, itemsize: int,
                    chunk_bytes: Optional[int] = None) -> List[Tuple[int, int]]:
    """Return the element ranges a pipelined transfer of ``length`` elements is cut into.

    ``chunk_bytes`` None picks the alpha-beta optimum (one piece for small buffers).
    """
    if length <= 0:
        return []
    nbytes = length * itemsize
    if chunk_bytes is None:
        chunk_bytes = pipeline_piece_bytes(nbytes)
    step = max(1, int(chunk_bytes) // itemsize)
    return [(a, min(a + step, length)) for a in range(0, length, step)]


# the element types a collective takes
DTYPES = (np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64,
          np.uint8, np.uint16, np.uint32, np.uint64)


class CommunicatorBase:
    """A parallel structure over a transport: rank, size, streams and argument checks."""

    name = "base"
    topology = "flat"           # "hierarchical": through one leader per node (comm.hierarchical)

    def __init__(self, transport: Any, layout: Any = None):
        """``transport``: the :class:`~ringnet.comm.transport.Transport` to run over (one by
        name: :func:`ringnet.comm.create`, or :func:`ringnet.comm.make_transport`);
        ``layout``: the :class:`~ringnet.placement.NodeLayout` of the ranks (default: the
        transport's, :func:`ringnet.placement.layout_of`)."""
        from ringnet.placement import layout_of
        if isinstance(transport, str):
            raise TypeError(f"{type(self).__name__} takes a Transport, got the name {transport!r}: "
                            "make it with ringnet.comm.make_transport, or use ringnet.comm.create")
        self.transport = transport
        self.rank = transport.rank
        self.size = transport.size
        self.layout = layout_of(transport) if layout is None else layout
        if len(self.layout.rank_nodes) != self.size:
            raise ValueError(f"layout has {len(self.layout.rank_nodes)} ranks, the transport {self.size}")
        self._scratch = {}

    def __repr__(self):
        return f"{type(self).__name__}(rank={self.rank}, size={self.size}, transport={self.transport.name})"

    def shard_bounds(self, length: int) -> List[Tuple[int, int]]:
        """Return (start, stop) per rank: contiguous, as even as possible."""
        return shard_bounds(length, self.size)

    def new_stream(self) -> CpuStream:
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
        if buf.dtype.type not in DTYPES:
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

    def _one_at_a_time(self, buf):
        """True when transfers of ``buf`` must not overlap: MPI staging GPU buffers through
        host memory keeps one pinned buffer per shape, which two transfers in flight would share."""
        transport = self.transport
        return is_gpu_array(buf) and transport.name == "mpi" \
            and not getattr(transport, "cuda_aware", False)

    def _pieces(self, buf):
        """The element ranges :meth:`_gather_sum` and :meth:`_relay` move ``buf`` in (whole here)."""
        return [(0, buf.size)] if buf.size else []

    # -- the two movements of every rooted structure (and of a node's ranks and its leader) --
    def _gather_sum(self, buf, senders, parent):
        """Sum ``buf`` and the buffers of ``senders`` (in that order) and send it to ``parent``.

        Without senders ``buf`` itself goes to ``parent``. With senders and a parent the sum is
        formed in scratch, so ``buf`` is left unchanged; without a parent (the root) the sum
        lands in ``buf``.
        """
        pieces = self._pieces(buf)
        transport = self.transport
        partial = buf
        if senders and parent is not None:
            partial = self._scratch_for(buf, buf.size, slot=1)
            partial[...] = buf
        inbox = [self._scratch_for(buf, buf.size, slot=2 + i) for i in range(len(senders))]

        def receive(j):
            a, b = pieces[j]
            return [transport.isendrecv(None, None, inbox[i][a:b], sender)
                    for i, sender in enumerate(senders)]

        if self._one_at_a_time(buf):
            for a, b in pieces:
                for i, sender in enumerate(senders):
                    transport.isendrecv(None, None, inbox[i][a:b], sender).wait()
                    self._add_from(partial[a:b], inbox[i][a:b])
                if parent is not None:
                    transport.isendrecv(partial[a:b], parent, None, None).wait()
            return
        sends = []
        posted = receive(0) if senders and pieces else []
        for j, (a, b) in enumerate(pieces):
            if senders:
                arriving, posted = posted, (receive(j + 1) if j + 1 < len(pieces) else [])
                for i, pending in enumerate(arriving):     # fixed order: exact reruns
                    pending.wait()
                    self._add_from(partial[a:b], inbox[i][a:b])
            if parent is not None:
                sends.append(transport.isendrecv(partial[a:b], parent, None, None))
        for pending in sends:
            pending.wait()

    def _relay(self, buf, parent, receivers):
        """Receive ``buf`` from ``parent`` (if any) and pass it on to ``receivers``, piece by piece."""
        pieces = self._pieces(buf)
        transport = self.transport

        def receive(j):
            a, b = pieces[j]
            return transport.isendrecv(None, None, buf[a:b], parent)

        if self._one_at_a_time(buf):
            for a, b in pieces:
                if parent is not None:
                    receive_piece = transport.isendrecv(None, None, buf[a:b], parent)
                    receive_piece.wait()
                # The same bytes to every receiver: these may share a staging buffer.
                for pending in [transport.isendrecv(buf[a:b], r, None, None) for r in receivers]:
                    pending.wait()
            return
        sends = []
        posted = receive(0) if parent is not None and pieces else None
        for j, (a, b) in enumerate(pieces):
            if parent is not None:
                arriving, posted = posted, (receive(j + 1) if j + 1 < len(pieces) else None)
                arriving.wait()
            sends += [transport.isendrecv(buf[a:b], receiver, None, None) for receiver in receivers]
        for pending in sends:
            pending.wait()


class RootedCommunicator(CommunicatorBase):
    """Collectives through one root: subclasses define ``_reduce`` and ``_bcast``.

    Both are built from :meth:`_gather_sum` and :meth:`_relay`: a rank posts the receives
    from all its senders at once (MPI then moves them concurrently) and adds them as they
    complete in a fixed order (the float sum is the same on every run); buffers are cut
    into pieces (``chunk_bytes``; by default :func:`pipeline_pieces` where a rank forwards)
    so that a rank forwards piece k while piece k+1 still arrives.
    """

    def __init__(self, transport: Any, chunk_bytes: Optional[int] = None, layout: Any = None):
        super().__init__(transport, layout)
        if chunk_bytes is not None and int(chunk_bytes) <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes!r}")
        self.chunk_bytes = None if chunk_bytes is None else int(chunk_bytes)

    @classmethod
    def forwards(cls, n: int) -> bool:
        """True when, at ``n`` ranks, some rank passes on what it receives (only then do
        pieces pay by default)."""
        return False

    @classmethod
    def pieces(cls, length: int, itemsize: int, n: int,
               chunk_bytes: Optional[int] = None) -> List[Tuple[int, int]]:
        """Element ranges one transfer of ``length`` elements of ``itemsize`` bytes is cut into
        at ``n`` ranks: ``chunk_bytes`` pieces, or by default :func:`pipeline_pieces` where a
        rank forwards and the whole buffer otherwise (with nothing to forward, cutting only
        adds messages: measured 0.85x -> 0.72x native at 4 MiB, N = 2). The communicator cuts
        its buffers by this rule, and ``bench model`` counts and times the same pieces."""
        if chunk_bytes is None and not cls.forwards(n):
            return [(0, length)] if length else []
        return pipeline_pieces(length, itemsize, chunk_bytes)

    def _pieces(self, buf):
        return self.pieces(buf.size, buf.itemsize, self.size, self.chunk_bytes)

    def reduce(self, buf: Array, root: int = 0, op: str = "sum",
               stream: Optional[CpuStream] = None) -> Optional[Handle]:
        """Combine every rank's ``buf`` into ``root``'s ``buf``; every other rank's ``buf`` is
        left unchanged (as MPI's reduce leaves a send buffer). Returns a Handle on a stream."""
        self._check(buf, op, root)
        return self._launch(self._reduce, (buf, root, op), stream)

    def bcast(self, buf: Array, root: int = 0,
              stream: Optional[CpuStream] = None) -> Optional[Handle]:
        """Copy ``root``'s ``buf`` into every rank's ``buf`` (same length everywhere).

        Returns None, or a Handle when queued on ``stream``.
        """
        self._check(buf, root=root)
        return self._launch(self._bcast, (buf, root), stream)

    def allreduce(self, buf: Array, op: str = "sum",
                  stream: Optional[CpuStream] = None) -> Optional[Handle]:
        """Reduce to rank 0, then broadcast from it: every rank's ``buf`` holds the result.

        Returns None, or a Handle when queued on ``stream``.
        """
        self._check(buf, op)
        return self._launch(self.allreduce_now, (buf, op), stream)

    def _reduce(self, buf, root, op):
        raise NotImplementedError

    def _bcast(self, buf, root):
        raise NotImplementedError

    def allreduce_now(self, buf, op):
        """The all-reduce of a checked ``buf``, blocking, on this thread (what :meth:`allreduce`
        runs or queues; another communicator that already checked ``buf`` may call it)."""
        self._reduce(buf, 0, op)
        self._bcast(buf, 0)
