"""The delay-1 compensation in one process, against the recurrence written out here.

The data-parallel strategy without a communicator runs the delayed recurrence in
process (the exchange is the local plan); its weights must equal the written-out
``g_t = G_t(w[t-1] + c (w[t-1] - w[t-2]))``, momentum ``1 - (1 - mu)/k``, lr ``lr/k``.
The stability bounds that choose k are checked against the recurrences iterated on a
quadratic.
"""
import numpy as np
import pytest

from ringnet.config import TrainConfig
from ringnet.errors import UsageError
from ringnet.models import build_model
from ringnet.optim import SGD, LRPolicy
from ringnet.parallel.delayed_update import heavy_ball_bound, lookahead_bound, lookahead_k
from ringnet.parallel import COMPENSATIONS
from ringnet.parallel.base import DataParallelStrategy
from ringnet.parallel.delayed_update import Lookahead

LR, MU, WD = 0.05, 0.9, 5e-4
# the lookahead default at momentum 0.9, written here on purpose:
# k = A (4 A + 2 (1 - mu)) / (A + 1 - mu) with A = 2 (1 + mu) = 3.8, i.e. 58.52 / 3.9
K, C = 15.005128205128205, 2.0


def _batches(steps, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(8, 1, 8, 8)), rng.integers(0, 10, size=8)) for _ in range(steps)]


def _optimizer(n):
    return SGD(n, LRPolicy("fixed", LR), momentum=MU, weight_decay=WD, dtype="float64")


def _engine_run(compensation, steps):
    if compensation == "lookahead":     # the recurrence itself: no synchronous warm-up
        compensation = Lookahead(warmup=0)
    elif isinstance(compensation, str):
        compensation = COMPENSATIONS[compensation]
    strategy = DataParallelStrategy(build_model("digits", dtype="float64", seed=1), _optimizer,
                                    None, delay=1, lookahead=compensation)
    losses = [float(strategy.step(x, y, it)[0]) for it, (x, y) in enumerate(_batches(steps))]
    return np.array(strategy.eval_model().params), losses


def _written_out(steps, k, c, warmup=0):
    """The recurrence; the first ``warmup`` steps synchronous with momentum MU and lr LR."""
    model = build_model("digits", dtype="float64", seed=1)
    w = model.params.copy()
    w1 = w2 = w.copy()           # w[t-1], w[t-2]
    v = np.zeros_like(w)
    losses = []
    for t, (x, y) in enumerate(_batches(steps)):
        model.params[...] = w if t <= warmup else w1 + c * (w1 - w2)
        losses.append(float(model.loss_and_grad(x, y)[0]))
        mu, lr = (MU, LR) if t < warmup else (1 - (1 - MU) / k, LR / k)
        if t == warmup > 0:         # the switch keeps the momentum's coasting: v (1 - mu') / (1 - mu)
            v = v * (1 - mu) / (1 - MU)
        v = mu * v + lr * (model.grads + WD * w)
        w2, w1, w = w1, w, w - v
    return w, losses


def _rel(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("compensation, k, c", [("lookahead", K, C), ("none", 1.0, 0.0)])
def test_engine_follows_the_written_out_recurrence(compensation, k, c):
    params, losses = _engine_run(compensation, steps=6)
    reference, ref_losses = _written_out(6, k, c)
    assert _rel(params, reference) <= 1e-12
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-12)


@pytest.mark.parametrize("warmup", [1, 3, 8])
def test_engine_with_warmup_follows_the_written_out_recurrence(warmup):
    """Synchronous steps t < W (momentum and lr as given, gradient at w[t]), then the
    compensated recurrence from the momentum buffer as the warm-up left it."""
    params, losses = _engine_run(Lookahead(warmup=warmup), steps=6)
    reference, ref_losses = _written_out(6, K, C, warmup)
    assert _rel(params, reference) <= 1e-12
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-12)
    if warmup < 6:      # the switch is really made: not the synchronous run throughout
        assert _rel(params, _written_out(6, 1.0, 0.0, 6)[0]) > 1e-6
        assert _rel(params, _written_out(6, K, C, warmup - 1)[0]) > 1e-6


def test_the_compensation_changes_the_trajectory():
    lookahead, _ = _engine_run("lookahead", steps=6)
    plain, _ = _engine_run("none", steps=6)
    assert _rel(lookahead, plain) > 1e-4
    # each of the two ingredients matters: look-ahead point and corrected momentum/lr
    assert _rel(lookahead, _written_out(6, K, 0.0)[0]) > 1e-5
    assert _rel(lookahead, _written_out(6, 1.0, C)[0]) > 1e-5


def test_default_warmup_is_ten_momentum_spans():
    """The default compensation starts with ceil(10 / (1 - mu)) synchronous steps (100 at
    mu 0.9): for a run shorter than that, delay 1 is synchronous SGD."""
    default = COMPENSATIONS["lookahead"]
    assert [default.warmup_for(mu) for mu in (0.0, 0.5, 0.9, 0.99)] == [10, 20, 100, 1000]
    params, losses = _engine_run(default, steps=6)
    reference, ref_losses = _written_out(6, 1.0, 0.0, warmup=6)      # all synchronous
    assert _rel(params, reference) <= 1e-12
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-12)
    assert TrainConfig(mode="ring").resolved(2).warmup_steps == 100
    assert TrainConfig(mode="ring", momentum=0.5).resolved(2).warmup_steps == 20
    assert TrainConfig(mode="ring", warmup_steps=0).resolved(2).warmup_steps == 0
    assert TrainConfig(mode="ring", delay=0).resolved(2).warmup_steps == 0
    assert TrainConfig(mode="ring", delay_compensation="none").resolved(2).warmup_steps == 0
    for bad, match in ((dict(warmup_steps=-1), "must be >= 0"),
                       (dict(delay=0, warmup_steps=5), "applies to --delay 1"),
                       (dict(delay_compensation="none", warmup_steps=5), "applies to --delay 1")):
        with pytest.raises(UsageError, match=match):
            TrainConfig(mode="ring", **bad).resolved(2)


def test_default_compensation_and_its_checks():
    assert TrainConfig(mode="ring").resolved(2).delay_compensation == "lookahead"
    assert TrainConfig(mode="ring", delay=0).resolved(2).delay_compensation == "none"
    assert TrainConfig(mode="tree", delay=1).resolved(2).delay_compensation == "lookahead"
    assert TrainConfig(mode="ring", delay_compensation="none").resolved(2).delay_compensation == "none"
    with pytest.raises(UsageError, match="--delay 1 only"):
        TrainConfig(mode="ring", delay=0, delay_compensation="lookahead").resolved(2)
    with pytest.raises(UsageError, match="must be one of"):
        TrainConfig(mode="ring", delay_compensation="dc").resolved(2)


def _iterate(a, mu, k=None, c=0.0, steps=8000, warmup=0, rescale=True):
    """Iterate the recurrence on f(w) = w^2 / 2 at lr*h = a from w = 1; yield each |w|.

    ``k=None``: heavy-ball SGD; else the delay-1 recurrence with momentum ``1 - (1 - mu)/k``,
    lr ``a/k`` and the gradient at ``w[t-1] + c (w[t-1] - w[t-2])``, after ``warmup``
    heavy-ball steps whose momentum is divided by k at the switch (``rescale``).
    """
    w2 = w1 = w = 1.0
    v = 0.0
    for t in range(steps):
        if k is None or t < warmup:
            v = mu * v + a * w
        else:
            if t == warmup > 0 and rescale:
                v /= k
            point = w if t == 0 else w1 + c * (w1 - w2)
            v = (1 - (1 - mu) / k) * v + a / k * point
        w2, w1, w = w1, w, w - v
        yield abs(w)


def _grows(a, mu, k=None, c=0.0, steps=8000, warmup=0):
    """True if |w| does not shrink under :func:`_iterate`: compares the largest |w| of the
    last quarter of the steps with that of the second quarter."""
    peaks = [0.0] * 4
    for t, w in enumerate(_iterate(a, mu, k, c, steps, warmup)):
        if w > 1e12:
            return True
        q = 4 * t // steps
        peaks[q] = max(peaks[q], w)
    return peaks[3] > 0 and peaks[3] >= peaks[1]     # all zero: converged exactly


def test_the_switch_keeps_how_far_the_momentum_carries():
    """At lr*h of 1% of heavy ball's bound (a network's first steps): a switch after 5 or
    10 warm-up steps that kept the warm-up's velocity would coast it k times as far and
    overshoot to twice the starting distance; divided by k it never passes the start."""
    mu = 0.9
    k, a = lookahead_k(mu, C), 0.01 * heavy_ball_bound(mu)
    for warmup in (5, 10):
        kept = max(list(_iterate(a, mu, k, C, 3000, warmup, rescale=False))[warmup:])
        rescaled = max(list(_iterate(a, mu, k, C, 3000, warmup))[warmup:])
        assert kept > 1.9 and rescaled < 1.0, (warmup, kept, rescaled)


def test_every_warmup_trains_where_single_does():
    """LeNet on the synthetic set, 160 steps at the default lr and momentum: the delayed
    update after a short warm-up, where the velocity at the switch is that of training's
    first, large gradients, ends at a loss as low as single's (a warm-up of 5 or 10 steps
    reached 17 and 6 when the switch kept the warm-up's velocity; 0, 30 and 100 steps
    trained either way, as the written-out and quadratic tests above also check)."""
    from ringnet.train import train
    base = dict(model="lenet", dataset="synthetic", steps=160, eval_every_epoch=False, quiet=True)
    single = train(TrainConfig(mode="single", **base)).summary["train_loss"]
    for warmup in (2, 5, 10):
        loss = train(TrainConfig(mode="ring", delay=1, warmup_steps=warmup, **base)).summary["train_loss"]
        assert loss < max(10 * single, 0.01), (warmup, loss, single)


@pytest.mark.parametrize("mu", [0.0, 0.5, 0.9, 0.99])
def test_stability_bounds_match_the_iterated_recurrence(mu):
    cases = [(None, 0.0, heavy_ball_bound(mu)), (1.0, 0.0, lookahead_bound(mu, 1.0, 0.0)),
             (5.0, 2.0, lookahead_bound(mu, 5.0, 2.0)), (15.0, 1.5, lookahead_bound(mu, 15.0, 1.5))]
    for k, c, bound in cases:
        assert not _grows(0.95 * bound, mu, k, c), (mu, k, c, bound)
        assert _grows(1.05 * bound, mu, k, c), (mu, k, c, bound)
        assert not _grows(0.05 * bound, mu, k, c), (mu, k, c, bound)
    assert heavy_ball_bound(mu) == pytest.approx(2 * (1 + mu))
    assert lookahead_bound(mu, 1.0, 0.0) == pytest.approx(1 - mu)


@pytest.mark.parametrize("mu", [0.0, 0.5, 0.9, 0.99])
def test_default_k_is_stable_wherever_heavy_ball_is(mu):
    k = COMPENSATIONS["lookahead"].k_for(mu)
    assert k == pytest.approx(lookahead_k(mu, 2.0))
    single = heavy_ball_bound(mu)
    # the iterated delayed recurrence converges up to synchronous SGD's bound ...
    for frac in (0.02, 0.3, 0.7, 0.97):
        assert not _grows(frac * single, mu, k, C), (mu, frac)
    # ... and k is the smallest that does: a slightly smaller k diverges just under it
    assert _grows(0.99 * single, mu, 0.9 * k, C)
    # the earlier fixed k = 5 does not reach it (momentum 0.9: diverges at 40 % of it)
    assert _grows(0.97 * single, mu, 5.0, C)


@pytest.mark.parametrize("mu", [0.0, 0.5, 0.9])
def test_a_synchronous_warmup_keeps_the_stable_range(mu):
    """W heavy-ball steps, then the compensated recurrence from the momentum they left
    (divided by k): stable wherever heavy ball is (each phase is; one switch adds a finite
    transient)."""
    k, single = lookahead_k(mu, C), heavy_ball_bound(mu)
    for warmup in (1, 30, 300):
        for frac in (0.02, 0.5, 0.97):
            assert not _grows(frac * single, mu, k, C, warmup=warmup), (mu, warmup, frac)
        assert _grows(1.05 * single, mu, k, C, warmup=warmup)


def test_default_k_at_momentum_0_9():
    assert COMPENSATIONS["lookahead"].k_for(0.9) == pytest.approx(K, rel=1e-12)
    assert COMPENSATIONS["none"].k_for(0.9) == 1.0 and COMPENSATIONS["none"].plain


def test_warmup_steps_are_recorded_and_kept_by_a_resume(tmp_path):
    """The checkpoint records --warmup-steps; a resume without the flag continues with it
    (the same weights as the uninterrupted run), and a lookahead checkpoint written before
    the warm-up existed (no such attribute) resumes without one."""
    import h5py
    from mpi4py import MPI

    from ringnet.checkpoint import load_checkpoint
    from ringnet.train import train
    base = TrainConfig(mode="ring", delay=1, model="digits", dataset="digits", dtype="float64",
                       progress=False, quiet=True, eval_every_epoch=False)

    def weights(result):
        params = np.array(result.strategy.eval_model().params)
        result.strategy.close()
        return params

    path = str(tmp_path / "ck.h5")
    whole = train(base, world=MPI.COMM_SELF, steps=8, warmup_steps=5)
    assert whole.summary["warmup_steps"] == 5
    expected = weights(whole)
    weights(train(base, world=MPI.COMM_SELF, steps=3, warmup_steps=5, save=path))
    assert load_checkpoint(path)[3]["warmup_steps"] == 5
    resumed = train(base, world=MPI.COMM_SELF, steps=8, resume=path)
    assert resumed.summary["warmup_steps"] == 5
    assert resumed.summary["resumed"]["from_checkpoint"]["warmup_steps"] == 5
    np.testing.assert_array_equal(weights(resumed), expected)
    with h5py.File(path, "a") as f:            # as written before --warmup-steps existed
        del f.attrs["warmup_steps"]
    old = train(base, world=MPI.COMM_SELF, steps=8, resume=path)
    assert old.summary["warmup_steps"] == 0
    no_warmup = weights(old)
    assert _rel(no_warmup, expected) > 1e-6
    # the default (100 steps) would have made steps 3..7 synchronous: not what it was
    default = train(base, world=MPI.COMM_SELF, steps=8, warmup_steps=100)
    assert _rel(no_warmup, weights(default)) > 1e-6
