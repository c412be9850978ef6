"""Where the ranks run, the one home of every such question: their nodes and node-local
ranks, what SLURM says of them, the cores a node's ranks share, the GPU a rank binds, and
the path MPI takes between nodes.

:func:`layout` (collective) groups the ranks of a communicator by node: two ranks share a
node when MPI puts them in one shared-memory group (``MPI_COMM_TYPE_SHARED``) or when
MPI names the same processor (``MPI_Get_processor_name``, the node's host name). Both
come from MPI; the second is needed where shared memory is turned off
(``MPIR_CVAR_NOLOCAL=1`` makes every rank its own shared-memory group). Nodes are
numbered by their lowest rank; a rank's node-local rank is its position among its node's
ranks in rank order.

Before MPI is up, or for a launcher: :func:`slurm_task_counts` reads SLURM's tasks-per-node
lists (``2(x3),1``), :func:`slurm_rank_nodes` places each task of a step on its node (block
or ``--distribution=cyclic``), :func:`local_ranks_on_node` counts this node's ranks from
the launcher's variables, :func:`node_cores` the cores they share and :func:`crowded`
whether they outnumber them.

:func:`mpi_path` says which path MPI's messages take, from the settings the MPI library
reads (MPICH: ``MPIR_CVAR_CH4_NETMOD``, ``FI_PROVIDER``, ``UCX_TLS``, ``MPIR_CVAR_NOLOCAL``).
"""
import os
from dataclasses import dataclass, field
from typing import List, Optional

__all__ = ["NodeLayout", "layout", "mpi_path", "ranks_text", "world_layout", "where", "one_node",
           "layout_of", "group", "local_rank", "bind_gpu", "slurm_task_counts", "slurm_tasks_per_node",
           "slurm_rank_nodes", "allocation_tasks_per_node", "local_ranks_on_node", "check_world_size",
           "node_cores", "crowded", "lean_spins", "LEAN_SPINS", "OVERSUBSCRIBED_SPINS"]


@dataclass
class NodeLayout:
    """The node of every rank of one communicator (index = rank)."""
    rank_nodes: List[str]                     # node name of each rank
    rank_node_index: List[int]                # node number of each rank (0: rank 0's node)
    rank_local_ranks: List[int]               # node-local rank of each rank
    rank: int = 0                             # the calling rank
    node_names: List[str] = field(default_factory=list)    # by node number

    @property
    def nodes(self) -> int:
        """Number of nodes."""
        return len(self.node_names)

    @property
    def node(self) -> str:
        """This rank's node."""
        return self.rank_nodes[self.rank]

    @property
    def local_rank(self) -> int:
        """This rank's rank among its node's ranks."""
        return self.rank_local_ranks[self.rank]

    @property
    def local_size(self) -> int:
        """Number of ranks on this rank's node."""
        return self.ranks_on(self.rank_node_index[self.rank])

    def ranks_on(self, index: int) -> int:
        return sum(1 for i in self.rank_node_index if i == index)

    def ranks_of(self, index: int) -> List[int]:
        """Ranks on node number ``index``, in rank order."""
        return [r for r, i in enumerate(self.rank_node_index) if i == index]

    def node_order(self) -> List[int]:
        """The ranks ordered by (node number, node-local rank): each node's ranks together.
        With one node, or ranks placed in blocks, this is rank order."""
        return sorted(range(len(self.rank_nodes)),
                      key=lambda r: (self.rank_node_index[r], self.rank_local_ranks[r]))

    def leaders(self, root: int = 0) -> List[int]:
        """One rank per node, by node number: its lowest rank, on ``root``'s node ``root``."""
        mine = self.rank_node_index[root]
        return [root if i == mine else self.ranks_of(i)[0] for i in range(self.nodes)]

    def describe(self) -> str:
        """'2 nodes x 2 ranks (rnd1: ranks 0-1; rnd2: ranks 2-3)'."""
        per = sorted({self.ranks_on(i) for i in range(self.nodes)})
        shape = f"{self.nodes} node{'s' if self.nodes != 1 else ''}"
        shape += f" x {per[0]} rank{'s' if per[0] != 1 else ''}" if len(per) == 1 else \
            f" with {per[0]}-{per[-1]} ranks each"
        where = "; ".join(f"{name}: {_span(self.ranks_of(i))}"
                          for i, name in enumerate(self.node_names))
        return f"{shape} ({where})"


def _span(ranks):
    """'rank 3', 'ranks 0-3' or 'ranks 0, 2'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def group(names, shared_groups, rank=0):
    """Return the NodeLayout of ranks with processor ``names`` and shared-memory group ids
    ``shared_groups`` (one each per rank): ranks sharing either are on one node."""
    size = len(names)
    parent = list(range(size))

    def find(r):
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    for keys in (names, shared_groups):
        first = {}
        for r, key in enumerate(keys):
            if key not in first:
                first[key] = r
                continue
            a, b = find(first[key]), find(r)
            if a != b:
                parent[max(a, b)] = min(a, b)
    roots = [find(r) for r in range(size)]
    order = sorted(set(roots))                     # each node by its lowest rank
    index = [order.index(root) for root in roots]
    local, seen = [], {}
    for i in index:
        local.append(seen.get(i, 0))
        seen[i] = seen.get(i, 0) + 1
    # one name per node: ranks that share a processor name are on one node already
    node_names = [names[root] for root in order]
    return NodeLayout([node_names[i] for i in index], index, local, rank, node_names)


def one_node(size: int, rank: int = 0) -> NodeLayout:
    """The layout of ``size`` ranks on one node."""
    return NodeLayout(["localhost"] * size, [0] * size, list(range(size)), rank, ["localhost"])


def layout_of(transport) -> NodeLayout:
    """The node layout a transport's ranks run with: its own ``layout`` (an MPI transport),
    else the one its ``placement`` reports, else one node."""
    found = getattr(transport, "layout", None)
    if isinstance(found, NodeLayout) and len(found.rank_nodes) == transport.size:
        return found
    placement = getattr(transport, "placement", None)
    names = getattr(placement, "rank_nodes", None)
    if names and len(names) == transport.size:
        return group(list(names), list(names), transport.rank)
    return one_node(transport.size, transport.rank)


_WORLD = None


def layout(comm=None) -> NodeLayout:
    """Return the NodeLayout of ``comm`` (default MPI.COMM_WORLD); collective."""
    from mpi4py import MPI
    global _WORLD
    comm = MPI.COMM_WORLD if comm is None else comm
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        # the shared-memory group's id: the communicator rank of its first member
        leader = shared.bcast(comm.Get_rank(), root=0)
    finally:
        shared.Free()
    names_groups = comm.allgather((MPI.Get_processor_name(), leader))
    result = group([n for n, _ in names_groups], [g for _, g in names_groups], comm.Get_rank())
    if comm == MPI.COMM_WORLD or _same_group(comm, MPI.COMM_WORLD):
        _WORLD = result
    return result


def _same_group(comm, world):
    """True when ``comm`` holds the world's ranks in the world's order."""
    from mpi4py import MPI
    if comm.Get_size() != world.Get_size():
        return False
    try:
        mine, theirs = comm.Get_group(), world.Get_group()
    except Exception:  # noqa: BLE001 - an intercommunicator or a freed one: not the world
        return False
    try:
        return MPI.Group.Compare(mine, theirs) == MPI.IDENT
    finally:
        mine.Free()
        theirs.Free()


def world_layout() -> Optional[NodeLayout]:
    """The layout of MPI.COMM_WORLD (or a communicator of its ranks in its order) that
    :func:`layout` found last in this process, or None before."""
    return _WORLD


def where(rank: int, node_layout: Optional[NodeLayout] = None) -> str:
    """'rank 3 on rnd2' when the ranks span nodes, 'rank 3' otherwise."""
    node_layout = node_layout or _WORLD
    if node_layout is None or node_layout.nodes < 2 or not 0 <= rank < len(node_layout.rank_nodes):
        return f"rank {rank}"
    return f"rank {rank} on {node_layout.rank_nodes[rank]}"


def ranks_text(ranks, node_layout: Optional[NodeLayout] = None, comm=None) -> str:
    """'ranks 2, 3 (node rnd2)' where the ranks span nodes, 'ranks 2, 3' otherwise; ranks
    on several nodes are named node by node, the nodes all of whose ranks are named first
    (a lost node or a cut link: 'ranks 2, 3 (node rnd2), rank 0 (node rnd1)'). ``ranks``
    are ranks of ``comm``: without ``node_layout`` the world's layout names their nodes
    when ``comm`` is None or holds the world's ranks in order (for another communicator
    the nodes are not named)."""
    ranks = list(ranks)

    def plain(some):
        return f"rank {some[0]}" if len(some) == 1 else f"ranks {', '.join(map(str, some))}"

    if node_layout is None and _WORLD is not None:
        from mpi4py import MPI
        if comm is None or comm == MPI.COMM_WORLD or _same_group(comm, MPI.COMM_WORLD):
            node_layout = _WORLD
    if node_layout is None or node_layout.nodes < 2 or \
            not all(0 <= r < len(node_layout.rank_nodes) for r in ranks):
        return plain(ranks)
    by_node = {}
    for r in ranks:
        by_node.setdefault(node_layout.rank_nodes[r], []).append(r)
    whole = {name for name, named in by_node.items()
             if len(set(named)) == node_layout.rank_nodes.count(name)}
    order = sorted(by_node, key=lambda name: name not in whole)     # stable: by first rank
    return ", ".join(f"{plain(by_node[name])} (node {name})" for name in order)


def mpi_path(environ=None) -> str:
    """Return which path the MPI library's messages take, as its settings say.

    MPICH: the netmod (``MPIR_CVAR_CH4_NETMOD``: ofi or ucx; unset: the build's first),
    its provider or transports (``FI_PROVIDER``, ``UCX_TLS``), and whether ranks of one
    node use shared memory (``MPIR_CVAR_NOLOCAL=1``: no). Other MPIs: their name.
    """
    env = os.environ if environ is None else environ
    try:
        from mpi4py import MPI
        version = MPI.Get_library_version()
    except Exception:  # noqa: BLE001 - no MPI library: nothing to say
        return "no MPI library"
    if "MPICH" not in version:
        return version.splitlines()[0].strip() if version.strip() else "MPI"
    device = ""
    for line in version.splitlines():
        if line.startswith("MPICH Device:"):
            device = line.split(":", 1)[1].strip()          # "ch4:ucx ofi"
    built = device.split(":", 1)[1].split() if ":" in device else []
    netmod = env.get("MPIR_CVAR_CH4_NETMOD", "") or (built[0] if built else "")
    if netmod == "ofi":
        provider = env.get("FI_PROVIDER", "")
        path = f"MPICH ofi ({provider or 'libfabric picks the provider'})"
    elif netmod == "ucx":
        tls = env.get("UCX_TLS", "")
        path = f"MPICH ucx ({'UCX_TLS=' + tls if tls else 'UCX picks shared memory or the network'})"
    else:
        path = f"MPICH {netmod or device or 'default netmod'}"
    if env.get("MPIR_CVAR_NOLOCAL", "") in ("1", "yes", "true"):
        path += ", no shared memory within a node (MPIR_CVAR_NOLOCAL=1)"
    return path


def local_rank(mpi_comm=None):
    """Return (rank among the ranks on this node, number of ranks on this node); collective.

    From :func:`layout`, not a shared-memory split alone: where shared memory between ranks
    is turned off (``MPIR_CVAR_NOLOCAL=1``) every rank would be its own group, local rank 0,
    and all ranks of a node would bind GPU 0."""
    from mpi4py import MPI
    placed = layout(MPI.COMM_WORLD if mpi_comm is None else mpi_comm)
    return placed.local_rank, placed.local_size


def bind_gpu(mpi_comm=None):
    """Bind this rank's GPU (node-local rank modulo visible devices), check it runs; collective.

    Returns (device id, PCI bus id, [(host, bus id) of every rank]).
    """
    from mpi4py import MPI
    from ringnet import backend
    comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
    device_id = backend.bind_device(local_rank(comm)[0])
    backend.check_gpu()
    bus_id = backend.pci_bus_id(device_id)
    return device_id, bus_id, comm.allgather((MPI.Get_processor_name(), bus_id))


# -- what SLURM and the launchers say, before MPI is up --------------------------------------
# Environment variables MPI launchers set to the number of ranks on this node.
_LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS",              # MPICH / Hydra
                    "OMPI_COMM_WORLD_LOCAL_SIZE",   # Open MPI
                    "MV2_COMM_WORLD_LOCAL_SIZE",    # MVAPICH2
                    "PMI_LOCAL_SIZE")
# What srun says of the tasks per node, most specific first: the step's own layout, the
# allocation's, and --ntasks-per-node (which SLURM sets only when it was given). The first
# two are lists, one entry per node, "2(x3),1" for 2, 2, 2, 1; SLURM_NODEID picks this node's.
_SLURM_TASK_VARS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")


def _positive(text):
    """``text`` as a positive int, or None (unset, empty, not a number, 0 or less)."""
    text = (text or "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def slurm_task_counts(text):
    """Return the counts of a SLURM tasks-per-node list, one per node ("2(x3),1" ->
    [2, 2, 2, 1]; "4" -> [4]), or None where ``text`` is not one."""
    counts = []
    for item in (text or "").split(","):
        count, sep, repeat = item.strip().partition("(x")
        if sep and not repeat.endswith(")"):
            return None
        count, repeat = _positive(count), _positive(repeat[:-1]) if sep else 1
        if count is None or repeat is None:
            return None
        counts += [count] * repeat
    return counts or None


def slurm_tasks_per_node(text, node=0):
    """Return node ``node``'s entry of a SLURM tasks-per-node list ("2(x3),1"), or None."""
    counts = slurm_task_counts(text)
    return counts[node] if counts and 0 <= node < len(counts) else None


def _step_counts(env):
    for var in _SLURM_TASK_VARS:
        counts = slurm_task_counts(env.get(var))
        if counts:
            return var, counts
    return None, None


def slurm_rank_nodes(environ=None):
    """Return the node index (0 = the step's first node) of every task of this SLURM step,
    or None outside one: block placement fills each node with its count in turn; with
    ``--distribution=cyclic`` (``SLURM_DISTRIBUTION`` starting "cyclic") tasks go round
    the nodes one at a time, skipping a node once it holds its count."""
    env = os.environ if environ is None else environ
    var, counts = _step_counts(env)
    if counts is None:
        return None
    if var == "SLURM_NTASKS_PER_NODE":          # one count for every node of the allocation
        nodes = _positive(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_JOB_NUM_NODES")) or 1
        counts = counts * nodes
    total = _positive(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")) or sum(counts)
    if (env.get("SLURM_DISTRIBUTION") or "").startswith("cyclic"):
        placed, left = [], list(counts)
        while len(placed) < total and any(left):
            for node, remaining in enumerate(left):
                if remaining and len(placed) < total:
                    placed.append(node)
                    left[node] -= 1
        return placed
    return [node for node, count in enumerate(counts) for _ in range(count)][:total]


def allocation_tasks_per_node(environ=None):
    """The most tasks SLURM put on one node (the step's, else the allocation's list, else
    ``--ntasks-per-node``), or None outside SLURM: what a relaunch may place on a node."""
    env = os.environ if environ is None else environ
    _, counts = _step_counts(env)
    return max(counts) if counts else None


def local_ranks_on_node(environ=None):
    """Return the number of ranks the launcher put on this node (1 when unknown)."""
    env = os.environ if environ is None else environ
    for var in _LOCAL_SIZE_VARS:
        if _positive(env.get(var)):
            return _positive(env.get(var))
    node_id = env.get("SLURM_NODEID", "").strip()
    node = int(node_id) if node_id.isdigit() else 0
    for var in _SLURM_TASK_VARS:
        count = slurm_tasks_per_node(env.get(var), node)
        if count:
            return count
    return 1


def check_world_size(size, environ=None):
    """Raise UsageError when ``srun`` started several tasks but MPI sees a world of one.

    That happens when srun and the MPI library share no process-management interface
    (PMI): every task then starts as its own one-rank MPI job and would train alone.
    Only task 0 reports it, so the job log holds one line; the other tasks exit 2 quietly.
    """
    from ringnet.errors import EXIT_USAGE, UsageError
    environ = os.environ if environ is None else environ
    try:
        tasks = int(environ.get("SLURM_STEP_NUM_TASKS", "1"))
    except ValueError:
        return
    if size != 1 or tasks <= 1:
        return
    if environ.get("SLURM_PROCID", "0") != "0":
        raise SystemExit(EXIT_USAGE)
    raise UsageError(f"srun started {tasks} tasks but MPI sees a world of 1 rank in each: srun "
                     "and this MPI library share no PMI; use `srun --mpi=pmi2` (MPICH) or "
                     "`--mpi=pmix` (Open MPI), or MpiDefault in slurm.conf")


# -- the cores a node's ranks share -----------------------------------------------------------
# Polls of MPI_Testall before a wait is handed to the transport (which yields the core,
# then sleeps, and raises CommTimeoutError at its deadline). A small message completes
# within a few polls while every rank has a core. Where the launcher put more ranks on
# the node than they have cores (:func:`node_cores`), the awaited peer is usually descheduled,
# and polling only delays it: yield after OVERSUBSCRIBED_SPINS (measured with 3 and 4
# ranks on 2 cores: 64 polls 0.30-0.46x native at 8 B, 2 polls 0.57-0.95x).
LEAN_SPINS = 64
OVERSUBSCRIBED_SPINS = 2


def _cgroups(controller, proc_cgroup, mounts):
    """This process's control groups: (the lines of ``proc_cgroup`` as [id, controllers,
    path], {"v1": the mount of the cgroup v1 hierarchy with ``controller``, "v2": the
    cgroup2 mount}, each the first the mount table lists and only where there is one), or
    None where either file cannot be read."""
    try:
        with open(proc_cgroup) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
        with open(mounts) as f:
            table = [line.split() for line in f]
    except OSError:
        return None
    roots = {}
    for fields in table:
        if len(fields) < 4:
            continue
        kind, where, options = fields[2], fields[1], fields[3].split(",")
        if kind == "cgroup" and controller in options:
            roots.setdefault("v1", where)
        elif kind == "cgroup2":
            roots.setdefault("v2", where)
    return lines, roots


def cpu_quota(proc_cgroup="/proc/self/cgroup", mounts="/proc/self/mounts"):
    """The cores this process's control group may use by its CFS bandwidth quota (cgroup v1's
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, cgroup v2's ``cpu.max``; the tightest of
    the group and its parents), as a float, or None where no quota holds it (or nothing
    can be read). ``hpc/cluster.sh start --cpus-per-node C`` holds each node to C cores
    this way, as container runtimes and SLURM's cgroup plugin can."""
    tightest = _tightest(_cgroups("cpu", proc_cgroup, mounts))
    return tightest[0] if tightest else None


def cpu_period_s(proc_cgroup="/proc/self/cgroup", mounts="/proc/self/mounts"):
    """The period, in seconds, of the CFS quota :func:`cpu_quota` reads (the quota is that
    share of each period: a thread held to it runs at a full core's speed until it has
    spent it and waits for the next period), or None where no quota holds the process."""
    tightest = _tightest(_cgroups("cpu", proc_cgroup, mounts))
    return tightest[1] if tightest else None


def _tightest(found):
    """(cores, period in seconds) of the tightest quota of :func:`_cgroups`' ``found``, or None."""
    if found is None:
        return None
    lines, roots = found
    quotas = []
    for _, controllers, path in lines:
        if "cpu" in controllers.split(",") and "v1" in roots:
            quotas += _walk(roots["v1"], path, _v1_quota)
        elif controllers == "" and "v2" in roots:
            quotas += _walk(roots["v2"], path, _v2_quota)
    return min(quotas) if quotas else None


def group_cpu_s(proc_cgroup="/proc/self/cgroup", mounts="/proc/self/mounts"):
    """The CPU seconds this process's control group has used so far (cgroup v1's
    ``cpuacct.usage``, v2's ``usage_usec`` in ``cpu.stat``), or None where nothing can be
    read. On a node of ``hpc/cluster.sh`` that group is the node's, held to its quota:
    the difference of two readings over the wall time between them, against
    :func:`cpu_quota`, says how much of the budget the node spent."""
    found = _cgroups("cpuacct", proc_cgroup, mounts)
    if found is None:
        return None
    lines, roots = found
    v1, v2 = roots.get("v1"), roots.get("v2")
    for _, controllers, path in lines:
        try:
            if v1 is not None and "cpuacct" in controllers.split(","):
                with open(os.path.join(v1, *[p for p in path.split("/") if p],
                                       "cpuacct.usage")) as f:
                    return int(f.read()) / 1e9
            if v1 is None and v2 is not None and controllers == "":
                with open(os.path.join(v2, *[p for p in path.split("/") if p],
                                       "cpu.stat")) as f:
                    for line in f:
                        key, _, value = line.partition(" ")
                        if key == "usage_usec":
                            return int(value) / 1e6
        except (OSError, ValueError):
            return None
    return None


def _walk(root, path, read):
    """The quotas of the group at ``path`` under ``root`` and of each parent (None left out)."""
    parts = [p for p in path.split("/") if p]
    found = []
    for depth in range(len(parts), -1, -1):
        q = read(os.path.join(root, *parts[:depth]))
        if q is not None:
            found.append(q)
    return found


def _v1_quota(folder):
    try:
        with open(os.path.join(folder, "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(folder, "cpu.cfs_period_us")) as f:
            period = int(f.read())
    except (OSError, ValueError):
        return None
    return (quota / period, period * 1e-6) if quota > 0 and period > 0 else None


def _v2_quota(folder):
    try:
        with open(os.path.join(folder, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
        if quota == "max" or int(period) <= 0:
            return None
        return int(quota) / int(period), int(period) * 1e-6
    except (OSError, ValueError):
        return None


def node_cores():
    """The cores the node's ranks share: this process's CPU affinity, or, where the launcher
    bound it to a single core (each rank to its own), the machine's; fewer where a CPU quota
    (:func:`cpu_quota`) holds the node to less (a fraction of a core counts as one, the
    quota itself is :func:`cpu_quota`'s)."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = 0
    cores = affinity if affinity > 1 else (os.cpu_count() or 1)
    quota = cpu_quota()
    return cores if quota is None else max(1, min(cores, int(quota)))


def crowded(ranks_here=None, cores=None):
    """Whether this node holds more ranks (:func:`local_ranks_on_node`) than cores
    (:func:`node_cores`)."""
    if ranks_here is None:
        ranks_here = local_ranks_on_node()
    if cores is None:
        cores = node_cores()
    return ranks_here > cores


def lean_spins(ranks_here=None, cores=None):
    """Testall polls before yielding: LEAN_SPINS while each of the node's ranks has a core,
    else OVERSUBSCRIBED_SPINS (:func:`crowded`)."""
    return OVERSUBSCRIBED_SPINS if crowded(ranks_here, cores) else LEAN_SPINS
