"""bench scaling's cluster flags without a cluster: the shapes, the launcher's command lines,
the nodes it reaches, and the bytes a step sends between nodes counted from the plan."""
import json

import pytest

from ringnet import cluster
from ringnet.bench import scaling
from ringnet.errors import UsageError
from ringnet.models import build_model
from ringnet.parallel import step_traffic

from tests.test_docs import _main_output

LENET = build_model("lenet")
P, WORD = LENET.num_params, LENET.dtype.itemsize


def test_shapes_tell_layouts_of_the_same_rank_count_apart():
    a, b = cluster.parse_nodes(["4", "2x2"], 1)
    assert int(a) == int(b) == 4 and a != b and len({a, b}) == 2
    assert (a.nodes, a.per_node, b.nodes, b.per_node) == (4, 1, 2, 2)
    assert cluster.parse_nodes(["2"], 2)[0].per_node == 2
    assert repr(b) == "2x2" and f"{b}" == "4" and json.dumps(b) == "4"
    for bad in ("0", "2x0", "two", "2x"):
        with pytest.raises(UsageError):
            cluster.parse_nodes([bad], 1)


def test_the_launcher_is_given_its_nodes():
    shape = cluster.Shape(2, 2)
    assert cluster.launch_prefix("srun --mpi=pmi2", shape) == [
        "srun", "--mpi=pmi2", "--unbuffered", "--output=0", "-N", "2", "-n", "4", "--ntasks-per-node", "2"]
    assert cluster.launch_prefix("mpirun", shape) == ["mpirun", "-np", "4", "-ppn", "2"]
    assert cluster.launch_prefix("mpirun", 3) == ["mpirun", "-np", "3"]
    assert cluster.placed(4, 1) == cluster.Shape(4, 1) and cluster.placed(1, 2) == cluster.Shape(1, 1)
    with pytest.raises(UsageError):
        cluster.placed(3, 2)


def test_the_nodes_mpirun_reaches_are_its_hosts_file(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("a\nb:2\n# c\n\nd\n")
    assert cluster.available_nodes("mpirun", {"HYDRA_HOST_FILE": str(hosts)}) == 3
    assert cluster.available_nodes(f"mpirun -f {hosts}", {}) == 3
    assert cluster.available_nodes("mpirun", {}) == 1
    # the same reading as the launcher's (ringnet.hosts): hosts on the command line count
    assert cluster.available_nodes("mpirun -hosts a,b -ppn 2", {}) == 2
    with pytest.raises(UsageError, match=f"cannot read the hosts file {tmp_path}/gone"):
        cluster.available_nodes(f"mpirun -f {tmp_path}/gone", {})


def test_bytes_between_nodes_follow_the_placement():
    ring2 = sum(step_traffic("ring", LENET, 2, 64).sent())
    # one rank per node: everything anyone sends leaves its node
    assert cluster.inter_node_bytes("ring", LENET, ["a", "b"], 64) == ring2 == 2 * P * WORD
    assert cluster.inter_node_bytes("tree", LENET, ["a", "b", "c", "d"], 64) == \
        sum(step_traffic("tree", LENET, 4, 64).sent()) == 6 * P * WORD
    # one node: nothing
    assert cluster.inter_node_bytes("master", LENET, ["a"] * 4, 64) == 0
    # 2 x 2 in blocks: the ring (node order) crosses on 2 of its 4 edges; the tree's heap
    # 0 -> 1, 2; 1 -> 3 on 2 of its 3; the master's star on 2 of its 3
    sent = step_traffic("ring", LENET, 4, 64).sent()
    assert cluster.inter_node_bytes("ring", LENET, ["a", "a", "b", "b"], 64) == sent[1] + sent[3]
    assert cluster.inter_node_bytes("tree", LENET, ["a", "a", "b", "b"], 64) == 4 * P * WORD
    assert cluster.inter_node_bytes("master", LENET, ["a", "a", "b", "b"], 64) == 4 * P * WORD
    # cyclic placement: the ring is ordered by node, so it still crosses twice
    assert cluster.inter_node_bytes("ring", LENET, ["a", "b", "a", "b"], 64) == sent[1] + sent[3]
    # hierarchical: the leaders alone cross, the whole exchange up and down once
    assert cluster.inter_node_bytes("ring", LENET, ["a", "a", "b", "b"], 64,
                                    topology="hierarchical") == 2 * P * WORD
    # split-fc: the conv prefix's ring and the activations
    fc = step_traffic("split-fc", LENET, 2, 64)
    assert cluster.inter_node_bytes("split-fc", LENET, ["a", "b"], 64) == sum(fc.sent())


def _fake(args, mode, delay, n, extra=(), **kw):
    nodes = [f"n{i // n.per_node}" for i in range(int(n))]
    plan = cluster.inter_node_bytes(mode, LENET, nodes, 64, delay) if mode != "single" else 0
    asked = extra[1] if extra else "flat"
    return {"step_ms": 100.0 / n, "comm_wait_s": 0.01, "steps": 2, "overlap": 0.5,
            "bytes_per_step": 1000, "fc_params_per_rank": None, "rank_nodes": nodes,
            "topology": f"{asked} (asked for)" if mode in ("ring", "tree") else None,
            "link_bytes": int(2 * 1.03 * plan)}


def test_rows_name_their_nodes_and_bytes_between_them(monkeypatch):
    monkeypatch.setattr(scaling, "run_config", _fake)
    monkeypatch.setattr(cluster, "available_nodes", lambda launcher: 2)
    out = _main_output(scaling.main, ["--launcher", "mpirun", "--nodes", "1", "2", "2x2",
                                      "--modes", "ring", "--delays", "0", "--model", "lenet",
                                      "--repeats", "1", "--json"])
    rows = json.loads(out.strip().splitlines()[-1])["rows"]
    got = {(r["mode"], r["nodes"], r["ranks_per_node"]): r for r in rows}
    assert set(got) == {("single", 1, 1), ("ring", 2, 1), ("ring", 2, 2)}
    assert got[("ring", 2, 1)]["np"] == 2 and got[("ring", 2, 2)]["np"] == 4
    assert got[("ring", 2, 1)]["inter_node_bytes_per_step"] == 2 * P * WORD
    assert got[("ring", 2, 1)]["link_bytes_per_step"] == int(1.03 * 2 * P * WORD)
    assert got[("ring", 2, 2)]["topology"] == "flat"
    md = _main_output(scaling.main, ["--launcher", "mpirun", "--nodes", "1", "2x2", "--modes",
                                     "ring", "--delays", "0", "--repeats", "1", "--markdown"])
    assert "| mode | delay | nodes x ranks | topology | step ms |" in md
    assert "| ring | 0 | 2 x 2 | flat |" in md


def test_a_node_count_the_cluster_lacks_is_refused_before_anything_runs(monkeypatch):
    monkeypatch.setattr(scaling, "run_config", lambda *a, **kw: pytest.fail("ran"))
    monkeypatch.setattr(cluster, "available_nodes", lambda launcher: 2)
    with pytest.raises(UsageError, match=r"--nodes 4x1: 'mpirun' reaches 2 nodes"):
        scaling.main(["--launcher", "mpirun", "--nodes", "1", "4"])
    with pytest.raises(UsageError, match="not found"):
        scaling.main(["--launcher", "no-such-launcher -x", "--nodes", "1"])
    with pytest.raises(UsageError, match="--topologies"):
        scaling.main(["--nodes", "1", "--topologies", "ring"])


def test_the_cluster_figure_is_drawn_from_the_csv_files(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    from ringnet.bench import plot
    monkeypatch.setattr(scaling, "run_config", _fake)
    monkeypatch.setattr(cluster, "available_nodes", lambda launcher: 2)
    table = tmp_path / "lenet-1gbit.csv"
    _main_output(scaling.main, ["--launcher", "mpirun", "--nodes", "1", "2", "2x2", "--modes",
                                "ring,master", "--topologies", "flat,hierarchical", "--repeats",
                                "1", "--csv", str(table)])
    rows = plot.read_cluster_csv(str(table))
    assert {(r["mode"], r["nodes"], r["ranks_per_node"], r["topology"]) for r in rows} >= {
        ("single", 1, 1, ""), ("ring", 2, 2, "hierarchical"), ("master", 2, 2, "")}
    out = tmp_path / "cluster.png"
    assert plot.main(["cluster", str(table), str(table), str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = tmp_path / "plain.csv"
    bad.write_text("mode,delay,np\nring,1,2\n")
    with pytest.raises(UsageError, match="bench scaling --nodes"):
        plot.main(["cluster", str(bad), str(out)])


def test_overlap_runs_each_progress_mode_on_the_nodes(monkeypatch):
    """bench overlap --launcher --nodes: single on one node, every variant on the shape, each
    run with its RINGNET_CPU_PROGRESS set, the header naming the nodes; a shape the launcher
    does not reach and --launcher without --nodes are refused before anything runs."""
    from ringnet.bench import overlap
    monkeypatch.setattr(cluster, "available_nodes", lambda launcher: 4)
    seen = []

    def fake(args, mode, delay, n, **kw):
        seen.append((mode, delay, repr(n), overlap.os.environ.get("RINGNET_CPU_PROGRESS")))
        return {"step_ms": {"driven": 50.0, "poll": 40.0, "block": 80.0}[seen[-1][3]]
                if mode != "single" else 100.0, "comm_wait_s": 0.0, "steps": 2, "overlap": 0.0}
    monkeypatch.setattr(overlap, "run_config", fake)
    out = _main_output(overlap.main, ["--launcher", "mpirun", "--nodes", "2x2", "--modes", "ring",
                                      "--repeats", "1", "--variants",
                                      "1:driven:default,1:poll:default,1:block:default"])
    assert seen == [("single", 0, "1x1", "driven"), ("ring", 1, "2x2", "driven"),
                    ("ring", 1, "2x2", "poll"), ("ring", 1, "2x2", "block")]
    assert "2 nodes x 2 ranks" in out
    rows = {line.split()[2]: line.split() for line in out.splitlines() if line.split()[:1] == ["ring"]}
    assert float(rows["poll"][3]) == 40.0 and float(rows["poll"][4]) == 2.5      # step, speedup
    monkeypatch.setattr(overlap, "run_config", lambda *a, **kw: pytest.fail("ran"))
    with pytest.raises(UsageError, match="--nodes 8x1: 'mpirun' reaches 4 nodes"):
        overlap.main(["--launcher", "mpirun", "--nodes", "8"])
    with pytest.raises(UsageError, match="give --nodes"):
        overlap.main(["--launcher", "mpirun"])
