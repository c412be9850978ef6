"""Making transports and communicators: :func:`make_transport` chooses the transport for
the device (and says why in :class:`Placement`), :func:`create` a communicator by name from
:data:`COMMUNICATORS` over it (:func:`local_rank` and :func:`bind_gpu`, which place a rank on its
node and GPU, are :mod:`ringnet.placement`'s). Re-exported by :mod:`ringnet.comm`, whose table describes the names.
"""
import os
from dataclasses import dataclass

from mpi4py import MPI

from ringnet import backend
from ringnet.comm.auto import AutoCommunicator
from ringnet.comm.channels import MultiChannelRingCommunicator
from ringnet.comm.hierarchical import TOPOLOGIES, HierarchicalTreeCommunicator
from ringnet.comm.master_slave import MasterSlaveCommunicator
from ringnet.comm.mpi_transport import MpiTransport
from ringnet.comm.nccl_transport import NCCL_INSTALL, NcclTransport, nccl_module
from ringnet.comm.ring import RingCommunicator
from ringnet.comm.tree import TreeCommunicator
from ringnet.errors import TransportUnavailable
from ringnet.placement import bind_gpu, local_rank

__all__ = ["create", "make_transport", "local_rank", "bind_gpu", "Placement", "COMMUNICATORS",
           "TRANSPORTS", "HIERARCHICAL"]

# The registry: the names create() and make_transport() take (ringnet.comm re-exports it).
# CUDA is reached through ringnet.backend's attributes, looked up at each call.
COMMUNICATORS = {
    "ring": RingCommunicator,
    "tree": TreeCommunicator,
    "master": MasterSlaveCommunicator,
    "auto": AutoCommunicator,
}

# The communicators with a hierarchical variant (``create(..., topology="hierarchical")``).
HIERARCHICAL = {
    "ring": MultiChannelRingCommunicator,
    "tree": HierarchicalTreeCommunicator,
}

TRANSPORTS = {
    "mpi": MpiTransport,
    "nccl": NcclTransport,
}


@dataclass
class Placement:
    """Where a rank computes and how its bytes move: what the run header and --json report.

    The node fields come from :func:`ringnet.placement.layout` (:meth:`locate`; until
    then one node is assumed): ``nodes``, this rank's ``node`` (its host name),
    ``local_rank`` and ``local_size`` on it, and for every rank (index = rank)
    ``rank_nodes`` and ``rank_local_ranks``. Across nodes ``mpi_path`` says which path MPI
    takes between them, ``progress`` how CPU streams progress their transfers, and
    ``topology`` which exchange the mode runs and why ("hierarchical (auto: ...)", set when
    the strategy is made).
    """
    device: str                 # "cpu" or "gpu"
    gpu: str = None             # "GPU 0 (0000:3b:00.0)" on a GPU
    transport: str = None       # "mpi" or "nccl"
    reason: str = ""            # why this transport
    nodes: int = 1              # number of nodes the ranks are on
    node: str = None            # this rank's node
    local_rank: int = 0         # this rank's rank among its node's ranks
    local_size: int = 1         # ranks on this rank's node
    rank_nodes: list = None     # the node of every rank
    rank_local_ranks: list = None   # the node-local rank of every rank
    mpi_path: str = None        # the path MPI's messages take (MPICH ofi (tcp), ...)
    progress: str = None        # CPU streams' progress: "poll (auto: the ranks span 2 nodes)"
    topology: str = None        # "flat (auto: ...)", "hierarchical (asked for)"; None: no choice made
    graphs: str = None          # --cuda-graphs on a GPU: "on (auto: ...)", "off (...)"
    waits: str = None           # how waits for a transfer spin, where a CPU quota changed it

    def locate(self, layout, progress=None, waits=None):
        """Fill the node fields from a :class:`~ringnet.placement.NodeLayout`; return self.
        ``progress``/``waits``: the MPI transport's :attr:`progress_reason`/:attr:`wait_reason`."""
        from ringnet.placement import mpi_path
        self.nodes, self.node = layout.nodes, layout.node
        self.local_rank, self.local_size = layout.local_rank, layout.local_size
        self.rank_nodes, self.rank_local_ranks = list(layout.rank_nodes), list(layout.rank_local_ranks)
        if layout.nodes > 1 and self.transport == "mpi":
            self.mpi_path = mpi_path()
        if progress is not None and self.device == "cpu" and self.transport == "mpi":
            self.progress = progress
        if self.transport == "mpi":
            self.waits = waits
        return self

    def describe(self):
        where = "CPU" if self.device == "cpu" else self.gpu
        if self.graphs and self.device != "cpu":
            where += f", CUDA graphs {self.graphs}"
        if self.transport is None:
            return where
        text = f"{where}, transport {self.transport} ({self.reason})"
        if self.nodes > 1 and self.rank_nodes:
            from ringnet.placement import group
            text += f", {group(self.rank_nodes, list(range(len(self.rank_nodes)))).describe()}"
            if self.mpi_path:
                text += f", MPI over {self.mpi_path}"
            if self.progress:
                text += f", CPU streams {self.progress}"
            if self.topology:
                text += f", topology {self.topology}"
        if self.waits:
            text += f", {self.waits}"
        return text


def _shared_gpu(places):
    """Return a sentence naming ranks that share a GPU, or None when every rank owns one."""
    seen = {}
    for rank, place in enumerate(places):
        if place in seen:
            sharing = [r for r, p in enumerate(places) if p == place]
            return (f"ranks {', '.join(map(str, sharing))} share GPU {place[1]} on {place[0]}; "
                    "NCCL needs one GPU per rank")
        seen[place] = rank
    return None


def make_transport(name="auto", mpi_comm=None, timeout_s=None, device="auto"):
    """Return a transport by name (auto, mpi, nccl) for ``device`` (auto, cpu, gpu); collective.

    ``device="cpu"`` never touches CUDA. On a GPU this binds the rank's GPU. The choice and
    its reason are in ``transport.placement``. ``RINGNET_NCCL=standin`` makes ``nccl`` the
    host-memory stand-in (for tests; it moves NumPy arrays).
    """
    from ringnet.comm.mpi_transport import mpi_cuda_aware  # noqa: WPS433
    if name not in ("auto", *TRANSPORTS):
        raise ValueError(f"unknown transport {name!r}: choose auto, {', '.join(TRANSPORTS)}")
    if device not in ("auto", "cpu", "gpu"):
        raise ValueError(f"unknown device {device!r}: choose auto, cpu or gpu")
    comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
    from ringnet.placement import layout as node_layout  # noqa: WPS433
    layout = node_layout(comm)
    standin = os.environ.get("RINGNET_NCCL", "") == "standin"
    if device == "auto":
        device = "gpu" if comm.allreduce(int(backend.gpu_available()), op=MPI.MIN) else "cpu"
    if device == "cpu":
        if name == "nccl" and not standin:
            raise TransportUnavailable("transport nccl moves GPU memory, but the device is "
                                       "the CPU", "cpu-device", transport=name)
        if name == "nccl":
            return _placed(NcclTransport(comm, timeout_s=timeout_s),
                           Placement("cpu", None, "nccl", "RINGNET_NCCL=standin: the host stand-in"),
                           layout)
        return _placed(MpiTransport(comm, timeout_s=timeout_s, device="cpu", layout=layout),
                       Placement("cpu", None, "mpi", "device cpu"), layout)
    if not backend.gpu_available():
        raise TransportUnavailable("device gpu asked for, but no usable CUDA GPU on this rank",
                                   "no-gpu")
    device_id, bus_id, places = bind_gpu(comm)
    gpu = f"GPU {device_id} ({bus_id})"
    shared = _shared_gpu(places)
    nccl_everywhere = comm.allreduce(int(nccl_module() is not None and not standin), op=MPI.MIN)
    if name == "nccl":
        if shared:
            raise TransportUnavailable(shared, "shared-gpu", transport=name)
        if not nccl_everywhere:
            raise TransportUnavailable("transport nccl: NCCL cannot be loaded on every rank "
                                       f"({NCCL_INSTALL})", "no-nccl",
                                       transport=name)
        return _placed(NcclTransport(comm, timeout_s=timeout_s),
                       Placement("gpu", gpu, "nccl", "every rank owns a GPU"), layout)
    if name == "auto" and not shared and nccl_everywhere:
        return _placed(NcclTransport(comm, timeout_s=timeout_s),
                       Placement("gpu", gpu, "nccl", "every rank owns a GPU"), layout)
    aware, how = mpi_cuda_aware()
    staging = f"CUDA-aware MPI ({how})" if aware else f"staged through pinned host memory ({how})"
    if name == "auto":
        why = shared or "NCCL cannot be loaded on every rank"
        reason = f"{why}; {staging}"
    else:
        reason = staging
    return _placed(MpiTransport(comm, timeout_s=timeout_s, device="gpu", layout=layout),
                   Placement("gpu", gpu, "mpi", reason), layout)


def _placed(transport, placement, layout):
    transport.placement = placement.locate(layout, getattr(transport, "progress_reason", None),
                                           getattr(transport, "wait_reason", None))
    return transport


def create(name, transport="auto", mpi_comm=None, device="auto", topology="flat", **options):
    """Return the communicator ``name`` (see the table above) over ``transport``.

    ``transport`` is a name for :func:`make_transport` or a Transport instance; ``device``
    says where the buffers live: ``cpu`` for NumPy (never touches CUDA), ``gpu`` for CuPy,
    ``auto`` the GPU when every rank has one; ``topology``: ``flat`` or ``hierarchical``
    (:data:`HIERARCHICAL`: the ring in channels, the tree through one leader per node). ``options`` go to
    the communicator (e.g. ``chunk_bytes`` for the ring and the rooted ones, ``algorithm``
    to force one of auto's, ``layout`` to give the node layout).
    """
    if name not in COMMUNICATORS:
        raise ValueError(f"unknown communicator {name!r}: choose {', '.join(COMMUNICATORS)}")
    if topology not in TOPOLOGIES[1:]:
        raise ValueError(f"unknown topology {topology!r}: choose {', '.join(TOPOLOGIES[1:])}")
    if topology == "hierarchical" and name not in HIERARCHICAL:
        raise ValueError(f"communicator {name!r} has no hierarchical variant: "
                         f"{', '.join(HIERARCHICAL)} have one")
    if isinstance(transport, str):
        transport = make_transport(transport, mpi_comm=mpi_comm, device=device)
    table = HIERARCHICAL if topology == "hierarchical" else COMMUNICATORS
    return table[name](transport, **options)
