"""Timing rule of the hierarchical exchanges (``--topology hierarchical``), where the ranks
span nodes: the node-local phases on the intra-node link, the phases between nodes on the
inter-node one.

The model places ranks in blocks of ``ranks_per_node`` (L per node, M nodes). As the code
runs them:

* ring, every node full (:mod:`ringnet.comm.channels`): the direct reduce-scatter within
  the node, L-1 messages of a channel region (1/L of the gradient) and one add of the L
  copies; the channel's reduce-scatter
  between the nodes in the steps of :func:`ringnet.comm.cost.between_phases` for the
  algorithm :func:`ringnet.comm.cost.between_nodes` picks (the same call the communicator
  makes), each with its add; the update of one shard; the same steps back without adds,
  and the region to the node's other ranks.
  The L channels run at once, each on its rank's own link (``links_per_node`` None) or
  sharing the node's links.
* ring, a node part-full: the leader receives the L-1 other gradients at once (one wait,
  (L-1) P bytes on its link) and adds them; M-1 lockstep steps of a node region (its L
  shards) between the leaders, each with its add; each rank's shard back from its leader;
  the update of one shard; the shards to the leader; M-1 steps of the leaders' all-gather;
  the whole weights to the node's ranks at once.
* tree: the node reduce as above, then the tree's heap over the M leaders (the flat tree's
  rule with every hop between nodes); the root updates all P; the broadcast down the heap,
  then to each node's ranks at once.
"""
import dataclasses
import math

from ringnet.perfmodel.exchange import message_time, tree_time, without_latency
from ringnet.comm.cost import between_nodes, between_phases

__all__ = ["HIERARCHICAL_MODES", "spans_nodes", "hierarchical_items", "between_choice"]

# (mode, delay) rows the hierarchical tables print: the modes with a hierarchical exchange
HIERARCHICAL_MODES = (("ring", 1), ("ring", 0), ("tree", 0))


def spans_nodes(system, n):
    """True when N ranks fill more than one node and some node holds more than one: only
    there is the hierarchical exchange different from the flat one."""
    return system.ranks_per_node > 1 and n > system.ranks_per_node


def _node_of(system, n):
    local = min(n, system.ranks_per_node)
    return local, math.ceil(n / local)


def _channel_link(system):
    """The link one channel sees between nodes: the rank's own, or a share of the node's."""
    local = system.ranks_per_node
    links = getattr(system, "links_per_node", None)
    share = local / min(local, links) if links else 1.0
    if share == 1.0:
        return system.inter
    return dataclasses.replace(system.inter, beta_Bps=system.inter.beta_Bps / share)


def between_choice(system, n, region_bytes):
    """(algorithm, seconds) between the nodes for a channel's ``region_bytes``: the cost
    model's choice (:func:`ringnet.comm.cost.between_nodes`) on the channel's link."""
    local, nodes = _node_of(system, n)
    link = _channel_link(system)
    return between_nodes(region_bytes, nodes, (link.alpha_s, 1.0 / link.beta_Bps))


def _channel_items(system, n, transfers, update_s):
    reduce = next(t for t in transfers if t.phase == "reduce")
    bounds, itemsize = reduce.bounds, reduce.itemsize
    local, nodes = _node_of(system, n)
    sizes = [b - a for a, b in bounds]
    region = max(sum(sizes[j::local]) for j in range(local))
    peer, cp = system.msg_wait_s, system.compute
    link = _channel_link(system)
    algorithm, _ = between_choice(system, n, region * itemsize)
    phases = between_phases(algorithm, region * itemsize, nodes)
    items = []
    for _ in range(local - 1):          # the direct reduce-scatter: one message per peer
        items += message_time(system.intra, region * itemsize, peer)
    if local > 1:
        items.append(("cpu", cp.add((local - 1) * region)))    # one pass over the L copies
    for _, nbytes, added in phases:
        items += message_time(link, nbytes, peer)
        items.append(("cpu", cp.add(added / itemsize)))
    items.append(("cpu", update_s))
    for _, nbytes, _ in reversed(phases):
        items += message_time(link, nbytes, peer)
    for _ in range(local - 1):
        items += message_time(system.intra, region * itemsize, peer)
    return items


def _ring_items(system, n, transfers, update_s):
    local, nodes = _node_of(system, n)
    if local * nodes == n:
        return _channel_items(system, n, transfers, update_s)
    reduce = next(t for t in transfers if t.phase == "reduce")
    bounds, itemsize = reduce.bounds, reduce.itemsize
    local, nodes = _node_of(system, n)
    sizes = [b - a for a, b in bounds]
    elems, shard = sum(sizes), max(sizes)
    region = max(sum(sizes[j * local:(j + 1) * local]) for j in range(nodes))
    peer, cp = system.msg_wait_s, system.compute
    items = message_time(system.intra, (local - 1) * elems * itemsize, peer)
    items.append(("cpu", (local - 1) * cp.add(elems)))
    for _ in range(nodes - 1):
        items += message_time(system.inter, region * itemsize, peer)
        items.append(("cpu", cp.add(region)))
    items += message_time(system.intra, (local - 1) * shard * itemsize, peer)
    items.append(("cpu", update_s))
    items += message_time(system.intra, (local - 1) * shard * itemsize, peer)
    for _ in range(nodes - 1):
        items += message_time(system.inter, region * itemsize, peer)
    items += message_time(system.intra, (local - 1) * elems * itemsize, peer)
    return items


def _tree_items(system, n, transfers, update_s):
    reduce = transfers[0]
    elems, itemsize = reduce.length, reduce.itemsize
    nbytes = elems * itemsize
    local, nodes = _node_of(system, n)
    peer, cp = system.msg_wait_s, system.compute
    leaders = dataclasses.replace(system, intra=system.inter, ranks_per_node=1)
    up, down = tree_time(leaders, nodes, nbytes, elems)
    moved_up, moved_down = tree_time(without_latency(leaders), nodes, nbytes, elems)

    def between(total, copied):
        return [("msg", max(0.0, total - copied)), ("copy", copied)] + ([("peer", peer)] if peer else [])

    items = message_time(system.intra, (local - 1) * nbytes, peer)
    items.append(("cpu", (local - 1) * cp.add(elems)))
    items += between(up, moved_up) + [("cpu", update_s)] + between(down, moved_down)
    return items + message_time(system.intra, (local - 1) * nbytes, peer)


def hierarchical_items(system, n, part, update_s, after_idle=False):
    """The hierarchical exchange of one part of the plan (a :class:`~ringnet.parallel.traffic.Part`)
    as the stream runs it, in the kinds of :func:`~ringnet.perfmodel.exchange.flat_items`
    (``after_idle`` is not modelled here: a token bucket's burst is left out)."""
    if n == 1 or not part.transfers:
        return [("cpu", update_s)]
    if part.transfers[0].route == "tree":
        return _tree_items(system, n, part.transfers, update_s)
    return _ring_items(system, n, part.transfers, update_s)
