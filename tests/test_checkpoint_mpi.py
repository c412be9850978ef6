"""Resume continues the exact trajectory of a dropout model (carnet): Dropout masks are a
function of seed, step and global sample, and the checkpoint holds the step. Reference: the
uninterrupted run of the same length, in ring delay 1 and split-fc delay 1 on the MPI world,
and single on one process resumed from a checkpoint the world wrote at another N (tree,
delay 0, float64)."""
import numpy as np
import pytest
from mpi4py import MPI

from ringnet.backend import to_numpy
from ringnet.config import TrainConfig
from ringnet.train import train

WORLD = MPI.COMM_WORLD
BASE = dict(model="carnet", dataset="synthetic", synthetic_size=(48, 12), batch_size=12,
            dtype="float64", lr=0.01, seed=5, progress=False, quiet=True, eval_every_epoch=False)


def _params(result):
    params = np.array(to_numpy(result.strategy.eval_model().params), dtype=np.float64)
    result.strategy.close()
    return params


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["ring", "split-fc"])
def test_dropout_model_resumes_exactly_in_delay1(tmp_path, mode):
    path = WORLD.bcast(str(tmp_path / "ck.h5"))
    # warm-up 4: the checkpoint (step 3) inside it, the switch to the delayed update after
    cfg = TrainConfig(mode=mode, delay=1, warmup_steps=4, **BASE)
    expected = _params(train(cfg, world=WORLD, steps=6))
    _params(train(cfg, world=WORLD, steps=3, save=path))
    got = _params(train(cfg, world=WORLD, steps=6, resume=path))
    assert np.array_equal(got, expected), f"{mode} delay 1: resumed dropout run differs"


@pytest.mark.mpi
def test_dropout_model_resumes_at_another_rank_count(tmp_path):
    path = WORLD.bcast(str(tmp_path / "ck.h5"))
    mode = "tree" if WORLD.Get_size() > 1 else "single"
    _params(train(TrainConfig(mode=mode, delay=0, **BASE), world=WORLD, steps=3, save=path))
    rel = None
    if WORLD.Get_rank() == 0:
        single = TrainConfig(mode="single", delay=0, **BASE)
        expected = _params(train(single, world=MPI.COMM_SELF, steps=6))
        got = _params(train(single, world=MPI.COMM_SELF, steps=6, resume=path))
        rel = np.max(np.abs(got - expected)) / np.max(np.abs(expected))
    rel = WORLD.bcast(rel)      # every rank asserts: a failure on rank 0 alone would hang the rest
    assert rel <= 1e-9, f"single resumed from a {WORLD.Get_size()}-rank checkpoint differs by {rel:.2e}"
