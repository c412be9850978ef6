"""CUDA graphs on a GPU: the cuBLAS route, its capture, and replayed steps against eager ones,
bit for bit (the same checks as tests/test_graphs.py, on the real device); skipped without
a GPU."""
import numpy as np
import pytest

from ringnet import graphs, models, optim
from ringnet.backend import gpu_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs a usable CUDA GPU (CuPy)")]


@pytest.fixture
def cupy():
    import cupy
    from ringnet.layers import gemm
    gemm.enable(False)
    yield cupy
    assert not gemm.enabled(), "the cuBLAS route outlived the graph step"


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_cublas_route_multiplies_every_layout_as_cupy_does(cupy, dtype):
    from ringnet.layers import gemm
    rng = np.random.default_rng(0)
    a = cupy.asarray(rng.normal(size=(37, 53)).astype(dtype))
    b = cupy.asarray(rng.normal(size=(53, 29)).astype(dtype))
    for left in (a, cupy.asfortranarray(a), cupy.asarray(rng.normal(size=(53, 37)).astype(dtype)).T):
        for right in (b, cupy.asfortranarray(b), b[:, :29]):
            for out in (cupy.empty((37, 29), dtype), cupy.empty((29, 37), dtype).T):
                with gemm.routed():
                    gemm.matmul(cupy, left, right, out=out)
                want = cupy.matmul(left, right)
                tol = 1e-4 if dtype == "float32" else 1e-12
                np.testing.assert_allclose(cupy.asnumpy(out), cupy.asnumpy(want), rtol=tol, atol=tol)


def test_a_captured_gemm_replays_on_new_contents(cupy):
    from ringnet.layers import gemm
    backend = graphs.CudaGraphs(cupy)
    a = cupy.ones((16, 8), dtype=np.float32)
    b = cupy.ones((8, 4), dtype=np.float32)
    out = cupy.zeros((16, 4), dtype=np.float32)
    with gemm.routed():
        gemm.matmul(cupy, a, b, out=out)                 # the handle made before capturing
        graph, _ = backend.capture(lambda: gemm.matmul(cupy, a, b, out=out))
    a[...] = 2.0
    backend.launch(graph)
    cupy.cuda.get_current_stream().synchronize()
    assert float(out[0, 0]) == 16.0


def _run(cupy, name, steps, off):
    model = models.build_model(name, xp=cupy, seed=0)
    opt = optim.SGD(model.num_params, optim.LRPolicy("inv", 0.01, gamma=0.1, power=0.75),
                    momentum=0.9, weight_decay=5e-4, xp=cupy, dtype=model.dtype)
    step = graphs.GraphStep(model, opt, graphs.CudaGraphs(cupy), strict=True)
    if off:
        step.off = "eager reference"                     # the same step, never captured
    rng = np.random.default_rng(1)
    losses = []
    for it in range(steps):
        x = rng.normal(size=(16,) + model.input_shape).astype(np.float32)
        y = rng.integers(0, model.num_classes, 16)
        losses.append(step.step(x, y, it)[0])
    return cupy.asnumpy(model.params), [float(v) for v in losses], step


@pytest.mark.parametrize("name", ["lenet", "cifar10_quick", "carnet"])
def test_replayed_steps_equal_eager_steps_bit_for_bit(cupy, name):
    want = _run(cupy, name, 6, off=True)
    got = _run(cupy, name, 6, off=False)
    assert got[2].replays == 6 - graphs.WARMUP and got[2].off is None
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1] == want[1]


def test_a_training_run_with_graphs_on_learns_as_without(cupy):
    from mpi4py import MPI
    from ringnet.config import TrainConfig
    from ringnet.train import train
    base = dict(mode="single", model="digits", dataset="digits", batch_size=32, steps=30, seed=2,
                progress=False, quiet=True, eval_every_epoch=False, device="gpu")
    on = train(TrainConfig(cuda_graphs="on", **base), world=MPI.COMM_SELF)
    off = train(TrainConfig(cuda_graphs="off", **base), world=MPI.COMM_SELF)
    for run in (on, off):
        run.strategy.close()
    assert on.summary["cuda_graphs"] == "on (28 steps replayed)", on.summary["cuda_graphs"]
    assert off.summary["cuda_graphs"] == "off (asked for)"
    assert abs(on.summary["train_loss"] - off.summary["train_loss"]) < 1e-3


def test_a_bucketed_delay0_ring_with_graphs_on_learns_as_without(cupy, monkeypatch):
    """One graph per bucket span, each bucket's exchange started between them (N = 1)."""
    from mpi4py import MPI
    from ringnet.config import TrainConfig
    from ringnet.train import train
    monkeypatch.setenv("RINGNET_BUCKET_BYTES", "1")          # a bucket per parameter layer
    base = dict(mode="ring", delay=0, model="lenet", dataset="synthetic", batch_size=32,
                steps=20, seed=2, progress=False, quiet=True, eval_every_epoch=False,
                device="gpu", transport="mpi")
    on = train(TrainConfig(cuda_graphs="on", **base), world=MPI.COMM_SELF)
    off = train(TrainConfig(cuda_graphs="off", **base), world=MPI.COMM_SELF)
    assert len(on.strategy.graphs.graph) == 4 and on.strategy.graphs.splits
    for run in (on, off):
        run.strategy.close()
    assert on.summary["cuda_graphs"] == "on (18 steps replayed)", on.summary["cuda_graphs"]
    assert abs(on.summary["train_loss"] - off.summary["train_loss"]) < 1e-3


def test_the_cublas_workspace_outlives_the_graph_steps_pool(cupy):
    """The handle is made by the first GEMM, inside a graph step's private pool; once that
    step is closed and collected, the handle's GEMMs still run right."""
    import gc
    from ringnet.layers import gemm
    gemm.release()                                       # the next routed GEMM makes the handle
    _run(cupy, "lenet", graphs.WARMUP + 2, off=False)[2].close()
    gc.collect()
    cupy.get_default_memory_pool().free_all_blocks()
    junk = cupy.full(64 << 20, 7, dtype=np.uint8)        # reuse whatever went back to CUDA
    a = cupy.ones((256, 128), dtype=np.float32)
    out = cupy.zeros((256, 64), dtype=np.float32)
    with gemm.routed():
        gemm.matmul(cupy, a, cupy.ones((128, 64), dtype=np.float32), out=out)
    cupy.cuda.get_current_stream().synchronize()
    assert float(out.min()) == float(out.max()) == 128.0
    del junk
