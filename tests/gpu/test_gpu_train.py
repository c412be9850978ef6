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


def test_gpu_dropout_masks_are_the_cpu_masks_bit_for_bit():
    """The mask hash is plain uint64 arithmetic on xp arrays: CuPy gives NumPy's bits."""
    import cupy
    from ringnet.layers.activation import hash_bits, keep_mask
    for key, first, shape in [((3, 0, 14), 0, (64, 256)), ((2**40 + 5, 123456, 7), 1000, (5, 3, 4, 4)),
                              ((0, 2**62, 0), 3, (1, 1))]:
        np.testing.assert_array_equal(cupy.asnumpy(hash_bits(cupy, shape, key, first)),
                                      hash_bits(np, shape, key, first))
        np.testing.assert_array_equal(cupy.asnumpy(keep_mask(cupy, shape, 0.3, key, first)),
                                      keep_mask(np, shape, 0.3, key, first))


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="one process (gpu-n1): ranks would share tmp_path")
def test_gpu_dropout_model_resumes_exactly_and_equals_the_cpu_run(tmp_path):
    """carnet (dropout) on the GPU: 3 steps, save, resume to 6 equals 6 straight, bit for
    bit; and the GPU run equals the CPU run (same masks) to float64 summation order."""
    cfg = dict(BASE, model="carnet", dataset="synthetic", synthetic_size=(48, 12), batch_size=12,
               steps=6, seed=5)
    gpu = TrainConfig(mode="single", delay=0, device="gpu", **cfg)
    straight = train(gpu, world=MPI.COMM_SELF)
    expected = _weights(straight)
    straight.strategy.close()
    path = str(tmp_path / "ck.h5")
    train(gpu, world=MPI.COMM_SELF, steps=3, save=path).strategy.close()
    resumed = train(gpu, world=MPI.COMM_SELF, resume=path)
    got = _weights(resumed)
    resumed.strategy.close()
    assert np.array_equal(got, expected), "GPU resume of a dropout model differs"
    cpu = train(TrainConfig(mode="single", delay=0, device="cpu", **cfg), world=MPI.COMM_SELF)
    reference = _weights(cpu)
    cpu.strategy.close()
    assert np.max(np.abs(expected - reference)) <= 1e-9 * np.max(np.abs(reference))
