"""ringnet.comm: transports, streams and communicators, usable without the training loop.

=========  ===  ===  ================  ==============================================
name       CPU  GPU  transport         what it is for
=========  ===  ===  ================  ==============================================
``ring``   yes  yes  mpi, nccl         the circle structure: reduce-scatter /
                                       all-gather / all-reduce in N-1 neighbour
                                       steps; bandwidth-optimal, default
``tree``   yes  yes  mpi, nccl         binary-tree reduce to a root + tree broadcast
                                       (any N); the reduction-tree baseline
``master`` yes  yes  mpi, nccl         workers send to the root, the root answers
                                       each; the synchronous master-slave baseline
=========  ===  ===  ================  ==============================================

Transports: ``mpi`` (mpi4py buffers; CuPy arrays direct with a CUDA-aware MPI,
host-staged otherwise) and ``nccl`` (``cupy.cuda.nccl``, one GPU per rank); ``auto``
takes nccl when every rank has its own GPU, mpi otherwise.

Every collective blocks when ``stream`` is None; given a stream (``comm.new_stream()``)
it is queued there and returns a :class:`Handle` whose ``wait()`` re-raises errors.
"""
from mpi4py import MPI

from ringnet.backend import bind_device, gpu_available
from ringnet.comm.base import CommunicatorBase, shard_bounds
from ringnet.comm.master_slave import MasterSlaveCommunicator
from ringnet.comm.mpi_transport import MpiTransport
from ringnet.comm.nccl_transport import NcclTransport, nccl_module
from ringnet.comm.ring import RingCommunicator
from ringnet.comm.stream import CpuStream, GpuStream, Handle
from ringnet.comm.transport import CommTimeoutError, Transport
from ringnet.comm.tree import TreeCommunicator

__all__ = ["create", "make_transport", "local_rank", "COMMUNICATORS", "TRANSPORTS",
           "Transport", "MpiTransport", "NcclTransport", "CommTimeoutError",
           "CommunicatorBase", "RingCommunicator", "TreeCommunicator",
           "MasterSlaveCommunicator", "CpuStream", "GpuStream", "Handle", "shard_bounds"]

COMMUNICATORS = {
    "ring": RingCommunicator,
    "tree": TreeCommunicator,
    "master": MasterSlaveCommunicator,
}

TRANSPORTS = {
    "mpi": MpiTransport,
    "nccl": NcclTransport,
}


def local_rank(mpi_comm=None):
    """Return (rank among the ranks on this node, number of ranks on this node)."""
    comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def _own_gpu_everywhere(comm, local_size):
    """Return True on every rank when every rank can have a GPU of its own (collective)."""
    mine = gpu_available() and nccl_module() is not None
    if mine:
        from ringnet.backend import cupy  # noqa: WPS433
        mine = local_size <= cupy.cuda.runtime.getDeviceCount()
    return bool(comm.allreduce(int(mine), op=MPI.MIN))


def make_transport(name="auto", mpi_comm=None, timeout_s=None):
    """Return a transport by name: auto, mpi or nccl (binds this rank's GPU if any)."""
    if name not in ("auto", *TRANSPORTS):
        raise ValueError(f"unknown transport {name!r}: choose auto, {', '.join(TRANSPORTS)}")
    comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
    rank_on_node, ranks_on_node = local_rank(comm)
    if gpu_available():
        bind_device(rank_on_node)
    if name == "auto":
        name = "nccl" if _own_gpu_everywhere(comm, ranks_on_node) else "mpi"
    return TRANSPORTS[name](comm, timeout_s=timeout_s)


def create(name, transport="auto", mpi_comm=None, **options):
    """Return the communicator ``name`` (see the table above) over ``transport``.

    ``transport`` is a name for :func:`make_transport` or a Transport instance;
    ``options`` go to the communicator (e.g. ``chunk_bytes`` for the ring).
    """
    if name not in COMMUNICATORS:
        raise ValueError(f"unknown communicator {name!r}: choose {', '.join(COMMUNICATORS)}")
    return COMMUNICATORS[name](transport, mpi_comm=mpi_comm, **options)
