"""Runs on a cluster of nodes (the benchmarks', the performance model's calibration): where
the ranks go, and the bytes between the nodes.

* :class:`Shape`: a rank count that also says how many nodes it spans (``2x2``: 2 nodes x
  2 ranks); :func:`parse_nodes` reads ``--nodes 1 2 4 2x2``.
* :func:`launch_prefix`: the launcher's command line for a shape. ``srun ...`` gets ``-N K
  -n N --ntasks-per-node R`` (rank 0's output alone, unbuffered); an ``mpirun``/``mpiexec`` (MPICH's hydra, reaching the nodes
  through its hosts file, as ``hpc/cluster.sh env`` sets it up) gets ``-np N -ppn R``, so
  ranks fill the first K hosts in blocks.
* :func:`available_nodes`: how many nodes the launcher can reach (SLURM's ``sinfo``; the
  hydra hosts file), so a shape the cluster does not have is refused before anything runs.
* :func:`inter_node_bytes`: the bytes one training step sends between nodes, from what the
  mode sends (:func:`ringnet.parallel.step_traffic`) and who sends it to whom on the run's
  own placement (the ring ordered by node, the tree's heap, the master's star, the
  hierarchical exchanges' leaders).
* :class:`LinkCounters`: the bytes the nodes' links really carried (the host ends of the
  cluster's veth links, ``hpc/cluster.sh``'s ``nodes`` file), read around each run.
"""
import os
import shlex
import shutil
import subprocess

from ringnet.errors import UsageError
from ringnet.hosts import hydra_hosts

__all__ = ["Shape", "parse_nodes", "launch_prefix", "placed", "check_launcher", "available_nodes",
           "inter_node_bytes", "LinkCounters", "nodes_text", "cluster_files"]


class Shape(int):
    """N ranks on ``nodes`` nodes of ``per_node`` ranks each: an int (N) that also tells the
    layout apart (4 ranks on 4 nodes is not 4 ranks on 2)."""

    def __new__(cls, nodes, per_node=1):
        self = super().__new__(cls, nodes * per_node)
        self.nodes, self.per_node = nodes, per_node
        return self

    def __eq__(self, other):
        if isinstance(other, Shape):
            return int(self) == int(other) and self.nodes == other.nodes
        return int(self) == other

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return hash((int(self), self.nodes))

    def __lt__(self, other):
        return (int(self), getattr(self, "nodes", 0)) < (int(other), getattr(other, "nodes", 0))

    def __repr__(self):
        return f"{self.nodes}x{self.per_node}"

    __str__ = int.__repr__


def parse_nodes(items, per_node):
    """[Shape] of ``--nodes`` items: ``K`` (K nodes of ``per_node`` ranks) or ``KxR``."""
    shapes = []
    for item in items:
        k, x, r = str(item).lower().partition("x")
        try:
            nodes, ranks = int(k), int(r) if x else per_node
        except ValueError:
            raise UsageError(f"--nodes takes K or KxR (nodes x ranks per node), got {item!r}") from None
        if nodes < 1 or ranks < 1:
            raise UsageError(f"--nodes {item}: nodes and ranks per node must be >= 1")
        shapes.append(Shape(nodes, ranks))
    return shapes


def _is_srun(launcher):
    return os.path.basename(launcher[0]) == "srun"


def launch_prefix(launcher, n):
    """The launcher's command line that starts ``n`` ranks (a :class:`Shape`: on its nodes)."""
    launcher = shlex.split(launcher) if isinstance(launcher, str) else list(launcher)
    if _is_srun(launcher):
        # rank 0's output only, as written: srun's line buffering cuts a long line (a --json
        # summary) in two, and unbuffered the other ranks' lines land inside it
        out = ["--unbuffered", "--output=0"]
        if isinstance(n, Shape):
            return launcher + out + ["-N", str(n.nodes), "-n", str(int(n)),
                                     "--ntasks-per-node", str(n.per_node)]
        return launcher + out + ["-n", str(int(n))]
    if isinstance(n, Shape):
        return launcher + ["-np", str(int(n)), "-ppn", str(n.per_node)]
    return launcher + ["-np", str(int(n))]


def placed(n, per_node):
    """N ranks placed ``per_node`` to a node (None: as the launcher likes, a plain N)."""
    if not per_node:
        return n
    local = min(n, per_node)
    if n % local:
        raise UsageError(f"{n} ranks do not fill nodes of {per_node} ranks")
    return Shape(n // local, local)


def check_launcher(launcher):
    """Raise the one-line UsageError where the launcher's program is not there."""
    words = shlex.split(launcher) if isinstance(launcher, str) else list(launcher)
    if not words or shutil.which(words[0]) is None:
        raise UsageError(f"launcher {launcher!r} not found; `pip install mpich`, start a "
                         "cluster (hpc/cluster.sh) or pass --launcher / --mpirun")


def available_nodes(launcher, environ=None):
    """How many nodes ``launcher`` reaches: SLURM's nodes (``sinfo``) for srun; for mpirun
    the hosts it names (:func:`ringnet.hosts.hydra_hosts`: ``-hosts``, a ``-f``/``-hostfile``
    file or ``$HYDRA_HOST_FILE``; one node without any)."""
    env = os.environ if environ is None else environ
    words = shlex.split(launcher) if isinstance(launcher, str) else list(launcher)
    if _is_srun(words):
        try:
            proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True,
                                  text=True, timeout=30, env=env)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise UsageError(f"cannot ask SLURM for its nodes (sinfo): {exc}") from None
        if proc.returncode != 0:
            raise UsageError(f"cannot ask SLURM for its nodes (sinfo): "
                             f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
        return len(set(proc.stdout.split()))
    try:
        hosts = hydra_hosts(words, env, strict=True)[1]
    except OSError as exc:
        raise UsageError(f"cannot read the hosts file {exc.filename}: {exc.strerror}") from None
    return len(set(hosts)) if hosts else 1


def cluster_files(name, environ=None):
    """Yield the paths of ``hpc/cluster.sh``'s file ``name`` (``nodes``, ``cluster``) that
    exist beside ``$SLURM_CONF`` or ``$HYDRA_HOST_FILE``, in that order (none: no cluster)."""
    env = os.environ if environ is None else environ
    for var in ("SLURM_CONF", "HYDRA_HOST_FILE"):
        if env.get(var):
            path = os.path.join(os.path.dirname(env[var]), name)
            if os.path.exists(path):
                yield path


def _pairs(transfer, n, order):
    """[(sender, receiver, bytes)] of one collective of the flat exchange."""
    size = transfer.length * transfer.itemsize
    if transfer.route == "tree":
        up = [(v, (v - 1) // 2, size) for v in range(1, n)]
        return up if transfer.op == "reduce" else [(b, a, s) for a, b, s in up]
    if transfer.route == "master":
        up = [(r, 0, size) for r in range(1, n)]
        return up if transfer.op == "reduce" else [(0, r, size) for r in range(1, n)]
    sent = transfer.sent(n)             # ring: each place of the ring sends to the next
    return [(order[p], order[(p + 1) % n], sent[p]) for p in range(n)]


def inter_node_bytes(mode, model, rank_nodes, batch, delay=0, topology="flat"):
    """Bytes one step of ``mode`` sends between nodes, summed over the ranks, for the ranks
    placed on ``rank_nodes`` (each rank's node name, as train's --json reports it).

    Flat: every collective's sends (:func:`ringnet.parallel.step_traffic`), each counted
    where sender and receiver are on different nodes; the ring runs in node order. A
    hierarchical ring sends 2 (M-1) P in all: over channels each of the N ranks sends 2
    (M-1)/M of its channel's P/L (ring or halving-doubling alike), through one leader per
    node each leader 2 (M-1) node regions. A hierarchical tree sends the whole exchange up
    and down each of the M-1 edges of the leaders' heap: 2 (M-1) times it."""
    from ringnet.parallel import step_traffic
    n = len(rank_nodes)
    names = list(dict.fromkeys(rank_nodes))
    nodes = [names.index(x) for x in rank_nodes]
    if n < 2 or len(names) < 2:
        return 0
    traffic = step_traffic(mode, model, n, batch, delay)
    if topology == "hierarchical" and len(names) < n:
        total = 0
        for part in traffic.parts:
            length = sum(b - a for a, b in part.transfers[0].bounds) if part.transfers else 0
            total += 2 * (len(names) - 1) * length * model.dtype.itemsize
        return total
    order = sorted(range(n), key=lambda r: (nodes[r], r))
    total = 0
    for transfer in traffic.transfers():
        total += sum(b for src, dst, b in _pairs(transfer, n, order) if nodes[src] != nodes[dst])
    return total


class LinkCounters:
    """The bytes the cluster's node links carried: the host ends of ``hpc/cluster.sh``'s veth
    links, named in its ``nodes`` file (beside ``$SLURM_CONF`` or ``$HYDRA_HOST_FILE``).
    What a node sends is what its link's host end receives, so the sum of those counters is
    every byte that left a node (TCP/IP headers, and the launch's own traffic, included)."""

    def __init__(self, environ=None):
        self.links = []
        for path in cluster_files("nodes", environ):
            with open(path) as f:
                self.links = [line.split()[2] for line in f if len(line.split()) >= 3]
            break

    def __bool__(self):
        return bool(self.links)

    def read(self):
        """Bytes received at the host ends so far (None without a cluster's links)."""
        if not self.links:
            return None
        total = 0
        for link in self.links:
            try:
                with open(f"/sys/class/net/{link}/statistics/rx_bytes") as f:
                    total += int(f.read())
            except (OSError, ValueError):
                return None
        return total


def nodes_text(n):
    """'2x2' for a Shape, else the rank count."""
    return repr(n) if isinstance(n, Shape) else str(n)

