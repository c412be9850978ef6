"""The exchanges on four nodes of a rank each (4 x 1), on a running cluster of 4 or more
nodes (``hpc/cluster.sh start --nodes 4 --link 1gbit``; skips without one: CI's cluster has
2 nodes):

* ring flat, ring hierarchical (one channel between four nodes) and tree hierarchical train
  to the weights of ``single`` (float64, 1e-9), and the header says the shape that ran;
* ring delay 1 through the channel equals the flat ring's delayed run on one machine up to
  summation order;
* the bytes a step sends between the nodes are what ``ringnet.parallel.step_traffic`` counts
  for 4 ranks (every byte a rank sends leaves its node), and the links carried them.

Run: ``hpc/cluster.sh start --nodes 4 --link 1gbit`` then
``python -m pytest tests/hpc/test_cluster_four_nodes.py``.
"""
import json
import os
import sys

import pytest

from conftest import rel_error
from test_cluster_runs import (BASE, Cluster, cluster_nodes, run_local, script,  # noqa: F401
                               single, weights)

from ringnet.models import build_model
from ringnet.parallel import step_traffic

NODES = 4


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """The cluster of $RINGNET_SLURM_DIR (or the default one) when it has 4+ nodes."""
    status = script("status")
    found = cluster_nodes(status.stdout) if status.returncode == 0 else []
    if len(found) < NODES:
        pytest.skip(f"needs a running cluster of {NODES} nodes (hpc/cluster.sh start --nodes "
                    f"{NODES} --link 1gbit); found {len(found)}")
    state_env = {k: os.environ[k] for k in ("RINGNET_SLURM_DIR", "RINGNET_SLURM_PORT")
                 if k in os.environ}
    return Cluster(state_env, status.stdout, script("env").stdout)


def _srun(four, args, timeout=300):
    return four.run(["srun", "-N", str(NODES), "-n", str(NODES), "--mpi=pmi2", sys.executable,
                     "-m", "ringnet.train", *args], timeout=timeout)


def test_four_nodes_train_as_single_with_each_topology(four, single, tmp_path):
    reference, _ = single
    for mode, topology in (("ring", "flat"), ("ring", "hierarchical"), ("tree", "hierarchical")):
        path = tmp_path / f"{mode}-{topology}.h5"
        proc = _srun(four, BASE + ["--mode", mode, "--delay", "0", "--topology", topology,
                                   "--save", str(path)])
        assert proc.returncode == 0, proc.stderr[-3000:]
        text = proc.stdout + proc.stderr
        assert f"{NODES} nodes" in text and f"topology {topology} (asked for" in text, text[-2000:]
        if (mode, topology) == ("ring", "hierarchical"):
            assert f"1 channel x {NODES} nodes" in text, text[-2000:]
        assert rel_error(weights(path), reference) <= 1e-9, f"{mode} {topology} differs from single"


def test_ring_delay1_through_the_channel_is_the_delayed_recurrence(four, single, tmp_path):
    args = BASE + ["--mode", "ring", "--delay", "1"]
    one_machine, _ = run_local(args + ["--topology", "flat"], tmp_path, "flat-d1", ranks=NODES)
    path = tmp_path / "channel-d1.h5"
    proc = _srun(four, args + ["--topology", "hierarchical", "--save", str(path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = weights(path)
    assert rel_error(got, one_machine) <= 1e-9, "ring delay 1 through the channel differs"
    assert rel_error(got, single[0]) > 1e-6, "delay 1 came out synchronous"


def test_four_nodes_send_the_plan_s_bytes_between_them(four):
    model_name, batch = "lenet", 64
    proc = four.run([sys.executable, "-m", "ringnet.bench", "scaling", "--launcher",
                     "srun --mpi=pmi2", "--model", model_name, "--batch-size", str(batch),
                     "--nodes", "1", str(NODES), "--modes", "ring,tree,master", "--delays", "0",
                     "--topologies", "flat,hierarchical", "--steps", "4", "--repeats", "1",
                     "--json"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.splitlines()[-1])["rows"]
    got = {(r["mode"], r["nodes"], r["topology"]): r for r in rows}
    model = build_model(model_name)
    word = model.dtype.itemsize
    for (mode, nodes, topology), row in got.items():
        if nodes == 1:
            assert row["inter_node_bytes_per_step"] == 0, row
            continue
        # one rank a node: everything a rank sends leaves its node, whatever the topology
        nbytes = sum(step_traffic(mode, model, NODES, batch, 0).sent())
        assert abs(row["inter_node_bytes_per_step"] - nbytes) <= 8 * word * NODES, \
            ((mode, topology), row["inter_node_bytes_per_step"], nbytes)
        link = row["link_bytes_per_step"]
        assert link is not None and nbytes <= link <= 1.12 * nbytes, ((mode, topology), link, nbytes)
    assert {(m, t) for m, n, t in got if n == NODES} == {
        ("ring", "flat"), ("ring", "hierarchical"), ("tree", "flat"), ("tree", "hierarchical"),
        ("master", None)}, sorted(got)
