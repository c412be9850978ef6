"""Transports and communicators with CuPy buffers; skipped without a GPU.

``tests/gpu/run.sh`` runs these on a GPU machine, also under mpirun.
"""
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
        if nccl_module("cupy") is None:
            pytest.fail("NCCL cannot be loaded by CuPy (install the gpu-cuda12/gpu-cuda13 extra)")
        if N > cupy.cuda.runtime.getDeviceCount():
            pytest.skip("more ranks than GPUs: NCCL refuses them (tested below)")
    return make_transport(kind, device="gpu")


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
def test_ranks_sharing_a_gpu_get_mpi_from_auto_and_a_refusal_from_nccl():
    from ringnet.comm import make_transport
    from ringnet.errors import TransportUnavailable
    if N < 2 or N <= cupy.cuda.runtime.getDeviceCount():
        pytest.skip("needs more ranks than GPUs")
    auto = make_transport("auto", device="gpu")
    assert auto.name == "mpi" and "share GPU" in auto.placement.reason, auto.placement
    auto.close()
    with pytest.raises(TransportUnavailable, match=r"ranks [\d, ]+ share GPU") as info:
        make_transport("nccl", device="gpu")
    assert info.value.reason == "shared-gpu"


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
