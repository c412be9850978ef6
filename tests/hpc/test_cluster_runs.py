"""ringnet across nodes: a 2-node cluster of network namespaces (``hpc/cluster.sh start
--nodes 2 --link 1gbit``) with one slurmd per node, 2 ranks per node.

* every mode ends as on one node: the synchronous ones (ring delay 0, tree, master,
  split-fc) equal the single-process run (float64, within 1e-9), ring delay 1 equals the
  same run of 4 ranks on one node, weight for weight;
* the placement (nodes, each rank's node and node-local rank) is what SLURM says it placed,
  in block and cyclic order, and the run header names it, the MPI path and the progress;
* ``mpirun`` across the nodes (hydra through the cluster's launcher) and ``sbatch -N 2
  hpc/train.sbatch`` run the same job;
* a link taken down in training ends the job within its deadline with one line naming the
  unreachable ranks and their node.

The cluster is one that runs in ``$RINGNET_SLURM_DIR`` with 2 or more nodes, or else one
these tests start (and stop) themselves in a temporary folder; that needs root and
Debian's SLURM packages, and the tests skip saying which is missing.
"""
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from conftest import launcher_free_env, rel_error

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER = os.path.join(ROOT, "hpc", "cluster.sh")
RANKS_PER_NODE = 2
# float64 so that a different summation order shows only as rounding (1e-9 relative)
BASE = ["--model", "digits", "--dataset", "digits", "--dtype", "float64", "--steps", "6",
        "--batch-size", "32", "--seed", "5", "--no-eval", "--no-progress", "--json",
        "--warmup-steps", "0"]
# what the cluster's environment sets and a run on one node must not have
CLUSTER_VARS = ("SLURM_", "MPIR_CVAR_", "FI_", "UCX_", "HYDRA_")
TOOLS = ("munged", "slurmctld", "slurmd", "sinfo", "srun", "sbatch", "ip", "tc", "nsenter",
         "unshare")


def parse_env(text):
    """{name: value} of the `export A=B C=D` lines `hpc/cluster.sh env` prints."""
    found = {}
    for line in text.splitlines():
        words = shlex.split(line)
        if words[:1] == ["export"]:
            for word in words[1:]:
                name, _, value = word.partition("=")
                found[name] = value
    return found


def cluster_nodes(status_text):
    """[(name, address)] of the nodes `hpc/cluster.sh status` lists."""
    return re.findall(r"^node (\S+): address (\S+),", status_text, re.M)


def script(*args, env=None, timeout=120):
    return subprocess.run(["bash", CLUSTER, *args], capture_output=True, text=True,
                          env=env or os.environ, timeout=timeout)


def listening_ports():
    ports = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        ports |= {int(r.split()[1].rsplit(":", 1)[1], 16) for r in rows if r.split()[3] == "0A"}
    return ports


def free_settings():
    """(port, subnet, prefix) no other cluster on this machine uses."""
    rng = random.Random()
    taken = listening_ports()
    port = next(p for p in rng.sample(range(20000, 30000, 2), 500)
                if p not in taken and p + 1 not in taken)
    addresses = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True,
                               text=True).stdout
    routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    subnet = next(f"10.28.{x}.0/24" for x in rng.sample(range(1, 255), 254)
                  if f" 10.28.{x}." not in addresses and f"10.28.{x}.0/24" not in routes)
    while True:
        prefix = "rt" + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(3))
        if not os.path.exists(f"/run/netns/{prefix}1"):
            return port, subnet, prefix


def socket_room(spool_under_state, node):
    """The longest RINGNET_SLURM_DIR whose batch-step socket fits a Unix socket's 107 bytes:
    ``STATE/<spool>/NODE_<8-digit job id>.4294967291`` (SLURM's batch step id)."""
    return 107 - len(f"/{spool_under_state}/{node}_67043327.4294967291")


def long_folder(length):
    """(a new folder under /tmp, a path of exactly ``length`` characters in it, not made)."""
    base = tempfile.mkdtemp(prefix="rl", dir="/tmp")
    path = os.path.join(base, "x" * (length - len(base) - 1))
    assert len(path) == length
    return base, path


def missing_for_a_cluster():
    """Why no cluster can be started here (None when one can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, links and tc); CI runs these as root"
    absent = [t for t in TOOLS if shutil.which(t) is None]
    if absent:
        return (f"{', '.join(absent)} not found: apt-get install slurmctld slurmd slurm-client "
                "munge iproute2")
    return None


class Cluster:
    """A running cluster: its environment for SLURM and MPI commands and its nodes."""

    def __init__(self, state_env, status_text, env_text):
        self.state_env = state_env          # RINGNET_SLURM_DIR/PORT: for hpc/cluster.sh
        self.nodes = cluster_nodes(status_text)
        env = {k: v for k, v in os.environ.items() if not k.startswith(CLUSTER_VARS + ("PMI_",))}
        env.update(state_env)
        env.update(parse_env(env_text))
        env.update(OMP_NUM_THREADS="1", RINGNET_BLAS_THREADS="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
        self.env = env
        self.names = [name for name, _ in self.nodes]

    def run(self, cmd, timeout=240, env=None, **kwargs):
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                              env=dict(self.env, **(env or {})), timeout=timeout, **kwargs)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The cluster of $RINGNET_SLURM_DIR when it has 2+ nodes, else one started here."""
    status = script("status")
    if status.returncode == 0 and len(cluster_nodes(status.stdout)) >= 2:
        state_env = {k: os.environ[k] for k in ("RINGNET_SLURM_DIR", "RINGNET_SLURM_PORT")
                     if k in os.environ}
        yield Cluster(state_env, status.stdout, script("env").stdout)
        return
    why = missing_for_a_cluster()
    if why:
        pytest.skip(f"no multi-node cluster: {why}")
    port, subnet, prefix = free_settings()
    state = tmp_path_factory.mktemp("cluster")
    state_env = {"RINGNET_SLURM_DIR": str(state / "slurm"), "RINGNET_SLURM_PORT": str(port)}
    env = dict(os.environ, **state_env)
    started = script("start", "--nodes", "2", "--link", "1gbit", "--prefix", prefix,
                     "--subnet", subnet, env=env)
    assert started.returncode == 0, started.stderr
    try:
        status = script("status", env=env)
        assert status.returncode == 0, status.stdout + status.stderr
        yield Cluster(state_env, status.stdout, script("env", env=env).stdout)
    finally:
        stopped = script("stop", env=env)
        assert stopped.returncode == 0, stopped.stderr


def summary_of(proc):
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    assert lines, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    return json.loads(lines[-1])


def weights(path):
    from ringnet.checkpoint import load_checkpoint
    params = load_checkpoint(str(path))[0]
    return np.concatenate([np.ravel(params[name]) for name in sorted(params)])


def local_env():
    """The environment of a run on this machine alone: no cluster settings."""
    env = {k: v for k, v in launcher_free_env().items() if not k.startswith(CLUSTER_VARS)}
    env.update(OMP_NUM_THREADS="1", RINGNET_BLAS_THREADS="1")
    return env


def run_local(args, tmp_path, name, ranks=None):
    """The same run on this machine (one process, or ``ranks`` under mpirun); its weights."""
    path = tmp_path / f"{name}.h5"
    cmd = [sys.executable, "-m", "ringnet.train", *args, "--save", str(path)]
    if ranks:
        cmd = ["mpirun", "-np", str(ranks), *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=local_env(),
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return weights(path), summary_of(proc)


def srun(cluster, args, *options, timeout=240):
    return cluster.run(["srun", "-N", "2", "--ntasks-per-node", str(RANKS_PER_NODE),
                        "--mpi=pmi2", *options, sys.executable, "-m", "ringnet.train", *args],
                       timeout=timeout)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run_local(BASE + ["--mode", "single"], tmp_path_factory.mktemp("single"), "single")


def header(proc):
    return next(l for l in proc.stderr.splitlines() + proc.stdout.splitlines()
                if l.startswith("ringnet: ") and " rank(s), " in l)


# -- every mode across nodes ----------------------------------------------------------------

@pytest.mark.parametrize("mode", ["ring", "tree", "master", "split-fc"])
def test_synchronous_modes_across_nodes_equal_single(cluster, single, mode, tmp_path):
    path = tmp_path / "run.h5"
    proc = srun(cluster, BASE + ["--mode", mode, "--delay", "0", "--save", str(path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = summary_of(proc)
    assert summary["ranks"] == 2 * RANKS_PER_NODE and summary["mode"] == mode
    # the job did run on two nodes, and MPI went over the links
    first = cluster.names[0], cluster.names[1]
    assert f"2 nodes x {RANKS_PER_NODE} ranks ({first[0]}: ranks 0-1; {first[1]}: ranks 2-3)" \
        in header(proc), header(proc)
    reference, reference_summary = single
    assert rel_error(weights(path), reference) <= 1e-9, f"{mode} across nodes differs from single"
    assert abs(summary["train_loss"] - reference_summary["train_loss"]) <= \
        1e-9 * abs(reference_summary["train_loss"])


def test_ring_delay1_across_nodes_equals_one_node(cluster, tmp_path):
    # the flat ring (auto takes the channels across nodes, which sum in another order)
    args = BASE + ["--mode", "ring", "--delay", "1", "--topology", "flat"]
    one_node, one_node_summary = run_local(args, tmp_path, "one-node", ranks=2 * RANKS_PER_NODE)
    path = tmp_path / "nodes.h5"
    proc = srun(cluster, args + ["--save", str(path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    across = weights(path)
    assert np.array_equal(across, one_node), \
        f"ring delay 1 across nodes differs from one node by {rel_error(across, one_node):.3g}"
    assert summary_of(proc)["train_loss"] == one_node_summary["train_loss"]
    # and it is delay 1: not the synchronous run
    synchronous, _ = run_local(BASE + ["--mode", "single"], tmp_path, "single")
    assert rel_error(across, synchronous) > 1e-6


def test_mpirun_across_nodes_runs_the_same_job(cluster, single, tmp_path):
    """hydra with the cluster's launcher and hosts file (`hpc/cluster.sh env`)."""
    path = tmp_path / "tree.h5"
    proc = cluster.run(["mpirun", "-np", str(2 * RANKS_PER_NODE), "-ppn", str(RANKS_PER_NODE),
                        sys.executable, "-m", "ringnet.train", *BASE, "--mode", "tree",
                        "--save", str(path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"2 nodes x {RANKS_PER_NODE} ranks" in header(proc), header(proc)
    assert rel_error(weights(path), single[0]) <= 1e-9


def test_sbatch_train_script_runs_across_nodes(cluster, tmp_path):
    args = BASE + ["--mode", "ring", "--delay", "1"]
    proc = cluster.run(["sbatch", "--wait", "-N", "2", f"--ntasks-per-node={RANKS_PER_NODE}",
                        f"--chdir={ROOT}", f"--output={tmp_path}/job-%j.out",
                        f"--error={tmp_path}/job-%j.err",
                        os.path.join(ROOT, "hpc", "train.sbatch"), *args], timeout=300)
    # srun forwards stdout and stderr in pieces of at most 1 KiB each, in no fixed order
    # between the two: in one shared file a log line can land inside the JSON line.
    out = "".join(p.read_text() for p in tmp_path.glob("job-*.out"))
    log = "".join(p.read_text() for p in tmp_path.glob("job-*.err"))
    assert proc.returncode == 0, proc.stderr + log[-3000:]
    line = next(l for l in log.splitlines() if l.startswith("ringnet: ring"))
    assert f"2 nodes x {RANKS_PER_NODE} ranks" in line, line
    summary = json.loads([l for l in out.splitlines() if l.startswith("{")][-1])
    _, reference = run_local(args, tmp_path, "one-node", ranks=2 * RANKS_PER_NODE)
    assert summary["train_loss"] == reference["train_loss"]


# -- placement ------------------------------------------------------------------------------

PLACEMENT = r"""
import json, os, socket
from mpi4py import MPI
from ringnet import comm
t = comm.make_transport("mpi", device="cpu")
p = t.placement
print(json.dumps({"rank": MPI.COMM_WORLD.Get_rank(), "nodes": p.nodes, "node": p.node,
                  "local_rank": p.local_rank, "local_size": p.local_size,
                  "rank_nodes": p.rank_nodes, "rank_local_ranks": p.rank_local_ranks,
                  "mpi_path": p.mpi_path, "progress": p.progress, "stream": t.new_stream().mode,
                  "hostname": socket.gethostname(), "slurm": [os.environ.get("SLURMD_NODENAME"),
                  int(os.environ["SLURM_NODEID"]), int(os.environ["SLURM_LOCALID"])]}))
t.close()
"""


@pytest.mark.parametrize("distribution", ["block", "cyclic"])
def test_placement_is_where_slurm_put_each_rank(cluster, distribution):
    proc = cluster.run(["srun", "-N", "2", "--ntasks-per-node", str(RANKS_PER_NODE),
                        "--mpi=pmi2", f"--distribution={distribution}", sys.executable, "-c",
                        PLACEMENT])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = sorted((json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")),
                  key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == list(range(2 * RANKS_PER_NODE))
    # SLURM's own word for where each task runs is the reference
    slurm_nodes = [r["slurm"][0] for r in rows]
    expected = {"block": [cluster.names[0]] * 2 + [cluster.names[1]] * 2,
                "cyclic": [cluster.names[0], cluster.names[1]] * 2}[distribution]
    assert slurm_nodes == expected
    for r in rows:
        assert r["nodes"] == 2
        assert r["rank_nodes"] == slurm_nodes
        assert r["node"] == r["hostname"] == r["slurm"][0]
        assert r["local_rank"] == r["slurm"][2] and r["local_size"] == RANKS_PER_NODE
        assert r["rank_local_ranks"] == [x["slurm"][2] for x in rows]
        assert r["mpi_path"].startswith("MPICH ofi (tcp)") and "MPIR_CVAR_NOLOCAL=1" in r["mpi_path"]
        assert r["stream"] == "poll" and r["progress"].startswith("poll (RINGNET_CPU_PROGRESS=auto")


def test_one_node_of_the_cluster_is_one_node(cluster):
    """Both ranks on one namespace: one node, and CPU streams stay driven."""
    proc = cluster.run(["srun", "-N", "1", "-n", "2", "--mpi=pmi2", sys.executable, "-c",
                        PLACEMENT])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
    assert len(rows) == 2
    for r in rows:
        assert r["nodes"] == 1 and r["local_size"] == 2 and r["stream"] == "driven"
        assert r["rank_local_ranks"] == [0, 1] and r["mpi_path"] is None


# -- a link taken down ----------------------------------------------------------------------

def running(pids, needle):
    """The processes among ``pids`` whose command line holds ``needle`` (bytes); those gone
    meanwhile are left out."""
    found = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if needle in f.read():
                    found.append(pid)
        except OSError:
            pass
    return found


def _job_processes(namespace):
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True,
                          text=True).stdout.split()
    return running(pids, b"ringnet.train")


def test_a_link_taken_down_ends_the_job_naming_the_ranks_and_their_node(cluster, tmp_path):
    timeout_s = 4.0
    second, link = cluster.names[1], f"{cluster.names[1]}-h"
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        job = subprocess.Popen(
            ["mpirun", "-np", str(2 * RANKS_PER_NODE), "-ppn", str(RANKS_PER_NODE),
             sys.executable, "-m", "ringnet.train", "--model", "lenet", "--dataset", "synthetic",
             "--steps", "3000", "--mode", "ring", "--delay", "0", "--no-eval"],
            cwd=ROOT, stdout=stdout, stderr=stderr,
            env=dict(cluster.env, RINGNET_COMM_TIMEOUT=str(timeout_s),
                     RINGNET_PROGRESS_SECONDS="0.5"))
    cut = None
    try:
        for _ in range(600):                # training runs: its first progress line
            if re.search(r"^step \d+/", out.read_text() + err.read_text(), re.M):
                break
            assert job.poll() is None, err.read_text()[-3000:]
            time.sleep(0.1)
        subprocess.run(["ip", "link", "set", link, "down"], check=True)
        cut = time.monotonic()
        # the transfer deadline, the stall check (half of it + 2 s), then the launcher's
        # clean-up: far less than this bound, which only catches a job that hangs
        code = job.wait(timeout=3 * timeout_s + 30)
        took = time.monotonic() - cut
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        if cut is not None:
            subprocess.run(["ip", "link", "set", link, "up"], check=True)
    assert code != 0
    assert took >= timeout_s, f"ended {took:.1f} s after the cut, before the deadline"
    lines = [l for l in err.read_text().splitlines() if "ringnet: error:" in l]
    assert len(lines) == 1, err.read_text()[-3000:]
    # the ranks behind the cut link, with their node, named first; a rank of the live node
    # still waiting on the cut link when the stall check closed may follow, with its node
    behind = ", ".join(str(r) for r in range(RANKS_PER_NODE, 2 * RANKS_PER_NODE))
    named = re.search(r"ringnet: error: (.*) did not arrive", lines[0])
    assert named, lines[0]
    groups = re.findall(r"ranks? ([\d, ]+) \(node ([^)]+)\)", named.group(1))
    assert ", ".join(f"{'rank' if ',' not in r else 'ranks'} {r} (node {n})"
                     for r, n in groups) == named.group(1), lines[0]
    assert groups[0] == (behind, second), lines[0]
    assert all(node == cluster.names[0] for _, node in groups[1:]), lines[0]
    # nothing of the job is left on the cut-off node
    for _ in range(3 * int(timeout_s) + 30):
        if not _job_processes(second):
            break
        time.sleep(1)
    assert not _job_processes(second)
