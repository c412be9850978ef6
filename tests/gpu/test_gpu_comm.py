"""Transports and communicators with CuPy buffers; skipped without a GPU.

``tests/gpu/run.sh`` runs these on a GPU machine, also under mpirun.
"""
import os

import numpy as np
import pytest
from mpi4py import MPI

from ringnet.backend import cupy, gpu_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs a usable CUDA GPU with CuPy")]

WORLD = MPI.COMM_WORLD
N, RANK = WORLD.Get_size(), WORLD.Get_rank()


def expected(length):
    """Sum over ranks of (rank+1)*pattern: N(N+1)/2*pattern."""
    return N * (N + 1) / 2 * (np.arange(length) % 7 + 1)


def fill(length, dtype):
    return cupy.asarray((RANK + 1) * (np.arange(length) % 7 + 1), dtype=dtype)


def _transport(kind):
    from ringnet.comm import make_transport
    from ringnet.comm.nccl_transport import nccl_module
    if kind == "nccl":
        if nccl_module() is None:
            pytest.skip("NCCL not loadable by CuPy")
        per_gpu = N > cupy.cuda.runtime.getDeviceCount()
        if per_gpu and os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
            pytest.skip("more ranks than GPUs; set NCCL_MULTI_RANK_GPU_ENABLE=1 to try NCCL")
    return make_transport(kind)


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["mpi", "nccl"])
@pytest.mark.parametrize("name", ["ring", "tree", "master"])
@pytest.mark.parametrize("length", [0, 1, N + 1, 100003])
def test_allreduce_cupy_buffers(kind, name, length):
    from ringnet.comm import create
    transport = _transport(kind)
    comm = create(name, transport=transport)
    buf = fill(length, cupy.float32)
    comm.allreduce(buf)
    first = cupy.asnumpy(buf)
    buf = fill(length, cupy.float32)
    stream = comm.new_stream()
    try:
        handle = comm.allreduce(buf, op="mean", stream=stream)
        handle.wait()
    finally:
        stream.close()
    second = cupy.asnumpy(buf)
    np.testing.assert_allclose(first, expected(length), rtol=1e-6, err_msg=f"{kind} {name} sum")
    np.testing.assert_allclose(second, expected(length) / N, rtol=1e-6, err_msg=f"{kind} {name} mean")


@pytest.mark.mpi
def test_nccl_refuses_two_ranks_on_one_gpu():
    from ringnet.comm.nccl_transport import NcclTransport, nccl_module
    from ringnet.errors import UsageError
    if N < 2 or N <= cupy.cuda.runtime.getDeviceCount() or nccl_module() is None:
        pytest.skip("needs more ranks than GPUs and NCCL")
    if os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1":
        pytest.skip("NCCL_MULTI_RANK_GPU_ENABLE=1 allows sharing")
    with pytest.raises(UsageError, match=r"ranks \d+ and \d+ share GPU"):
        NcclTransport(WORLD)


def test_gpu_stream_reports_errors_at_wait():
    from ringnet.comm import GpuStream
    stream = GpuStream(tag=99)
    try:
        bad = stream.submit(lambda: 1 // 0)
        good = stream.submit(lambda: cupy.arange(5).sum())
        with pytest.raises(ZeroDivisionError):
            bad.wait()
        assert int(good.wait()) == 10
    finally:
        stream.close()
