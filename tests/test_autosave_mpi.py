"""--save-every K on the real MPI world (N = 1..4): periodic checkpoints are exact and free.

Reference: the checkpoint a separate run of k steps writes at its end (``--steps k
--save``). The periodic checkpoint of step k of a longer run must equal it bit for bit
(weights, momentum, and under delay 1 the weights the next step computes on), and the
longer run must end on the same weights as a run without periodic saves: collecting
the state mid-run (a drain, split-fc's FC gather) does not change the trajectory.
Together with an exact --resume at any N this is what makes a relaunch exact; the
end-to-end test with a killed rank is tests/test_autosave.py.
"""
import numpy as np
import pytest
from mpi4py import MPI

import ringnet.checkpoint
from ringnet.backend import to_numpy
from ringnet.config import TrainConfig
from ringnet.train import train

WORLD = MPI.COMM_WORLD
BASE = dict(model="digits", dataset="digits", batch_size=12, dtype="float64", lr=0.05,
            momentum=0.9, weight_decay=5e-4, seed=3, progress=False, quiet=True,
            eval_every_epoch=False)
MODES = [("ring", 0), ("ring", 1), ("tree", 0), ("tree", 1), ("master", 0), ("master", 1),
         ("split-fc", 0), ("split-fc", 1)]


@pytest.fixture
def recorded(monkeypatch):
    """Record every checkpoint written (rank 0): {step: (params, momentum, prev_params)}."""
    writes = {}
    real = ringnet.checkpoint.save_checkpoint

    def save_checkpoint(path, params, momentum=None, prev_params=None, /, **attrs):
        copy = lambda d: None if d is None else {k: np.array(v) for k, v in d.items()}  # noqa: E731
        writes[attrs["step"]] = (copy(params), copy(momentum), copy(prev_params))
        return real(path, params, momentum, prev_params, **attrs)
    monkeypatch.setattr(ringnet.checkpoint, "save_checkpoint", save_checkpoint)
    return writes


def _difference(a, b, what):
    """Return what differs between two named-tensor dicts, or None."""
    if (a is None) != (b is None):
        return f"{what}: one of the two is missing"
    if a is None:
        return None
    if a.keys() != b.keys():
        return f"{what}: tensor names differ"
    for name in a:
        if not np.array_equal(a[name], b[name]):
            return f"{what}: tensor {name} differs"
    return None


def _agreed(problem):
    """Rank 0's verdict on every rank, so a failure fails every rank (no rank left waiting)."""
    return WORLD.bcast(problem)


@pytest.mark.mpi
@pytest.mark.parametrize("mode, delay", MODES)
def test_periodic_checkpoint_equals_a_run_that_ends_there(tmp_path, recorded, mode, delay):
    if WORLD.Get_size() == 1:
        pytest.skip("parallel modes on one rank add nothing here (tests/test_train.py runs single)")
    path = WORLD.bcast(str(tmp_path / "ck.h5"))
    cfg = TrainConfig(mode=mode, delay=delay, **BASE)
    plain = train(cfg, world=WORLD, steps=10)
    expected = np.array(to_numpy(plain.strategy.eval_model().params))
    plain.strategy.close()

    periodic = train(cfg, world=WORLD, steps=10, save=path, save_every=4)
    got = np.array(to_numpy(periodic.strategy.eval_model().params))
    periodic.strategy.close()
    assert np.array_equal(got, expected), f"{mode} delay {delay}: periodic saves changed the run"
    problem = None
    if WORLD.Get_rank() == 0 and sorted(recorded) != [4, 8, 10]:
        problem = f"checkpoints written at steps {sorted(recorded)}"
    problem = _agreed(problem)
    assert problem is None, problem
    at_8 = recorded.get(8)      # written in the background (the save at 4 is agreed at once)

    # another file: a run refuses to replace the step-10 checkpoint with its step 8
    short = train(cfg, world=WORLD, steps=8, save=WORLD.bcast(str(tmp_path / "short.h5")))
    short.strategy.close()
    problem = None
    if WORLD.Get_rank() == 0:
        for i, what in enumerate(("params", "momentum", "prev_params")):
            problem = problem or _difference(at_8[i], recorded[8][i],
                                             f"{mode} delay {delay} step-8 {what}")
    problem = _agreed(problem)
    assert problem is None, problem


@pytest.mark.mpi
def test_unwritable_checkpoint_stops_at_the_first_periodic_save(tmp_path, monkeypatch):
    """A save that fails is agreed by every rank at the first periodic save: exit 2, no more steps."""
    path = WORLD.bcast(str(tmp_path / "ck.h5"))
    steps_done = []

    def failing_save(path, *args, **attrs):
        steps_done.append(attrs["step"])
        raise ringnet.errors.UsageError(f"cannot write checkpoint {path} (disk full)")
    import ringnet.errors
    from ringnet.autosave import HEARTBEAT_ENV, read_heartbeat
    monkeypatch.setattr(ringnet.checkpoint, "save_checkpoint", failing_save)
    heartbeat = WORLD.bcast(str(tmp_path / "heartbeat"))
    monkeypatch.setenv(HEARTBEAT_ENV, heartbeat)      # rank 0 counts the steps it finished
    cfg = TrainConfig(mode="ring" if WORLD.Get_size() > 1 else "single", delay=0, **BASE)
    with pytest.raises(SystemExit) as exit_info:
        train(cfg, world=WORLD, steps=40, save=path, save_every=5)
    assert exit_info.value.code == 2
    problem = None
    if WORLD.Get_rank() == 0 and (steps_done != [5] or read_heartbeat(heartbeat) != 5):
        problem = f"saves tried at steps {steps_done}, run stopped after {read_heartbeat(heartbeat)}"
    problem = _agreed(problem)
    assert problem is None, problem
