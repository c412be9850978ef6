"""bench scaling across real nodes, on the 2-node cluster at 1 Gbit/s of
tests/hpc/test_cluster_runs.py (skips without root or SLURM, as there).

* ``--launcher "srun --mpi=pmi2" --nodes 1 2 2x2`` runs every row where it says: each row's
  nodes and topology are those the runs report;
* the bytes a step sends between nodes, as the plan counts them on the run's placement, are
  what ``ringnet.parallel.step_traffic`` says every rank sends where each rank has a node of
  its own, the edges between the nodes where two share one (the ring in node order, the
  hierarchical ring's leaders, the master's star);
* the nodes' links (the kernel's counters on the veth links) carried those bytes, within
  the TCP/IP headers and the runs' set-up;
* a node count the cluster does not have is one line and exit 2, before anything runs.
"""
import json
import sys

from test_cluster_runs import cluster  # noqa: F401

from ringnet.models import build_model
from ringnet.parallel import step_traffic

MODEL = "lenet"
BATCH = 64


def _bench(cluster, *args, timeout=240):
    return cluster.run([sys.executable, "-m", "ringnet.bench", "scaling", "--launcher",
                        "srun --mpi=pmi2", "--model", MODEL, "--batch-size", str(BATCH),
                        *args], timeout=timeout)


def test_scaling_across_nodes_counts_the_bytes_between_them(cluster):
    proc = _bench(cluster, "--nodes", "1", "2", "2x2", "--modes", "ring,master", "--delays", "0",
                  "--topologies", "flat,hierarchical", "--steps", "4", "--repeats", "1", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.splitlines()[-1])["rows"]
    got = {(r["mode"], r["nodes"], r["ranks_per_node"], r["topology"]): r for r in rows}
    assert set(got) == {("single", 1, 1, None), ("ring", 2, 1, "flat"),
                        ("ring", 2, 1, "hierarchical"), ("master", 2, 1, None),
                        ("ring", 2, 2, "flat"), ("ring", 2, 2, "hierarchical"),
                        ("master", 2, 2, None)}, sorted(got)
    model = build_model(MODEL)
    word = model.dtype.itemsize
    params = model.num_params
    every = {m: sum(step_traffic(m, model, 2, BATCH, 0).sent()) for m in ("ring", "master")}
    expected = {
        # one rank per node: everything a rank sends leaves its node
        ("ring", 2, 1, "flat"): every["ring"], ("ring", 2, 1, "hierarchical"): every["ring"],
        ("master", 2, 1, None): every["master"],
        # 2 x 2, ring in node order 0 1 | 2 3: the edges 1->2 and 3->0 cross, each sending
        # everything but one shard in each phase
        ("ring", 2, 2, "flat"): 2 * 2 * (params - params // 4) * word,
        # the leaders' ring over two node regions: each sends the other's region twice
        ("ring", 2, 2, "hierarchical"): 2 * params * word,
        # the master's star: ranks 2 and 3 send their gradient and get the weights
        ("master", 2, 2, None): 2 * 2 * params * word,
    }
    assert got[("single", 1, 1, None)]["inter_node_bytes_per_step"] == 0
    for key, nbytes in expected.items():
        row = got[key]
        assert abs(row["inter_node_bytes_per_step"] - nbytes) <= 8 * word, (key, row, nbytes)
        link = row["link_bytes_per_step"]
        assert link is not None, row
        # the links carried the plan's bytes: TCP/IP headers (~3%) and the set-up over 4 steps
        assert nbytes <= link <= 1.12 * nbytes, (key, link, nbytes)
    assert got[("ring", 2, 2, "hierarchical")]["inter_node_bytes_per_step"] < \
        got[("ring", 2, 2, "flat")]["inter_node_bytes_per_step"]


def test_more_nodes_than_the_cluster_has_is_one_line(cluster):
    too_many = len(cluster.names) + 1
    proc = _bench(cluster, "--nodes", "1", str(too_many), "--steps", "2", "--repeats", "1",
                  timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"reaches {len(cluster.names)} nodes" in lines[0], lines
    assert not proc.stdout.strip()
