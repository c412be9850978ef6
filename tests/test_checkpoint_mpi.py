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


@pytest.mark.mpi
def test_a_synchronous_checkpoint_resumes_into_ring_delay1_with_its_warmup(tmp_path):
    """A single-mode checkpoint resumed into ring delay 1 takes ring's own default warm-up
    (counted from step 0): its synchronous steps are the single run's, so the resumed run
    is the uninterrupted ring delay-1 run. A warm-up of 0 (the single checkpoint's) would
    start the delayed update at once."""
    path = WORLD.bcast(str(tmp_path / "single.h5"))
    if WORLD.Get_rank() == 0:
        _params(train(TrainConfig(mode="single", delay=0, **BASE), world=MPI.COMM_SELF,
                      steps=3, save=path))
    WORLD.Barrier()
    ring = TrainConfig(mode="ring", delay=1, **BASE)
    expected = _params(train(ring, world=WORLD, steps=6))
    resumed = train(ring, world=WORLD, steps=6, resume=path)
    assert resumed.summary["warmup_steps"] == resumed.summary["resumed"]["followed_mode"]["warmup_steps"] > 6
    got = _params(resumed)
    rel = np.max(np.abs(got - expected)) / np.max(np.abs(expected))
    assert rel <= 1e-9, f"ring delay 1 resumed from single differs by {rel:.2e}"


@pytest.mark.mpi
@pytest.mark.parametrize("mode,delay", [("single", 0), ("tree", 0), ("ring", 0)])
def test_a_ring_delay1_checkpoint_resumes_in_a_synchronous_mode(tmp_path, mode, delay):
    """A ring delay-1 checkpoint inside its warm-up (synchronous so far) resumed in a mode
    without the look-ahead drops the warm-up and continues as the uninterrupted synchronous
    run of that mode."""
    path = WORLD.bcast(str(tmp_path / "ring.h5"))
    _params(train(TrainConfig(mode="ring", delay=1, **BASE), world=WORLD, steps=3, save=path))
    world = MPI.COMM_SELF if mode == "single" else WORLD
    rel = None
    if mode != "single" or WORLD.Get_rank() == 0:
        cfg = TrainConfig(mode=mode, delay=delay, **BASE)
        expected = _params(train(cfg, world=world, steps=6))
        resumed = train(cfg, world=world, steps=6, resume=path)
        assert resumed.summary["warmup_steps"] == 0
        assert "dropped" in resumed.summary["resumed"]["followed_mode"]["why"]
        got = _params(resumed)
        rel = np.max(np.abs(got - expected)) / np.max(np.abs(expected))
    rel = WORLD.bcast(rel)
    assert rel <= 1e-9, f"{mode} delay {delay} resumed from ring delay 1 differs by {rel:.2e}"


@pytest.mark.mpi
def test_a_resume_without_model_takes_the_checkpoints(tmp_path):
    path = WORLD.bcast(str(tmp_path / "ck.h5"))
    mode = "ring" if WORLD.Get_size() > 1 else "single"
    cfg = TrainConfig(mode=mode, **BASE)
    expected = _params(train(cfg, world=WORLD, steps=5))
    _params(train(cfg, world=WORLD, steps=2, save=path))
    without = dict(BASE, model=None)
    resumed = train(TrainConfig(mode=mode, **without), world=WORLD, steps=5, resume=path)
    assert resumed.summary["model"] == "carnet"
    assert resumed.summary["resumed"]["from_checkpoint"]["model"] == "carnet"
    assert np.array_equal(_params(resumed), expected)
