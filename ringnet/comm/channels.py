"""The multi-channel hierarchical ring: every rank of a node takes part in the exchange
between nodes, as NCCL's and Horovod's hierarchical all-reduces do.

With M nodes of L ranks each, local rank j of every node forms *channel* j (M ranks, one
per node). Channel j's region is the union of its ranks' shards. A reduce-scatter is

1. within each node, a direct reduce-scatter over the L channel regions: every rank sends
   each other local rank its copy of that rank's region at once, and local rank j sums
   the L copies of channel j's region in one pass, in local-rank order ((L-1)/L of the
   buffer sent per rank, on the links within the node; one add where a ring would take
   L-1, each a kernel launch on a GPU);
2. within each channel, a reduce-scatter between the nodes over the channel's M shards:
   each rank holds the global sum of its own shard. All L channels run at once, each on
   its own rank's link; a channel moves (M-1)/M of its region, 1/L of the buffer.

An all-gather is the reverse (between the nodes within each channel, then every rank's
region to the other local ranks at once), so rank r still owns shard r and the ring mode's update stays divided 1/N per rank.

The step between the nodes is the algorithm :func:`ringnet.comm.cost.between_nodes` picks
for the channel's bytes and the node count: the ring (2(M-1) messages) or, where M is a
power of two, recursive halving (reduce-scatter) and doubling (all-gather), 2 log2 M
messages. Each shard's sum is formed once, by its owner, so every rank ends with the same
bits.

Placements where nodes hold different numbers of ranks (3 ranks on 2 nodes, 2 + 1) have
no channels: they run the exchange through one leader per node
(:class:`~ringnet.comm.hierarchical.HierarchicalRingCommunicator`), and :attr:`shape`
says so.
"""
from typing import Any, Optional

from ringnet.backend import get_array_module
from ringnet.comm import cost
from ringnet.comm.hierarchical import HierarchicalRingCommunicator, merged_ranges
from ringnet.comm.schedules import ring_steps

__all__ = ["MultiChannelRingCommunicator", "channels_of", "between_algorithm"]


def channels_of(layout):
    """Return the channels of a node layout (channel j: local rank j of every node, in node
    order), or None when its nodes hold different numbers of ranks."""
    per_node = [layout.ranks_of(i) for i in range(layout.nodes)]
    if len({len(ranks) for ranks in per_node}) != 1:
        return None
    return [[ranks[j] for ranks in per_node] for j in range(len(per_node[0]))]


def between_algorithm(nbytes, per_node, inter=cost.INTER):
    """The algorithm between the nodes for an exchange of ``nbytes`` (the whole buffer) over
    full nodes of ``per_node`` ranks: :func:`ringnet.comm.cost.between_nodes` for one
    channel's share on ``inter``, the (alpha, beta) of a link between nodes."""
    return cost.between_nodes(nbytes / per_node[0], len(per_node), inter)[0]


class MultiChannelRingCommunicator(HierarchicalRingCommunicator):
    """The ring's reduce-scatter, all-gather and all-reduce as a multi-channel hierarchy.

    Same contract as :class:`~ringnet.comm.ring.RingCommunicator` (any bounds, one per rank;
    outside its own shard a rank's buffer is scratch after a reduce-scatter). ``between``:
    "ring" or "rhd" to fix the algorithm between the nodes (default: the cost model's
    choice per call, from the bytes, the node count and ``inter``, the (alpha, beta) of a
    link between nodes). :attr:`shape` names the shape that runs.
    """

    def __init__(self, transport: Any, chunk_bytes=None, pipeline: bool = True,
                 layout: Any = None, between: Optional[str] = None, inter=None):
        super().__init__(transport, chunk_bytes, pipeline, layout)
        nodes = self.layout
        self.channels = channels_of(nodes)
        self.inter = cost.INTER if inter is None else tuple(inter)
        if between not in (None,) + cost.BETWEEN_NODES:
            raise ValueError(f"unknown algorithm between nodes {between!r}: choose "
                             f"{', '.join(cost.BETWEEN_NODES)}")
        if between == "rhd" and self.channels is not None and not cost.is_pow2(nodes.nodes):
            raise ValueError(f"recursive halving between nodes needs a power-of-two node count, "
                             f"got {nodes.nodes} nodes")
        self.between = between
        if self.channels is None:
            counts = "+".join(str(nodes.ranks_on(i)) for i in range(nodes.nodes))
            self.shape = f"one leader per node (uneven placement {counts}: no channels)"
            return
        local = len(self.channels)
        self.local_index = nodes.ranks_of(self.node_index).index(self.rank)
        self.node_peers = nodes.ranks_of(self.node_index)       # the ring within the node
        self.channel = self.channels[self.local_index]           # the ranks between nodes
        self.shape = f"{local} channel{'s' if local > 1 else ''} x {nodes.nodes} nodes"

    def describe(self, nbytes):
        """The shape and, with channels, the algorithm between nodes for ``nbytes``: what
        the run header prints after the topology."""
        if self.channels is None:
            return self.shape
        return f"{self.shape}, {self.between_for(nbytes)} between nodes"

    # -- the algorithm between the nodes ------------------------------------------------
    def between_for(self, nbytes):
        """The algorithm between the nodes for an exchange of ``nbytes`` (the whole buffer)."""
        if self.between is not None:
            return self.between
        return between_algorithm(nbytes, [len(self.channels)] * self.layout.nodes, self.inter)

    # -- the collectives ----------------------------------------------------------------
    def _reduce_scatter(self, buf, op, bounds):
        if self.channels is None:
            return super()._reduce_scatter(buf, op, bounds)
        if self.size > 1:
            regions = [self._ranges(channel, bounds) for channel in self.channels]
            self._direct_reduce(buf, regions)
            shards = [[bounds[r]] for r in self.channel]
            if self.between_for(buf.nbytes) == "rhd":
                self._halving(buf, shards)
            else:
                self._ring(buf, self.channel, self.node_index, shards, reduce=True)
        if op == "mean":
            a, b = bounds[self.rank]
            self._divide(buf[a:b])
        return None

    def _allgather(self, buf, bounds):
        if self.channels is None:
            return super()._allgather(buf, bounds)
        if self.size == 1:
            return None
        shards = [[bounds[r]] for r in self.channel]
        if self.between_for(buf.nbytes) == "rhd":
            self._doubling(buf, shards)
        else:
            self._ring(buf, self.channel, self.node_index, shards, reduce=False)
        regions = [self._ranges(channel, bounds) for channel in self.channels]
        self._direct_gather(buf, regions)
        return None

    # -- the pieces -----------------------------------------------------------------------
    @staticmethod
    def _ranges(ranks, bounds):
        """The element ranges of ``ranks``' shards, in buffer order, adjacent ones merged."""
        return merged_ranges(bounds[r] for r in ranks)

    def _swap(self, buf, out_ranges, to, in_ranges, source, reduce):
        """Send ``buf``'s ``out_ranges`` to rank ``to`` while receiving ``in_ranges`` from
        ``source``, added into them (``reduce``) or copied."""
        out = self._packed(buf, out_ranges, slot=10) if out_ranges else None
        size = sum(b - a for a, b in in_ranges)
        direct = not reduce and len(in_ranges) == 1
        if direct:
            got = buf[in_ranges[0][0]:in_ranges[0][1]]
        else:
            got = self._scratch_for(buf, size, 11) if size else None
        if out is None and got is None:
            return
        self.transport.isendrecv(out, to if out is not None else None,
                                 got, source if got is not None else None).wait()
        if not direct and got is not None:
            self._unpack(buf, in_ranges, got, reduce)

    def _post(self, pairs):
        """Post [(out, to, got, source)] at once and wait for all (one at a time where
        transfers of GPU buffers share a staging buffer)."""
        if pairs and self._one_at_a_time(pairs[0][0] if pairs[0][0] is not None else pairs[0][2]):
            for out, to, got, source in pairs:
                self.transport.isendrecv(out, to, got, source).wait()
            return
        for pending in [self.transport.isendrecv(*pair) for pair in pairs]:
            pending.wait()

    def _direct_reduce(self, buf, regions):
        """Within the node: every local rank's copy of region j to local rank j at once;
        this rank sums the L copies of its own region (local-rank order, one pass)."""
        peers, place = self.node_peers, self.local_index
        count = len(peers)
        if count == 1:
            return
        mine = regions[place]
        size = sum(b - a for a, b in mine)
        stack = self._scratch_for(buf, count * size, slot=12).reshape(count, size)
        pairs = []
        for k in range(1, count):
            to, source = (place + k) % count, (place - k) % count
            out = self._packed(buf, regions[to], slot=20 + k) if regions[to] else None
            got = stack[source] if size else None
            pairs.append((out, peers[to] if out is not None else None,
                          got, peers[source] if got is not None else None))
        pairs = [p for p in pairs if p[0] is not None or p[2] is not None]
        if size:
            at = 0
            for a, b in mine:
                stack[place, at:at + b - a] = buf[a:b]
                at += b - a
        self._post(pairs)
        if not size:
            return
        xp = get_array_module(buf)
        total = self._scratch_for(buf, size, slot=13)
        xp.sum(stack, axis=0, out=total)
        self._unpack(buf, mine, total, reduce=False)

    def _direct_gather(self, buf, regions):
        """Within the node: this rank's region to every other local rank at once, theirs
        into place."""
        peers, place = self.node_peers, self.local_index
        count = len(peers)
        if count == 1:
            return
        out = self._packed(buf, regions[place], slot=10) if regions[place] else None
        pairs, unpack = [], []
        for k in range(1, count):
            to, source = (place + k) % count, (place - k) % count
            ranges = regions[source]
            if len(ranges) == 1:
                got = buf[ranges[0][0]:ranges[0][1]]
            elif ranges:
                got = self._scratch_for(buf, sum(b - a for a, b in ranges), slot=20 + k)
                unpack.append((got, ranges))
            else:
                got = None
            if out is None and got is None:
                continue
            pairs.append((out, peers[to] if out is not None else None,
                          got, peers[source] if got is not None else None))
        self._post(pairs)
        for got, ranges in unpack:
            self._unpack(buf, ranges, got, reduce=False)

    def _ring(self, buf, peers, place, regions, reduce):
        """A ring over ``peers`` (this rank at ``place``) where place i owns ``regions[i]``:
        a reduce-scatter (``reduce``) or an all-gather."""
        count = len(peers)
        if count == 1:
            return
        right, left = peers[(place + 1) % count], peers[(place - 1) % count]
        for out_place, in_place in ring_steps(place, count)[0 if reduce else 1]:
            self._swap(buf, regions[out_place], right, regions[in_place], left, reduce)

    def _halving(self, buf, shards):
        """Recursive halving over the channel (a power of two of nodes): each step keeps the
        half of the current block of places that holds this rank's place, sends the other
        half to the partner across it and adds the partner's copy of the kept half."""
        place, lo, hi = self.node_index, 0, len(self.channel)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            keep, give = ((lo, mid), (mid, hi)) if place < mid else ((mid, hi), (lo, mid))
            partner = self.channel[place + (mid - lo) if place < mid else place - (mid - lo)]
            self._swap(buf, self._places(shards, give), partner, self._places(shards, keep),
                       partner, reduce=True)
            lo, hi = keep

    def _doubling(self, buf, shards):
        """Recursive doubling over the channel: the reverse of :meth:`_halving`, each step
        swapping the block this rank holds for the partner's block next to it."""
        count, place = len(self.channel), self.node_index
        width = 1
        while width < count:
            lo = place - place % width
            block = lo // width
            other = lo + width if block % 2 == 0 else lo - width
            partner = self.channel[place + width if block % 2 == 0 else place - width]
            self._swap(buf, self._places(shards, (lo, lo + width)), partner,
                       self._places(shards, (other, other + width)), partner, reduce=False)
            width *= 2

    @staticmethod
    def _places(shards, span):
        """The merged element ranges of the shards at places ``span`` = [start, stop)."""
        return merged_ranges(r for i in range(*span) for r in shards[i])
