"""Training on a GPU (CuPy) against the same run on the CPU (NumPy); skipped without a GPU."""
import numpy as np
import pytest
from mpi4py import MPI

from ringnet.backend import gpu_available, to_numpy
from ringnet.config import TrainConfig
from ringnet.train import train

pytestmark = [pytest.mark.gpu, pytest.mark.mpi,
              pytest.mark.skipif(not gpu_available(), reason="needs a usable CUDA GPU (CuPy)")]

BASE = dict(model="digits", dataset="digits", batch_size=32, steps=8, dtype="float64",
            seed=2, progress=False, quiet=True, eval_every_epoch=False)


def _weights(result):
    return np.array(to_numpy(result.strategy.eval_model().params))


@pytest.mark.parametrize("mode, delay", [("single", 0), ("ring", 1), ("tree", 0)])
def test_gpu_run_equals_cpu_run(mode, delay):
    world = MPI.COMM_SELF if mode == "single" else MPI.COMM_WORLD
    cpu = train(TrainConfig(mode=mode, delay=delay, device="cpu", **BASE), world=world)
    gpu = train(TrainConfig(mode=mode, delay=delay, device="gpu", transport="mpi", **BASE),
                world=world)
    a, b = _weights(cpu), _weights(gpu)
    cpu.strategy.close()
    gpu.strategy.close()
    assert gpu.summary["device"] == "gpu"
    assert np.max(np.abs(a - b)) <= 1e-9 * np.max(np.abs(a))
