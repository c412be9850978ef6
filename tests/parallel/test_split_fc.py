"""split-fc pieces in one process: a Linear layer split by output neurons over simulated ranks.

References: the unsplit ``ringnet.layers.Linear`` and plain NumPy for the forward,
central finite differences (float64) for dW, db and dX of the split layer; the
refusal of FC layers smaller than the rank count by its message.
"""
import numpy as np
import pytest

from ringnet.comm import shard_bounds
from ringnet.errors import InputError
from ringnet.layers import Conv2d, Dropout, Flatten, Linear, MaxPool2d, ReLU
from ringnet.models import Model
from ringnet.parallel.split_fc import FcSlice, check_split, fc_blocks

IN, OUT, BATCH = 7, 10, 5


def _split(weight, bias, ranks):
    """Return one FcSlice per simulated rank (views of weight/bias rows) and their bounds."""
    bounds = shard_bounds(weight.shape[0], ranks)
    slices = []
    for lo, hi in bounds:
        slices.append(FcSlice(weight[lo:hi], bias[lo:hi], np.empty((hi - lo, IN)), np.empty(hi - lo)))
    return slices, bounds


def _layer_output(slices, bounds, x):
    """Return the (B, out) output assembled from every slice's (out_r, B) block."""
    z = np.empty((OUT, x.shape[0]))
    for s, (lo, hi) in zip(slices, bounds):
        s.forward(x.T, z[lo:hi])
    return z.T


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_split_forward_equals_unsplit_linear(ranks):
    rng = np.random.default_rng(ranks)
    weight, bias, x = rng.normal(size=(OUT, IN)), rng.normal(size=OUT), rng.normal(size=(BATCH, IN))
    linear = Linear(IN, OUT)
    linear.bind({"weight": weight, "bias": bias}, {"weight": np.empty_like(weight),
                                                   "bias": np.empty_like(bias)})
    slices, bounds = _split(weight, bias, ranks)
    got = _layer_output(slices, bounds, x)
    assert [hi - lo for lo, hi in bounds] == [len(r) for r in np.array_split(np.arange(OUT), ranks)]
    np.testing.assert_allclose(got, linear.forward(x), rtol=1e-13, atol=1e-13,
                               err_msg="split forward differs from the unsplit Linear")
    np.testing.assert_allclose(got, x @ weight.T + bias, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_split_backward_equals_finite_differences(ranks):
    rng = np.random.default_rng(10 + ranks)
    weight, bias, x = rng.normal(size=(OUT, IN)), rng.normal(size=OUT), rng.normal(size=(BATCH, IN))
    probe = rng.normal(size=(BATCH, OUT))       # loss = sum(probe * z): dL/dz = probe

    def loss(w, b, xx):
        s, bd = _split(w, b, ranks)
        return float(np.sum(probe * _layer_output(s, bd, xx)))

    slices, bounds = _split(weight, bias, ranks)
    dx_total = np.zeros((BATCH, IN))
    da_total = np.zeros((IN, BATCH))
    for s, (lo, hi) in zip(slices, bounds):
        dz = np.ascontiguousarray(probe[:, lo:hi].T)            # this rank's columns, (out_r, B)
        dx, da = np.empty((BATCH, IN)), np.empty((IN, BATCH))
        s.backward(dz, x.T, da=da, dx=dx)
        dx_total += dx                                           # what reduce-scatter sums
        da_total += da
    dweight = np.concatenate([s.dweight for s in slices])
    dbias = np.concatenate([s.dbias for s in slices])

    def fd(array):
        grad, eps = np.empty_like(array), 1e-6
        for i in np.ndindex(array.shape):
            old = array[i]
            array[i] = old + eps
            up = loss(weight, bias, x)
            array[i] = old - eps
            down = loss(weight, bias, x)
            array[i] = old
            grad[i] = (up - down) / (2 * eps)
        return grad

    for name, got, ref in (("dW", dweight, fd(weight)), ("db", dbias, fd(bias)),
                           ("dX", dx_total, fd(x)), ("dA", da_total.T, fd(x))):
        np.testing.assert_allclose(got, ref, rtol=1e-7, atol=1e-8,
                                   err_msg=f"split {name} differs from finite differences")


def test_check_split_message():
    check_split("ip2", 10, 10)
    with pytest.raises(InputError) as info:
        check_split("ip2", 10, 16)
    assert str(info.value) == "layer ip2 has 10 outputs, fewer than the 16 ranks split-fc splits it over"


def test_fc_blocks_group_elementwise_layers():
    layers = [("conv1", Conv2d(1, 2, 3, padding=1)), ("pool1", MaxPool2d(2, 2)),
              ("flatten", Flatten()), ("ip1", Linear(2 * 4 * 4, 6)), ("relu", ReLU()),
              ("drop", Dropout(0.2, seed=1)), ("ip2", Linear(6, 3))]
    model = Model(layers, (1, 8, 8), 3, dtype="float64")
    blocks = fc_blocks(model)
    assert [(name, [a for a, _ in acts]) for name, _, acts in blocks] == \
        [("ip1", ["relu", "drop"]), ("ip2", [])]


def test_model_without_fc_is_refused():
    model = Model([("flatten", Flatten())], (1, 2, 5), 10, dtype="float64")
    with pytest.raises(InputError, match="split-fc needs a fully-connected layer"):
        fc_blocks(model)


def test_the_loss_stays_on_the_device_on_a_gpu(monkeypatch):
    """On a GPU (the recording stand-in for CuPy) split-fc's loss and correct count stay
    0-d device values, read by nobody inside the step; on the CPU they are the same numbers."""
    import contextlib
    from types import SimpleNamespace
    from ringnet.bench import budget
    from ringnet.layers import SoftmaxCrossEntropy
    from ringnet.parallel import split_fc

    rng = np.random.default_rng(3)
    logits = rng.normal(size=(8, 10)).astype(np.float32)
    labels = rng.integers(0, 10, size=8)
    labels[4:6] = logits[4:6].argmax(axis=1)          # rank 1's rows: at least two right

    def stub():
        return SimpleNamespace(model=SimpleNamespace(loss_layer=SoftmaxCrossEntropy()), rank=1,
                               _compute=lambda phase: contextlib.nullcontext())

    loss_cpu, correct_cpu, dlogits_cpu = split_fc.SplitFCStrategy._loss(stub(), logits, labels, 4)
    assert isinstance(loss_cpu, float) and correct_cpu == int(
        (logits[4:8].argmax(axis=1) == labels[4:8]).sum()) >= 2
    rec = budget.Recorder()
    with budget.recording(rec):
        monkeypatch.setattr(split_fc, "is_gpu_array", lambda a: isinstance(a, budget.DeviceArray))
        on_device = rec.asarray(logits), rec.asarray(labels)
        loss, correct, dlogits = split_fc.SplitFCStrategy._loss(stub(), *on_device, 4)
        assert rec.totals()["host_waits"] == 0, [e for e in rec.events if e[0] == "host_wait"]
        assert isinstance(loss, budget.DeviceArray) and isinstance(correct, budget.DeviceArray)
        assert float(loss) == pytest.approx(loss_cpu, rel=1e-6) and int(correct) == correct_cpu
        np.testing.assert_allclose(np.asarray(dlogits), dlogits_cpu, rtol=1e-5, atol=1e-7)
