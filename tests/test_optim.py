"""SGD and lr policies against Caffe's formulas written out with plain NumPy."""
import math

import numpy as np
import pytest

from ringnet.backend import gpu_available
from ringnet.optim import SGD, LRPolicy


def test_lr_policies_follow_caffe_formulas():
    fixed = LRPolicy("fixed", 0.1)
    step = LRPolicy("step", 0.1, gamma=0.5, stepsize=3)
    inv = LRPolicy("inv", 0.01, gamma=1e-4, power=0.75)
    for it in [0, 1, 2, 3, 5, 6, 7, 1000]:
        assert fixed(it) == 0.1
        assert math.isclose(step(it), 0.1 * 0.5 ** (it // 3))
        assert math.isclose(inv(it), 0.01 * (1 + 1e-4 * it) ** -0.75)
    with pytest.raises(ValueError, match="stepsize"):
        LRPolicy("step", 0.1)
    with pytest.raises(ValueError, match="unknown lr policy"):
        LRPolicy("cosine", 0.1)
    with pytest.raises(ValueError, match="base_lr"):
        LRPolicy("fixed", -1.0)


def reference_run(w, grads, lrs, momentum, decay):
    """The documented update, written out: v = m v + lr (g + wd w); w = w - v."""
    w, v = w.copy(), np.zeros_like(w)
    for g, lr in zip(grads, lrs):
        v = momentum * v + lr * (g + decay * w)
        w = w - v
    return w, v


def test_sgd_matches_the_documented_formula():
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=37)
    grads = [rng.normal(size=37) for _ in range(7)]
    policy = LRPolicy("step", 0.1, gamma=0.3, stepsize=2)
    opt = SGD(37, policy, momentum=0.85, weight_decay=0.01, dtype=np.float64)
    w = w0.copy()
    lrs = []
    for it, g in enumerate(grads):
        lrs.append(opt.step(w, g, it))
    assert lrs == [policy(it) for it in range(7)]
    w_ref, v_ref = reference_run(w0, grads, lrs, 0.85, 0.01)
    np.testing.assert_allclose(w, w_ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(opt.state_dict()["momentum"], v_ref, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("decay", [0.0, 5e-4])
def test_the_blocked_cpu_update_equals_the_whole_array_formula_bit_for_bit(dtype, decay):
    from ringnet.optim import CPU_BLOCK
    n = 2 * CPU_BLOCK + 123                             # two whole blocks and a part
    rng = np.random.default_rng(5)
    w = rng.normal(size=n).astype(dtype)
    opt = SGD(n, LRPolicy("inv", 0.05, gamma=0.1, power=0.75), momentum=0.9,
              weight_decay=decay, dtype=dtype)
    w_ref, v_ref = w.copy(), np.zeros(n, dtype)
    for it in range(3):
        g = rng.normal(size=n).astype(dtype)
        lr = opt.step(w, g, it)
        t = (w_ref * dtype(decay) + g) * dtype(lr) if decay else g * dtype(lr)
        v_ref = v_ref * dtype(0.9) + t
        w_ref = w_ref - v_ref
    np.testing.assert_array_equal(w, w_ref)
    np.testing.assert_array_equal(opt.v, v_ref)


def test_slice_updates_equal_whole_buffer_update():
    rng = np.random.default_rng(1)
    size, cut = 41, 17                                  # uneven shards
    w_whole = rng.normal(size=size).astype(np.float32)
    w_split = w_whole.copy()
    whole = SGD(size, LRPolicy("inv", 0.05, gamma=0.1), 0.9, 0.004, dtype=np.float32)
    parts = [SGD(cut, LRPolicy("inv", 0.05, gamma=0.1), 0.9, 0.004, dtype=np.float32),
             SGD(size - cut, LRPolicy("inv", 0.05, gamma=0.1), 0.9, 0.004, dtype=np.float32)]
    for it in range(5):
        g = rng.normal(size=size).astype(np.float32)
        whole.step(w_whole, g, it)
        parts[0].step(w_split[:cut], g[:cut], it)       # views: updated in place
        parts[1].step(w_split[cut:], g[cut:], it)
    np.testing.assert_array_equal(w_split, w_whole)
    assert w_split.dtype == np.float32 and parts[0].v.dtype == np.float32
    np.testing.assert_array_equal(np.concatenate([p.state_dict()["momentum"] for p in parts]),
                                  whole.state_dict()["momentum"])


def test_state_round_trip_continues_the_same_trajectory():
    rng = np.random.default_rng(2)
    grads = [rng.normal(size=9) for _ in range(6)]
    w_a = rng.normal(size=9)
    w_b = w_a.copy()
    a = SGD(9, LRPolicy("fixed", 0.1), 0.9, 0.001, dtype=np.float64)
    for it in range(6):
        a.step(w_a, grads[it], it)
    b = SGD(9, LRPolicy("fixed", 0.1), 0.9, 0.001, dtype=np.float64)
    for it in range(3):
        b.step(w_b, grads[it], it)
    c = SGD(9, LRPolicy("fixed", 0.1), 0.9, 0.001, dtype=np.float64)
    c.load_state_dict(b.state_dict())
    for it in range(3, 6):
        c.step(w_b, grads[it], it)
    np.testing.assert_array_equal(w_a, w_b)
    with pytest.raises(ValueError, match="size 9"):
        c.load_state_dict({"momentum": np.zeros(8)})


def test_bad_shapes_and_dtypes_are_refused():
    opt = SGD(4, 0.1, dtype=np.float32)
    with pytest.raises(ValueError, match="size 4"):
        opt.step(np.zeros(5, np.float32), np.zeros(5, np.float32), 0)
    with pytest.raises(ValueError, match="dtype"):
        opt.step(np.zeros(4), np.zeros(4), 0)
    with pytest.raises(ValueError, match="momentum"):
        SGD(4, 0.1, momentum=1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU with CuPy")
def test_fused_gpu_update_matches_numpy():
    import cupy
    rng = np.random.default_rng(3)
    w0 = rng.normal(size=1000).astype(np.float32)
    grads = [rng.normal(size=1000).astype(np.float32) for _ in range(4)]
    cpu = SGD(1000, LRPolicy("step", 0.1, stepsize=2), 0.9, 0.01, dtype=np.float32)
    gpu = SGD(1000, LRPolicy("step", 0.1, stepsize=2), 0.9, 0.01, xp=cupy, dtype=np.float32)
    w_cpu, w_gpu = w0.copy(), cupy.asarray(w0)
    for it, g in enumerate(grads):
        cpu.step(w_cpu, g, it)
        gpu.step(w_gpu, cupy.asarray(g), it)
    np.testing.assert_allclose(cupy.asnumpy(w_gpu), w_cpu, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gpu.state_dict()["momentum"], cpu.state_dict()["momentum"],
                               rtol=1e-5, atol=1e-6)
