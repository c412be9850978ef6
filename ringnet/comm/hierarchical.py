"""Hierarchical exchanges across nodes through one leader per node, and ``--topology auto``.

The ring mode's hierarchical exchange is the multi-channel one of :mod:`ringnet.comm.channels`
wherever every node holds the same number of ranks; these are its fall-back and the tree's.

* :class:`HierarchicalRingCommunicator` (ring mode, nodes of different sizes): a reduce-scatter is a reduce of the
  whole buffer to the node's leader (its lowest rank: buffer + the node's other ranks, in
  rank order), a ring reduce-scatter between the leaders over the node regions (a node's
  region: its ranks' shards), and each rank's shard from its leader; an all-gather is the
  reverse (shards to the leader, leader ring all-gather, the whole buffer to the node's
  ranks). Rank r still owns shard r: update work stays divided 1/N per rank.
* :class:`HierarchicalTreeCommunicator` (tree mode): a two-level tree. A rank's parent is
  its node's leader; a leader sums its buffer, its node's ranks (rank order) and its child
  leaders (a binary heap over the leaders, the root's node first) and passes the sum up;
  the broadcast runs down the same tree.

:func:`choose_topology` is ``--topology auto``: the alpha-beta cost
(:func:`ringnet.comm.cost.exchange_cost`, with :data:`~ringnet.comm.cost.INTRA` links within
a node and :data:`~ringnet.comm.cost.INTER` between nodes) of the flat and the hierarchical
exchange of the model's bytes over the placement; flat on one node and with one rank per node, where the two are the same exchange.
"""
import math
from typing import Any, Dict, List, Tuple

from ringnet.comm.base import pipeline_pieces
from ringnet.comm.cost import exchange_cost
from ringnet.comm.ring import RingCommunicator
from ringnet.comm.schedules import ring_steps
from ringnet.comm.tree import TreeCommunicator

__all__ = ["HierarchicalRingCommunicator", "HierarchicalTreeCommunicator", "TOPOLOGIES",
           "choose_topology", "parse_inter_link", "merged_ranges"]

TOPOLOGIES = ("auto", "flat", "hierarchical")


def parse_inter_link(text: str) -> Tuple[float, float]:
    """Return the (alpha s per message, beta s per byte) of ``--inter-link US,MB/S`` (e.g.
    ``100,125`` for 1 Gbit/s with 100 us per message); ValueError naming what is wrong."""
    parts = str(text).split(",")
    try:
        if len(parts) != 2:
            raise ValueError
        micros, mbytes = float(parts[0]), float(parts[1])
    except ValueError:
        raise ValueError(f"--inter-link takes microseconds per message and MB/s, e.g. "
                         f"100,125; got {text!r}") from None
    if not (math.isfinite(micros) and math.isfinite(mbytes)) or micros < 0 or mbytes <= 0:
        raise ValueError(f"--inter-link {text}: the microseconds must be >= 0 and the MB/s > 0")
    return micros * 1e-6, 1.0 / (mbytes * 1e6)


def merged_ranges(ranges):
    """``ranges`` ((start, stop) element ranges) in buffer order, empty ones dropped and
    adjacent ones merged."""
    merged = []
    for a, b in sorted(ranges):
        if b <= a:
            continue
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return merged


class HierarchicalRingCommunicator(RingCommunicator):
    """The ring's reduce-scatter, all-gather and all-reduce through one leader per node.

    Same contract as :class:`~ringnet.comm.ring.RingCommunicator` (any bounds, one per
    rank; outside its own shard a rank's buffer is scratch after a reduce-scatter).
    """

    topology = "hierarchical"

    def __init__(self, transport: Any, chunk_bytes=None, pipeline: bool = True,
                 layout: Any = None):
        super().__init__(transport, chunk_bytes, pipeline, layout)
        nodes = self.layout
        self.node_index = nodes.rank_node_index[self.rank]
        self.node_ranks = [nodes.ranks_of(i) for i in range(nodes.nodes)]
        self.leaders = nodes.leaders()
        self.leader = self.leaders[self.node_index]
        self.members = [r for r in self.node_ranks[self.node_index] if r != self.leader]
        count = len(self.leaders)
        self.leader_right = self.leaders[(self.node_index + 1) % count]
        self.leader_left = self.leaders[(self.node_index - 1) % count]

    def _reduce_scatter(self, buf, op, bounds):
        transport = self.transport
        if self.size > 1:
            if self.rank == self.leader:
                self._gather_sum(buf, self.members, None)      # the node's sum, in rank order
                self._leader_steps(buf, bounds, reduce=True)
                sends = [transport.isendrecv(buf[a:b], r, None, None)
                         for r in self.members for a, b in [bounds[r]] if b > a]
                for pending in sends:
                    pending.wait()
            else:
                self._gather_sum(buf, [], self.leader)
                a, b = bounds[self.rank]
                if b > a:
                    transport.isendrecv(None, None, buf[a:b], self.leader).wait()
        if op == "mean":
            a, b = bounds[self.rank]
            self._divide(buf[a:b])

    def _allgather(self, buf, bounds):
        if self.size == 1:
            return
        transport = self.transport
        if self.rank == self.leader:
            arriving = [transport.isendrecv(None, None, buf[a:b], r)
                        for r in self.members for a, b in [bounds[r]] if b > a]
            for pending in arriving:
                pending.wait()
            self._leader_steps(buf, bounds, reduce=False)
            self._relay(buf, None, self.members)
        else:
            a, b = bounds[self.rank]
            if b > a:
                transport.isendrecv(buf[a:b], self.leader, None, None).wait()
            self._relay(buf, self.leader, [])

    def _region(self, node, bounds):
        """The element ranges of ``node``'s shards, adjacent ones merged."""
        return merged_ranges(bounds[r] for r in self.node_ranks[node])

    def _unpack(self, buf, ranges, got, reduce):
        """``got`` (the ``ranges`` of ``buf`` packed end to end) added into them (``reduce``)
        or copied there."""
        at = 0
        for a, b in ranges:
            if reduce:
                self._add_from(buf[a:b], got[at:at + b - a])
            else:
                buf[a:b] = got[at:at + b - a]
            at += b - a

    def _leader_steps(self, buf, bounds, reduce):
        """The ring between the leaders over the node regions: a reduce-scatter (``reduce``,
        each received region added) or an all-gather (each received region copied)."""
        count = len(self.leaders)
        if count == 1:
            return
        steps = ring_steps(self.node_index, count)[0 if reduce else 1]
        for out_node, in_node in steps:
            out_ranges, in_ranges = self._region(out_node, bounds), self._region(in_node, bounds)
            out = self._packed(buf, out_ranges, slot=10)
            size = sum(b - a for a, b in in_ranges)
            direct = not reduce and len(in_ranges) == 1
            got = buf[in_ranges[0][0]:in_ranges[0][1]] if direct else self._scratch_for(buf, size, 11)
            self.transport.isendrecv(out, self.leader_right, got, self.leader_left).wait()
            if not direct:
                self._unpack(buf, in_ranges, got, reduce)

    def _packed(self, buf, ranges, slot):
        """``buf``'s ``ranges`` as one contiguous array (a view when there is one range)."""
        if len(ranges) == 1:
            return buf[ranges[0][0]:ranges[0][1]]
        out = self._scratch_for(buf, sum(b - a for a, b in ranges), slot)
        at = 0
        for a, b in ranges:
            out[at:at + b - a] = buf[a:b]
            at += b - a
        return out


class HierarchicalTreeCommunicator(TreeCommunicator):
    """The tree's reduce and broadcast as a two-level tree: node ranks -> leader, leaders' heap."""

    topology = "hierarchical"

    def _family(self, root):
        """(parent, children) of this rank in the two-level tree rooted at ``root``."""
        nodes = self.layout
        leaders = nodes.leaders(root)
        root_node = nodes.rank_node_index[root]
        heap = [root_node] + [i for i in range(nodes.nodes) if i != root_node]
        mine = nodes.rank_node_index[self.rank]
        leader = leaders[mine]
        if self.rank != leader:
            return leader, []
        v = heap.index(mine)
        parent = None if v == 0 else leaders[heap[(v - 1) // 2]]
        members = [r for r in nodes.ranks_of(mine) if r != leader]
        kids = [leaders[heap[c]] for c in (2 * v + 1, 2 * v + 2) if c < len(heap)]
        return parent, members + kids

    def _pieces(self, buf):
        """Pipeline pieces where some leader passes on what it receives (a node of more than
        one rank below the root's, or a leader heap with inner leaders); else whole."""
        if self.chunk_bytes is None and not self._forwards_here():
            return [(0, buf.size)] if buf.size else []
        return pipeline_pieces(buf.size, buf.itemsize, self.chunk_bytes)

    def _forwards_here(self):
        nodes = self.layout
        return nodes.nodes >= 4 or (nodes.nodes >= 2 and any(
            nodes.ranks_on(i) > 1 for i in range(nodes.nodes) if i != nodes.rank_node_index[0]))


# -- --topology auto ----------------------------------------------------------------------
def choose_topology(route: str, nbytes: float, per_node: List[int], asked: str = "auto",
                    **links) -> Tuple[str, str]:
    """Return (topology, why) for ``--topology asked`` of an exchange of ``nbytes`` on
    ``route`` over nodes of ``per_node`` ranks: auto takes the cheaper of :func:`exchange_cost`
    (flat on one node, with one rank per node, and on a tie)."""
    if asked not in TOPOLOGIES:
        raise ValueError(f"unknown topology {asked!r}: choose {', '.join(TOPOLOGIES)}")
    if asked != "auto":
        return asked, "asked for"
    if len(per_node) == 1:
        return "flat", "auto: one node"
    if len(per_node) == sum(per_node):
        return "flat", "auto: one rank per node"
    costs: Dict[str, float] = {t: exchange_cost(route, t, nbytes, per_node, **links)
                               for t in ("flat", "hierarchical")}
    pick = "hierarchical" if costs["hierarchical"] < costs["flat"] else "flat"
    return pick, (f"auto: modelled {1e3 * costs[pick]:.3g} ms against "
                  f"{1e3 * costs['flat' if pick != 'flat' else 'hierarchical']:.3g} ms "
                  f"for {_size(nbytes)} over {len(per_node)} nodes")


def _size(nbytes):
    for unit, scale in (("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{int(nbytes)} B"
