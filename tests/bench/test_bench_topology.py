"""bench model's hierarchical topology: its timing rule against sums written out by hand for
links with round numbers, and where it is printed.

* ring and tree: node-local phases on the intra-node link, the leaders' on the inter-node one;
* the hierarchical prediction equals the flat one where the ranks fill one node;
* the tables print the hierarchical rows only where the ranks span nodes, after the
  flat tables (which stay as they were).
"""
import dataclasses

import pytest

from ringnet.bench import model as pm
from ringnet.bench.model import cli
from ringnet.bench.model.prediction import predict
from ringnet.bench.model.topology import hierarchical_items, spans_nodes
from ringnet.models import build_model
from ringnet.parallel.traffic import Part, Transfer
from ringnet.shards import shard_bounds

INTRA, INTER = pm.Link("intra", 1e-3, 1e9), pm.Link("inter", 1e-2, 1e8)


def _system(ranks_per_node):
    compute = pm.roofline_compute("k40", ("lenet",))
    compute.add_s_per_elem, compute.add_s_per_call = 0.0, 0.0
    compute.update_s_per_param, compute.update_s_per_call = 0.0, 0.0
    return pm.System("test", INTRA, INTER, ranks_per_node, compute)


def _part(route, elems, n):
    if route == "ring":
        bounds = shard_bounds(elems, n)
        return Part(0, elems, elems // n, [
            Transfer("reduce", "gradients", "reduce_scatter", "ring", bounds, 4),
            Transfer("distribute", "weights", "allgather", "ring", bounds, 4)])
    return Part(0, elems, elems, [
        Transfer("reduce", "gradients", "reduce", "tree", [(0, elems)], 4),
        Transfer("distribute", "weights", "bcast", "tree", [(0, elems)], 4)])


def _seconds(items, kinds=("msg", "copy")):
    return sum(t for kind, t in items if kind in kinds)


def test_hierarchical_ring_by_hand():
    # 8 ranks, 4 per node: 2 nodes; 8000 elements of 4 bytes, shards of 1000
    items = hierarchical_items(_system(4), 8, _part("ring", 8000, 8), update_s=0.0)
    node_reduce = 1e-3 + 3 * 32000 / 1e9           # 3 gradients into the leader at once
    shard_back = 1e-3 + 3 * 4000 / 1e9              # 3 shards out of (or into) the leader
    leaders = 1e-2 + 4 * 4000 / 1e8                 # one step of a 4-shard region between nodes
    expected = 2 * node_reduce + 2 * shard_back + 2 * leaders
    assert _seconds(items) == pytest.approx(expected, rel=1e-12)


def test_hierarchical_tree_by_hand():
    # 8 ranks, 4 per node: the leaders' heap is one parent and one child, over the inter link
    system = dataclasses.replace(_system(4))
    items = hierarchical_items(system, 8, _part("tree", 8000, 8), update_s=0.0)
    node = 1e-3 + 3 * 32000 / 1e9
    leaders = 1e-2 + 32000 / 1e8
    assert _seconds(items) == pytest.approx(2 * node + 2 * leaders, rel=1e-9)


@pytest.mark.parametrize("mode, delay", [("ring", 1), ("ring", 0), ("tree", 0)])
def test_one_node_predicts_the_flat_step(mode, delay):
    system, lenet = _system(8), build_model("lenet")
    assert not spans_nodes(system, 8) and spans_nodes(system, 16)
    assert not spans_nodes(_system(1), 16)          # one rank per node: the same exchange
    assert predict(system, lenet, mode, delay, 8, 512, "hierarchical") == \
        predict(system, lenet, mode, delay, 8, 512)
    assert predict(system, lenet, mode, delay, 16, 1024, "hierarchical") != \
        predict(system, lenet, mode, delay, 16, 1024)


def test_tables_print_hierarchical_rows_only_where_ranks_span_nodes(capsys):
    args = ["--compute", "k40", "--models", "lenet", "--profile", "pcie3/eth-10g"]
    cli.main(args + ["--np", "1", "2", "4", "8"])
    one_node = capsys.readouterr().out
    assert "hierarchical topology" not in one_node
    cli.main(args + ["--np", "1", "2", "4", "8", "16"])
    spanning = capsys.readouterr().out
    flat, _, hierarchical = spanning.partition("hierarchical topology")
    assert "ring d1 hier" in hierarchical and "tree d0 hier" in hierarchical
    rows = [line.split()[0] for line in hierarchical.splitlines()[1:] if line.strip()[:1].isdigit()]
    assert rows == ["16"]
    cli.main(args + ["--np", "1", "2", "4", "8", "16", "--markdown", "--table", "hierarchical"])
    markdown = capsys.readouterr().out
    assert "ring d1 hierarchical (step, efficiency)" in markdown and "x flat)" in markdown
    cli.main(args + ["--np", "1", "2", "4", "8", "16", "--markdown"])
    assert "hierarchical" not in capsys.readouterr().out      # the predictions table as it was
