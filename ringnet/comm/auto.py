"""AutoCommunicator: all-reduce by the algorithm that is fastest for the message size and N.

Every algorithm here is built from the transport's point-to-point calls, like the ring:

=========  ========================  ==========================  =====================
algorithm  rounds (latency terms)    bytes sent by busiest rank  bytes it adds
=========  ========================  ==========================  =====================
direct     1                         (N-1) n                     (N-1) n
rd         log2 p + 2f               (log2 p + 2f) n             (log2 p + f) n
rhd        2 log2 p + 2f             2 (p-1)/p n + 2f n          (p-1)/p n + f n
ring       2 (N-1)                   2 (N-1)/N n                 (N-1)/N n
=========  ========================  ==========================  =====================

``direct``: every rank sends its buffer to every other rank at once and sums all N in
rank order (one round). ``rd``: recursive doubling. ``rhd``: recursive halving
(reduce-scatter) then recursive doubling (all-gather). ``p`` is the largest power of two
<= N; when N is not one (f = 1), the first 2(N-p) ranks fold in pairs before and unfold
after. ``ring``: :class:`~ringnet.comm.ring.RingCommunicator`.

The choice minimises the alpha-beta-gamma cost ``rounds * ALPHA + sent * BETA +
added * GAMMA`` of the table (:func:`cost`). The three constants were measured on the
development machine (2 cores, MPICH shared memory, one rank per core): ALPHA, the cost of
one round in Python (posting, polling, the peer being scheduled), from the small-message
rows of ``python -m ringnet.bench comm --algos direct,rd,rhd,ring``; BETA and GAMMA from
its large-message rows and a NumPy add. The resulting switch points (:func:`thresholds`)
are printed by the benchmark. Every rank computes the same choice from (n, N) alone.

Every algorithm leaves bit-identical results on all ranks: ``direct`` sums in rank order
everywhere; in ``rd`` and ``rhd`` both partners of an exchange compute ``x + y`` (float
addition is commutative) or one rank sums an element and the others copy it.
"""
from ringnet.comm.base import CommunicatorBase
from ringnet.comm.ring import RingCommunicator
from ringnet.shards import shard_bounds

__all__ = ["AutoCommunicator", "ALGORITHMS", "terms", "cost", "fit", "choose", "thresholds"]

ALGORITHMS = ("direct", "rd", "rhd", "ring")

ALPHA = 25e-6           # s per round
BETA = 0.25e-9          # s per byte sent (4 GB/s)
GAMMA = 0.15e-9         # s per byte added (~7 GB/s, one core)


def _pow2_below(n):
    return 1 << (n.bit_length() - 1)


def terms(algorithm, nbytes, n):
    """Return (rounds, bytes sent by the busiest rank, bytes it adds) of the table above."""
    if n <= 1:
        return 0, 0, 0
    p = _pow2_below(n)
    log_p = p.bit_length() - 1
    f = int(p != n)
    if algorithm == "direct":
        return 1, (n - 1) * nbytes, (n - 1) * nbytes
    if algorithm == "rd":
        return log_p + 2 * f, (log_p + 2 * f) * nbytes, (log_p + f) * nbytes
    if algorithm == "rhd":
        return (2 * log_p + 2 * f, 2 * (p - 1) / p * nbytes + 2 * f * nbytes,
                (p - 1) / p * nbytes + f * nbytes)
    if algorithm == "ring":
        return 2 * (n - 1), 2 * (n - 1) / n * nbytes, (n - 1) / n * nbytes
    raise ValueError(f"unknown all-reduce algorithm {algorithm!r}: choose {', '.join(ALGORITHMS)}")


def cost(algorithm, nbytes, n, alpha=ALPHA, beta=BETA, gamma=GAMMA):
    """Return the modelled seconds of one all-reduce of ``nbytes`` over ``n`` ranks."""
    rounds, sent, added = terms(algorithm, nbytes, n)
    return rounds * alpha + sent * beta + added * gamma


def fit(samples):
    """Least-squares (alpha, beta, gamma) from [(algorithm, nbytes, n, seconds)], relative error."""
    import numpy as np  # noqa: WPS433
    rows = np.array([terms(a, b, n) for a, b, n, _ in samples], np.float64)
    seconds = np.array([s for *_, s in samples], np.float64)
    weights = 1.0 / seconds
    solution = np.linalg.lstsq(rows * weights[:, None], seconds * weights, rcond=None)[0]
    return tuple(float(max(x, 0.0)) for x in solution)


def choose(nbytes, n, candidates=ALGORITHMS, **constants):
    """Return the candidate with the least :func:`cost` (ties: the earlier in ``candidates``)."""
    return min(candidates, key=lambda a: (cost(a, nbytes, n, **constants), candidates.index(a)))


def thresholds(n, max_bytes=1 << 30, **constants):
    """Return [(first byte count, algorithm)] where the choice changes, from 1 byte up."""
    out, nbytes = [], 1
    while nbytes <= max_bytes:
        algorithm = choose(nbytes, n, **constants)
        if not out or out[-1][1] != algorithm:
            out.append((nbytes, algorithm))
        nbytes = _next_switch(nbytes, n, algorithm, max_bytes, constants)
    return out


def _next_switch(nbytes, n, algorithm, max_bytes, constants):
    """Smallest byte count above ``nbytes`` whose choice differs (bisection over doublings)."""
    high = nbytes * 2
    while high <= max_bytes and choose(high, n, **constants) == algorithm:
        high *= 2
    if high > max_bytes:
        return high
    low = high // 2
    while high - low > 1:
        mid = (low + high) // 2
        if choose(mid, n, **constants) == algorithm:
            low = mid
        else:
            high = mid
    return high


class AutoCommunicator(CommunicatorBase):
    """All-reduce with the algorithm :func:`choose` picks for the buffer's size and N.

    ``algorithm`` forces one of :data:`ALGORITHMS` (for measurement); ``chunk_bytes`` goes
    to the ring. ``last_algorithm`` names the algorithm of the latest call.
    """

    name = "auto"

    def __init__(self, transport="auto", mpi_comm=None, algorithm=None, chunk_bytes=None):
        super().__init__(transport, mpi_comm)
        if algorithm is not None and algorithm not in ALGORITHMS:
            raise ValueError(f"unknown all-reduce algorithm {algorithm!r}: "
                             f"choose {', '.join(ALGORITHMS)}")
        self.algorithm = algorithm
        self.ring = RingCommunicator(self.transport, chunk_bytes=chunk_bytes)
        self.last_algorithm = None
        self._choices = {}
        self._p = _pow2_below(self.size)
        self._extra = self.size - self._p

    def choose(self, nbytes):
        """Return the algorithm an all-reduce of ``nbytes`` uses on this communicator."""
        if self.algorithm is not None:
            return self.algorithm
        algorithm = self._choices.get(nbytes)
        if algorithm is None:
            algorithm = self._choices[nbytes] = choose(nbytes, self.size)
        return algorithm

    def allreduce(self, buf, op: str = "sum", stream=None):
        """Reduce ``buf`` over the ranks in place on every rank, bit-identical everywhere.

        Returns None, or a Handle when queued on ``stream``.
        """
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

