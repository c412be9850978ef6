"""Every parallel mode on the GPU (CuPy buffers over MPI, ranks sharing the GPUs) against its reference.

Run by ``tests/gpu/run.sh`` under ``mpirun -np 2`` and ``-np 4``; skipped without a GPU.

* delay 0 (ring, tree, master, split-fc): the same weights as ``single`` on the CPU over
  the same global batches, float64, relative difference <= 1e-9; ring, tree and master
  also with a bucket per parameter layer under ``--cuda-graphs on`` (a graph per bucket
  span, each bucket's exchange started between them);
* delay 1 (ring, tree, master): the one-process simulation of
  ``w[t+1] = upd(w[t], G_t(w[t-1]))`` from ``tests/parallel/test_parallel_mpi.py``;
* split-fc delay 1, with and without the activation stream: the one-process simulation of
  its recurrence (conv delayed, FC immediate) from ``tests/parallel/test_split_fc_mpi.py``.
"""
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

pytestmark = [pytest.mark.gpu, pytest.mark.mpi,
              pytest.mark.skipif(not gpu_available(), reason="needs a usable CUDA GPU (CuPy)")]

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


def _trained(mode, delay, **more):
    from ringnet.config import TrainConfig
    from ringnet.train import train
    # delay 1: the compensated recurrence from step 0 (no warm-up), as dp._simulate_delay1
    result = train(TrainConfig(mode=mode, delay=delay, device="gpu", transport="mpi",
                               warmup_steps=0 if delay else None, **dp.BASE, **more), world=WORLD)
    params = flat_params(result.strategy)
    summary = result.summary
    result.strategy.close()
    return params, summary


@pytest.mark.parametrize("mode", ["ring", "tree", "master", "split-fc"])
def test_delay0_on_the_gpu_equals_single_on_the_cpu(mode):
    params, summary = _trained(mode, 0)
    reference, _ = dp._single_reference()
    assert summary["device"] == "gpu" and summary["transport"] == "mpi"
    assert rel_error(params, reference) <= 1e-9, f"{mode} on the GPU differs from single"


@pytest.mark.parametrize("mode", ["ring", "tree", "master"])
def test_delay0_graphs_per_bucket_span_on_the_gpu_equal_single_on_the_cpu(mode, monkeypatch):
    """A bucket per parameter layer, CUDA graphs on: one graph per bucket span, each
    bucket's exchange started between them."""
    monkeypatch.setenv("RINGNET_BUCKET_BYTES", "1")
    params, summary = _trained(mode, 0, cuda_graphs="on")
    reference, _ = dp._single_reference()
    assert summary["cuda_graphs"].startswith("on ("), summary["cuda_graphs"]
    assert rel_error(params, reference) <= 1e-9, f"{mode} graphed on the GPU differs from single"


@pytest.mark.parametrize("mode", ["ring", "tree", "master"])
def test_delay1_on_the_gpu_equals_the_recurrence(mode):
    params, _ = _trained(mode, 1)
    reference = dp._simulate_delay1()
    assert rel_error(params, reference) <= 1e-9, f"{mode} delay 1 on the GPU differs from the recurrence"


@pytest.mark.parametrize("overlap", [False, True])
def test_split_fc_delay1_on_the_gpu_equals_the_recurrence(overlap):
    from ringnet.comm import MpiTransport, create
    from ringnet.models import build_model
    from ringnet.optim import SGD, LRPolicy
    from ringnet.parallel.split_fc import SplitFCStrategy
    steps = 4
    model = build_model("digits", dtype="float64", seed=3, xp=cupy)

    def make_optimizer(n):
        return SGD(n, LRPolicy("fixed", sf.LR), momentum=sf.MOMENTUM, weight_decay=sf.DECAY,
                   xp=cupy, dtype="float64")
    comm = create("ring", transport=MpiTransport(WORLD, device="gpu"))
    strategy = SplitFCStrategy(model, make_optimizer, WORLD, comm, delay=1, overlap=overlap)
    for it, (x, y) in enumerate(sf._batches(model, steps)):
        x, y = sf._mine(x, y)
        strategy.step(cupy.asarray(x), cupy.asarray(y), it)
    strategy.drain()
    params = np.array(to_numpy(strategy.eval_model().params))
    strategy.close()
    reference, _ = sf._simulate_delay1("digits", steps)
    assert rel_error(params, reference) <= 1e-9, f"split-fc delay 1 (overlap {overlap}) on the GPU"
