"""Every parallel mode against its independent reference, on the real MPI world (N = 1..4).

* delay 0 (ring, tree, master): the same weights as ``single`` run in-process on the
  whole global batch, float64, relative difference <= 1e-9.
* delay 1: the same weights as a one-process simulation of the recurrence written out
  below with the bare model and the update formula: by default (lookahead compensation)
  ``g_t = G_t(w[t-1] + c (w[t-1] - w[t-2]))`` with momentum ``1 - (1 - mu)/k`` and lr
  ``lr/k``; with ``--delay-compensation none`` the plain ``w[t+1] = upd(w[t], G_t(w[t-1]))``.
* every mode: all replicas bit-identical at the end.
"""
import numpy as np
import pytest
from mpi4py import MPI

from ringnet.backend import to_numpy
from ringnet.config import TrainConfig
from ringnet.data import ShardedLoader, open_dataset
from ringnet.models import build_model
from ringnet.optim import SGD, LRPolicy
from ringnet.train import train

WORLD = MPI.COMM_WORLD
BATCH = 12          # divisible by 1, 2, 3 and 4
STEPS = 7

BASE = dict(model="digits", dataset="digits", batch_size=BATCH, steps=STEPS, dtype="float64",
            lr=0.05, momentum=0.9, weight_decay=5e-4, seed=3, progress=False, quiet=True,
            eval_every_epoch=False)


def _params(result):
    return np.array(to_numpy(result.strategy.eval_model().params), dtype=np.float64)


def _rel(a, b):
    return float(np.max(np.abs(a - b)) / max(1e-30, np.max(np.abs(b))))


def _single_reference():
    result = train(TrainConfig(mode="single", **BASE), world=MPI.COMM_SELF)
    return _params(result), result.summary["train_loss"]


# the lookahead compensation's constants, written here (not read from ringnet)
LOOKAHEAD_K, LOOKAHEAD_C = 5.0, 2.0


def _simulate_delay1(steps=STEPS, k=LOOKAHEAD_K, c=LOOKAHEAD_C):
    """One process, the delayed recurrence written out (k = 1, c = 0: the plain one)::

        g_t = G_t(w[t-1] + c (w[t-1] - w[t-2]))     (w[-1] = w[0]; g_0 = G_0(w[0]))
        v <- mu' v + lr' (g_t + wd w[t]),  w[t+1] = w[t] - v,  mu' = 1 - (1 - mu)/k, lr' = lr/k
    """
    ds = open_dataset("digits", seed=BASE["seed"])
    model = build_model("digits", dtype="float64", seed=BASE["seed"])
    mu, lr = 1 - (1 - BASE["momentum"]) / k, BASE["lr"] / k
    loader = ShardedLoader(ds.train, BATCH, seed=BASE["seed"], dtype="float64",
                           mean=ds.mean, std=ds.std, prefetch=0)
    w_cur = model.params.copy()
    w_prev = w_prev2 = w_cur.copy()
    v = np.zeros_like(w_cur)
    batches = loader.epoch(0)
    for t in range(steps):
        x, y = next(batches)
        model.params[...] = w_prev + c * (w_prev - w_prev2) if t > 0 else w_cur
        model.loss_and_grad(x, y)
        v = mu * v + lr * (model.grads + BASE["weight_decay"] * w_cur)
        w_prev2, w_prev, w_cur = w_prev, w_cur, w_cur - v
    batches.close()
    ds.close()
    return w_cur


def _replicas_identical(params):
    everyone = WORLD.allgather(params)
    return all(np.array_equal(everyone[0], p) for p in everyone)


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["ring", "tree", "master"])
def test_delay0_equals_single(mode):
    result = train(TrainConfig(mode=mode, delay=0, **BASE), world=WORLD)
    params = _params(result)
    loss = result.summary["train_loss"]
    identical = _replicas_identical(params)
    result.strategy.close()
    reference, reference_loss = _single_reference()
    assert _rel(params, reference) <= 1e-9, f"{mode} weights differ from single"
    assert abs(loss - reference_loss) <= 1e-9 * abs(reference_loss)
    assert identical, f"{mode}: replicas differ"


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["ring", "tree", "master"])
@pytest.mark.parametrize("compensation", [None, "none"])
def test_delay1_equals_simulated_recurrence(mode, compensation):
    result = train(TrainConfig(mode=mode, delay=1, delay_compensation=compensation, **BASE),
                   world=WORLD)
    params = _params(result)
    identical = _replicas_identical(params)
    result.strategy.close()
    plain = _simulate_delay1(k=1, c=0)
    if compensation is None:        # the default: lookahead
        reference = _simulate_delay1()
        assert _rel(plain, reference) > 1e-4, "the compensation changes nothing here"
        # a wrong look-ahead or a missing momentum correction is caught
        assert _rel(_simulate_delay1(c=1.0), reference) > 1e-6
        assert _rel(_simulate_delay1(k=1.0), reference) > 1e-6
    else:
        reference = plain
    assert _rel(params, reference) <= 1e-9, f"{mode} delay 1 differs from the simulated recurrence"
    assert identical, f"{mode} delay 1: replicas differ"
    # and delay 1 really is a different trajectory from delay 0
    single, _ = _single_reference()
    assert _rel(params, single) > 1e-6


@pytest.mark.mpi
def test_ring_keeps_momentum_for_its_shard_only():
    result = train(TrainConfig(mode="ring", delay=1, **BASE), world=WORLD)
    strategy = result.strategy
    n = strategy.model.num_params
    lo, hi = strategy.owned.start, strategy.owned.stop
    sizes = WORLD.allgather(hi - lo)
    momentum = to_numpy(strategy.optimizer.state_dict()["momentum"])
    strategy.close()
    assert len(momentum) == hi - lo
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1


@pytest.mark.mpi
def test_ring_delay1_reaches_95_percent_on_digits():
    size = WORLD.Get_size()
    result = train(TrainConfig(mode="ring", delay=1, model="digits", dataset="digits",
                               batch_size=60, epochs=20, seed=0, progress=False, quiet=True,
                               eval_every_epoch=False), world=WORLD)
    acc = result.summary["test_accuracy"]
    overlap = result.summary["overlap"]
    result.strategy.close()
    assert acc >= 0.95, f"ring delay 1 at N={size}: test accuracy {acc:.3f}"
    assert 0.0 <= overlap <= 1.0


@pytest.mark.mpi
def test_diverged_replicas_are_detected_and_named():
    from ringnet.errors import TrainingError
    from ringnet.train import check_replicas
    size = WORLD.Get_size()
    if size < 2:
        pytest.skip("needs two ranks")
    result = train(TrainConfig(mode="ring", delay=0, **BASE), world=WORLD)
    model = result.strategy.eval_model()
    check_replicas(result.strategy, WORLD, 7)            # identical: no error
    if WORLD.Get_rank() == size - 1:
        model.params[0] += 1e-3
    with pytest.raises(TrainingError, match=rf"rank\(s\) {size - 1} differ"):
        check_replicas(result.strategy, WORLD, 7)
    result.strategy.close()


def _dropout_model():
    from ringnet.layers import Conv2d, Dropout, Flatten, Linear, ReLU
    from ringnet.models import Model
    layers = [("conv1", Conv2d(1, 4, 3, padding=1)), ("relu1", ReLU()), ("flatten", Flatten()),
              ("ip1", Linear(4 * 8 * 8, 16)), ("relu2", ReLU()), ("drop1", Dropout(0.5, seed=7)),
              ("ip2", Linear(16, 10))]
    return Model(layers, (1, 8, 8), 10, dtype="float64", seed=1, name="dropnet")


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["ring", "tree", "master"])
def test_dropout_masks_match_single_at_any_rank_count(mode):
    """With dropout, the same sample gets the same mask at every N: delay 0 still equals single."""
    from ringnet import comm as ringcomm
    from ringnet.parallel.ring import RingStrategy
    from ringnet.parallel.single import SingleStrategy
    from ringnet.parallel.tree import TreeStrategy
    from ringnet.parallel.master import MasterStrategy
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, 1, 8, 8))
    y = rng.integers(0, 10, size=BATCH)

    def optimizer(n):
        return SGD(n, LRPolicy("fixed", 0.1), momentum=0.9, weight_decay=1e-3, dtype="float64")

    cls = {"ring": RingStrategy, "tree": TreeStrategy, "master": MasterStrategy}[mode]
    communicator = ringcomm.create("ring" if mode == "ring" else mode, transport="mpi",
                                   mpi_comm=WORLD)
    strategy = cls(_dropout_model(), optimizer, WORLD, communicator, delay=0)
    part = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
    for it in range(4):
        strategy.step(x[part], y[part], it)
    params = np.array(strategy.eval_model().params)
    strategy.close()
    single = SingleStrategy(_dropout_model(), optimizer)
    for it in range(4):
        single.step(x, y, it)
    reference = np.array(single.eval_model().params)
    no_dropout = _dropout_model()
    assert _rel(params, reference) <= 1e-9, f"{mode} with dropout differs from single"
    assert not np.allclose(reference, no_dropout.params)   # training moved the weights


@pytest.mark.mpi
@pytest.mark.parametrize("mode, delay", [("ring", 1), ("tree", 0), ("split-fc", 0), ("split-fc", 1)])
def test_resume_continues_the_exact_trajectory(tmp_path, mode, delay):
    """k steps + checkpoint + resume to k+m equals an uninterrupted k+m run (delay 1 included)."""
    path = WORLD.bcast(str(tmp_path / "ck.h5"))
    cfg = TrainConfig(mode=mode, delay=delay, **dict(BASE, steps=None))
    whole = train(cfg, world=WORLD, steps=9)
    expected = _params(whole)
    whole.strategy.close()
    first = train(cfg, world=WORLD, steps=4, save=path)
    first.strategy.close()
    resumed = train(cfg, world=WORLD, steps=9, resume=path)
    got = _params(resumed)
    resumed.strategy.close()
    assert np.array_equal(got, expected), f"{mode} delay {delay}: resumed run differs"
