"""auto's lean path: its algorithms straight on mpi4py, for NumPy buffers over MPI off a stream.

:class:`LeanPath` runs the rounds of :mod:`ringnet.comm.schedules` (the same as
:class:`~ringnet.comm.auto.AutoCommunicator`'s transport path, so both add in the same order
and count the same bytes) with Irecv/Isend on views of the caller's buffer, ``numpy.add(...,
out=)`` into it and one preallocated scratch buffer per dtype; ``rd`` and ``direct`` in whole
steps keep a plan per byte count (the short path) and, for an array that comes back,
persistent requests (:class:`Bound`), freed before MPI finalizes (:func:`free_persistent`).
``native`` (MPI_Allreduce in place, its deadline kept by
:class:`~ringnet.comm.mpi_transport.NativeWatch`) has a plan per byte count too.
See :mod:`ringnet.comm.auto` for the measurements behind it.
"""
import atexit
import os
import time
import weakref

import numpy as np
from mpi4py import MPI

from ringnet import trace
from ringnet.comm import stream as _stream
from ringnet.comm.mpi_transport import YIELD_ROUNDS, NativeWatch
from ringnet.comm.schedules import (direct_peers, direct_slot, eager_cuts, ring_steps, step_pieces,
                                    sum_in_rank_order)
from ringnet.placement import lean_spins
from ringnet.shards import shard_bounds

__all__ = ["LeanPath", "Bound", "free_persistent"]

# After the spin (topology.lean_spins), polls that yield the core (sched_yield, then
# Testall) in rounds of this many between looks at the clock and the driven streams, in a
# loop of its own: with 3 ranks on 2 cores nearly every small all-reduce waits, and the
# transport's wait looked at both on every poll (interleaved, 3 rounds: auto 0.74-0.79x native at 8 B through it,
# 0.95-1.01x here; 1 KiB 0.90-1.07x -> 1.32-1.35x). Even entering that wait (its stream
# and tag look-ups) measured 0.66-0.82x at 8 B in rounds of 32.
_YIELD_ROUNDS = range(YIELD_ROUNDS)
_perf_counter, _sched_yield = time.perf_counter, os.sched_yield


class Bound:
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
_STARTALL, _TESTALL, _IN_PLACE = MPI.Prequest.Startall, MPI.Request.Testall, MPI.IN_PLACE


@atexit.register
def free_persistent():
    """Free every plan's persistent requests before MPI is finalized (MPICH warns about
    each one left); mpi4py finalizes after the interpreter's atexit handlers."""
    if MPI.Is_initialized() and not MPI.Is_finalized():
        for lean in list(_LEANS):
            lean.free()


class LeanPath:
    """auto's algorithms straight on mpi4py: Irecv/Isend (or, for an array that comes
    back, persistent requests: :class:`Bound`) on the caller's buffer views, numpy ufuncs
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
        self.n, self.rank = auto.size, auto.rank
        self.piece_bytes = auto.ring.chunk_bytes
        r = self.rank
        self.fold, self.role = auto._fold, auto._fold.role
        self.partners = auto._partners
        self.steps = len(self.partners)
        self.right, self.left = (r + 1) % self.n, (r - 1) % self.n
        self.peers = direct_peers(r, self.n)
        self.scratch = {}
        self.plans = {}
        self.irecv, self.isend = self.mpi.Irecv, self.mpi.Isend
        self.mpi_allreduce = self.mpi.Allreduce
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
        if trace.recording:       # tracing: the generic path, which records every transfer
            self.transport_path(buf, algorithm)
            return
        plan = self.plan(buf, algorithm)
        if plan is not None:    # whole steps, no MPI lock: rd, direct and native, planned per size
            plan[2](buf, plan)
            return
        if algorithm == "native":
            self.transport.allreduce_native(buf)
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
        self.auto.allreduce_now(buf, "sum", algorithm)

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
        elif algorithm == "native":
            function, slots = self.quick_native, 0
            NativeWatch.start(self.transport)
        else:
            return None
        cuts = eager_cuts(buf.size, buf.itemsize)
        space = np.empty(slots * buf.size, buf.dtype)
        views = [(part, [[part[a:b], MPI.BYTE] for a, b in cuts])
                 for part in (np.split(space, slots) if slots else ())]
        if len(self.plans) >= 64:               # many sizes seen: start over
            self.free()
            self.plans.clear()
        old = self.plans.get(buf.nbytes)
        if old is not None:                     # same size, another dtype or algorithm
            self.unbind(old)
        plan = self.plans[buf.nbytes] = (buf.dtype, algorithm, function, cuts, views, Bound())
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
        driven streams), then, from the transport's ``spin_s``, its own wait (sleeps,
        progresses streams), with the deadline counted from the first yield."""
        for _ in self.spins:
            if test(requests):
                return
        start = _perf_counter()
        spin_s = self.transport.spin_s
        while True:
            for _ in _YIELD_ROUNDS:
                _sched_yield()
                if test(requests):
                    return
            if _stream.driven_streams:
                _stream.progress_all()
            if _perf_counter() - start > spin_s:
                break
        self.transport._wait(requests, ("all-reduce", to, source, nbytes), start=start)

    def quick_native(self, buf, plan):
        """``native``: one MPI_Allreduce in place (its deadline: :class:`NativeWatch`).
        ``buf`` (checked by the caller) becomes the array auto's ``allreduce`` looks for
        first, which then makes the call itself."""
        self.auto._native_buf = buf
        self.mpi_allreduce(_IN_PLACE, buf)

    def quick_doubling(self, buf, plan):
        """``doubling`` for a rank of the power-of-two core: per step one Irecv + Isend
        (two of each in the band where MPI's eager limit cuts, see :func:`~ringnet.comm.schedules.eager_cuts`),
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
        sum_in_rank_order(np, buf, part, n, r, lambda: self._space(buf, buf.size, slot=1))

    def post_direct(self, inbox, receive, send, sends):
        """``direct``'s requests: from rank r - k into inbox slot k - 1, ``sends`` to r + k."""
        requests = []
        for (to, source), (_, specs) in zip(self.peers, inbox):
            requests += [receive(spec, source, 0) for spec in specs]
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
            pieces = step_pieces(max(send.size, length), target.itemsize, self.piece_bytes)
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
        pieces = eager_cuts(buf.size, buf.itemsize) if self.quick else None
        for partner in self.partners:
            self.exchange_add(buf, partner, buf, inc, pieces=pieces)

    def halving_doubling(self, buf):
        inc = self._space(buf, buf.size)
        *steps, (partner, (ka, kb), (ga, gb)) = self.fold.halving_steps(buf.size)
        for peer, (a, b), (c, d) in steps:       # reduce-scatter: keep half, send half
            self.exchange_add(buf[c:d], peer, buf[a:b], inc)
        # the last step, fused with the all-gather's first: each piece goes back at once
        self.reduce_and_pass(buf[ga:gb], partner, partner, buf[ka:kb], buf[ga:gb], inc)
        for peer, (a, b), (c, d) in reversed(steps):   # the rest of the all-gather: the mirror image
            self.exchange(buf[a:b], peer, buf[c:d], peer)

    def reduce_and_pass(self, send, to, source, target, refill, inc):
        """A last reduce step fused with the first gather step, piece by piece: ``send``
        goes to ``to``, what ``source`` sends is added into ``target``, each finished piece
        of ``target`` goes to ``to`` at once and ``refill`` is filled from ``source``."""
        length = target.size
        pieces = step_pieces(max(length, send.size, refill.size), target.itemsize, self.piece_bytes)
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
        for k, (to, source) in enumerate(self.peers):       # from rank r - k - 1 into slot k
            self.post(buf, to, inbox[k * length:(k + 1) * length], source, requests)
        self.wait(requests)

        def part(rank):
            if rank == r:
                return buf
            k = direct_slot(r, rank, n)
            return inbox[k * length:(k + 1) * length]
        sum_in_rank_order(np, buf, part, n, r, lambda: self._space(buf, length, slot=1))

    def ring(self, buf):
        n, r = self.n, self.rank
        bounds = shard_bounds(buf.size, n)
        inc = self._space(buf, max(b - a for a, b in bounds))

        def shard(i):
            a, b = bounds[i]
            return buf[a:b]
        reduce, gather = ring_steps(r, n)
        *reduce, (last_out, own) = reduce
        for out, into in reduce:        # reduce-scatter, as RingCommunicator
            self.exchange_add(shard(out), self.left, shard(into), inc, to=self.right)
        # its last step (own shard complete) fused with the all-gather's first (own shard out)
        self.reduce_and_pass(shard(last_out), self.right, self.left, shard(own), shard(gather[0][1]),
                             inc)
        for out, into in gather[1:]:    # the rest of the all-gather
            self.exchange(shard(out), self.right, shard(into), self.left)


NativeWatch.site(LeanPath.quick_native, "mpi_allreduce")
