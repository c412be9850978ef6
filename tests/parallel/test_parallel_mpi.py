"""Every parallel mode against its independent reference, on the real MPI world (N = 1..4).

* delay 0 (ring, tree, master): the same weights as ``single`` run in-process on the
  whole global batch, float64, relative difference <= 1e-9.
* delay 1: the same weights as a one-process simulation of the recurrence
  (``conftest.simulate_delay1``): by default with the lookahead compensation,
  ``g_t = G_t(w[t-1] + c (w[t-1] - w[t-2]))`` at momentum ``1 - (1 - mu)/k`` and lr
  ``lr/k`` after a synchronous warm-up (``--warmup-steps``; 0 here where the recurrence
  itself is checked, 3 and the default where the warm-up is); with
  ``--delay-compensation none`` the plain ``w[t+1] = upd(w[t], G_t(w[t-1]))``.
* every mode: all replicas bit-identical at the end.
"""
import time

import numpy as np
import pytest
from mpi4py import MPI

from ringnet.backend import to_numpy
from ringnet.comm import RingCommunicator, make_transport, shard_bounds
from ringnet.config import TrainConfig
from ringnet.data import ShardedLoader, open_dataset
from ringnet.models import build_model
from ringnet.optim import SGD, LRPolicy
from ringnet.parallel.ring import RingStrategy
from ringnet.train import train

from conftest import LOOKAHEAD, flat_params, rel_error, simulate_delay1

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()
BATCH = 12          # divisible by 1, 2, 3 and 4
STEPS = 7

BASE = dict(model="digits", dataset="digits", batch_size=BATCH, steps=STEPS, dtype="float64",
            lr=0.05, momentum=0.9, weight_decay=5e-4, seed=3, progress=False, quiet=True,
            eval_every_epoch=False)


def _single_reference():
    result = train(TrainConfig(mode="single", **BASE), world=MPI.COMM_SELF)
    return flat_params(result.strategy), result.summary["train_loss"]


def _simulate_delay1(steps=STEPS, lookahead=LOOKAHEAD, warmup=0):
    """The delayed recurrence in one process on the same global batches (None: plain)."""
    ds = open_dataset("digits", seed=BASE["seed"])
    model = build_model("digits", dtype="float64", seed=BASE["seed"])
    opt = SGD(model.num_params, LRPolicy("fixed", BASE["lr"]), momentum=BASE["momentum"],
              weight_decay=BASE["weight_decay"], dtype="float64")
    loader = ShardedLoader(ds.train, BATCH, seed=BASE["seed"], dtype="float64",
                           mean=ds.mean, std=ds.std, prefetch=0)
    batches = loader.epoch(0)
    weights, _ = simulate_delay1(model, (next(batches) for _ in range(steps)), opt,
                                 lookahead=lookahead, warmup=warmup)
    batches.close()
    ds.close()
    return weights


def _replicas_identical(params):
    everyone = WORLD.allgather(params)
    return all(np.array_equal(everyone[0], p) for p in everyone)


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["ring", "tree", "master"])
def test_delay0_equals_single(mode):
    result = train(TrainConfig(mode=mode, delay=0, **BASE), world=WORLD)
    params = flat_params(result.strategy)
    loss = result.summary["train_loss"]
    identical = _replicas_identical(params)
    result.strategy.close()
    reference, reference_loss = _single_reference()
    assert rel_error(params, reference) <= 1e-9, f"{mode} weights differ from single"
    assert abs(loss - reference_loss) <= 1e-9 * abs(reference_loss)
    assert identical, f"{mode}: replicas differ"


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["ring", "tree", "master", "split-fc"])
def test_delay0_buckets_change_no_bit(mode, monkeypatch):
    """Delay 0 with one bucket per layer (exchanges started during the backward) gives the
    same bits as one exchange after the backward, and equals single."""
    runs = {}
    for size in ("1", "0"):
        monkeypatch.setenv("RINGNET_BUCKET_BYTES", size)
        result = train(TrainConfig(mode=mode, delay=0, **BASE), world=WORLD)
        runs[size] = (flat_params(result.strategy), len(result.strategy.buckets))
        result.strategy.close()
    (bucketed, n_buckets), (whole, none) = runs["1"], runs["0"]
    assert none == 0 and n_buckets >= 2, f"{mode}: {n_buckets} buckets"
    assert np.array_equal(bucketed, whole), f"{mode}: buckets changed the weights"
    assert _replicas_identical(bucketed)
    if mode != "split-fc":      # split-fc against single: tests/parallel/test_split_fc_mpi.py
        reference, _ = _single_reference()
        assert rel_error(bucketed, reference) <= 1e-9


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["ring", "tree", "master", "split-fc"])
def test_delay0_buckets_start_during_the_backward(mode, monkeypatch):
    """Recorded spans: a bucket's exchange starts before the backward of the step that wrote
    it ends (the first layer's backward, which computes no input gradient, is made 0.2 s
    longer, as a larger model's would be)."""
    from ringnet.layers import Conv2d
    from ringnet.stats import subscribe
    monkeypatch.setenv("RINGNET_BUCKET_BYTES", "1")
    backward = Conv2d.backward

    first_layer = []        # (start, end) of each backward of the first layer

    def slow_first_layer(self, d):
        if self.needs_dx:
            return backward(self, d)
        start = time.perf_counter()
        time.sleep(0.2)
        try:
            return backward(self, d)
        finally:
            first_layer.append((start, time.perf_counter()))
    monkeypatch.setattr(Conv2d, "backward", slow_first_layer)
    phase = "conv_backward" if mode == "split-fc" else "forward_backward"
    events = []
    unsubscribe = subscribe(events.append)
    try:
        result = train(TrainConfig(mode=mode, delay=0, **dict(BASE, steps=3)), world=WORLD)
    finally:
        unsubscribe()
    result.strategy.close()
    reduces = [e.start for e in events if e.name == "comm" and e.args.get("op") == "reduce"
               and "bucket" in e.args]
    assert len(first_layer) == 3 and reduces
    steps = [e.start for e in events if e.name == "step"]
    assert len(steps) == 3
    # an exchange that started in step i before step i's first-layer backward ended
    early = [r for r in reduces if any(steps[i] <= r < first_layer[i][1] for i in range(3))]
    assert early, f"{mode}: no bucket's exchange started before the first layer's backward ended"


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["ring", "tree", "master"])
@pytest.mark.parametrize("compensation", [None, "none"])
def test_delay1_equals_simulated_recurrence(mode, compensation):
    # no warm-up: the compensated recurrence from step 0 (the warm-up: the test below)
    warmup = 0 if compensation is None else None
    result = train(TrainConfig(mode=mode, delay=1, delay_compensation=compensation,
                               warmup_steps=warmup, **BASE), world=WORLD)
    params = flat_params(result.strategy)
    identical = _replicas_identical(params)
    result.strategy.close()
    plain = _simulate_delay1(lookahead=None)
    if compensation is None:        # the default: lookahead
        reference = _simulate_delay1()
        assert rel_error(plain, reference) > 1e-4, "the compensation changes nothing here"
        # a wrong look-ahead or a missing momentum correction would be caught
        assert rel_error(_simulate_delay1(lookahead=(LOOKAHEAD[0], 1.0)), reference) > 1e-6
        assert rel_error(_simulate_delay1(lookahead=(1.0, LOOKAHEAD[1])), reference) > 1e-6
    else:
        reference = plain
    assert rel_error(params, reference) <= 1e-9, f"{mode} delay 1 differs from the simulated recurrence"
    assert identical, f"{mode} delay 1: replicas differ"
    # and delay 1 really is a different trajectory from delay 0
    single, _ = _single_reference()
    assert rel_error(params, single) > 1e-6


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["ring", "tree"])
@pytest.mark.parametrize("warmup", [3, None])
def test_delay1_warmup_equals_simulated_recurrence(mode, warmup):
    """The default compensation after W synchronous steps: W = 3 switches inside the run;
    the default W (100 at momentum 0.9) is longer than the run, so it is synchronous SGD."""
    result = train(TrainConfig(mode=mode, delay=1, warmup_steps=warmup, **BASE), world=WORLD)
    params = flat_params(result.strategy)
    assert result.summary["warmup_steps"] == (100 if warmup is None else warmup)
    identical = _replicas_identical(params)
    result.strategy.close()
    single, _ = _single_reference()
    if warmup is None:
        reference = single
    else:
        reference = _simulate_delay1(warmup=warmup)
        for other in (single, _simulate_delay1(warmup=warmup - 1), _simulate_delay1(warmup=0)):
            assert rel_error(other, reference) > 1e-6       # the switch is where it should be
    assert rel_error(params, reference) <= 1e-9, f"{mode} delay 1, warm-up {warmup}: differs"
    assert identical, f"{mode} delay 1: replicas differ"


@pytest.mark.mpi
def test_ring_keeps_the_momentum_of_its_shard_only():
    """Rank r's optimizer holds exactly shard r of the single run's momentum (delay 0)."""
    result = train(TrainConfig(mode="ring", delay=0, **BASE), world=WORLD)
    strategy = result.strategy
    lo, hi = strategy.owned.start, strategy.owned.stop
    mine = np.array(to_numpy(strategy.optimizer.v), dtype=np.float64)
    _, full_momentum, _ = strategy.full_state()       # collective: every shard gathered
    strategy.close()
    bounds = WORLD.allgather((lo, hi))
    single = train(TrainConfig(mode="single", **BASE), world=MPI.COMM_SELF)
    reference = np.array(to_numpy(single.strategy.optimizer.v), dtype=np.float64)
    single.strategy.close()
    assert bounds == shard_bounds(len(reference), WORLD.Get_size()), "shards are not the ring's"
    assert mine.shape == (hi - lo,)
    assert rel_error(mine, reference[lo:hi]) <= 1e-9, f"rank {RANK}'s momentum is not shard {RANK}'s"
    gathered = np.concatenate([full_momentum[name].ravel()
                               for name in single.strategy.model.param_names()])
    assert rel_error(gathered, reference) <= 1e-9, "gathered momentum differs from single"


class _SlowRing(RingCommunicator):
    """A ring whose every collective first sleeps: a slow link, on whichever thread runs it."""
    delay_s = 0.04

    def _reduce_scatter(self, *args):
        time.sleep(self.delay_s)
        super()._reduce_scatter(*args)

    def _allgather(self, *args):
        time.sleep(self.delay_s)
        super()._allgather(*args)


@pytest.mark.mpi
def test_delay1_hides_a_slow_exchange_that_delay0_exposes():
    """Communication slowed on purpose (80 ms a step) behind a compute of 250 ms a step:
    delay 1 leaves almost none of it exposed, delay 0 without buckets exposes all of it."""
    steps, compute_s = 6, 0.25
    ds = open_dataset("digits", seed=0)
    loader = ShardedLoader(ds.train, BATCH, rank=RANK, size=WORLD.Get_size(), seed=0,
                           dtype="float64", mean=ds.mean, std=ds.std, prefetch=0)
    stats = {}
    for delay in (0, 1):
        model = build_model("digits", dtype="float64", seed=0)
        compute = model.loss_and_grad

        def slow_compute(x, y, compute=compute):
            time.sleep(compute_s)               # a long forward/backward that releases the GIL
            return compute(x, y)
        model.loss_and_grad = slow_compute
        ring = _SlowRing(make_transport("mpi", mpi_comm=WORLD))
        strategy = RingStrategy(model, lambda n: SGD(n, LRPolicy("fixed", 0.01), dtype="float64"),
                                WORLD, ring, delay=delay, bucket_size=0)
        batches = loader.epoch(0)
        for it in range(steps):
            strategy.step(*next(batches), it)
        strategy.drain()
        batches.close()
        strategy.close()
        stats[delay] = strategy.stats
    ds.close()
    slow = steps * 2 * _SlowRing.delay_s
    for delay, st in stats.items():
        assert st.comm_total_s >= 0.95 * slow, f"delay {delay}: the slow link was not timed"
    assert stats[0].comm_wait_s >= 0.95 * stats[0].comm_total_s, "delay 0 hid communication"
    assert stats[0].overlap() <= 0.05
    # delay 1: only the last step's exchange (drained after the loop) has no compute to hide behind
    assert stats[1].comm_wait_s <= 0.35 * stats[1].comm_total_s, \
        f"delay 1 exposed {stats[1].comm_wait_s:.3f} s of {stats[1].comm_total_s:.3f} s"
    assert stats[1].overlap() >= 0.65


@pytest.mark.mpi
def test_ring_delay1_reaches_95_percent_on_digits():
    size = WORLD.Get_size()
    result = train(TrainConfig(mode="ring", delay=1, model="digits", dataset="digits",
                               batch_size=60, epochs=20, seed=0, progress=False, quiet=True,
                               eval_every_epoch=False), world=WORLD)
    acc = result.summary["test_accuracy"]
    result.strategy.close()
    assert acc >= 0.95, f"ring delay 1 at N={size}: test accuracy {acc:.3f}"


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
    params = flat_params(strategy)
    strategy.close()
    single = SingleStrategy(_dropout_model(), optimizer)
    for it in range(4):
        single.step(x, y, it)
    reference = np.array(single.eval_model().params)
    no_dropout = _dropout_model()
    assert rel_error(params, reference) <= 1e-9, f"{mode} with dropout differs from single"
    assert not np.allclose(reference, no_dropout.params)   # training moved the weights


@pytest.mark.mpi
@pytest.mark.parametrize("mode, delay, warmup", [("ring", 1, 0), ("ring", 1, 6), ("tree", 0, None),
                                                 ("split-fc", 0, None), ("split-fc", 1, 6)])
def test_resume_continues_the_exact_trajectory(tmp_path, mode, delay, warmup):
    """k steps + checkpoint + resume to k+m equals an uninterrupted k+m run (delay 1 included;
    warm-up 6: checkpoint at step 4 inside it, the switch after the resume)."""
    path = WORLD.bcast(str(tmp_path / "ck.h5"))
    cfg = TrainConfig(mode=mode, delay=delay, warmup_steps=warmup, **dict(BASE, steps=None))
    whole = train(cfg, world=WORLD, steps=9)
    expected = flat_params(whole.strategy)
    whole.strategy.close()
    first = train(cfg, world=WORLD, steps=4, save=path)
    first.strategy.close()
    resumed = train(cfg, world=WORLD, steps=9, resume=path)
    got = flat_params(resumed.strategy)
    resumed.strategy.close()
    assert np.array_equal(got, expected), f"{mode} delay {delay}: resumed run differs"


def count_sends(strategy, model, batch, steps):
    """Run ``steps`` steps of ``strategy`` on random data; return every rank's (bytes sent,
    non-empty sends posted), counted by its transport. Closes the strategy."""
    transport = strategy.transport
    posted = [0]
    isendrecv = transport.isendrecv

    def counting(send_array, *args):          # non-empty sends, as the transport posts them
        posted[0] += send_array is not None and send_array.nbytes > 0
        return isendrecv(send_array, *args)
    transport.isendrecv = counting
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    rng = np.random.default_rng(rank)
    local = batch // size
    for it in range(steps):
        x = rng.normal(size=(local,) + model.input_shape).astype(model.dtype)
        strategy.step(x, rng.integers(0, model.num_classes, size=local), it)
    strategy.drain()
    sent = WORLD.allgather(int(transport.bytes_sent))
    messages = WORLD.allgather(posted[0])
    strategy.close()
    return sent, messages


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["lenet", "digits"])
@pytest.mark.parametrize("mode, delay", [("ring", 0), ("ring", 1), ("tree", 0), ("tree", 1),
                                         ("master", 0), ("split-fc", 0), ("split-fc", 1)])
def test_step_traffic_is_what_a_step_sends(name, mode, delay):
    # the library's per-step account (a pure function of model, N, batch, dtype) against the
    # transport's own counters of a real run: bytes and non-empty sends of every rank
    from ringnet import parallel
    size = WORLD.Get_size()
    model = build_model(name, seed=1)
    strategy = parallel.create(mode, model, lambda k: SGD(k, LRPolicy("fixed", 1e-3)), WORLD,
                               delay=delay, transport="mpi")
    steps = 2
    sent, messages = count_sends(strategy, model, BATCH, steps)
    traffic = parallel.step_traffic(mode, build_model(name), size, BATCH, delay)
    assert sent == [steps * b for b in traffic.sent()], f"{mode} d{delay} N={size}: bytes per rank"
    assert messages == [steps * m for m in traffic.messages()], f"{mode} d{delay}: messages"
    phases = traffic.by_phase()
    assert [sum(p) for p in zip(*phases.values())] == traffic.sent()
    assert (sum(phases["activations"]) > 0) == (mode == "split-fc" and size > 1)
