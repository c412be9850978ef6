"""Who sends what to whom in each round of auto's all-reduce algorithms.

:class:`~ringnet.comm.auto.AutoCommunicator` runs each algorithm on two paths: through the
transport's transfers, and straight on mpi4py (:mod:`ringnet.comm._lean`). Both take the
rounds from here, so the ranks of either path pair up and add in the same order:

- ``direct``: :func:`direct_peers` (to whom and from whom, in posting order),
  :func:`direct_slot` (where a rank's buffer arrives) and :func:`sum_in_rank_order`.
- ``rd`` and ``rhd``: :class:`Fold` (the fold to a power of two, its partners and the
  blocks of recursive halving).
- ``ring``: :func:`ring_steps` (as :class:`~ringnet.comm.ring.RingCommunicator`).
- :func:`step_pieces` and :func:`eager_cuts`: how a step is cut into messages.
"""
from ringnet.comm.cost import pow2_below
from ringnet.shards import shard_bounds

__all__ = ["Fold", "direct_peers", "direct_slot", "sum_in_rank_order", "ring_steps", "step_pieces",
           "eager_cuts", "EAGER_SPLIT"]


def step_pieces(length, itemsize, piece_bytes=None):
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


def eager_cuts(length, itemsize):
    """Element ranges a short-path message is sent in: two halves for byte counts in
    the band ``EAGER_SPLIT`` (above the eager limit, below large transfers), else whole."""
    if EAGER_SPLIT[0] < length * itemsize < EAGER_SPLIT[1] and length > 1:
        half = length // 2
        return [(0, half), (half, length)]
    return [(0, length)]


# -- direct ----------------------------------------------------------------------------------
def direct_peers(rank, n):
    """[(to, source)]: in step k (from 1) rank r sends its buffer to r + k and receives
    r - k's into inbox slot k - 1 (a shift per k, so every rank posts in the same order)."""
    return [((rank + k) % n, (rank - k) % n) for k in range(1, n)]


def direct_slot(rank, source, n):
    """The inbox slot ``source``'s buffer arrives in on ``rank`` (``source`` != ``rank``)."""
    return (rank - source) % n - 1


def sum_in_rank_order(xp, buf, part, n, rank, scratch):
    """Sum ``part(0) + part(1) + ... + part(n - 1)`` into ``buf``, the same order on every
    rank (bit-identical results); ``part(rank)`` is ``buf``. Where ``buf`` is one of the
    first two terms it is summed straight into, else into ``scratch()`` and copied."""
    if rank <= 1:
        xp.add(part(0), part(1), out=buf)
        total = buf
    else:
        total = scratch()
        xp.add(part(0), part(1), out=total)
    for source in range(2, n):
        xp.add(total, part(source), out=total)
    if total is not buf:
        buf[...] = total


# -- recursive doubling and halving-doubling ---------------------------------------------------
class Fold:
    """The fold of N ranks to a power of two ``p``: ranks 2i and 2i+1 < 2(N-p) pair up.

    ``role``: "give" (hands its buffer to ``rank + 1`` and gets the result back), "take"
    (adds ``rank - 1``'s buffer, runs the core, sends the result back) or "core"; ``me``
    is the rank in the folded group of ``p``.
    """

    __slots__ = ("n", "rank", "p", "extra", "role", "me")

    def __init__(self, rank, n):
        self.n, self.rank = n, rank
        self.p = pow2_below(n)
        self.extra = extra = n - self.p
        self.role = ("give" if rank % 2 == 0 else "take") if rank < 2 * extra else "core"
        self.me = rank // 2 if rank < 2 * extra else rank - extra

    def real(self, virtual):
        """Real rank of a rank of the folded power-of-two group."""
        return 2 * virtual + 1 if virtual < self.extra else virtual + self.extra

    def doubling_partners(self):
        """Recursive doubling: the partner of each step (distance 1, 2, 4, ... < p)."""
        partners, mask = [], 1
        while mask < self.p:
            partners.append(self.real(self.me ^ mask))
            mask <<= 1
        return partners

    def halving_steps(self, length):
        """Recursive halving (reduce-scatter) of ``length`` elements: per step (partner,
        (start, stop) kept and added into, (start, stop) sent), distance p/2 down to 1.
        The all-gather is its mirror image: the steps reversed, kept sent, sent received."""
        p, me = self.p, self.me
        blocks = shard_bounds(length, p)
        lo, hi = 0, p                            # blocks this rank is still responsible for
        distance = p // 2
        steps = []
        while distance >= 1:                     # keep half, send half
            mid = (lo + hi) // 2
            keep, give = ((lo, mid), (mid, hi)) if me & distance == 0 else ((mid, hi), (lo, mid))
            steps.append((self.real(me ^ distance),
                          (blocks[keep[0]][0], blocks[keep[1] - 1][1]),
                          (blocks[give[0]][0], blocks[give[1] - 1][1])))
            lo, hi = keep
            distance //= 2
        return steps


# -- ring --------------------------------------------------------------------------------------
def ring_steps(rank, n):
    """The ring's rounds as shard indices, rank r sending to r + 1 and receiving from r - 1:
    (reduce-scatter: per step (shard sent, shard received and added into), all-gather: per
    step (shard sent, shard received)). Step k of the reduce-scatter passes on the shard
    summed at step k - 1; the all-gather forwards the shard that arrived (own shard first)."""
    return ([((rank - k - 1) % n, (rank - k - 2) % n) for k in range(n - 1)],
            [((rank - k) % n, (rank - k - 1) % n) for k in range(n - 1)])
