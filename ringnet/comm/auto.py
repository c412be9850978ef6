"""AutoCommunicator: all-reduce by the algorithm that is fastest for the message size and N.

The algorithms (``rd``, ``direct``, ``rhd``, ``ring``, and ``native``: the MPI library's
own MPI_Allreduce, where that is cheaper), their cost table and the choice between them
are in :mod:`ringnet.comm.cost`; the node's cores and how long a rank polls
before yielding in :mod:`ringnet.placement`. Every rank computes the same choice from
(n, N) and whether the ranks agreed, when the communicator was made, that some node holds
more ranks than cores (``oversubscribed``: it then chooses with
:data:`~ringnet.comm.cost.ALPHA_OVERSUBSCRIBED`).

**Native.** ``native`` is a candidate for calls off a stream over the MPI transport with
MPI_THREAD_MULTIPLE (a blocking collective holding the transport's lock would stall the
streams' transfers; on a stream it would race them): every rank knows that of a call
alike, so every rank picks the same. It is one blocking MPI_Allreduce in place. Where
ranks outnumber cores every bit of Python before the call is multiplied (the other ranks
spin in MPICH's wait): 0.2-0.4 us of Python more per call measured 0.75-0.94x the bare
call at 8 B and 1 KB with 4 ranks on 2 cores. So the array native ran on last is looked for before anything
else, and ``allreduce`` then checks only the stream, ``op`` and the thread's stream tag and
calls MPI's bound method itself: as thin as a bare wrapper. The persistent form
(MPI_Allreduce_init on a buffer of auto's own, since every rank must start the same
request whatever array it passes, the caller's copied in and out, polled with MPI_Test)
measured 0.64-0.77x the blocking call at 4 KB - 1 MB with 4 ranks on 2 cores (1.1-1.4x at
64 B - 1 KB), so it is not used. The call's deadline is kept from outside, at no cost to
it, by :class:`~ringnet.comm.mpi_transport.NativeWatch` (past ``timeout_s`` the job ends
instead of a CommTimeoutError: a collective cannot be taken back). The transport's byte
counters count what ringnet moves itself, not MPI's own traffic.

**Two paths.** Called without a stream on a NumPy buffer over the MPI transport, auto runs
its algorithm straight on mpi4py (the lean path, :class:`~ringnet.comm._lean.LeanPath`):
Irecv/Isend on views of the caller's buffer, ``numpy.add(..., out=)`` into it, one
preallocated scratch buffer per dtype, a short MPI_Testall spin, then polls that yield the core and look at the clock (the
transfer deadline) and the driven streams every 32 polls, and after 50 ms the transport's
own sleeping wait. A message then costs ~1-2 us of Python instead of the ~20 us
of the generic path (a transfer object, trace span and checks per message), against 3-5 us
for a whole MPI_Allreduce of a few bytes. On a stream, with CuPy buffers, over NCCL or
while a trace records, auto goes through the transport's transfers like the other
communicators. Both paths run the rounds of :mod:`ringnet.comm.schedules` (who sends what
to whom), add in the same order and count the same bytes (tested). The
lean ``rhd`` and ``ring`` fuse their last reduce step with the first gather step, and
``chunk_bytes`` cuts their steps into pipelined pieces (none by default: see
:func:`~ringnet.comm.schedules.step_pieces`).

**The short path.** ``rd`` (on the ranks of its power-of-two core) and ``direct`` in whole
steps keep a plan per byte count: scratch views and their MPI buffer specs, made once.
``allreduce`` looks the plan up before any other check, so a small all-reduce costs about
the bare mpi4py calls (Irecv, Isend, a first MPI_Testall, ``numpy.add``) plus ~0.5 us; a
wait that the first test does not finish goes through the same spin and deadline wait.
An array that comes back (the second call in a row with the same array object, as a
training loop's buffers do) gets persistent requests (MPI_Recv_init / MPI_Send_init,
bound to it and to the plan's scratch) that every later call with it starts with one
MPI_Startall; ``allreduce`` checks for that array first. At N = 2 this halves what the
call costs beyond MPI's own work (8 B: ~3.3 us with new requests, ~2.3 us started, against
~2.3-2.7 us for MPI_Allreduce). A timed-out wait unbinds them, another array of the same
size is sent as itself (the bound requests only ever serve their own array), and they are
freed before MPI finalizes.
Messages of 8-16 KB go as two halves (:data:`~ringnet.comm.schedules.EAGER_SPLIT`: under
MPICH's shared-memory eager limit); the generic ``rd`` step cuts them alike, so ranks on
either path pair up.
``python -m ringnet.bench comm --algos native,auto,floor`` times a bare mpi4py exchange
beside auto: the least a Python all-reduce from point-to-point calls can cost.

Every algorithm leaves bit-identical results on all ranks: ``direct`` sums in rank order
everywhere; in ``rd`` and ``rhd`` both partners of an exchange compute ``x + y`` (float
addition is commutative) or one rank sums an element and the others copy it.
"""
import contextlib
from typing import Any, Optional

import numpy as np
from mpi4py import MPI

from ringnet import trace
from ringnet.backend import get_array_module
from ringnet.comm import stream as _stream
from ringnet.comm._lean import LeanPath
from ringnet.comm.base import DTYPES, Array, CommunicatorBase
from ringnet.comm.cost import ALGORITHMS, CHOICES, NATIVE, choose, constants, thresholds
from ringnet.comm.ring import RingCommunicator
from ringnet.comm.schedules import Fold, direct_peers, direct_slot, sum_in_rank_order
from ringnet.comm.mpi_transport import NativeWatch
from ringnet.comm.stream import CpuStream, Handle
from ringnet.placement import crowded

__all__ = ["AutoCommunicator"]

_IN_PLACE = MPI.IN_PLACE


class AutoCommunicator(CommunicatorBase):
    """All-reduce with the algorithm :func:`choose` picks for the buffer's size and N.

    ``algorithm`` forces one of :data:`CHOICES` (for measurement; ``native`` off a stream
    only); ``chunk_bytes`` goes to the ring. ``last_algorithm`` names the algorithm of the
    latest call. ``constants`` are the cost model's it chooses with
    (:func:`~ringnet.comm.cost.constants`; ``alpha`` is its per-message cost): those of a
    crowded node where ``oversubscribed`` (some rank's node holds more ranks than cores,
    agreed by all ranks when the communicator is made, which is collective unless
    ``algorithm`` is forced). ``native_ok``: whether ``native`` is a candidate off a stream.
    """

    name = "auto"

    def __init__(self, transport: Any, algorithm: Optional[str] = None,
                 chunk_bytes: Optional[int] = None):
        super().__init__(transport)
        if algorithm is not None and algorithm not in CHOICES:
            raise ValueError(f"unknown all-reduce algorithm {algorithm!r}: "
                             f"choose {', '.join(CHOICES)}")
        self.algorithm = algorithm
        self.ring = RingCommunicator(self.transport, chunk_bytes=chunk_bytes)
        self.last_algorithm = None
        self._choices, self._stream_choices = {}, {}
        self._native_buf = None         # see allreduce and LeanPath.quick_native
        self.oversubscribed = algorithm is None and self._agreed_oversubscribed()
        self.constants = constants(self.oversubscribed)
        self.alpha = self.constants["alpha"]
        transport = self.transport
        self.native_ok = getattr(transport, "name", None) == "mpi" \
            and hasattr(transport, "mpi_comm") and getattr(transport, "_lock", True) is None
        self._native_call = transport.mpi_comm.Allreduce if self.native_ok else None
        # across nodes MPI's own all-reduce takes the small messages (cost.choose)
        self.nodes = getattr(getattr(transport, "layout", None), "nodes", 1) or 1
        self._fold = Fold(self.rank, self.size)
        self._partners = self._fold.doubling_partners()
        # NumPy buffers over MPI, called off a stream: the lean path (see LeanPath).
        self._lean = LeanPath(self) if getattr(self.transport, "name", None) == "mpi" \
            and hasattr(self.transport, "mpi_comm") and self.size > 1 else None

    def _agreed_oversubscribed(self):
        """Whether any rank's node holds more ranks than cores, the same on every rank (one
        MPI all-reduce of the flag; over a transport other than MPI's, never)."""
        transport = self.transport
        if self.size < 2 or getattr(transport, "name", None) != "mpi" \
                or not hasattr(transport, "mpi_comm"):
            return False
        with getattr(transport, "_lock", None) or contextlib.nullcontext():
            return bool(transport.mpi_comm.allreduce(crowded(), op=MPI.LOR))

    def candidates(self, on_stream=False):
        """The algorithms a call chooses from: :data:`CHOICES` off a stream where
        ``native_ok``, else :data:`ALGORITHMS`."""
        return CHOICES if self.native_ok and not on_stream else ALGORITHMS

    def choose(self, nbytes: int, on_stream: bool = False) -> str:
        """Return the algorithm an all-reduce of ``nbytes`` uses on this communicator (off a
        stream, or ``on_stream``)."""
        if self.algorithm is not None:
            return self.algorithm
        choices = self._stream_choices if on_stream else self._choices
        algorithm = choices.get(nbytes)
        if algorithm is None:
            algorithm = choices[nbytes] = choose(nbytes, self.size, self.candidates(on_stream),
                                                 self.nodes, **self.constants)
        return algorithm

    def thresholds(self, max_bytes=1 << 30, on_stream=False):
        """:func:`thresholds` at this communicator's N, constants and candidates."""
        return thresholds(self.size, max_bytes, self.candidates(on_stream), self.nodes,
                          **self.constants)

    def allreduce(self, buf: Array, op: str = "sum",
                  stream: Optional[CpuStream] = None) -> Optional[Handle]:
        """Reduce ``buf`` over the ranks in place on every rank, bit-identical everywhere.

        Returns None, or a Handle when queued on ``stream``.
        """
        if buf is self._native_buf and stream is None and op == "sum" \
                and "tag" not in _stream.thread_local.__dict__:
            # the array native ran on last off a stream thread (only those set a tag),
            # checked then: a 1-D C-contiguous ndarray of a size auto delegates. Nothing
            # else to check (native records no trace spans) and nothing to mark: the
            # deadline is NativeWatch's, which watches this line.
            self.last_algorithm = "native"
            self._native_call(_IN_PLACE, buf)
            return None
        lean = self._lean
        if lean is not None and buf is lean.hot and stream is None:
            # the array whose persistent requests were bound last (a 1-D C-contiguous
            # ndarray of its plan's size, checked when it came in): fewer checks
            plan = lean.hot_plan
            if plan[0] is buf.dtype and op == "sum" and not trace.recording \
                    and not _stream.thread_local.__dict__.get("tag"):
                self.last_algorithm = plan[1]
                plan[2](buf, plan)
                return None
        if lean is not None and stream is None and type(buf) is np.ndarray:
            plan = lean.plans.get(buf.nbytes)     # the short path: a plan for this size
            if plan is not None and plan[0] is buf.dtype and op == "sum" and buf.ndim == 1 \
                    and buf.flags.c_contiguous and not trace.recording \
                    and not _stream.thread_local.__dict__.get("tag"):
                self.last_algorithm = plan[1]
                plan[2](buf, plan)
                return None
        # The checks of the lean path, cheapest first; a stream thread's tag lives in the
        # stream module's thread-local (a plain dict lookup: getattr with a default costs
        # ~0.4 us when the attribute is missing, a fifth of a whole small all-reduce).
        if lean is not None and stream is None and type(buf) is np.ndarray and buf.ndim == 1 \
                and buf.flags.c_contiguous and not _stream.thread_local.__dict__.get("tag") \
                and (op == "sum" or (op == "mean" and buf.dtype.kind == "f")) \
                and buf.dtype.type in DTYPES:
            nbytes = buf.nbytes
            algorithm = self.algorithm or self._choices.get(nbytes) or self.choose(nbytes)
            self.last_algorithm = algorithm
            if nbytes:
                lean.run(buf, algorithm)
                if op == "mean":
                    np.divide(buf, buf.dtype.type(self.size), out=buf)
            return None
        self._check(buf, op)
        on_stream = stream is not None or bool(_stream.thread_local.__dict__.get("tag"))
        algorithm = self.choose(buf.nbytes, on_stream=on_stream)
        if algorithm == NATIVE and on_stream:
            raise ValueError("the native all-reduce runs off a stream only (on one it would "
                             "race the other streams' MPI calls)")
        self.last_algorithm = algorithm
        return self._launch(self.allreduce_now, (buf, op, algorithm), stream)

    # -- implementation: the transport path -------------------------------------------------
    def allreduce_now(self, buf, op, algorithm):
        """The all-reduce of a checked ``buf`` by ``algorithm``, blocking, on this thread
        (what :meth:`allreduce` runs or queues; the lean path's fallback)."""
        if self.size > 1 and buf.size:
            if algorithm == NATIVE:
                self.transport.allreduce_native(buf)
            elif algorithm == "ring":
                self.ring.allreduce_now(buf, "sum", self.ring.shard_bounds(buf.size))
            elif algorithm == "direct":
                self._direct(buf)
            else:
                self._folded(buf, self._halving_doubling if algorithm == "rhd" else self._doubling)
        if op == "mean":
            self._divide(buf)

    def _direct(self, buf):
        """Everyone sends to everyone at once; every rank sums the N buffers in rank order."""
        n, r, length = self.size, self.rank, buf.size
        inbox = self._scratch_for(buf, (n - 1) * length)
        peers = direct_peers(r, n)
        if self._one_at_a_time(buf):
            for k, (to, source) in enumerate(peers):
                self.transport.isendrecv(buf, to, inbox[k * length:(k + 1) * length], source).wait()
        else:
            pending = [self.transport.isendrecv(buf, to, inbox[k * length:(k + 1) * length], source)
                       for k, (to, source) in enumerate(peers)]
            for p in pending:
                p.wait()

        def part(rank):      # rank's buffer: my own, or the slot it arrived in
            if rank == r:
                return buf
            k = direct_slot(r, rank, n)
            return inbox[k * length:(k + 1) * length]
        sum_in_rank_order(get_array_module(buf), buf, part, n, r,
                          lambda: self._scratch_for(buf, length, slot=1))

    def _folded(self, buf, core):
        """Fold to a power of two (:class:`~ringnet.comm.schedules.Fold`), run ``core``, unfold."""
        fold, r = self._fold, self.rank
        transport = self.transport
        if fold.role == "give":              # hands its buffer to r+1, gets the result back
            transport.isendrecv(buf, r + 1, None, None).wait()
            transport.isendrecv(None, None, buf, r + 1).wait()
            return
        if fold.role == "take":
            incoming = self._scratch_for(buf, buf.size)
            transport.isendrecv(None, None, incoming, r - 1).wait()
            self._add_from(buf, incoming)
            core(buf)
            transport.isendrecv(buf, r - 1, None, None).wait()
        else:
            core(buf)

    def _doubling(self, buf):
        incoming = self._scratch_for(buf, buf.size, slot=2)
        for partner in self._partners:
            self.transport.isendrecv(buf, partner, incoming, partner).wait()
            self._add_from(buf, incoming)        # x + y on one side, y + x on the other

    def _halving_doubling(self, buf):
        incoming = self._scratch_for(buf, buf.size, slot=2)
        steps = self._fold.halving_steps(buf.size)
        for partner, (ka, kb), (ga, gb) in steps:        # reduce-scatter: keep half, send half
            self.transport.isendrecv(buf[ga:gb], partner, incoming[:kb - ka], partner).wait()
            self._add_from(buf[ka:kb], incoming[:kb - ka])
        for partner, (ka, kb), (ga, gb) in reversed(steps):   # all-gather: the mirror image
            self.transport.isendrecv(buf[ka:kb], partner, buf[ga:gb], partner).wait()


NativeWatch.site(AutoCommunicator.allreduce, "_native_call")
