"""The ring and the tree across real nodes placed cyclically (``srun --distribution=cyclic``:
ranks 0, 2 on the first node, 1, 3 on the second), on the 2-node cluster of
tests/hpc/test_cluster_runs.py (skips without root or SLURM, as there).

* the ring is ordered by node (0, 2, 1, 3): each rank's neighbours, from the real layout;
* ring flat, ring hierarchical and tree hierarchical train to the weights of ``single``
  (float64, 1e-9), and the header says which topology ran; so does ``--topology auto``
  told the links' measured speed (``--inter-link``), which then takes hierarchical;
* ring delay 1 through the channels (2 x 2, block) equals the flat ring's delayed run on
  one node up to summation order, and is not the synchronous run;
* one rank a node (2 x 1): the hierarchical ring (one channel) and tree equal ``single``;
* an uneven placement, 2 + 1 ranks (``srun -N 2 -n 3``): the hierarchical ring falls back to
  one leader per node and says so, and it and the hierarchical tree train to ``single``'s
  weights at the same global batch.
"""
import json
import sys

from conftest import rel_error
from test_cluster_runs import (BASE, RANKS_PER_NODE, cluster, run_local, single,  # noqa: F401
                               weights)

def _srun_cyclic(cluster, command, timeout=240):
    return cluster.run(["srun", "-N", "2", "--ntasks-per-node", str(RANKS_PER_NODE), "--mpi=pmi2",
                        "--distribution=cyclic", sys.executable, *command], timeout=timeout)


def test_cyclic_placement_trains_as_single_with_each_topology(cluster, single, tmp_path):
    reference, _ = single
    for mode, topology in (("ring", "flat"), ("ring", "hierarchical"), ("tree", "hierarchical")):
        path = tmp_path / f"{mode}-{topology}.h5"
        proc = _srun_cyclic(cluster, ["-m", "ringnet.train", *BASE, "--mode", mode, "--delay", "0",
                                      "--topology", topology, "--save", str(path)])
        assert proc.returncode == 0, proc.stderr[-3000:]
        text = proc.stdout + proc.stderr
        assert f"topology {topology} (asked for" in text, text[-2000:]
        if (mode, topology) == ("ring", "hierarchical"):
            assert "2 channels x 2 nodes, ring between nodes" in text, text[-2000:]
        assert rel_error(weights(path), reference) <= 1e-9, f"{mode} {topology} differs from single"
    # auto told the cluster's 1 Gbit/s link (as bench model --calibrate measured it) takes
    # the hierarchical ring, which the default 10 Gbit/s pricing does not
    path = tmp_path / "ring-auto.h5"
    proc = _srun_cyclic(cluster, ["-m", "ringnet.train", *BASE, "--mode", "ring", "--delay", "0",
                                  "--inter-link", "142,117.8", "--save", str(path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "topology hierarchical (auto: modelled" in proc.stdout + proc.stderr, proc.stderr[-2000:]
    assert rel_error(weights(path), reference) <= 1e-9, "ring auto differs from single"


NEIGHBOURS = """
import json
from mpi4py import MPI
from ringnet import comm
ring = comm.create("ring", transport="mpi", device="cpu")
print(json.dumps({"rank": ring.rank, "order": ring.order, "left": ring.left, "right": ring.right,
                  "node": MPI.Get_processor_name()}))
"""


def test_cyclic_ring_is_ordered_by_node(cluster):
    proc = _srun_cyclic(cluster, ["-c", NEIGHBOURS])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = sorted((json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")),
                  key=lambda r: r["rank"])
    assert [r["node"] for r in rows] == [cluster.names[0], cluster.names[1]] * 2
    assert all(r["order"] == [0, 2, 1, 3] for r in rows)
    assert [(r["left"], r["right"]) for r in rows] == [(3, 2), (2, 3), (0, 1), (1, 0)]


def _hierarchical_as_single(cluster, ranks, args, reference, tmp_path, shape, ring_says):
    """Ring and tree, hierarchical, on 2 nodes and ``ranks`` ranks: the header names the
    shape (and the ring's exchange, ``ring_says``); the weights are ``reference``'s."""
    for mode in ("ring", "tree"):
        path = tmp_path / f"{mode}.h5"
        proc = cluster.run(["srun", "-N", "2", "-n", str(ranks), "--mpi=pmi2", sys.executable,
                            "-m", "ringnet.train", *args, "--mode", mode, "--delay", "0",
                            "--topology", "hierarchical", "--save", str(path)], timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        text = proc.stdout + proc.stderr
        assert "2 nodes" in text and f"{ranks} rank(s)" in text, text[-2000:]
        assert "topology hierarchical (asked for" in text, text[-2000:]
        if mode == "ring":
            assert ring_says in text, text[-2000:]
        assert rel_error(weights(path), reference) <= 1e-9, f"{mode} on {shape} differs from single"


def test_uneven_placement_trains_as_single(cluster, tmp_path):
    """3 ranks on 2 nodes (2 + 1): the channels need the same ranks on every node, so the
    hierarchical ring runs one leader per node, as its header says; it and the tree equal
    single at a batch the 3 ranks split evenly."""
    args = [*BASE, "--batch-size", "48"]
    reference, _ = run_local(args + ["--mode", "single"], tmp_path, "single48")
    _hierarchical_as_single(cluster, 3, args, reference, tmp_path, "2 + 1",
                            "one leader per node (uneven placement")


def test_ring_delay1_through_the_channels_is_the_delayed_recurrence(cluster, single, tmp_path):
    """Delay 1 over the whole hierarchical exchange (2 x 2, block placement: the channels):
    the same delayed recurrence as the flat ring on one node, whose weights it equals up to
    the channels' summation order (float64, 1e-9), and not the synchronous run's."""
    args = BASE + ["--mode", "ring", "--delay", "1"]
    one_node, _ = run_local(args + ["--topology", "flat"], tmp_path, "flat-d1", ranks=4)
    path = tmp_path / "channels-d1.h5"
    proc = cluster.run(["srun", "-N", "2", "--ntasks-per-node", str(RANKS_PER_NODE), "--mpi=pmi2",
                        sys.executable, "-m", "ringnet.train", *args, "--topology", "hierarchical",
                        "--save", str(path)], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 channels x 2 nodes" in proc.stdout + proc.stderr, proc.stderr[-2000:]
    channels = weights(path)
    assert rel_error(channels, one_node) <= 1e-9, "ring delay 1 through the channels differs"
    reference, _ = single
    assert rel_error(channels, reference) > 1e-6, "delay 1 came out synchronous"


def test_one_rank_a_node_trains_as_single_hierarchically(cluster, single, tmp_path):
    """2 x 1: a channel of one rank a node (the ring) and the leaders' tree train to the
    weights of ``single``."""
    _hierarchical_as_single(cluster, 2, BASE, single[0], tmp_path, "2 x 1", "1 channel x 2 nodes")
