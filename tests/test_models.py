"""Models: flat-buffer views, rebinding, export/import, whole-model gradients vs finite differences."""
from pathlib import Path

import numpy as np
import pytest

from ringnet.layers import AvgPool2d, Conv2d, Flatten, Linear, MaxPool2d, ReLU
from ringnet.models import MODELS, Model, build_model
from ringnet.optim import SGD, LRPolicy

try:
    import torch
except ImportError:
    torch = None

DIGITS = Path(__file__).resolve().parent.parent / "datasets" / "digits.h5"


def small_lenet(dtype="float64", seed=0):
    layers = [("conv1", Conv2d(1, 4, 5)), ("pool1", MaxPool2d(2, 2)),
              ("conv2", Conv2d(4, 6, 3, padding=1)), ("relu1", ReLU()),
              ("pool2", AvgPool2d(3, 2)), ("flatten", Flatten()),
              ("ip1", Linear(6 * 2 * 2, 12)), ("relu2", ReLU()), ("ip2", Linear(12, 3))]
    return Model(layers, (1, 12, 12), 3, dtype=dtype, seed=seed, name="small_lenet")


def model_fd_check(model, n_coords=25, eps=1e-6, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(3,) + model.input_shape)
    labels = rng.integers(0, model.num_classes, size=3)
    model.grads[...] = np.nan
    model.loss_and_grad(x, labels)
    assert np.all(np.isfinite(model.grads)), "backward left gradient slots unwritten"
    analytic = model.grads.copy()
    names = model.param_names()
    offsets = model.param_offsets()
    for c in rng.choice(model.num_params, size=n_coords, replace=False):
        old = model.params[c]
        model.params[c] = old + eps
        up, _ = model.evaluate(x, labels)
        model.params[c] = old - eps
        down, _ = model.evaluate(x, labels)
        model.params[c] = old
        numeric = (up - down) / (2 * eps)
        name = next(n for n in names if offsets[n][0] <= c < offsets[n][1])
        assert abs(numeric - analytic[c]) <= 1e-6 * max(1.0, abs(numeric)), \
            f"{name} (flat {c}): analytic {analytic[c]} vs FD {numeric}"


def test_small_lenet_gradient_matches_finite_differences():
    model_fd_check(small_lenet(), seed=1)


def test_digits_gradient_matches_finite_differences():
    model_fd_check(build_model("digits", dtype="float64", seed=3), seed=2)


def test_shapes_names_and_pytorch_layouts():
    m = build_model("lenet")
    assert m.param_names() == ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias",
                               "ip1.weight", "ip1.bias", "ip2.weight", "ip2.bias"]
    shapes = {n: v.shape for n, v in m.named_params().items()}
    assert shapes["conv1.weight"] == (20, 1, 5, 5) and shapes["conv2.weight"] == (50, 20, 5, 5)
    assert shapes["ip1.weight"] == (500, 800) and shapes["ip2.weight"] == (10, 500)
    assert m.num_params == sum(int(np.prod(s)) for s in shapes.values()) == 431080
    assert m.layers[m.fc_start()][0] == "ip1"
    # the feature part and the FC part run separately give the whole forward
    x = np.random.default_rng(0).normal(size=(2, 1, 28, 28)).astype(np.float32)
    features = m.forward_layers(x, 0, m.fc_start(), train=False)
    assert features.shape == (2, 800)
    np.testing.assert_array_equal(m.forward_layers(features, m.fc_start(), train=False),
                                  m.forward(x, train=False))
    q = build_model("cifar10_quick")
    pooled = [out for name, _, out in q.shapes if name.startswith("pool")]
    assert pooled == [(32, 16, 16), (32, 8, 8), (64, 4, 4)]   # Caffe's 32-16-8-4
    assert q.named_params()["ip1.weight"].shape == (64, 1024)
    for name, spec in MODELS.items():
        model = build_model(name, num_classes=7)
        x = np.zeros((2,) + spec.input_shape, dtype=np.float32)
        assert model.forward(x, train=False).shape == (2, 7), name
    with pytest.raises(ValueError, match="unknown model"):
        build_model("resnet")


def test_params_and_grads_are_views_into_flat_buffers():
    m = small_lenet()
    start, stop, shape = m.param_offsets()["conv2.weight"]
    view = m.named_params()["conv2.weight"]
    view[1, 2, 0, 1] = 123.0
    assert m.params[start + np.ravel_multi_index((1, 2, 0, 1), shape)] == 123.0
    m.params[start] = -7.0
    assert m.layers[2][1].params["weight"][0, 0, 0, 0] == -7.0
    m.loss_and_grad(np.ones((2, 1, 12, 12)), [0, 1])
    np.testing.assert_array_equal(m.named_grads()["ip2.bias"], m.grads[-3:])
    # offsets tile the buffer in order, weight before bias
    ends = [0]
    for name in m.param_names():
        s, e, _ = m.param_offsets()[name]
        assert s == ends[-1]
        ends.append(e)
    assert ends[-1] == m.num_params == len(m.params) == len(m.grads)


def test_bind_flat_swaps_buffers_without_copying():
    m = small_lenet(seed=0)
    other = small_lenet(seed=5)
    x = np.random.default_rng(0).normal(size=(2, 1, 12, 12))
    y0, y5 = m.forward(x, train=False).copy(), other.forward(x, train=False)
    front, back = m.params, other.params.copy()
    grads_b = np.zeros_like(m.grads)
    m.bind_flat(back, grads_b)
    assert m.params is back and m.grads is grads_b
    np.testing.assert_allclose(m.forward(x, train=False), y5)
    m.loss_and_grad(x, [0, 2])
    assert np.any(grads_b != 0)
    back[:] = front                                   # writes through the rebound views
    np.testing.assert_allclose(m.forward(x, train=False), y0)
    m.bind_flat(front)
    assert m.params is front and m.grads is grads_b
    with pytest.raises(ValueError, match="length"):
        m.bind_flat(np.zeros(m.num_params + 1))
    with pytest.raises(ValueError, match="float64"):
        m.bind_flat(np.zeros(m.num_params, dtype=np.float32))


def test_state_round_trip_and_errors():
    a, b = build_model("digits", seed=1), build_model("digits", seed=2)
    assert not np.array_equal(a.params, b.params)
    state = a.state()
    state["conv1.bias"][0] = 9.0                      # a copy: the model is unaffected
    assert a.named_params()["conv1.bias"][0] != 9.0
    b.load_state(a.state())
    np.testing.assert_array_equal(a.params, b.params)
    bad = a.state()
    bad["ip1.weight"] = bad["ip1.weight"].T
    with pytest.raises(ValueError, match="ip1.weight"):
        b.load_state(bad)
    missing = a.state()
    del missing["ip2.bias"]
    with pytest.raises(ValueError, match="ip2.bias"):
        b.load_state(missing)


def test_same_seed_same_init_and_dtypes():
    a, b = build_model("cifar10_quick", seed=4), build_model("cifar10_quick", seed=4)
    np.testing.assert_array_equal(a.params, b.params)
    assert a.params.dtype == a.grads.dtype == np.float32
    d = build_model("cifar10_quick", dtype="float64", seed=4)
    np.testing.assert_array_equal(d.params.astype(np.float32), a.params)
    std = np.std(a.named_params()["conv2.weight"])
    assert 0.009 < std < 0.011                          # gaussian(0.01), as in Caffe
    assert np.all(a.named_params()["conv2.bias"] == 0)
    x = np.random.default_rng(0).normal(size=(3, 3, 32, 32)).astype(np.float32)
    loss, correct = a.loss_and_grad(x, [1, 2, 3])
    assert isinstance(loss, float) and isinstance(correct, int)
    assert a.forward(x).dtype == np.float32 and a.grads.dtype == np.float32


def test_evaluate_matches_forward_and_leaves_grads_alone():
    m = small_lenet()
    rng = np.random.default_rng(6)
    x, y = rng.normal(size=(7, 1, 12, 12)), rng.integers(0, 3, 7)
    m.grads[...] = 1.5
    loss, correct = m.evaluate(x, y, batch_size=3)
    assert np.all(m.grads == 1.5)
    logits = m.forward(x, train=False)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    assert abs(loss - np.mean(-np.log(p[np.arange(7), y]))) < 1e-12
    assert correct == int(np.sum(logits.argmax(1) == y))


@pytest.mark.skipif(torch is None, reason="PyTorch not installed")
@pytest.mark.parametrize("name", ["lenet", "cifar10_quick", "carnet"])
def test_models_match_torch(name):
    from ringnet.bench.layers import torch_model
    m = build_model(name, dtype="float64", seed=7)
    net = torch_model(m).eval()
    rng = np.random.default_rng(8)
    x = rng.normal(size=(2,) + m.input_shape)
    y = rng.integers(0, m.num_classes, 2)
    xt = torch.tensor(x)
    with torch.no_grad():
        ref = net(xt).numpy()
    np.testing.assert_allclose(m.forward(x, train=False), ref, rtol=1e-9, atol=1e-9)
    if name != "carnet":                              # carnet trains with dropout
        m.loss_and_grad(x, y)
        torch.nn.functional.cross_entropy(net(xt), torch.tensor(y)).backward()
        grads = m.named_grads()
        for pname, p in net.named_parameters():
            np.testing.assert_allclose(grads[pname], p.grad.numpy(), rtol=1e-7, atol=1e-10,
                                       err_msg=pname)


def test_digits_model_learns_uci_digits():
    h5py = pytest.importorskip("h5py")
    with h5py.File(DIGITS, "r") as f:
        xtr, ytr = f["train/images"][:].astype(np.float32), f["train/labels"][:]
        xte, yte = f["test/images"][:].astype(np.float32), f["test/labels"][:]
    mean, std = xtr.mean(), xtr.std()
    xtr, xte = (xtr - mean) / std, (xte - mean) / std
    m = build_model("digits", seed=0)
    sgd = SGD(m.num_params, LRPolicy("fixed", 0.05), momentum=0.9)
    rng = np.random.default_rng(0)
    it = 0
    for _ in range(5):
        order = rng.permutation(len(xtr))
        for s in range(0, len(order) - 63, 64):
            idx = order[s:s + 64]
            m.loss_and_grad(xtr[idx].astype(np.float32), ytr[idx])
            sgd.step(m.params, m.grads, it)
            it += 1
    _, correct = m.evaluate(xte.astype(np.float32), yte)
    assert correct / len(yte) >= 0.95, f"test accuracy {correct / len(yte):.3f}"


def test_step_flops_closed_form():
    from ringnet.bench.layers import step_flops
    m = build_model("lenet")
    b = 64
    conv1 = 2 * b * 20 * 24 * 24 * 1 * 5 * 5        # forward; weight gradient: the same again
    conv2 = 2 * b * 50 * 8 * 8 * 20 * 5 * 5          # forward, weight and input gradients
    ip1, ip2 = 2 * b * 800 * 500, 2 * b * 500 * 10
    assert step_flops(m, b) == 2 * conv1 + 3 * (conv2 + ip1 + ip2) == 843_648_000


def test_layer_floors_closed_form():
    """bench layers' per-layer floors: GEMM FLOPs at the GEMM rate for conv and linear
    layers (backward two GEMMs, one for the first layer), bytes in and out at the copy
    rate for the rest, 0 for a Flatten (a view)."""
    from ringnet.bench.layers import layer_floors, step_flops
    m = build_model("lenet")
    b, gemm, copy = 64, 1e11, 1e10
    floors = {name: (f, bw, unit) for name, f, bw, unit in layer_floors(m, b, gemm, copy)}
    assert list(floors) == [name for name, _ in m.layers]
    conv1 = 2 * b * 20 * 24 * 24 * 1 * 5 * 5
    conv2 = 2 * b * 50 * 8 * 8 * 20 * 5 * 5
    assert floors["conv1"] == pytest.approx((conv1 / gemm * 1e3, conv1 / gemm * 1e3, "GEMM"))
    assert floors["conv2"] == pytest.approx((conv2 / gemm * 1e3, 2 * conv2 / gemm * 1e3, "GEMM"))
    pool1 = b * (20 * 24 * 24 + 20 * 12 * 12) * 4 / copy * 1e3
    assert floors["pool1"] == pytest.approx((pool1, pool1, "memory"))
    assert floors["flatten"] == (0, 0, "memory")
    gemm_total = sum(f + bw for f, bw, unit in floors.values() if unit == "GEMM")
    assert gemm_total == pytest.approx(step_flops(m, b) / gemm * 1e3)


def _layer_by_layer(model, x, labels):
    """The model's loss, logits and gradients from each layer's own forward and backward
    (no pair of layers fused)."""
    a = model.as_input(x)
    for _, layer in model.layers:
        a = layer.forward(a, True)
    loss = model.loss_layer.forward(a, labels)
    d = model.loss_layer.backward()
    for _, layer in reversed(model.layers):
        d = layer.backward(d)
    return float(loss), a.copy(), model.grads.copy()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_relus_fused_into_pools_change_nothing(dtype):
    """On the CPU a ReLU next to a pool is applied by the pool (max pool then ReLU, ReLU
    then average or max pool): loss, logits, gradients and an evaluation equal the layers
    run one by one, bit for bit, on inputs where ReLU zeros tie in the max pools; a range
    that splits a pair runs both layers in full."""
    layers = [("conv1", Conv2d(2, 4, 3, padding=1)), ("pool1", MaxPool2d(3, 2)),
              ("relu1", ReLU()), ("conv2", Conv2d(4, 6, 3, padding=1)), ("relu2", ReLU()),
              ("pool2", AvgPool2d(3, 2, 1)), ("conv3", Conv2d(6, 6, 1)), ("relu3", ReLU()),
              ("pool3", MaxPool2d(2, 2)), ("flat", Flatten()), ("ip", Linear(6 * 2 * 2, 3))]
    model = Model(layers, (2, 13, 13), 3, dtype=dtype, seed=3)
    assert model._fused == {1: 2, 2: 1, 4: 5, 5: 4, 7: 8, 8: 7}
    model.named_params()["conv1.bias"][...] = -2.0      # many pool1 windows with no x > 0
    rng = np.random.default_rng(4)
    x = rng.normal(size=(5, 2, 13, 13)).astype(dtype)
    labels = rng.integers(0, 3, size=5)
    loss_ref, logits_ref, grads_ref = _layer_by_layer(model, x, labels)
    logits = model.forward(x, train=True)
    loss, _ = model.loss_and_grad(x, labels)
    assert all(model.layers[i][1]._passed for i in (2, 4, 7))      # the ReLUs were skipped
    assert loss == loss_ref
    np.testing.assert_array_equal(logits, logits_ref)
    np.testing.assert_array_equal(model.grads, grads_ref)
    np.testing.assert_array_equal(model.forward(x, train=False), logits_ref)
    # relu1 | pool... : a range ending between a pool and its ReLU runs the pool unfused
    head = model.forward_layers(model.as_input(x), 0, 2)
    a = model.as_input(x)
    for _, layer in model.layers[:2]:
        a = layer.forward(a, True)
    np.testing.assert_array_equal(head, a)
    assert (np.asarray(head) < 0).any()                           # not rectified
