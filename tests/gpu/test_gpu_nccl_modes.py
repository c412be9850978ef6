"""Every parallel mode over NCCL, one rank per GPU, against its reference; skipped elsewhere.

Run by ``tests/gpu/run.sh`` (stage ``multi-gpu``) under ``mpirun -np G`` on a host with
G >= 2 GPUs; skipped with fewer GPUs than ranks, with one rank, or without CuPy's NCCL.

* delay 0 (ring, tree, master, split-fc): the same weights as ``single`` on the CPU over
  the same global batches, float64, relative difference <= 1e-9; ring, tree and master
  also with a bucket per parameter layer under ``--cuda-graphs on`` (a graph per bucket
  span, each bucket's exchange started between them);
* delay 1 (ring, tree, master): the one-process simulation of the recurrence from
  ``tests/parallel/test_parallel_mpi.py``; split-fc delay 1, with and without the activation
  stream (three NCCL communicators busy on each GPU): its recurrence from
  ``tests/parallel/test_split_fc_mpi.py``;
* after each run this process has a CUDA context on its own GPU only: no thread of the
  transport (the caller's, a stream's, the watchdog's) touched another one.
"""
import ctypes
import os
import sys

import numpy as np
import pytest
from mpi4py import MPI

from ringnet.backend import cupy, gpu_available, to_numpy

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "parallel"))
import test_parallel_mpi as dp  # noqa: E402  (the CPU references)
import test_split_fc_mpi as sf  # noqa: E402
from conftest import flat_params, rel_error  # noqa: E402

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


def _why_not():
    if not gpu_available():
        return "needs a usable CUDA GPU (CuPy)"
    from ringnet.comm.nccl_transport import nccl_module
    if nccl_module("cupy") is None:
        return "CuPy cannot load NCCL"
    if SIZE < 2 or SIZE > cupy.cuda.runtime.getDeviceCount():
        return "needs 2 or more ranks, one GPU each"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.mpi,
              pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))]


def _contexts():
    """Return the CUDA devices on which this process has an active primary context."""
    driver = ctypes.CDLL("libcuda.so.1")
    assert driver.cuInit(0) == 0
    count = ctypes.c_int()
    assert driver.cuDeviceGetCount(ctypes.byref(count)) == 0
    active = []
    for ordinal in range(count.value):
        device, flags, on = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        assert driver.cuDeviceGet(ctypes.byref(device), ordinal) == 0
        assert driver.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(on)) == 0
        if on.value:
            active.append(ordinal)
    return active


@pytest.fixture(autouse=True)
def _only_this_ranks_gpu():
    yield
    assert _contexts() == [cupy.cuda.Device().id], \
        f"rank {RANK} has CUDA contexts on GPUs {_contexts()}, its own is {cupy.cuda.Device().id}"


def _trained(mode, delay, **more):
    from ringnet.config import TrainConfig
    from ringnet.train import train
    # delay 1: the compensated recurrence from step 0 (no warm-up), as dp._simulate_delay1
    result = train(TrainConfig(mode=mode, delay=delay, device="gpu", transport="nccl",
                               warmup_steps=0 if delay else None, **dp.BASE, **more), world=WORLD)
    params = flat_params(result.strategy)
    summary = result.summary
    result.strategy.close()
    result.strategy.transport.close()
    return params, summary


@pytest.mark.parametrize("mode", ["ring", "tree", "master", "split-fc"])
def test_delay0_over_nccl_equals_single_on_the_cpu(mode):
    params, summary = _trained(mode, 0)
    reference, _ = dp._single_reference()
    assert summary["device"] == "gpu" and summary["transport"] == "nccl", summary
    assert rel_error(params, reference) <= 1e-9, f"{mode} over NCCL differs from single"


@pytest.mark.parametrize("mode", ["ring", "tree", "master"])
def test_delay0_graphs_per_bucket_span_over_nccl_equal_single_on_the_cpu(mode, monkeypatch):
    """A bucket per parameter layer, CUDA graphs on: one graph per bucket span, each
    bucket's NCCL exchange started between them."""
    monkeypatch.setenv("RINGNET_BUCKET_BYTES", "1")
    params, summary = _trained(mode, 0, cuda_graphs="on")
    reference, _ = dp._single_reference()
    assert summary["cuda_graphs"].startswith("on ("), summary["cuda_graphs"]
    assert rel_error(params, reference) <= 1e-9, f"{mode} graphed over NCCL differs from single"


@pytest.mark.parametrize("mode", ["ring", "tree", "master"])
def test_delay1_over_nccl_equals_the_recurrence(mode):
    params, summary = _trained(mode, 1)
    reference = dp._simulate_delay1()
    assert summary["transport"] == "nccl", summary
    assert rel_error(params, reference) <= 1e-9, f"{mode} delay 1 over NCCL differs from the recurrence"


@pytest.mark.parametrize("overlap", [False, True])
def test_split_fc_delay1_over_nccl_equals_the_recurrence(overlap):
    from ringnet.comm import NcclTransport, bind_gpu, create
    from ringnet.models import build_model
    from ringnet.optim import SGD, LRPolicy
    from ringnet.parallel.split_fc import SplitFCStrategy
    steps = 4
    bind_gpu(WORLD)                          # first: the model's buffers on this rank's GPU
    model = build_model("digits", dtype="float64", seed=3, xp=cupy)

    def make_optimizer(n):
        return SGD(n, LRPolicy("fixed", sf.LR), momentum=sf.MOMENTUM, weight_decay=sf.DECAY,
                   xp=cupy, dtype="float64")
    transport = NcclTransport(WORLD)
    strategy = SplitFCStrategy(model, make_optimizer, WORLD, create("ring", transport=transport),
                               delay=1, overlap=overlap)
    for it, (x, y) in enumerate(sf._batches(model, steps)):
        x, y = sf._mine(x, y)
        strategy.step(cupy.asarray(x), cupy.asarray(y), it)
    strategy.drain()
    params = np.array(to_numpy(strategy.eval_model().params))
    strategy.close()
    transport.close()
    reference, _ = sf._simulate_delay1("digits", steps)
    assert rel_error(params, reference) <= 1e-9, f"split-fc delay 1 (overlap {overlap}) over NCCL"
