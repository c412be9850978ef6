"""NcclTransport: GPU-to-GPU transfers with ``cupy.cuda.nccl``, set up over MPI."""
import os
import time

from mpi4py import MPI

from ringnet.backend import cupy, gpu_available, is_gpu_array
from ringnet.comm.transport import CommTimeoutError, Transport, describe
from ringnet.errors import UsageError

__all__ = ["NcclTransport", "nccl_module"]


def nccl_module():
    """Return ``cupy.cuda.nccl`` when NCCL can be loaded, else None."""
    if cupy is None:
        return None
    try:
        from cupy.cuda import nccl  # noqa: WPS433 - optional, loads libnccl
    except Exception:  # noqa: BLE001
        return None
    return nccl if getattr(nccl, "available", False) else None


def _nccl_dtype(nccl, dtype):
    """Map a NumPy dtype to NCCL's enum; None for types NCCL lacks (sent as bytes)."""
    names = {"float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
             "int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32",
             "uint32": "NCCL_UINT32", "int64": "NCCL_INT64", "uint64": "NCCL_UINT64"}
    name = names.get(str(dtype))
    return getattr(nccl, name, None) if name else None


class _Enqueued:
    """A paired NCCL transfer already ordered on the current CUDA stream."""

    __slots__ = ("transport",)

    def __init__(self, transport):
        self.transport = transport

    def wait(self):
        # Later work on the same stream runs after it; only asynchronous errors to check.
        self.transport.check_error()


class NcclTransport(Transport):
    """Transfers between GPUs with NCCL; every rank must own a distinct GPU.

    Two ranks on one GPU are refused (naming both ranks and the device) unless
    ``NCCL_MULTI_RANK_GPU_ENABLE=1`` is set, for NCCL builds that support it.
    """

    name = "nccl"

    def __init__(self, mpi_comm=None, timeout_s=None):
        nccl = nccl_module()
        if not gpu_available() or nccl is None:
            raise UsageError("transport nccl needs a usable CUDA GPU and CuPy with NCCL "
                             "(pip install nvidia-nccl-cu12); use --transport mpi")
        parent = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        super().__init__(parent.Dup(), timeout_s)
        self.nccl = nccl
        self.device_id = cupy.cuda.Device().id
        self._check_devices()
        uid = nccl.get_unique_id() if self.rank == 0 else None
        self._unique_id = self.mpi_comm.bcast(uid, root=0)
        self._nccl_comm = None

    def _check_devices(self):
        """Refuse two ranks on one GPU (same host, same PCI bus id) unless enabled."""
        bus_id = cupy.cuda.Device(self.device_id).pci_bus_id
        places = self.mpi_comm.allgather((MPI.Get_processor_name(), bus_id))
        if os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1":
            return
        seen = {}
        for rank, place in enumerate(places):
            if place in seen:
                raise UsageError(f"ranks {seen[place]} and {rank} share GPU {place[1]} on "
                                 f"{place[0]}; NCCL needs one GPU per rank (use --transport mpi, "
                                 "or set NCCL_MULTI_RANK_GPU_ENABLE=1 where NCCL supports it)")
            seen[place] = rank

    @property
    def nccl_comm(self):
        """The NCCL communicator, created at first use.

        Created lazily because NCCL binds a communicator to the CUDA device that is
        current when it is initialised: by first use the rank's device is bound. Its
        creation is collective, so the first operation must involve every rank.
        """
        if self._nccl_comm is None:
            with cupy.cuda.Device(self.device_id):
                self._nccl_comm = self.nccl.NcclCommunicator(self.size, self._unique_id, self.rank)
        return self._nccl_comm

    def uses_gpu(self):
        return True

    def check_error(self):
        """Raise if NCCL reported an asynchronous error (e.g. a peer failed)."""
        check = getattr(self._nccl_comm, "check_async_error", None)
        if check is not None:
            check()

    def _args(self, array):
        dtype = _nccl_dtype(self.nccl, array.dtype)
        if dtype is None:
            return array.data.ptr, array.nbytes, self.nccl.NCCL_UINT8
        return array.data.ptr, array.size, dtype

    def isendrecv(self, send_array, send_peer, recv_array, recv_peer):
        """Enqueue send and receive on the current CUDA stream inside one NCCL group."""
        self._check_pair(send_array, send_peer, recv_array, recv_peer)
        for array in (send_array, recv_array):
            if array is not None and not is_gpu_array(array):
                raise ValueError("transport nccl moves CuPy arrays only; use transport mpi for NumPy")
        send_bytes = 0 if send_array is None else send_array.nbytes
        recv_bytes = 0 if recv_array is None else recv_array.nbytes
        comm = self.nccl_comm
        stream = cupy.cuda.get_current_stream().ptr
        # A lone send and a lone receive in opposite orders deadlock: group them.
        self.nccl.groupStart()
        try:
            if send_bytes:
                ptr, count, dtype = self._args(send_array)
                comm.send(ptr, count, dtype, send_peer, stream)
            if recv_bytes:
                ptr, count, dtype = self._args(recv_array)
                comm.recv(ptr, count, dtype, recv_peer, stream)
        finally:
            self.nccl.groupEnd()
        self._count(send_bytes, recv_bytes)
        return _Enqueued(self)

    def finish(self, what="stream"):
        """Wait for the current CUDA stream, raising CommTimeoutError past the timeout."""
        event = cupy.cuda.get_current_stream().record()
        start = time.perf_counter()
        while not event.done:
            self.check_error()
            if time.perf_counter() - start > self.timeout_s:
                self._nccl_comm.abort()
                raise CommTimeoutError(f"{what} did not complete within {self.timeout_s:g} s")
            time.sleep(1e-4)

    def allreduce_native(self, buf, op="sum"):
        """ncclAllReduce in place on the current stream."""
        ptr, count, dtype = self._args(buf)
        self.nccl_comm.allReduce(ptr, ptr, count, dtype, self.nccl.NCCL_SUM,
                                 cupy.cuda.get_current_stream().ptr)
        self.finish(describe("allreduce", None, None, buf.nbytes))

    def close(self):
        if self._nccl_comm is not None:
            self._nccl_comm.destroy()
            self._nccl_comm = None
        if self.mpi_comm is not None:
            self.mpi_comm.Free()
            self.mpi_comm = None
