"""The delay-1 compensation in one process, against the recurrence written out here.

The data-parallel strategy without a communicator runs the delayed recurrence in
process (the exchange is the local plan); its weights must equal the written-out
``g_t = G_t(w[t-1] + c (w[t-1] - w[t-2]))``, momentum ``1 - (1 - mu)/k``, lr ``lr/k``.
"""
import numpy as np
import pytest

from ringnet.config import TrainConfig
from ringnet.errors import UsageError
from ringnet.models import build_model
from ringnet.optim import SGD, LRPolicy
from ringnet.parallel import COMPENSATIONS
from ringnet.parallel.base import DataParallelStrategy

LR, MU, WD = 0.05, 0.9, 5e-4
K, C = 5.0, 2.0             # the lookahead defaults, written here on purpose


def _batches(steps, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(8, 1, 8, 8)), rng.integers(0, 10, size=8)) for _ in range(steps)]


def _optimizer(n):
    return SGD(n, LRPolicy("fixed", LR), momentum=MU, weight_decay=WD, dtype="float64")


def _engine_run(compensation, steps):
    strategy = DataParallelStrategy(build_model("digits", dtype="float64", seed=1), _optimizer,
                                    None, delay=1, lookahead=COMPENSATIONS[compensation])
    losses = [float(strategy.step(x, y, it)[0]) for it, (x, y) in enumerate(_batches(steps))]
    return np.array(strategy.eval_model().params), losses


def _written_out(steps, k, c):
    model = build_model("digits", dtype="float64", seed=1)
    mu, lr = 1 - (1 - MU) / k, LR / k
    w = model.params.copy()
    w1 = w2 = w.copy()           # w[t-1], w[t-2]
    v = np.zeros_like(w)
    losses = []
    for t, (x, y) in enumerate(_batches(steps)):
        model.params[...] = w if t == 0 else w1 + c * (w1 - w2)
        losses.append(float(model.loss_and_grad(x, y)[0]))
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


def test_the_compensation_changes_the_trajectory():
    lookahead, _ = _engine_run("lookahead", steps=6)
    plain, _ = _engine_run("none", steps=6)
    assert _rel(lookahead, plain) > 1e-4
    # each of the two ingredients matters: look-ahead point and corrected momentum/lr
    assert _rel(lookahead, _written_out(6, K, 0.0)[0]) > 1e-5
    assert _rel(lookahead, _written_out(6, 1.0, C)[0]) > 1e-5


def test_default_compensation_and_its_checks():
    assert TrainConfig(mode="ring").resolved(2).delay_compensation == "lookahead"
    assert TrainConfig(mode="ring", delay=0).resolved(2).delay_compensation == "none"
    assert TrainConfig(mode="tree", delay=1).resolved(2).delay_compensation == "lookahead"
    assert TrainConfig(mode="ring", delay_compensation="none").resolved(2).delay_compensation == "none"
    with pytest.raises(UsageError, match="--delay 1 only"):
        TrainConfig(mode="ring", delay=0, delay_compensation="lookahead").resolved(2)
    with pytest.raises(UsageError, match="must be one of"):
        TrainConfig(mode="ring", delay_compensation="dc").resolved(2)
