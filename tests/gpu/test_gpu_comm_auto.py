"""auto's algorithms and the pipelined tree/master with CuPy buffers; skipped without a GPU.

Over MPI (ranks sharing a GPU stage through pinned host buffers, where transfers go one at
a time) and over NCCL (one rank per GPU). Integers in float64: every sum is exact.
"""
import numpy as np
import pytest
from mpi4py import MPI

from ringnet.backend import cupy, gpu_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs a usable CUDA GPU with CuPy")]

WORLD = MPI.COMM_WORLD
N, RANK = WORLD.Get_size(), WORLD.Get_rank()


def integers(length, rank):
    return (np.arange(length) * 7 + 3 * rank * rank + 1) % 1013.0


def _transport(kind):
    from ringnet.comm import make_transport
    from ringnet.comm.nccl_transport import nccl_module
    if kind == "nccl" and (nccl_module("cupy") is None or N > cupy.cuda.runtime.getDeviceCount()):
        pytest.skip("NCCL needs one GPU per rank and CuPy's NCCL")
    return make_transport(kind, device="gpu")


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["mpi", "nccl"])
@pytest.mark.parametrize("length", [0, 1, N + 1, 100003])
def test_every_algorithm_and_rooted_pieces_on_cupy(kind, length):
    from ringnet.comm import create
    transport = _transport(kind)
    comms = {a: create("auto", transport=transport, algorithm=a)
             for a in ("direct", "rd", "rhd", "ring")}
    comms["tree"] = create("tree", transport=transport, chunk_bytes=4096)
    comms["master"] = create("master", transport=transport, chunk_bytes=4096)
    results = {}
    for name, comm in comms.items():
        buf = cupy.asarray(integers(length, RANK))
        comm.allreduce(buf)
        stream = comm.new_stream()
        again = cupy.asarray(integers(length, RANK))
        comm.allreduce(again, stream=stream).wait()
        stream.close()
        results[name] = (cupy.asnumpy(buf), cupy.asnumpy(again))
    expected = sum(integers(length, r) for r in range(N))
    for name, (blocking, on_stream) in results.items():
        np.testing.assert_array_equal(blocking, expected, err_msg=f"{kind} {name}")
        np.testing.assert_array_equal(on_stream, expected, err_msg=f"{kind} {name} on a stream")
