"""split-fc on the real MPI world (N = 1..4) against independent references.

* delay 0: the same loss and weights as ``single`` run in-process on every rank with
  the whole global batch (float64, relative difference <= 1e-9), LeNet (ip2's 10
  outputs split 4/3/3 at N=3), a small net with dropout, and the digits model through
  ``train()``;
* gradients after one step: each rank's FC rows and conv shard equal the rows / shard
  of the unsplit model's full-batch gradient;
* delay 1: the same weights as a one-process simulation of the recurrence split-fc
  implements (conv delayed, FC immediate), plain and with the lookahead compensation
  (conv part only: look-ahead point, corrected momentum and lr; FC keeps the plain update);
* checkpoints: split-fc -> single and single -> split-fc resume onto the same weights
  as an uninterrupted single run;
* traffic: the bytes every rank sent add up to the closed form of the ring collectives;
* an FC layer with fewer outputs than ranks is refused in the constructor.
"""
import os

import numpy as np
import pytest
from mpi4py import MPI

from ringnet import comm as ringcomm
from ringnet.backend import to_numpy
from ringnet.config import TrainConfig
from ringnet.errors import InputError
from ringnet.layers import Conv2d, Dropout, Flatten, Linear, MaxPool2d, ReLU
from ringnet.models import Model, build_model
from ringnet.optim import SGD, LRPolicy
from ringnet.parallel.single import SingleStrategy
from ringnet.parallel.split_fc import SplitFCStrategy
from ringnet.train import train

from conftest import LOOKAHEAD, flat_params, rel_error, simulate_delay1

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
BATCH = 12          # divisible by 1, 2, 3 and 4
LR, MOMENTUM, DECAY = 0.05, 0.9, 5e-4


def _make_optimizer(n):
    return SGD(n, LRPolicy("fixed", LR), momentum=MOMENTUM, weight_decay=DECAY, dtype="float64")


def _dropout_net(seed=4):
    layers = [("conv1", Conv2d(1, 3, 3, padding=1)), ("relu1", ReLU()), ("pool1", MaxPool2d(2, 2)),
              ("flatten", Flatten()), ("ip1", Linear(3 * 4 * 4, 7)), ("relu2", ReLU()),
              ("drop1", Dropout(0.3, seed=seed + 1)), ("ip2", Linear(7, 5))]
    return Model(layers, (1, 8, 8), 5, dtype="float64", seed=seed, name="dropnet")


def _build(name):
    return _dropout_net() if name == "dropnet" else build_model(name, dtype="float64", seed=3)


def _batches(model, steps, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        yield (rng.normal(size=(BATCH,) + model.input_shape),
               rng.integers(0, model.num_classes, BATCH))


def _mine(x, y):
    b = BATCH // SIZE
    return x[RANK * b:(RANK + 1) * b], y[RANK * b:(RANK + 1) * b]


def _split_fc(model, delay=0, lookahead=None):
    comm = ringcomm.create("ring", transport="mpi", mpi_comm=WORLD)
    return SplitFCStrategy(model, _make_optimizer, WORLD, comm, delay=delay, lookahead=lookahead)


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["lenet", "dropnet"])
def test_delay0_equals_single(name):
    steps = 3
    model = _build(name)
    strategy = _split_fc(model)
    reference = SingleStrategy(_build(name), _make_optimizer)
    losses, ref_losses = [], []
    for it, (x, y) in enumerate(_batches(model, steps)):
        losses.append(strategy.step(*_mine(x, y), it)[0])
        ref_losses.append(reference.step(x, y, it)[0])
    strategy.drain()
    params = flat_params(strategy)
    everyone = WORLD.allgather(params)
    strategy.close()
    ref = np.array(to_numpy(reference.eval_model().params))
    assert rel_error(params, ref) <= 1e-9, f"{name}: split-fc weights differ from single"
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-9, err_msg=f"{name}: loss differs from single")
    assert all(np.array_equal(everyone[0], p) for p in everyone), "assembled models differ across ranks"


@pytest.mark.mpi
def test_gradients_are_the_rows_of_the_full_batch_gradient():
    model = _build("lenet")
    strategy = _split_fc(model)
    x, y = next(_batches(model, 1, seed=7))
    strategy.step(*_mine(x, y), 0)
    strategy.drain()
    grads = np.array(to_numpy(model.grads))
    regions = list(strategy.fc_regions)
    conv = strategy.conv_owned
    strategy.close()
    full = _build("lenet")
    full.loss_and_grad(x, y)                      # unsplit backward on the global batch
    ref = np.array(to_numpy(full.grads))
    scale = np.max(np.abs(ref))
    for a, b in regions + [(conv.start, conv.stop)]:
        assert np.max(np.abs(grads[a:b] - ref[a:b])) <= 1e-10 * scale, \
            f"rank {RANK}: gradient region [{a}, {b}) differs from the full-batch gradient"


def _simulate_delay1(name, steps, lookahead=None, warmup=0):
    """One process: the delayed update on the conv prefix, the FC part updated at once."""
    model = _build(name)
    first = model.layers[model.fc_start()][0]
    conv = model.param_offsets()[f"{first}.weight"][0]
    # element-wise SGD: one optimizer over the whole vector updates both parts alike
    return simulate_delay1(model, _batches(model, steps), _make_optimizer(model.num_params),
                           delayed=conv, lookahead=lookahead, warmup=warmup)


@pytest.mark.mpi
@pytest.mark.parametrize("compensation, warmup", [("none", 0), ("lookahead", 0), ("lookahead", 2)])
def test_delay1_equals_simulated_recurrence(compensation, warmup):
    import dataclasses

    from ringnet.parallel import COMPENSATIONS
    steps = 5
    model = _build("digits")
    lookahead = COMPENSATIONS[compensation]
    if compensation == "lookahead":
        lookahead = dataclasses.replace(lookahead, warmup=warmup)
    strategy = _split_fc(model, delay=1, lookahead=lookahead)
    losses = [strategy.step(*_mine(x, y), it)[0] for it, (x, y) in enumerate(_batches(model, steps))]
    strategy.drain()
    params = flat_params(strategy)
    strategy.close()
    plain, _ = _simulate_delay1("digits", steps)
    reference, ref_losses = plain, _
    if compensation == "lookahead":
        reference, ref_losses = _simulate_delay1("digits", steps, lookahead=LOOKAHEAD,
                                                 warmup=warmup)
        assert rel_error(plain, reference) > 1e-4
        if warmup:
            assert rel_error(_simulate_delay1("digits", steps, LOOKAHEAD)[0], reference) > 1e-6
    immediate = SingleStrategy(_build("digits"), _make_optimizer)
    for it, (x, y) in enumerate(_batches(model, steps)):
        immediate.step(x, y, it)
    assert rel_error(params, reference) <= 1e-9, "split-fc delay 1 differs from the simulated recurrence"
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-9)
    assert rel_error(params, np.array(immediate.eval_model().params)) > 1e-6, "delay 1 equals delay 0"


BASE = dict(model="digits", dataset="digits", batch_size=BATCH, dtype="float64", lr=LR,
            momentum=MOMENTUM, weight_decay=DECAY, seed=3, progress=False, quiet=True,
            eval_every_epoch=False)


def _train_params(world, **kw):
    result = train(TrainConfig(**{**BASE, **kw}), world=world)
    params = np.array(to_numpy(result.strategy.eval_model().params))
    summary = result.summary
    result.strategy.close()
    return params, summary


@pytest.mark.mpi
def test_train_delay0_equals_single_and_reports_fc_memory():
    params, summary = _train_params(WORLD, mode="split-fc", delay=0, steps=5)
    reference, ref_summary = _train_params(MPI.COMM_SELF, mode="single", steps=5)
    assert rel_error(params, reference) <= 1e-9, "train(split-fc) differs from train(single)"
    assert abs(summary["train_loss"] - ref_summary["train_loss"]) <= 1e-9 * ref_summary["train_loss"]
    model = build_model("digits")
    fc = sum(model.named_params()[f"{l}.{s}"].size for l in ("ip1", "ip2") for s in ("weight", "bias"))
    assert summary["fc_params"] == fc and summary["conv_params"] == model.num_params - fc
    # rank 0 holds the ceil(out / N) rows of every FC layer, each row in_features + 1 values
    linear = [layer for _, layer in model.layers if isinstance(layer, Linear)]
    assert summary["fc_params_per_rank"] == sum(-(-l.out_features // SIZE) * (l.in_features + 1)
                                                for l in linear)
    assert sum(summary["fc_params_by_rank"]) == fc


@pytest.mark.mpi
def test_checkpoints_cross_between_split_fc_and_single(mpi_tmp_path):
    folder = str(mpi_tmp_path)      # rank 0's pytest tmp_path, on every rank: pytest removes it
    split_ckpt, single_ckpt = os.path.join(folder, "split.h5"), os.path.join(folder, "single.h5")
    _train_params(WORLD, mode="split-fc", steps=3, save=split_ckpt)
    resumed_single = None
    if RANK == 0:
        resumed_single, _ = _train_params(MPI.COMM_SELF, mode="single", steps=6, resume=split_ckpt)
        _train_params(MPI.COMM_SELF, mode="single", steps=3, save=single_ckpt)
    WORLD.Barrier()
    resumed_split, _ = _train_params(WORLD, mode="split-fc", steps=6, resume=single_ckpt)
    straight, _ = _train_params(MPI.COMM_SELF, mode="single", steps=6)
    if RANK == 0:
        assert rel_error(resumed_single, straight) <= 1e-9, "single resumed from split-fc differs"
    assert rel_error(resumed_split, straight) <= 1e-9, "split-fc resumed from single differs"


@pytest.mark.mpi
def test_bytes_sent_match_the_ring_closed_form():
    steps = 2
    model = _build("lenet")
    strategy = _split_fc(model)
    before = strategy.transport.bytes_sent
    for it, (x, y) in enumerate(_batches(model, steps)):
        strategy.step(*_mine(x, y), it)
    strategy.drain()
    sent = WORLD.allreduce(strategy.transport.bytes_sent - before)
    strategy.close()
    # A ring all-gather or reduce-scatter of L elements moves every shard over N-1 links:
    # (N-1) * L elements in total, whatever the shard sizes.
    features, conv = 800, model.param_offsets()["ip1.weight"][0]
    elements = (BATCH * features                 # data conversion: features of the global batch
                + (500 + 10) * BATCH             # gathered outputs of ip1 and ip2
                + 500 * BATCH                    # ip2's input gradient
                + BATCH * features               # feature gradient back to the samples' ranks
                + 2 * conv)                      # conv gradients and weights
    expected = steps * (SIZE - 1) * (8 * elements + 8 * BATCH)   # float64 values, int64 labels
    assert sent == expected


@pytest.mark.mpi
def test_fc_smaller_than_ranks_is_refused():
    layers = [("flatten", Flatten()), ("ip1", Linear(16, 6)), ("relu", ReLU()), ("ip2", Linear(6, 2))]
    model = Model(layers, (1, 4, 4), 2, dtype="float64", name="tiny")
    comm = ringcomm.create("ring", transport="mpi", mpi_comm=WORLD)
    try:
        strategy = SplitFCStrategy(model, _make_optimizer, WORLD, comm)
    except InputError as exc:
        message = str(exc)
    else:
        strategy.close()
        message = None
    if SIZE > 2:
        assert message == f"layer ip2 has 2 outputs, fewer than the {SIZE} ranks split-fc splits it over"
    else:
        assert message is None, f"2 outputs over {SIZE} ranks must be accepted"
