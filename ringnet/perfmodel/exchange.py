"""Timing rules of the collectives, by route: the ring's lockstep steps, the tree's heap and
the master's star (reduce, the root's adds, broadcast), each cut into the waits the code makes;
and auto's all-reduce algorithms by the shared cost table (``ringnet.comm.cost.terms``)."""
import dataclasses
import math

import numpy as np

from ringnet.perfmodel.codefacts import rooted_concurrent as _rooted_concurrent
from ringnet.comm.cost import ALGORITHMS, choose, terms
from ringnet.comm.schedules import ring_steps
from ringnet.parallel.traffic import heap_children as _tree_children, rooted_pieces
from ringnet.shards import shard_bounds as _shard_bounds

__all__ = ["allreduce_time", "allreduce_rows", "auto_algorithms"]


def _pieces(length, itemsize, route, n):
    """Return the element ranges a rooted transfer of ``length`` elements is cut into, as
    the communicator ``route`` at ``n`` ranks cuts them (its own ``pieces`` rule)."""
    return rooted_pieces(route, length, itemsize, n)


def ring_time(system, bounds, itemsize, kind, after_idle=False, tokens=None):
    """Seconds of one ring reduce-scatter ("rs", with adds) or all-gather ("ag") over
    ``bounds``; ``after_idle``: the collective follows compute, so a shaped link's token
    bucket is full when it starts; ``tokens``: each rank's tokens as it starts, left as it
    ends them (:func:`_ring_items`)."""
    return sum(seconds for _, seconds in _ring_items(system, bounds, itemsize, kind, after_idle,
                                                     tokens))


def _ring_items(system, bounds, itemsize, kind, after_idle=False, tokens=None):
    """The ring collective as the stream runs it: [("msg", s) and ("cpu", s) for the adds].

    Lockstep: every step waits for the slowest of its messages, each rank sending the shard
    the code's schedule (:func:`~ringnet.comm.schedules.ring_steps`) gives it that step; a
    step whose shards are all empty sends nothing (the transport skips zero-byte sides).

    A link shaped by a token bucket (``Link.burst_bytes``; one per rank, the rank's link
    to its successor) passes the bytes its tokens cover at the wire's speed, which next to
    the shaped rate costs nothing, and the rest at the rate. Its tokens refill at the rate
    while it sends nothing: during each message's latency, the adds, and the steps whose
    shard for it is empty, up to the burst. ``tokens``: each rank's tokens when the
    collective starts (a list, left as the collective ends them, so the collectives of one
    exchange carry them on); else the burst where ``after_idle``, none otherwise."""
    n = len(bounds)
    if n == 1:
        return []
    sizes = np.array([(b - a) * itemsize for a, b in bounds], float)
    if not sizes.any():
        return []
    hop = system.link_of(n)
    burst = hop.burst_bytes
    items = []
    if not burst:                  # no bucket: every step waits for the largest shard
        shard = int(sizes.max())
        for _ in range(n - 1):
            items += message_time(hop, shard, system.msg_wait_s)
            if kind == "rs":
                items.append(("cpu", system.compute.add(shard // itemsize)))
        return items
    if tokens is None:
        tokens = [burst if after_idle else 0.0] * n
    have = np.array(tokens, float)
    # rank r sends shard (r + offset) mod N at each step, the offsets of rank 0's schedule
    offsets = [sent for sent, _ in ring_steps(0, n)[0 if kind == "rs" else 1]]
    ranks = np.arange(n)
    for offset in offsets:
        sent = sizes[(ranks + offset) % n]
        covered = np.minimum(have, sent)
        shaped = (sent - covered) / hop.beta_Bps
        slowest = int(np.argmax(np.where(sent > 0, shaped, -1.0)))
        message = message_time(hop, int(sent[slowest]), system.msg_wait_s, covered[slowest])
        items += message
        step_s = sum(seconds for _, seconds in message)
        if kind == "rs":
            add = system.compute.add(int(sent.max()) // itemsize)
            items.append(("cpu", add))
            step_s += add
        have = np.minimum(burst, have - covered + (step_s - shaped) * hop.beta_Bps)
    tokens[:] = have.tolist()
    return items


def refill(system, n, tokens, seconds):
    """Refill every rank's token bucket (``tokens``, as :func:`_ring_items` keeps them)
    for ``seconds`` in which their links send nothing."""
    hop = system.link_of(n)
    for r in range(len(tokens)):
        tokens[r] = min(hop.burst_bytes, tokens[r] + seconds * hop.beta_Bps)


def message_time(link, nbytes, peer_s=0.0, burst=0.0):
    """One message as the stream meets it: a wait for the peer ("msg", the latency), the
    copy of its bytes ("copy", bytes / beta, less the ``burst`` bytes a full token bucket
    passes at the wire's speed), and where ranks outnumber the cores the wait for a
    descheduled peer ("peer"; beside compute the calibrated rate already holds it)."""
    if not nbytes:
        return []
    return [("msg", link.alpha_s), ("copy", (nbytes - burst) / link.beta_Bps)] + \
        ([("peer", peer_s)] if peer_s else [])


def without_latency(system):
    """The same system with every hop's latency zero (what remains: bytes and adds)."""
    def flat(link):
        return dataclasses.replace(link, alpha_s=0.0)
    return dataclasses.replace(system, intra=flat(system.intra), inter=flat(system.inter))


class _Buckets:
    """The token buckets of a rooted collective's links on a shaped link (``Link.burst_bytes``):
    one on each rank's link to it and one on its link from it, by time. A transfer's bytes
    the buckets of both ends cover pass at the wire's speed (next to the rate: free); the
    buckets refill at the rate while their links send nothing, up to the burst. With no
    burst every transfer pays its bytes at the rate."""

    def __init__(self, system, n, full):
        link = system.link_of(n)
        self.burst, self.rate = link.burst_bytes, link.beta_Bps
        self.level_at = {(way, v): (self.burst if full else 0.0, 0.0)
                         for way in ("in", "out") for v in range(n)}

    def _level(self, key, t):
        tokens, since = self.level_at[key]
        return min(self.burst, tokens + max(0.0, t - since) * self.rate)

    def cover(self, root, peers, size, t, gather):
        """Bytes of ``size`` from each of ``peers`` to ``root`` (``gather``) or from ``root``
        to each of them, all at once on ``root``'s link, that the buckets cover at time
        ``t`` (after the latency); spends them. Call :meth:`until` with the end."""
        if not self.burst:
            return 0.0
        near, far = ("in", "out") if gather else ("out", "in")
        each = {c: min(size, self._level((far, c), t)) for c in peers}
        total = min(self._level((near, root), t), sum(each.values()))
        scale = total / sum(each.values()) if total else 0.0
        self._spent = [((near, root), total, t)] + [((far, c), each[c] * scale, t) for c in peers]
        return total

    def until(self, end):
        """The transfer :meth:`cover` priced ends at ``end``: its links' buckets refill from then."""
        if not self.burst:
            return
        for key, spent, t in self._spent:
            self.level_at[key] = (self._level(key, t) - spent, end)


def tree_time(system, n, nbytes, elems, after_idle=False):
    """Seconds of a tree reduce (to the root) plus broadcast (to the last leaf).

    Heap of the code (children 2v+1, 2v+2). With the pipelined communicator every rank
    receives both children's piece j at once (sharing its link), adds them and sends the
    sum up while piece j+1 arrives; the broadcast relays piece by piece, a rank sending
    each piece to both children at once. Without it (one piece, children one after the
    other) the same recursion runs with serial receives. On shaped links (pipelined) each
    transfer's bytes the links' token buckets cover pass at the wire's speed
    (:class:`_Buckets`; ``after_idle``: they start full).
    """
    if n <= 1:
        return 0.0, 0.0
    itemsize = max(1, nbytes // max(elems, 1))
    concurrent = _rooted_concurrent()
    pieces = [b - a for a, b in _pieces(elems, itemsize, "tree", n)] if concurrent else [elems]
    buckets = _Buckets(system, n, after_idle)
    ready = [[0.0] * len(pieces) for _ in range(n)]     # piece j's partial ready to go up
    for v in range(n - 1, -1, -1):                      # children before parents
        kids = _tree_children(v, n)
        link = add = 0.0
        for j, e in enumerate(pieces):
            if not kids:
                continue
            size = e * itemsize
            if concurrent:
                start = max(link, max(ready[c][j] for c in kids)) \
                    + max(system.hop(c, v).alpha_s for c in kids)
                covered = buckets.cover(v, kids, size, start, gather=True)
                link = start + sum(size / system.hop(c, v).beta_Bps for c in kids) \
                    - covered / buckets.rate
                buckets.until(link)
                add = max(add, link) + len(kids) * system.compute.add(e)
            else:
                for c in kids:
                    link = max(link, ready[c][j], add) + system.hop(c, v).time(size)
                    add = link + system.compute.add(e)
            ready[v][j] = add
    reduce = ready[0][-1]
    have = [[0.0] * len(pieces) for _ in range(n)]       # piece j arrived at v
    for v in range(n):                                   # parents before children
        kids = _tree_children(v, n)
        out = 0.0
        for j, e in enumerate(pieces):
            if not kids:
                continue
            start = max(out, have[v][j]) + max(system.hop(v, c).alpha_s for c in kids)
            # the broadcast follows the reduce: its buckets' clock is the reduce's
            covered = buckets.cover(v, kids, e * itemsize, reduce + start, gather=False)
            out = start + sum(e * itemsize / system.hop(v, c).beta_Bps for c in kids) \
                - covered / buckets.rate
            buckets.until(reduce + out)
            for c in kids:
                have[c][j] = out
    return reduce, max(h[-1] for h in have)


def master_time(system, n, nbytes, elems, after_idle=False):
    """Seconds of the master's reduce (N-1 gradients into the root) and broadcast.

    Pipelined communicator: the root posts every worker's piece j at once (they share its
    link) and adds them in rank order while piece j+1 arrives; it sends each piece to all
    workers at once. Without it: one worker after the other. On shaped links (pipelined)
    the links' token buckets as :func:`tree_time` counts them.
    """
    if n <= 1:
        return 0.0, 0.0
    itemsize = max(1, nbytes // max(elems, 1))
    workers = range(1, n)
    alpha = max(system.hop(w, 0).alpha_s for w in workers)
    if not _rooted_concurrent():
        reduce = sum(system.hop(w, 0).time(nbytes) + system.compute.add(elems) for w in workers)
        return reduce, alpha + sum(nbytes / system.hop(0, w).beta_Bps for w in workers)
    buckets = _Buckets(system, n, after_idle)
    link = add = out = 0.0
    spans = []
    for a, b in _pieces(elems, itemsize, "master", n):
        size = (b - a) * itemsize
        start = link + alpha
        covered = buckets.cover(0, workers, size, start, gather=True)
        link = start + sum(size / system.hop(w, 0).beta_Bps for w in workers) \
            - covered / buckets.rate
        buckets.until(link)
        add = max(add, link) + (n - 1) * system.compute.add(b - a)
        spans.append(size)
    for size in spans:                      # the broadcast follows the reduce
        start = out + alpha
        covered = buckets.cover(0, workers, size, add + start, gather=False)
        out = start + sum(size / system.hop(0, w).beta_Bps for w in workers) \
            - covered / buckets.rate
        buckets.until(add + out)
    return add, out


def auto_algorithms():
    """The all-reduce algorithms of the code's ``auto`` communicator (``ringnet.comm.cost``)."""
    return tuple(ALGORITHMS)


def allreduce_time(system, algorithm, nbytes, n, itemsize=4):
    """Seconds of one all-reduce of ``nbytes`` over N ranks by ``algorithm`` (``auto``: the
    algorithm the code's ``AutoCommunicator`` picks for this size and N, with its own rule).

    The ring runs as the model's ring; auto's other algorithms by their rounds, the bytes
    the busiest rank sends and the bytes it adds (``ringnet.comm.cost.terms``, the table
    the code's choice is made from), each round one message time on this link.
    """
    if n <= 1 or nbytes <= 0:
        return 0.0
    if algorithm == "auto":
        algorithm = choose(nbytes, n)
    elems = max(1, nbytes // itemsize)
    if algorithm == "ring":
        bounds = _shard_bounds(elems, n)
        return ring_time(system, bounds, itemsize, "rs") + ring_time(system, bounds, itemsize, "ag")
    rounds, sent, added = terms(algorithm, nbytes, n)
    link = system.link_of(n)
    cp = system.compute
    return rounds * (link.alpha_s + cp.add_s_per_call) + sent / link.beta_Bps \
        + added / itemsize * cp.add_s_per_elem


def allreduce_rows(system, model, nps):
    """Rows {model, profile, np, bytes, picked, auto_ms, ring_ms} for the whole gradient."""
    if "ring" not in auto_algorithms():
        return []
    nbytes = model.num_params * model.dtype.itemsize
    rows = []
    for n in nps:
        if n < 2:
            continue
        sys_n = system.at(n)
        rows.append({"model": model.name, "profile": system.name, "np": n, "bytes": nbytes,
                     "picked": choose(nbytes, n),
                     "auto_ms": 1e3 * allreduce_time(sys_n, "auto", nbytes, n, model.dtype.itemsize),
                     "ring_ms": 1e3 * allreduce_time(sys_n, "ring", nbytes, n, model.dtype.itemsize)})
    return rows


# route -> the timing of a rooted reduce and broadcast on it
ROOTED_TIMES = {"tree": tree_time, "master": master_time}
RING_KINDS = {"reduce_scatter": "rs", "allgather": "ag"}


def flat_items(system, n, part, update_s, after_idle=False):
    """The exchange of one part of the plan at N ranks (a :class:`~ringnet.parallel.traffic.Part`),
    as the stream runs it: [("msg", seconds) for each wait on a transfer, ("copy", seconds) for
    its bytes, ("cpu", seconds) for adds and the update].

    A ring collective runs over the part's shard bounds (:func:`_ring_items`); a rooted
    reduce and broadcast as their route's timing (:data:`ROOTED_TIMES`) cuts them into the
    waits the code makes; between the reduce and the distribution, the update of this
    rank's share (``update_s``). ``after_idle``: the exchange starts on an idle link, so
    its first ring collective meets a shaped link's token bucket full; the buckets are
    carried from one collective to the next.
    """
    if n == 1 or not part.transfers:
        return [("cpu", update_s)]
    first = part.transfers[0]
    if first.route in ROOTED_TIMES:
        return _rooted_items(system, n, first, update_s, after_idle)
    items = []
    # each rank's token bucket, carried from collective to collective (and refilled while
    # the update runs)
    tokens = [system.link_of(n).burst_bytes if after_idle else 0.0] * n
    for phase in ("reduce", "distribute"):
        for t in part.transfers:
            if t.phase == phase:
                items += _ring_items(system, t.bounds, t.itemsize, RING_KINDS[t.op],
                                     tokens=tokens)
        if phase == "reduce":
            items.append(("cpu", update_s))
            refill(system, n, tokens, update_s)
    return items


def _rooted_items(system, n, transfer, update_s, after_idle=False):
    """A rooted part: reduce, the root's update, broadcast, each cut into its waits
    (``after_idle``: on shaped links the token buckets start full)."""
    route, itemsize, elems = transfer.route, transfer.itemsize, transfer.length
    if system.rooted and route in system.rooted:    # local: the link fitted on this communicator
        link = system.rooted[route]
        system = dataclasses.replace(system, intra=link, inter=link)
    timing = ROOTED_TIMES[route]
    reduce, bcast = timing(system, n, elems * itemsize, elems, after_idle)
    moved = timing(without_latency(system), n, elems * itemsize, elems, after_idle)
    waits = _rooted_waits(route, n, elems, itemsize)

    peer = [("peer", system.msg_wait_s)] if system.msg_wait_s else []

    def cut(total, copied):
        return ([("msg", max(0.0, total - copied) / waits), ("copy", copied / waits)] + peer) * waits
    return cut(reduce, moved[0]) + [("cpu", update_s)] + cut(bcast, moved[1])


def _rooted_waits(route, n, elems, itemsize):
    """Waits on the critical path of a rooted reduce or broadcast (each may sleep until progressed)."""
    pieces = len(_pieces(elems, itemsize, route, n)) if _rooted_concurrent() else 1
    depth = max(1, math.ceil(math.log2(n + 1)) - 1) if route == "tree" else 1
    return max(1, pieces * depth)
