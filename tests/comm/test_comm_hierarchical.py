"""Across nodes without a cluster: node layouts given to the communicators (a fake 2-node
placement of the real MPI world), against closed-form sums.

* the ring is ordered by node: each node's ranks are neighbours whatever the placement,
  and in rank order on one node and with block placement;
* the hierarchical ring's reduce-scatter / all-gather / all-reduce and the hierarchical
  tree's reduce / broadcast give the closed-form result (any bounds, odd lengths, any root);
* ``--topology auto`` picks by the cost model, flat on one node and one rank per node.
The same across real namespaces: tests/hpc/test_cluster_topology.py.
"""
import numpy as np
import pytest
from mpi4py import MPI

from ringnet import comm as ringcomm
from ringnet.comm.cost import exchange_cost
from ringnet.comm.hierarchical import choose_topology
from ringnet.placement import group

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


def fake(pattern, size=SIZE, rank=RANK):
    """A node layout of ``size`` ranks: "cyclic" (rank r on node r mod 2), "block" (first half
    on node a), "one" (one node), "uneven" (rank 0 alone on node a), "four" (rank r on node
    r mod 4)."""
    if pattern == "cyclic":
        names = ["a" if r % 2 == 0 else "b" for r in range(size)]
    elif pattern == "block":
        names = ["a" if r < (size + 1) // 2 else "b" for r in range(size)]
    elif pattern == "uneven":
        names = ["a"] + ["b"] * (size - 1)
    elif pattern == "four":     # rank r on node r mod 4: up to 4 nodes of one rank
        names = ["abcd"[r % 4] for r in range(size)]
    else:
        names = ["a"] * size
    return group(names, names, rank)


def test_ring_order_puts_each_node_together():
    cyclic = fake("cyclic", 4, 0)
    assert cyclic.node_order() == [0, 2, 1, 3]
    assert fake("block", 4, 0).node_order() == [0, 1, 2, 3]
    assert fake("one", 3, 0).node_order() == [0, 1, 2]
    assert fake("cyclic", 5, 0).node_order() == [0, 2, 4, 1, 3]
    assert cyclic.leaders() == [0, 1] and cyclic.leaders(root=3) == [0, 3]


def test_auto_topology_follows_the_cost_model():
    assert choose_topology("ring", 1e6, [4]) == ("flat", "auto: one node")
    assert choose_topology("tree", 1e6, [1, 1, 1]) == ("flat", "auto: one rank per node")
    assert choose_topology("ring", 1e6, [2, 2], "hierarchical") == ("hierarchical", "asked for")
    for route in ("ring", "tree"):
        for nbytes in (1e3, 1e6, 1e8):
            for per_node in ([2, 2], [8, 8], [4, 4, 4, 4]):
                picked, why = choose_topology(route, nbytes, per_node)
                costs = {t: exchange_cost(route, t, nbytes, per_node) for t in ("flat", "hierarchical")}
                assert picked == min(costs, key=lambda t: (costs[t], t != "flat")), (route, nbytes)
                assert why.startswith("auto: modelled")
    # many ranks per node on a slow network: the tree's leaders move far fewer bytes
    assert choose_topology("tree", 1e8, [8, 8])[0] == "hierarchical"
    with pytest.raises(ValueError, match="unknown topology"):
        choose_topology("ring", 1, [1], "star")


def test_inter_link_prices_the_link_between_nodes():
    """--inter-link prices the link between nodes: the choice equals the cheaper of
    exchange_cost with those constants. At 2 nodes x 2 ranks the channel ring sends 2
    messages of a quarter of LeNet's bytes between nodes where the flat ring sends 6, so
    auto takes it on the default 10 Gbit/s Ethernet and on 1 Gbit/s (100 us, 125 MB/s);
    the leader ring of 2 + 1 ranks sends its node's whole gradient and loses to the flat
    ring on the default link."""
    from ringnet.comm.cost import INTER
    from ringnet.comm.hierarchical import parse_inter_link
    from ringnet.models import build_model
    from ringnet.parallel import topology_choice
    assert parse_inter_link("100,125") == pytest.approx((100e-6, 1 / 125e6))
    assert parse_inter_link("40,1250") == pytest.approx(INTER)
    for bad in ("100", "a,b", "1,2,3", "-1,125", "100,0", "nan,5", ""):
        with pytest.raises(ValueError, match="--inter-link"):
            parse_inter_link(bad)
    model, layout = build_model("lenet"), fake("block", 4, 0)
    nbytes = model.num_params * model.dtype.itemsize
    assert topology_choice("ring", model, layout)[0] == "hierarchical"
    uneven = fake("cyclic", 3, 0)
    costs = {t: exchange_cost("ring", t, nbytes, [2, 1]) for t in ("flat", "hierarchical")}
    assert costs["flat"] < costs["hierarchical"]
    assert topology_choice("ring", model, uneven)[0] == "flat"
    picked, why = topology_choice("ring", model, layout, inter_link="100,125")
    slow = (100e-6, 1 / 125e6)
    costs = {t: exchange_cost("ring", t, nbytes, [2, 2], inter=slow) for t in ("flat", "hierarchical")}
    assert picked == "hierarchical" and costs["hierarchical"] < costs["flat"]
    assert f"{1e3 * costs['hierarchical']:.3g} ms against {1e3 * costs['flat']:.3g} ms" in why
    assert topology_choice("ring", model, layout, "flat", inter_link="100,125")[0] == "flat"


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", ["cyclic", "block", "one"])
def test_flat_ring_neighbours_follow_the_nodes(pattern):
    ring = ringcomm.create("ring", transport="mpi", mpi_comm=WORLD, device="cpu",
                           layout=fake(pattern))
    order = fake(pattern).node_order()
    place = order.index(RANK)
    assert ring.right == order[(place + 1) % SIZE] and ring.left == order[(place - 1) % SIZE]
    if pattern != "cyclic" or SIZE < 3:
        assert (ring.right, ring.left) == ((RANK + 1) % SIZE, (RANK - 1) % SIZE)
    else:       # each node's ranks are neighbours: one edge out of each node
        nodes = fake(pattern).rank_node_index
        crossing = sum(nodes[order[p]] != nodes[order[(p + 1) % SIZE]] for p in range(SIZE))
        assert crossing == 2
    _check_ring(ring)


def _values(n, rank, dtype=np.float64):
    return (np.arange(n, dtype=dtype) * (rank + 1) + rank).astype(dtype)


def _check_ring(ring, length=23):
    expected = sum(_values(length, r) for r in range(SIZE))
    buf = _values(length, RANK)
    ring.allreduce(buf)
    assert np.allclose(buf, expected, rtol=1e-12), ring
    # uneven bounds, rank order, an empty shard
    cuts = sorted({0, length, *[(3 * k + 1) % length for k in range(SIZE - 1)]})
    cuts += [length] * (SIZE + 1 - len(cuts))
    bounds = [(cuts[i], cuts[i + 1]) for i in range(SIZE)]
    buf = _values(length, RANK)
    ring.reduce_scatter(buf, op="mean", bounds=bounds)
    a, b = bounds[RANK]
    assert np.allclose(buf[a:b], expected[a:b] / SIZE, rtol=1e-12)
    gathered = np.full(length, -1.0)
    gathered[a:b] = buf[a:b]
    ring.allgather(gathered, bounds=bounds)
    assert np.allclose(gathered, expected / SIZE, rtol=1e-12)


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", ["cyclic", "block", "uneven", "one"])
@pytest.mark.parametrize("length", [1, 23, 1000])
def test_hierarchical_ring_equals_the_sum(pattern, length):
    ring = ringcomm.create("ring", transport="mpi", mpi_comm=WORLD, device="cpu",
                           topology="hierarchical", layout=fake(pattern))
    assert ring.topology == "hierarchical"
    _check_ring(ring, length)
    stream = ring.new_stream()
    try:
        buf = _values(length, RANK, np.float32)
        ring.allreduce(buf, op="mean", stream=stream).wait()
        expected = sum(_values(length, r, np.float32) for r in range(SIZE)) / SIZE
        assert np.allclose(buf, expected, rtol=1e-5)
    finally:
        stream.close()


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", ["cyclic", "block", "uneven"])
@pytest.mark.parametrize("length", [1, 23, 70000])
def test_hierarchical_tree_equals_the_sum(pattern, length):
    tree = ringcomm.create("tree", transport="mpi", mpi_comm=WORLD, device="cpu",
                           topology="hierarchical", layout=fake(pattern), chunk_bytes=4096)
    expected = sum(_values(length, r) for r in range(SIZE))
    for root in sorted({0, SIZE - 1}):
        buf = _values(length, RANK)
        tree.reduce(buf, root=root, op="mean")
        if RANK == root:
            assert np.allclose(buf, expected / SIZE, rtol=1e-12)
        else:       # the rooted contract: a non-root buffer is unchanged
            assert np.array_equal(buf, _values(length, RANK))
        out = buf if RANK == root else np.zeros(length)
        tree.bcast(out, root=root)
        assert np.allclose(out, expected / SIZE, rtol=1e-12)
    buf = _values(length, RANK)
    tree.allreduce(buf)
    assert np.allclose(buf, expected, rtol=1e-12)


@pytest.mark.mpi
def test_hierarchical_tree_family_is_two_levels():
    if SIZE != 4:
        pytest.skip("written for 4 ranks")
    tree = ringcomm.create("tree", transport="mpi", mpi_comm=WORLD, device="cpu",
                           topology="hierarchical", layout=fake("cyclic"))
    # nodes a: ranks 0, 2; b: ranks 1, 3; leaders 0 and 1
    assert tree._family(0) == {0: (None, [2, 1]), 1: (0, [3]), 2: (0, []), 3: (1, [])}[RANK]
    assert tree._family(3) == {0: (3, [2]), 1: (3, []), 2: (0, []), 3: (None, [1, 0])}[RANK]


def test_create_refuses_a_hierarchical_master():
    with pytest.raises(ValueError, match="no hierarchical variant"):
        ringcomm.create("master", transport="mpi", mpi_comm=MPI.COMM_SELF, device="cpu",
                        topology="hierarchical")


# -- the multi-channel hierarchical ring (ringnet.comm.channels) --------------------------------
def _channels_ring(pattern, between=None):
    return ringcomm.create("ring", transport="mpi", mpi_comm=WORLD, device="cpu",
                           topology="hierarchical", layout=fake(pattern), between=between)


def test_channels_follow_the_placement():
    """Channel j is local rank j of every node, in node order; nodes of different sizes
    have none (the leader fall-back)."""
    from ringnet.comm.channels import channels_of
    assert channels_of(fake("block", 4, 0)) == [[0, 2], [1, 3]]
    assert channels_of(fake("cyclic", 4, 0)) == [[0, 1], [2, 3]]
    assert channels_of(fake("cyclic", 6, 0)) == [[0, 1], [2, 3], [4, 5]]
    assert channels_of(fake("uneven", 3, 0)) is None
    assert channels_of(fake("cyclic", 3, 0)) is None        # 2 + 1
    names = [f"n{r // 2}" for r in range(16)]               # 8 nodes of 2
    assert channels_of(group(names, names, 0)) == [list(range(0, 16, 2)), list(range(1, 16, 2))]


@pytest.mark.mpi
@pytest.mark.parametrize("between", [None, "ring", "rhd"])
@pytest.mark.parametrize("pattern", ["cyclic", "block", "uneven", "four"])
@pytest.mark.parametrize("length", [1, 23, 1000])
def test_channel_ring_equals_the_sum(pattern, between, length):
    """Against the closed-form sum: any bounds (uneven, an empty shard), mean and sum, on a
    stream; every rank ends with the same bits; uneven placements say they fall back."""
    from ringnet.comm.channels import channels_of
    layout = fake(pattern)
    even = channels_of(layout) is not None
    if between == "rhd" and even and layout.nodes & (layout.nodes - 1):
        pytest.skip("recursive halving needs a power-of-two node count")
    ring = _channels_ring(pattern, between)
    if not even:
        assert ring.shape.startswith("one leader per node (uneven placement")
    else:
        local = SIZE // layout.nodes
        assert ring.shape == f"{local} channel{'s' if local > 1 else ''} x {layout.nodes} nodes"
    _check_ring(ring, length)
    buf = _values(length, RANK)
    ring.allreduce(buf)
    everyone = WORLD.allgather(buf.tobytes())
    assert all(b == everyone[0] for b in everyone)
    stream = ring.new_stream()
    try:
        buf = _values(length, RANK, np.float32)
        ring.allreduce(buf, op="mean", stream=stream).wait()
        expected = sum(_values(length, r, np.float32) for r in range(SIZE)) / SIZE
        assert np.allclose(buf, expected, rtol=1e-5)
    finally:
        stream.close()


def test_between_nodes_is_log_depth_where_it_can_be():
    """The choice between nodes: the ring and rhd move the same bytes, rhd in 2 log2 M
    messages where M is a power of two; phases sum to the channel's (M-1)/M."""
    from ringnet.comm.cost import between_nodes, between_phases
    link = (10e-6, 1e-9)
    for nodes in (2, 3, 4, 8, 128):
        for algorithm in ("ring", "rhd"):
            if algorithm == "rhd" and nodes & (nodes - 1):
                with pytest.raises(ValueError, match="power-of-two"):
                    between_phases(algorithm, 1e6, nodes)
                continue
            phases = between_phases(algorithm, 1e6, nodes)
            assert sum(b for _, b, _ in phases) == pytest.approx(1e6 * (nodes - 1) / nodes)
            assert len(phases) == (nodes - 1 if algorithm == "ring" else nodes.bit_length() - 1)
    assert between_nodes(1e6, 2, link)[0] == "ring"              # one step either way: a tie
    assert between_nodes(1e6, 3, link)[0] == "ring"
    assert between_nodes(1e3, 128, link)[0] == "rhd"
    ring_s = 2 * 127 * link[0] + 2 * 127 / 128 * 1e3 * link[1] + 127 / 128 * 1e3 * 0.25e-9
    assert between_nodes(1e3, 128, link, share=1.0)[1] < ring_s


@pytest.mark.mpi
def test_channel_ring_sends_each_rank_its_share():
    """Bytes each rank sends, counted by a transport that records them: within the node
    2 (L-1)/L of the buffer, between nodes 2 (M-1)/M of its channel's 1/L; rhd and the ring
    between nodes send the same."""
    if SIZE != 4:
        pytest.skip("written for 2 nodes x 2 ranks")
    sent = {}
    for between in ("ring", "rhd"):
        ring = _channels_ring("block", between)
        counted = {"intra": 0, "inter": 0}
        inner = ring.transport.isendrecv
        nodes = fake("block").rank_node_index

        def counting(out, to, got, source, _inner=inner, _counted=counted):
            if out is not None and to is not None:
                _counted["intra" if nodes[to] == nodes[RANK] else "inter"] += out.nbytes
            return _inner(out, to, got, source)

        ring.transport.isendrecv = counting
        try:
            buf = _values(1000, RANK)
            ring.allreduce(buf)
        finally:
            del ring.transport.isendrecv
        sent[between] = counted
    assert sent["ring"] == sent["rhd"]
    assert sent["ring"]["intra"] == 2 * 500 * 8          # (L-1)/L of 1000 float64, twice
    assert sent["ring"]["inter"] == 2 * 250 * 8          # (M-1)/M of the channel's 500, twice
    # in all, what bench scaling counts on the cluster's links for the hierarchical ring
    # (ringnet.cluster.inter_node_bytes): 2 (M-1) P, as through one leader per node
    assert WORLD.allreduce(sent["ring"]["inter"]) == 2 * (2 - 1) * 1000 * 8
