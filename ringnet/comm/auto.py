"""AutoCommunicator: all-reduce by the algorithm that is fastest for the message size and N.

The algorithms (``rd``, ``direct``, ``rhd``, ``ring``), their cost table and the choice
between them are in :mod:`ringnet.comm.cost`; the node's cores and how long a rank polls
before yielding in :mod:`ringnet.comm.topology`. Every rank computes the same choice from
(n, N) and whether the ranks agreed, when the communicator was made, that some node holds
more ranks than cores (``oversubscribed``: it then chooses with
:data:`~ringnet.comm.cost.ALPHA_OVERSUBSCRIBED`).

**Two paths.** Called without a stream on a NumPy buffer over the MPI transport, auto runs
its algorithm straight on mpi4py (the lean path, :class:`_Lean`): Irecv/Isend on views of
the caller's buffer, ``numpy.add(..., out=)`` into it, one preallocated scratch buffer per
dtype, a short MPI_Testall spin, then polls that yield the core and look at the clock (the
transfer deadline) and the driven streams every 32 polls, and after 50 ms the transport's
own sleeping wait. A message then costs ~1-2 us of Python instead of the ~20 us
of the generic path (a transfer object, trace span and checks per message), against 3-5 us
for a whole MPI_Allreduce of a few bytes. On a stream, with CuPy buffers, over NCCL or
while a trace records, auto goes through the transport's transfers like the other
communicators. Both paths add in the same order and count the same bytes (tested). The
lean ``rhd`` and ``ring`` fuse their last reduce step with the first gather step, and
``chunk_bytes`` cuts their steps into pipelined pieces (none by default: see :func:`_cut`).

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
Messages of 8-16 KB go as two halves (:data:`EAGER_SPLIT`: under MPICH's shared-memory
eager limit); the generic ``rd`` step cuts them alike, so ranks on either path pair up.
``python -m ringnet.bench comm --algos native,auto,floor`` times a bare mpi4py exchange
beside auto: the least a Python all-reduce from point-to-point calls can cost.

Every algorithm leaves bit-identical results on all ranks: ``direct`` sums in rank order
everywhere; in ``rd`` and ``rhd`` both partners of an exchange compute ``x + y`` (float
addition is commutative) or one rank sums an element and the others copy it.
"""
import atexit
import contextlib
import os
import time
import weakref
from typing import Any, Optional

import numpy as np
from mpi4py import MPI

from ringnet import trace
from ringnet.comm import mpi_transport as _mpi_transport, stream as _stream
from ringnet.comm.base import Array, CommunicatorBase, _DTYPES
# The cost model and the topology are imported whole: ``ringnet.comm.auto.terms`` and the
# rest keep working for code that imported them from here.
from ringnet.comm.cost import (ALGORITHMS, ALPHA, ALPHA_OVERSUBSCRIBED, choose, cost, fit,  # noqa: F401
                               pow2_below as _pow2_below, terms, thresholds)
from ringnet.comm.mpi_transport import YIELD_ROUNDS
from ringnet.comm.ring import RingCommunicator
from ringnet.comm.stream import CpuStream, Handle
from ringnet.comm.topology import (LEAN_SPINS, OVERSUBSCRIBED_SPINS, crowded, lean_spins,  # noqa: F401
                                   node_cores)
from ringnet.shards import shard_bounds

__all__ = ["AutoCommunicator", "ALGORITHMS", "terms", "cost", "fit", "choose", "thresholds"]


class AutoCommunicator(CommunicatorBase):
    """All-reduce with the algorithm :func:`choose` picks for the buffer's size and N.

    ``algorithm`` forces one of :data:`ALGORITHMS` (for measurement); ``chunk_bytes`` goes
    to the ring. ``last_algorithm`` names the algorithm of the latest call. ``alpha`` is
    the per-message cost it chooses with: :data:`ALPHA_OVERSUBSCRIBED` where
    ``oversubscribed`` (some rank's node holds more ranks than cores, agreed by all ranks
    when the communicator is made, which is collective unless ``algorithm`` is forced),
    else :data:`ALPHA`.
    """

    name = "auto"

    def __init__(self, transport: Any = "auto", mpi_comm: Any = None,
                 algorithm: Optional[str] = None, chunk_bytes: Optional[int] = None):
        super().__init__(transport, mpi_comm)
        if algorithm is not None and algorithm not in ALGORITHMS:
            raise ValueError(f"unknown all-reduce algorithm {algorithm!r}: "
                             f"choose {', '.join(ALGORITHMS)}")
        self.algorithm = algorithm
        self.ring = RingCommunicator(self.transport, chunk_bytes=chunk_bytes)
        self.last_algorithm = None
        self._choices = {}
        self.oversubscribed = algorithm is None and self._agreed_oversubscribed()
        self.alpha = ALPHA_OVERSUBSCRIBED if self.oversubscribed else ALPHA
        self._p = _pow2_below(self.size)
        self._extra = self.size - self._p
        # NumPy buffers over MPI, called off a stream: the lean path (see _Lean).
        self._lean = _Lean(self) if getattr(self.transport, "name", None) == "mpi" \
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

    def choose(self, nbytes: int) -> str:
        """Return the algorithm an all-reduce of ``nbytes`` uses on this communicator."""
        if self.algorithm is not None:
            return self.algorithm
        algorithm = self._choices.get(nbytes)
        if algorithm is None:
            algorithm = self._choices[nbytes] = choose(nbytes, self.size, alpha=self.alpha)
        return algorithm

    def thresholds(self, max_bytes=1 << 30):
        """:func:`thresholds` at this communicator's N and ``alpha``."""
        return thresholds(self.size, max_bytes=max_bytes, alpha=self.alpha)

    def allreduce(self, buf: Array, op: str = "sum",
                  stream: Optional[CpuStream] = None) -> Optional[Handle]:
        """Reduce ``buf`` over the ranks in place on every rank, bit-identical everywhere.

        Returns None, or a Handle when queued on ``stream``.
        """
        lean = self._lean
        if lean is not None and buf is lean.hot and stream is None:
            # the array whose persistent requests were bound last (a 1-D C-contiguous
            # ndarray of its plan's size, checked when it came in): fewer checks
            plan = lean.hot_plan
            if plan[0] is buf.dtype and op == "sum" and not trace._active \
                    and not _stream._local.__dict__.get("tag"):
                self.last_algorithm = plan[1]
                plan[2](buf, plan)
                return None
        if lean is not None and stream is None and type(buf) is np.ndarray:
            plan = lean.plans.get(buf.nbytes)     # the short path: a plan for this size
            if plan is not None and plan[0] is buf.dtype and op == "sum" and buf.ndim == 1 \
                    and buf.flags.c_contiguous and not trace._active \
                    and not _stream._local.__dict__.get("tag"):
                self.last_algorithm = plan[1]
                plan[2](buf, plan)
                return None
        # The checks of the lean path, cheapest first; a stream thread's tag lives in the
        # stream module's thread-local (a plain dict lookup: getattr with a default costs
        # ~0.4 us when the attribute is missing, a fifth of a whole small all-reduce).
        if lean is not None and stream is None and type(buf) is np.ndarray and buf.ndim == 1 \
                and buf.flags.c_contiguous and not _stream._local.__dict__.get("tag") \
                and (op == "sum" or (op == "mean" and buf.dtype.kind == "f")) \
                and buf.dtype.type in _DTYPES:
            nbytes = buf.nbytes
            algorithm = self.algorithm or self._choices.get(nbytes) or self.choose(nbytes)
            self.last_algorithm = algorithm
            if nbytes:
                lean.run(buf, algorithm)
                if op == "mean":
                    np.divide(buf, buf.dtype.type(self.size), out=buf)
            return None
        self._check(buf, op)
        algorithm = self.last_algorithm = self.choose(buf.nbytes)
        return self._launch(self._allreduce, (buf, op, algorithm), stream)

    # -- implementation -----------------------------------------------------------------
    def _allreduce(self, buf, op, algorithm):
        if self.size > 1 and buf.size:
            if algorithm == "ring":
                self.ring._allreduce(buf, "sum", self.ring.shard_bounds(buf.size))
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
        # From rank r - k into slot k - 1: a shift per k, so every rank posts in the same order.
        peers = [((r + k) % n, (r - k) % n) for k in range(1, n)]
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
            k = (r - rank) % n
            return inbox[(k - 1) * length:k * length]
        total = buf if r == 0 else self._scratch_for(buf, length, slot=1)
        if r != 0:
            total[...] = part(0)
        for rank in range(1, n):
            self._add_from(total, part(rank))
        if r != 0:
            buf[...] = total

    def _folded(self, buf, core):
        """Fold to a power of two (ranks 2i and 2i+1 < 2(N-p) pair up), run ``core``, unfold."""
        r, extra = self.rank, self._extra
        transport = self.transport
        if r < 2 * extra and r % 2 == 0:     # hands its buffer to r+1, gets the result back
            transport.isendrecv(buf, r + 1, None, None).wait()
            transport.isendrecv(None, None, buf, r + 1).wait()
            return
        if r < 2 * extra:
            incoming = self._scratch_for(buf, buf.size)
            transport.isendrecv(None, None, incoming, r - 1).wait()
            self._add_from(buf, incoming)
            core(buf, r // 2)
            transport.isendrecv(buf, r - 1, None, None).wait()
        else:
            core(buf, r - extra)

    def _real(self, virtual):
        """Real rank of a rank of the folded power-of-two group."""
        return 2 * virtual + 1 if virtual < self._extra else virtual + self._extra

    def _doubling(self, buf, me):
        incoming = self._scratch_for(buf, buf.size, slot=2)
        mask = 1
        while mask < self._p:
            partner = self._real(me ^ mask)
            self.transport.isendrecv(buf, partner, incoming, partner).wait()
            self._add_from(buf, incoming)        # x + y on one side, y + x on the other
            mask <<= 1

    def _halving_doubling(self, buf, me):
        p = self._p
        blocks = shard_bounds(buf.size, p)
        incoming = self._scratch_for(buf, buf.size, slot=2)
        lo, hi = 0, p                            # blocks this rank is still responsible for
        distance = p // 2
        steps = []
        while distance >= 1:                     # reduce-scatter: keep half, send half
            mid = (lo + hi) // 2
            partner = self._real(me ^ distance)
            keep, give = ((lo, mid), (mid, hi)) if me & distance == 0 else ((mid, hi), (lo, mid))
            ka, kb = blocks[keep[0]][0], blocks[keep[1] - 1][1]
            ga, gb = blocks[give[0]][0], blocks[give[1] - 1][1]
            self.transport.isendrecv(buf[ga:gb], partner, incoming[:kb - ka], partner).wait()
            self._add_from(buf[ka:kb], incoming[:kb - ka])
            steps.append((partner, (ka, kb), (ga, gb)))
            lo, hi = keep
            distance //= 2
        for partner, (ka, kb), (ga, gb) in reversed(steps):   # all-gather: the mirror image
            self.transport.isendrecv(buf[ka:kb], partner, buf[ga:gb], partner).wait()



# -- the lean path: NumPy buffers over MPI, off a stream ---------------------------------
# After the spin (topology.lean_spins), polls that yield the core (sched_yield, then Testall) in rounds of this
# many between looks at the clock and the driven streams, in a loop of its own: with 3
# ranks on 2 cores nearly every small all-reduce waits, and the transport's wait looked at
# both on every poll (interleaved, 3 rounds: auto 0.74-0.79x native at 8 B through it,
# 0.95-1.01x here; 1 KiB 0.90-1.07x -> 1.32-1.35x). Even entering that wait (its stream
# and tag look-ups) measured 0.66-0.82x at 8 B in rounds of 32.
_YIELD_ROUNDS = range(YIELD_ROUNDS)
_perf_counter, _sched_yield = time.perf_counter, os.sched_yield


def _cut(length, itemsize, piece_bytes=None):
    """Element ranges of one step: pieces of ``piece_bytes`` (None: the whole step).

    Pieces let piece j+1 travel while piece j is added (and, in a fused last step, sent
    on), but every piece is one more meeting of two ranks: on 2 shared cores under load,
    pieces of 128 KiB-1 MiB measured 0.2-0.9x the whole step at 16-64 MiB (N = 2, 4), so
    by default steps move whole (``chunk_bytes`` cuts them).
    """
    if piece_bytes is None:
        return [(0, length)]
    step = max(1, piece_bytes // itemsize)
    return [(a, min(a + step, length)) for a in range(0, length, step)] or [(0, 0)]


# MPICH's shared-memory eager limit is near 8 KB: one message of 8-16 KB is measured slower
# than two of half its size (0.6-0.8x against 1.0-1.2x native at N = 2, MPICH 5.0), while
# below it one message wins and from 16 KB a single large transfer does.
EAGER_SPLIT = (7936, 16384)


def _eager_cuts(length, itemsize):
    """Element ranges a short-path message is sent in: two halves for byte counts in
    the band ``EAGER_SPLIT`` (above the eager limit, below large transfers), else whole."""
    if EAGER_SPLIT[0] < length * itemsize < EAGER_SPLIT[1] and length > 1:
        half = length // 2
        return [(0, half), (half, length)]
    return [(0, length)]


class _Bound:
    """A short-path plan's persistent requests (MPI_Recv_init / MPI_Send_init), bound to one
    caller buffer: the second call in a row with the same array object binds them, every
    later call with it starts them (MPI_Startall) instead of posting new Irecv/Isend. A call
    with another array takes the plain path (and may bind that one in turn)."""

    __slots__ = ("buf", "last", "requests")

    def __init__(self):
        self.buf = self.last = self.requests = None

    def free(self):
        """Free the requests (inactive, or left unfinished by an error: freed once done)."""
        for _, requests in self.requests or ():
            for request in requests:
                try:
                    request.Free()
                except MPI.Exception:
                    pass
        self.buf = self.last = self.requests = None


_LEANS = weakref.WeakSet()
_STARTALL, _TESTALL = MPI.Prequest.Startall, MPI.Request.Testall


@atexit.register
def _free_persistent():
    """Free every plan's persistent requests before MPI is finalized (MPICH warns about
    each one left); mpi4py finalizes after the interpreter's atexit handlers."""
    if MPI.Is_initialized() and not MPI.Is_finalized():
        for lean in list(_LEANS):
            lean.free()


class _Lean:
    """auto's algorithms straight on mpi4py: Irecv/Isend (or, for an array that comes
    back, persistent requests: :class:`_Bound`) on the caller's buffer views, numpy ufuncs
    with ``out=``, one preallocated scratch per dtype.

    The generic path (a transfer object per message, trace spans, checks per message) costs
    ~20 us per message in Python, MPI's own all-reduce 3-5 us per call; this one ~1-2 us per
    message. It sums in the same order as the generic path, waits with the transport's
    deadline (a short Testall spin first), uses the calling thread's message tag and counts
    bytes like the transport.
    """

    def __init__(self, auto):
        transport = auto.transport
        self.auto, self.transport = auto, transport
        self.mpi = transport.mpi_comm
        self.lock = getattr(transport, "_lock", None)
        self.n, self.rank, self.p, self.extra = auto.size, auto.rank, auto._p, auto._extra
        self.piece_bytes = auto.ring.chunk_bytes
        r, extra = self.rank, self.extra
        self.role = ("give" if r % 2 == 0 else "take") if r < 2 * extra else "core"
        self.me = r // 2 if r < 2 * extra else r - extra
        self.real = auto._real
        self.partners = []
        mask = 1
        while mask < self.p:
            self.partners.append(auto._real(self.me ^ mask))
            mask <<= 1
        self.steps = len(self.partners)
        self.right, self.left = (r + 1) % self.n, (r - 1) % self.n
        self.scratch = {}
        self.plans = {}
        self.irecv, self.isend = self.mpi.Irecv, self.mpi.Isend
        # The short path needs no lock around MPI calls and whole (unpieced) steps.
        self.quick = self.lock is None and self.piece_bytes is None
        self.sent = self.received = 0
        self.tag = 0            # off a stream only (see AutoCommunicator.allreduce)
        self.last = (None, None, None, None)
        self.hot = self.hot_plan = None     # the array bound last and its plan
        self.spins = range(lean_spins())
        _LEANS.add(self)

    def free(self):
        """Free the plans' persistent requests (the plans stay, and bind again on use)."""
        for plan in self.plans.values():
            self.unbind(plan)

    def _space(self, buf, length, slot=0):
        key = (buf.dtype.str, slot)
        space = self.scratch.get(key)
        if space is None or space.size < length:
            space = self.scratch[key] = np.empty(max(length, 1), buf.dtype)
        return space[:length]

    def run(self, buf, algorithm):
        if trace._active:       # tracing: the generic path, which records every transfer
            self.transport_path(buf, algorithm)
            return
        plan = self.plan(buf, algorithm)
        if plan is not None:    # whole steps, no MPI lock: rd and direct, planned per size
            plan[2](buf, plan)
            return
        self.sent = self.received = 0
        try:
            if algorithm == "direct":
                self.direct(buf)
            elif algorithm == "ring":
                self.ring(buf)
            else:
                self.folded(buf, self.halving_doubling if algorithm == "rhd" else self.doubling)
        finally:
            self.transport._count(self.sent, self.received)

    def transport_path(self, buf, algorithm):
        self.auto._allreduce(buf, "sum", algorithm)

    # -- the short path: rd (power-of-two N) and direct in whole steps --------------------
    def plan(self, buf, algorithm):
        """Return the short path's plan for ``buf``'s byte count, or None where it does not
        apply: (dtype, algorithm, function, pieces, scratch views with their MPI specs).

        Plans are cached per byte count (AutoCommunicator.allreduce looks them up before
        any other check), at most 64 of them."""
        if not self.quick:
            return None
        plan = self.plans.get(buf.nbytes)
        if plan is not None and plan[0] is buf.dtype and plan[1] == algorithm:
            return plan     # planned, but the caller's checks sent it here (e.g. op "mean")
        if algorithm == "rd" and self.role == "core":
            function, slots = self.quick_doubling, 1
        elif algorithm == "direct":
            function, slots = self.quick_direct, self.n - 1
        else:
            return None
        cuts = _eager_cuts(buf.size, buf.itemsize)
        space = np.empty(slots * buf.size, buf.dtype)
        views = [(part, [[part[a:b], MPI.BYTE] for a, b in cuts]) for part in np.split(space, slots)]
        if len(self.plans) >= 64:               # many sizes seen: start over
            self.free()
            self.plans.clear()
        old = self.plans.get(buf.nbytes)
        if old is not None:                     # same size, another dtype or algorithm
            self.unbind(old)
        plan = self.plans[buf.nbytes] = (buf.dtype, algorithm, function, cuts, views, _Bound())
        return plan

    def bind(self, plan, buf, requests):
        """Bind ``plan``'s persistent ``requests`` (made for ``buf``), freeing any before;
        ``buf`` becomes the array ``allreduce`` checks first."""
        state = plan[5]
        state.free()
        state.requests, state.buf, state.last = requests, buf, buf
        self.hot, self.hot_plan = buf, plan

    def unbind(self, plan):
        """Free ``plan``'s persistent requests; it is no longer the plan ``allreduce``
        checks first."""
        if plan is self.hot_plan:
            self.hot = self.hot_plan = None
        plan[5].free()

    def finish_bound(self, requests, plan, to, source, nbytes):
        """``finish`` for started persistent requests: an error (the deadline) unbinds them,
        so no later call starts requests whose transfer never ended."""
        try:
            self.finish(requests, to, source, nbytes)
        except BaseException:
            self.unbind(plan)
            raise

    def finish(self, requests, to, source, nbytes, test=_TESTALL):
        """Wait for ``requests`` after a first Testall failed: a short spin, then polls
        that yield the core (:data:`YIELD_ROUNDS` between looks at the clock and the
        driven streams), then, from the transport's ``SPIN_S``, its own wait (sleeps,
        progresses streams), with the deadline counted from the first yield."""
        for _ in self.spins:
            if test(requests):
                return
        start = _perf_counter()
        spin_s = _mpi_transport.SPIN_S
        while True:
            for _ in _YIELD_ROUNDS:
                _sched_yield()
                if test(requests):
                    return
            if _stream._driven:
                _stream.progress_all()
            if _perf_counter() - start > spin_s:
                break
        self.transport._wait(requests, ("all-reduce", to, source, nbytes), start=start)

    def quick_doubling(self, buf, plan):
        """``doubling`` for a rank of the power-of-two core: per step one Irecv + Isend
        (two of each in the band where MPI's eager limit cuts, see :func:`_eager_cuts`),
        ``x + y`` added in place (the generic path's order)."""
        _, _, _, cuts, ((inc, specs),), state = plan
        testall, add = _TESTALL, np.add
        if buf is state.buf:            # bound: start the requests made for this array
            state.last = buf
            for partner, requests in state.requests:
                _STARTALL(requests)
                if not testall(requests):
                    self.finish_bound(requests, plan, partner, partner, buf.nbytes)
                add(buf, inc, buf)
        elif buf is state.last:         # the second call in a row with this array: bind
            self.bind(plan, buf, [(partner, [self.mpi.Recv_init(spec, partner, 0) for spec in specs]
                                   + [self.mpi.Send_init([buf[x:y], MPI.BYTE], partner, 0)
                                      for x, y in cuts])
                                  for partner in self.partners])
            return self.quick_doubling(buf, plan)
        elif len(cuts) == 1:
            state.last = buf
            irecv, isend = self.irecv, self.isend
            send, spec = [buf, MPI.BYTE], specs[0]
            for partner in self.partners:
                requests = [irecv(spec, partner, 0), isend(send, partner, 0)]
                if not testall(requests):
                    self.finish(requests, partner, partner, buf.nbytes)
                add(buf, inc, buf)
        else:
            state.last = buf
            irecv, isend = self.irecv, self.isend
            sends = [[buf[a:b], MPI.BYTE] for a, b in cuts]
            for partner in self.partners:
                requests = [irecv(spec, partner, 0) for spec in specs]
                requests += [isend(send, partner, 0) for send in sends]
                if not testall(requests):
                    self.finish(requests, partner, partner, buf.nbytes)
                add(buf, inc, buf)
        # sent = received: counted without the transport's lock, as only one thread ever
        # takes the short path (a stream thread never does)
        self.transport.short_moved += buf.nbytes * self.steps

    def quick_direct(self, buf, plan):
        """``direct`` on the plan's inbox: all N-1 pairs posted at once, one wait, the
        sum in rank order as :meth:`direct`."""
        _, _, _, cuts, inbox, state = plan
        n, r = self.n, self.rank
        if buf is state.buf:            # bound: start the requests made for this array
            state.last = buf
            requests = state.requests[0][1]
            _STARTALL(requests)
            if not _TESTALL(requests):
                self.finish_bound(requests, plan, self.right, self.left, buf.nbytes)
        else:
            sends = [[buf, MPI.BYTE]] if len(cuts) == 1 else [[buf[x:y], MPI.BYTE] for x, y in cuts]
            if buf is state.last:       # the second call in a row with this array: bind
                self.bind(plan, buf, [(None, self.post_direct(inbox, self.mpi.Recv_init,
                                                              self.mpi.Send_init, sends))])
                return self.quick_direct(buf, plan)
            state.last = buf
            requests = self.post_direct(inbox, self.irecv, self.isend, sends)
            if not MPI.Request.Testall(requests):
                self.finish(requests, self.right, self.left, buf.nbytes)
        self.transport.short_moved += (n - 1) * buf.nbytes

        def part(rank):
            return buf if rank == r else inbox[(r - rank) % n - 1][0]
        if r <= 1:                  # buf is one of the first two terms: sum straight into it
            np.add(part(0), part(1), out=buf)
            total = buf
        else:
            total = self._space(buf, buf.size, slot=1)
            np.add(part(0), part(1), out=total)
        for rank in range(2, n):
            np.add(total, part(rank), out=total)
        if total is not buf:
            buf[...] = total

    def post_direct(self, inbox, receive, send, sends):
        """``direct``'s requests: from rank r - k into inbox slot k - 1, ``sends`` to r + k."""
        n, r, requests = self.n, self.rank, []
        for k in range(1, n):
            source, to = (r - k) % n, (r + k) % n
            requests += [receive(spec, source, 0) for spec in inbox[k - 1][1]]
            requests += [send(piece, to, 0) for piece in sends]
        return requests

    # -- messages --------------------------------------------------------------------------
    def post(self, send, to, recv, source, requests):
        """Append the requests of one paired transfer (empty sides skipped on both ends)."""
        mpi, tag = self.mpi, self.tag
        if self.lock is not None:
            self.lock.acquire()
        try:
            if recv is not None and recv.size:
                requests.append(mpi.Irecv([recv, MPI.BYTE], source, tag))
                self.received += recv.nbytes
            if send is not None and send.size:
                requests.append(mpi.Isend([send, MPI.BYTE], to, tag))
                self.sent += send.nbytes
        finally:
            if self.lock is not None:
                self.lock.release()
        self.last = (to, source, send, recv)
        return requests

    def wait(self, requests, *_):
        if not requests:
            return
        test = self.transport._test if self.lock is not None else _TESTALL
        if test(requests):
            return
        to, source, send, recv = self.last     # the latest transfer posted, for the message
        sizes = [x.nbytes for x in (send, recv) if x is not None and x.size]
        self.finish(requests, to if send is not None and send.size else None,
                    source if recv is not None and recv.size else None,
                    max(sizes, default=0), test)

    def exchange(self, send, to, recv, source):
        self.wait(self.post(send, to, recv, source, []), to)

    def exchange_add(self, send, peer, target, inc, to=None, pieces=None):
        """Send ``send`` to ``to`` (default ``peer``), receive as much as ``target`` from
        ``peer`` and add it into ``target`` (``x + y``: the same bits on both sides of a
        pair). Large steps go in pieces: piece j+1 is on the wire while piece j is added."""
        to = peer if to is None else to
        length = target.size
        if pieces is None:
            pieces = _cut(max(send.size, length), target.itemsize, self.piece_bytes)
        pending = self.post(send[:pieces[0][1]], to, inc[:min(pieces[0][1], length)], peer, [])
        for j, (a, b) in enumerate(pieces):
            arriving = pending
            if j + 1 < len(pieces):
                c, d = pieces[j + 1]
                pending = self.post(send[c:d], to, inc[c:min(d, length)], peer, [])
            self.wait(arriving, peer)
            b = min(b, length)
            if a < b:
                np.add(target[a:b], inc[a:b], out=target[a:b])

    # -- algorithms ------------------------------------------------------------------------
    def folded(self, buf, core):
        r = self.rank
        if self.role == "give":              # hands its buffer to r+1, gets the result back
            self.exchange(buf, r + 1, None, None)
            self.exchange(None, None, buf, r + 1)
            return
        if self.role == "take":
            inc = self._space(buf, buf.size)
            self.exchange(None, None, inc, r - 1)
            np.add(buf, inc, out=buf)
            core(buf)
            self.exchange(buf, r - 1, None, None)
        else:
            core(buf)

    def doubling(self, buf):
        inc = self._space(buf, buf.size)
        # the partner may be on the short path (quick_doubling): cut the same messages
        pieces = _eager_cuts(buf.size, buf.itemsize) if self.quick else None
        for partner in self.partners:
            self.exchange_add(buf, partner, buf, inc, pieces=pieces)

    def halving_doubling(self, buf):
        p, me = self.p, self.me
        blocks = shard_bounds(buf.size, p)
        inc = self._space(buf, buf.size)
        lo, hi = 0, p
        distance = p // 2
        steps = []
        while distance >= 1:                     # reduce-scatter: keep half, send half
            mid = (lo + hi) // 2
            partner = self.real(me ^ distance)
            keep, give = ((lo, mid), (mid, hi)) if me & distance == 0 else ((mid, hi), (lo, mid))
            ka, kb = blocks[keep[0]][0], blocks[keep[1] - 1][1]
            ga, gb = blocks[give[0]][0], blocks[give[1] - 1][1]
            if distance == 1:                    # the last step: each piece goes back at once
                self.reduce_and_pass(buf[ga:gb], partner, partner, buf[ka:kb], buf[ga:gb], inc)
            else:
                self.exchange_add(buf[ga:gb], partner, buf[ka:kb], inc)
                steps.append((partner, (ka, kb), (ga, gb)))
            lo, hi = keep
            distance //= 2
        for partner, (ka, kb), (ga, gb) in reversed(steps):   # all-gather: the mirror image
            self.exchange(buf[ka:kb], partner, buf[ga:gb], partner)

    def reduce_and_pass(self, send, to, source, target, refill, inc):
        """A last reduce step fused with the first gather step, piece by piece: ``send``
        goes to ``to``, what ``source`` sends is added into ``target``, each finished piece
        of ``target`` goes to ``to`` at once and ``refill`` is filled from ``source``."""
        length = target.size
        pieces = _cut(max(length, send.size, refill.size), target.itemsize, self.piece_bytes)
        if len(pieces) == 1:
            self.exchange_add(send, source, target, inc, to=to)
            self.exchange(target, to, refill, source)
            return

        def reduce_piece(a, b):
            return self.post(send[a:b], to, inc[a:min(b, length)], source, [])

        back = []
        pending = reduce_piece(*pieces[0])
        for j, (a, b) in enumerate(pieces):
            arriving = pending
            if j + 1 < len(pieces):
                pending = reduce_piece(*pieces[j + 1])
            self.wait(arriving, source)
            end = min(b, length)
            if a < end:
                np.add(target[a:end], inc[a:end], out=target[a:end])
            self.post(target[a:b], to, refill[a:b], source, back)
        self.wait(back, source)

    def direct(self, buf):
        n, r, length = self.n, self.rank, buf.size
        inbox = self._space(buf, (n - 1) * length)
        requests = []
        for k in range(1, n):       # from rank r - k into slot k - 1
            self.post(buf, (r + k) % n, inbox[(k - 1) * length:k * length], (r - k) % n, requests)
        self.wait(requests)

        def part(rank):
            if rank == r:
                return buf
            k = (r - rank) % n
            return inbox[(k - 1) * length:k * length]
        if r <= 1:                  # buf is one of the first two terms: sum straight into it
            np.add(part(0), part(1), out=buf)
            total = buf
        else:
            total = self._space(buf, length, slot=1)
            np.add(part(0), part(1), out=total)
        for rank in range(2, n):
            np.add(total, part(rank), out=total)
        if total is not buf:
            buf[...] = total

    def ring(self, buf):
        n, r = self.n, self.rank
        bounds = shard_bounds(buf.size, n)
        inc = self._space(buf, max(b - a for a, b in bounds))

        def shard(i):
            a, b = bounds[i % n]
            return buf[a:b]
        for k in range(n - 2):          # reduce-scatter, as RingCommunicator
            self.exchange_add(shard(r - k - 1), self.left, shard(r - k - 2), inc, to=self.right)
        # its last step (own shard complete) fused with the all-gather's first (own shard out)
        self.reduce_and_pass(shard(r + 1), self.right, self.left, shard(r), shard(r - 1), inc)
        for k in range(1, n - 1):       # the rest of the all-gather
            self.exchange(shard(r - k), self.right, shard(r - k - 1), self.left)
