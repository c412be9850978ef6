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
``auto``   yes  yes  mpi, nccl         all-reduce by the algorithm fastest for the
                                       size and N (direct, recursive doubling,
                                       halving-doubling, ring): see ``comm.auto``
=========  ===  ===  ================  ==============================================

Transports: ``mpi`` (mpi4py; CuPy buffers direct with a CUDA-aware MPI, staged through
pinned host buffers otherwise) and ``nccl`` (``cupy.cuda.nccl``, one GPU per rank, one
NCCL communicator per stream). :func:`make_transport` chooses: ``auto`` takes nccl when
every rank owns a distinct GPU (PCI bus ids gathered over each node) and NCCL loads on
every rank, mpi otherwise, and says why in ``transport.placement``.

Every collective blocks when ``stream`` is None; given a stream (``comm.new_stream()``)
it is queued there and returns a :class:`Handle` whose ``wait()`` re-raises errors.
"""
from mpi4py import MPI  # noqa: F401 - loaded (and MPI initialised) before the rest, as always

from ringnet.comm.auto import AutoCommunicator
from ringnet.comm.base import CommunicatorBase, shard_bounds
from ringnet.comm.factory import (COMMUNICATORS, TRANSPORTS, Placement, bind_gpu, create, local_rank,
                                  make_transport)
from ringnet.comm.master_slave import MasterSlaveCommunicator
from ringnet.comm.mpi_transport import MpiTransport
from ringnet.comm.nccl_transport import NcclTransport
from ringnet.comm.ring import RingCommunicator
from ringnet.comm.stream import CpuStream, GpuStream, Handle
from ringnet.comm.transport import CommTimeoutError, Transport
from ringnet.comm.tree import TreeCommunicator
from ringnet.errors import TransportUnavailable

__all__ = ["create", "make_transport", "local_rank", "bind_gpu", "Placement",
           "COMMUNICATORS", "TRANSPORTS",
           "Transport", "MpiTransport", "NcclTransport", "CommTimeoutError", "TransportUnavailable",
           "CommunicatorBase", "RingCommunicator", "TreeCommunicator",
           "MasterSlaveCommunicator", "AutoCommunicator", "CpuStream", "GpuStream", "Handle", "shard_bounds"]
