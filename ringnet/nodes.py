"""Where the ranks run: their nodes, node-local ranks, and the path MPI takes between nodes.

:func:`layout` (collective) groups the ranks of a communicator by node: two ranks share a
node when MPI puts them in one shared-memory group (``MPI_COMM_TYPE_SHARED``) or when
MPI names the same processor (``MPI_Get_processor_name``, the node's host name). Both
come from MPI; the second is needed where shared memory is turned off
(``MPIR_CVAR_NOLOCAL=1`` makes every rank its own shared-memory group). Nodes are
numbered by their lowest rank; a rank's node-local rank is its position among its node's
ranks in rank order.

:func:`mpi_path` says which path MPI's messages take, from the settings the MPI library
reads (MPICH: ``MPIR_CVAR_CH4_NETMOD``, ``FI_PROVIDER``, ``UCX_TLS``, ``MPIR_CVAR_NOLOCAL``).
"""
import os
from dataclasses import dataclass, field
from typing import List, Optional

__all__ = ["NodeLayout", "layout", "mpi_path", "ranks_text", "world_layout", "where", "one_node",
           "layout_of"]


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
    """'ranks 2, 3 (node rnd2)' / 'ranks 1, 3 (nodes rnd1, rnd2)' when the ranks span
    nodes, 'ranks 2, 3' otherwise. ``ranks`` are ranks of ``comm``: without
    ``node_layout`` the world's layout names their nodes when ``comm`` is None or holds
    the world's ranks in order (for another communicator the nodes are not named)."""
    ranks = list(ranks)
    text = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    if node_layout is None and _WORLD is not None:
        from mpi4py import MPI
        if comm is None or comm == MPI.COMM_WORLD or _same_group(comm, MPI.COMM_WORLD):
            node_layout = _WORLD
    if node_layout is None or node_layout.nodes < 2 or \
            not all(0 <= r < len(node_layout.rank_nodes) for r in ranks):
        return text
    names = []
    for r in ranks:
        if node_layout.rank_nodes[r] not in names:
            names.append(node_layout.rank_nodes[r])
    return f"{text} (node{'s' if len(names) > 1 else ''} {', '.join(names)})"


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
