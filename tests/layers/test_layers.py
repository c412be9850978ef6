"""Layers against central finite differences (float64), naive loops and PyTorch."""
import numpy as np
import pytest

from ringnet.backend import gpu_available
from ringnet.layers import (AvgPool2d, Conv2d, Dropout, Flatten, Linear, MaxPool2d, ReLU,
                            SoftmaxCrossEntropy, init_array, pool_output_size)

try:
    import torch
except ImportError:  # torch is optional: only the cross-checks need it
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch not installed")


def bound(layer, in_shape, seed=0, dtype=np.float64):
    """Bind random parameters (and gradient buffers) to ``layer``; return (params, grads)."""
    rng = np.random.default_rng(seed)
    params, grads = {}, {}
    for suffix, shape, _ in layer.param_specs(in_shape):
        params[suffix] = rng.normal(size=shape).astype(dtype)
        grads[suffix] = np.full(shape, np.nan, dtype=dtype)   # must be overwritten
    layer.bind(params, grads)
    return params, grads


def batch_last(x):
    """Return the same logical array stored in (C, H, W, B) memory."""
    return np.ascontiguousarray(x.transpose(1, 2, 3, 0)).transpose(3, 0, 1, 2)


def fd_check(layer, x, params, grads, seed=1, n_coords=40, eps=1e-6, tol=1e-6):
    """Compare backward's dx and parameter grads with central differences of sum(y * r)."""
    rng = np.random.default_rng(seed)
    y = layer.forward(x, train=True)
    r = rng.normal(size=y.shape)
    dx = layer.backward(r)

    def loss():
        return float(np.sum(layer.forward(x, train=True) * r))

    targets = [("x", x, dx)] + [(k, params[k], grads[k]) for k in params]
    for name, array, analytic in targets:
        assert analytic.shape == array.shape, name
        coords = rng.choice(array.size, size=min(n_coords, array.size), replace=False)
        for c in coords:
            idx = np.unravel_index(c, array.shape)
            old = array[idx]
            array[idx] = old + eps
            up = loss()
            array[idx] = old - eps
            down = loss()
            array[idx] = old
            numeric = (up - down) / (2 * eps)
            assert abs(numeric - analytic[idx]) <= tol * max(1.0, abs(numeric)), \
                f"{type(layer).__name__} d{name}{idx}: analytic {analytic[idx]} vs FD {numeric}"


def naive_conv(x, w, b, stride, pad):
    bsz, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    xp = np.zeros((bsz, c, h + 2 * pad[0], wd + 2 * pad[1]))
    xp[:, :, pad[0]:pad[0] + h, pad[1]:pad[1] + wd] = x
    ho = (h + 2 * pad[0] - kh) // stride[0] + 1
    wo = (wd + 2 * pad[1] - kw) // stride[1] + 1
    y = np.zeros((bsz, o, ho, wo))
    for n in range(bsz):
        for f in range(o):
            for i in range(ho):
                for j in range(wo):
                    patch = xp[n, :, i * stride[0]:i * stride[0] + kh, j * stride[1]:j * stride[1] + kw]
                    y[n, f, i, j] = np.sum(patch * w[f]) + b[f]
    return y


def naive_pool(x, k, s, p, mode):
    """Caffe's pooling loops: ceil-mode size, windows clipped to the input (max) or to
    input+pad for the divisor (ave)."""
    bsz, c, h, w = x.shape
    ho, wo = pool_output_size(h, k, s, p), pool_output_size(w, k, s, p)
    y = np.zeros((bsz, c, ho, wo))
    for i in range(ho):
        for j in range(wo):
            hs, ws = i * s - p, j * s - p
            he, we = min(hs + k, h + p), min(ws + k, w + p)
            size = (he - hs) * (we - ws)
            hs, ws, he, we = max(hs, 0), max(ws, 0), min(he, h), min(we, w)
            window = x[:, :, hs:he, ws:we].reshape(bsz, c, -1)
            y[:, :, i, j] = window.max(-1) if mode == "max" else window.sum(-1) / size
    return y


CONV_CASES = [  # (B, C, H, W, O, kernel, stride, padding)
    (2, 3, 7, 6, 4, 3, 1, 1),          # same padding: transposed-conv input gradient
    (1, 2, 9, 8, 3, 3, 2, 0),          # stride 2, batch 1
    (3, 2, 6, 7, 2, 5, 1, 2),          # big kernel, same padding
    (2, 2, 7, 9, 3, (3, 2), (2, 1), (1, 0)),
    (2, 3, 8, 8, 2, 5, 1, 0),          # valid conv: col2im input gradient
    (1, 1, 5, 5, 2, 3, 3, 1),          # stride 3 with padding
    # 8+ channels, stride 1: the Fourier path's geometry (auto picks it)
    (2, 8, 6, 7, 9, 3, 1, 1),          # same padding, odd padded width
    (2, 9, 8, 8, 8, 5, 1, 0),          # valid conv
    (1, 8, 7, 9, 8, (3, 5), 1, (2, 1)),  # non-square kernel, padding > k-1 on one axis
]
# Each conv test runs every CPU algorithm (Conv2d.algorithm); "fourier" runs im2col where
# the stride is not 1.
ALGORITHMS = ["im2col", "fourier", "rows"]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("case", CONV_CASES)
def test_conv_gradients_match_finite_differences(case, algorithm):
    b, c, h, w, o, k, s, p = case
    layer = Conv2d(c, o, k, stride=s, padding=p)
    layer.algorithm = algorithm
    params, grads = bound(layer, (c, h, w))
    x = np.random.default_rng(2).normal(size=(b, c, h, w))
    fd_check(layer, x, params, grads)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("case", CONV_CASES)
def test_conv_forward_matches_naive_loops(case, algorithm):
    b, c, h, w, o, k, s, p = case
    layer = Conv2d(c, o, k, stride=s, padding=p)
    layer.algorithm = algorithm
    params, _ = bound(layer, (c, h, w))
    x = np.random.default_rng(3).normal(size=(b, c, h, w))
    ref = naive_conv(x, params["weight"], params["bias"], layer.stride, layer.padding)
    for xin in (x, batch_last(x)):      # any memory order gives the same values
        y = layer.forward(xin)
        assert y.shape == (b, o) + layer.output_shape((c, h, w))[1:]
        np.testing.assert_allclose(y, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_conv_first_layer_skips_input_gradient(algorithm):
    layer = Conv2d(2, 3, 3, padding=1)
    layer.algorithm = algorithm
    params, grads = bound(layer, (2, 5, 5))
    layer.needs_dx = False
    x = np.random.default_rng(0).normal(size=(2, 2, 5, 5))
    dy = np.random.default_rng(1).normal(size=layer.forward(x).shape)
    assert layer.backward(dy) is None
    np.testing.assert_allclose(grads["bias"], dy.sum(axis=(0, 2, 3)))
    reference = Conv2d(2, 3, 3, padding=1)
    reference.algorithm = "im2col"
    _, ref_grads = bound(reference, (2, 5, 5))
    reference.params["weight"][...] = params["weight"]
    reference.forward(x)
    reference.backward(dy)
    np.testing.assert_allclose(grads["weight"], ref_grads["weight"], rtol=1e-12, atol=1e-12)


def test_conv_picks_the_fourier_path_where_it_is_faster():
    """auto: cifar10_quick's conv2/conv3 and LeNet's conv2 (8+ channels in and out, stride
    1, small maps); not a first layer's 1 or 3 channels, a stride, a 1x1 kernel or a large map."""
    from ringnet.layers.fft_conv import fits
    assert fits(32, 32, (5, 5), (1, 1), (20, 20)) and fits(32, 64, (5, 5), (1, 1), (12, 12))
    assert fits(20, 50, (5, 5), (1, 1), (12, 12))
    assert not fits(3, 32, (5, 5), (1, 1), (36, 36)) and not fits(1, 20, (5, 5), (1, 1), (28, 28))
    assert not fits(32, 32, (5, 5), (2, 2), (20, 20)) and not fits(32, 32, (1, 1), (1, 1), (16, 16))
    assert not fits(32, 32, (3, 3), (1, 1), (66, 66))
    layer = Conv2d(8, 8, 3, padding=1)
    bound(layer, (8, 6, 6))
    layer.algorithm = "winograd"
    with pytest.raises(ValueError, match="algorithm 'winograd'"):
        layer.forward(np.zeros((1, 8, 6, 6)))


def test_fourier_transforms_match_numpy_fft():
    """The split transforms against numpy.fft: the forward transform of a map placed in a
    zero map (half spectrum along w), the inverse evaluated at an offset window, and the
    kernel's conjugate spectrum in block form."""
    from ringnet.layers import fft_conv
    rng = np.random.default_rng(7)
    m, h, w, b, (ph, pw) = 3, 7, 6, 2, (2, 1)
    shape = (nh, nw) = (h + 2 * ph, w + 2 * pw)
    f2 = nw // 2 + 1
    a = rng.normal(size=(m, h, w, b))
    padded = np.zeros((m, nh, nw, b))
    padded[:, ph:ph + h, pw:pw + w] = a
    ref = np.fft.fft2(padded, axes=(1, 2))[:, :, :f2].transpose(1, 2, 0, 3)  # (nh, F2, M, B)
    split = fft_conv._transform(a, shape, (ph, pw))
    np.testing.assert_allclose(split[:, :, 0], ref.real, atol=1e-12)
    np.testing.assert_allclose(split[:, :, 1], ref.imag, atol=1e-12)
    back = fft_conv._inverse(split, shape, h - 1, w - 2, (ph + 1, pw + 2),
                             np.empty((m, h - 1, w - 2, b)))
    np.testing.assert_allclose(back, a[:, 1:, 2:], atol=1e-12)
    weight = rng.normal(size=(4, m, 3, 2))
    wpad = np.zeros((4, m, nh, nw))
    wpad[:, :, :3, :2] = weight
    conj = np.conj(np.fft.fft2(wpad, axes=(2, 3)))[:, :, :, :f2].transpose(2, 3, 0, 1)
    block = fft_conv._kernel_block(weight, shape).reshape(nh, f2, 2, 4, 2, m)
    for (i, j), part in {(0, 0): conj.real, (0, 1): -conj.imag, (1, 0): conj.imag,
                         (1, 1): conj.real}.items():
        np.testing.assert_allclose(block[:, :, i, :, j], part, atol=1e-12)


def test_conv_auto_lowers_rows_for_a_first_layer_only():
    """auto: a first layer (no input gradient) that the transforms do not fit runs the
    lowered rows (cifar10_quick's and LeNet's conv1); with an input gradient it runs
    im2col, and a geometry the transforms fit runs them either way."""
    rng = np.random.default_rng(6)
    for (c, o, size, padding), first, expected in [
            ((3, 32, 12, 2), True, "rows"), ((3, 32, 12, 2), False, "im2col"),
            ((8, 8, 12, 2), True, "fourier"), ((8, 8, 12, 2), False, "fourier")]:
        layer = Conv2d(c, o, 5, padding=padding)
        bound(layer, (c, size, size))
        layer.needs_dx = not first
        layer.forward(rng.normal(size=(2, c, size, size)))
        kind = layer._cache[0] if isinstance(layer._cache[0], str) else "im2col"
        assert kind == expected, ((c, o), first, kind)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cpu_algorithms_agree_in_each_dtype(dtype):
    """cifar10_quick's conv2 geometry: every algorithm gives im2col's outputs and
    gradients to the dtype's rounding, and float32 stays float32."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(4, 32, 16, 16)).astype(dtype)
    results = []
    for algorithm in ALGORITHMS:
        layer = Conv2d(32, 32, 5, padding=2)
        layer.algorithm = algorithm
        _, grads = bound(layer, (32, 16, 16), seed=3, dtype=dtype)
        y = layer.forward(x)
        dx = layer.backward(np.cos(np.arange(y.size)).reshape(y.shape).astype(dtype))
        assert y.dtype == dx.dtype == dtype
        results.append([y, dx, grads["weight"].copy(), grads["bias"].copy()])
    tol = 2e-5 if dtype == np.float32 else 1e-12
    for algorithm, result in zip(ALGORITHMS[1:], results[1:]):
        for name, a, b in zip(("y", "dx", "dW", "db"), result, results[0]):
            scale = np.abs(b).max()
            assert np.abs(a - b).max() <= tol * scale, (algorithm, name, np.abs(a - b).max())


POOL_CASES = [  # (B, C, H, W, kernel, stride, padding)
    (2, 3, 8, 8, 2, 2, 0),             # non-overlapping
    (1, 2, 7, 9, 3, 2, 0),             # overlapping with ceil-mode overhang, batch 1
    (2, 2, 6, 5, 3, 1, 1),             # padding
    (2, 1, 5, 5, 2, 2, 1),             # ceil rule drops the window starting in the pad
    (1, 2, 11, 11, 3, 2, 1),
]


@pytest.mark.parametrize("cls", [MaxPool2d, AvgPool2d])
@pytest.mark.parametrize("case", POOL_CASES)
def test_pool_gradients_match_finite_differences(cls, case, pool_chunks):
    b, c, h, w, k, s, p = case
    layer = cls(k, s, p)
    x = np.random.default_rng(4).normal(size=(b, c, h, w))
    fd_check(layer, x, {}, {})


@pytest.mark.parametrize("cls,mode", [(MaxPool2d, "max"), (AvgPool2d, "ave")])
@pytest.mark.parametrize("case", POOL_CASES)
def test_pool_forward_matches_caffe_loops(cls, mode, case, pool_chunks):
    b, c, h, w, k, s, p = case
    layer = cls(k, s, p)
    x = np.random.default_rng(5).normal(size=(b, c, h, w))
    ref = naive_pool(x, k, s, p, mode)
    for xin in (x, batch_last(x)):
        np.testing.assert_allclose(layer.forward(xin), ref, rtol=1e-12, atol=1e-12)


def test_pool_output_size_is_caffe_ceil_mode():
    # cifar10_quick: 3/2 pools take 32 -> 16 -> 8 -> 4 (floor mode would give 15 -> 7 -> 3)
    sizes = [32]
    for _ in range(3):
        sizes.append(pool_output_size(sizes[-1], 3, 2, 0))
    assert sizes == [32, 16, 8, 4]
    assert pool_output_size(24, 2, 2, 0) == 12            # LeNet
    assert pool_output_size(7, 2, 2, 0) == 4              # ceil((7-2)/2)+1
    assert pool_output_size(5, 2, 2, 1) == 3              # 4 dropped: last window would start in the pad


def test_max_pool_ties_go_to_the_first_tap(pool_chunks):
    x = np.zeros((1, 1, 4, 4))
    layer = MaxPool2d(2, 2)
    layer.forward(x)
    dx = layer.backward(np.ones((1, 1, 2, 2)))
    expected = np.zeros((4, 4))
    expected[::2, ::2] = 1
    np.testing.assert_array_equal(dx[0, 0], expected)


@pytest.mark.parametrize("b", [1, 5])
def test_linear_gradients_and_forward(b):
    layer = Linear(7, 4)
    params, grads = bound(layer, (7,))
    x = np.random.default_rng(6).normal(size=(b, 7))
    np.testing.assert_allclose(layer.forward(x), x @ params["weight"].T + params["bias"])
    fd_check(layer, x, params, grads)


def test_relu_and_flatten_gradients():
    x = np.random.default_rng(7).normal(size=(3, 2, 4, 5))
    x[np.abs(x) < 1e-3] = 0.5                                 # keep FD away from the kink
    fd_check(ReLU(), x, {}, {})
    fd_check(Flatten(), batch_last(x), {}, {})
    y = Flatten().forward(batch_last(x))
    np.testing.assert_array_equal(y, x.reshape(3, -1))        # C-order, as PyTorch flattens


def test_dropout_mask_scale_and_reproducibility():
    x = np.random.default_rng(8).normal(size=(50, 40))
    a, b = Dropout(0.3, seed=11), Dropout(0.3, seed=11)
    ya, yb = a.forward(x), b.forward(x)
    np.testing.assert_array_equal(ya, yb)
    kept = ya != 0
    np.testing.assert_allclose(ya[kept], x[kept] / 0.7)
    assert 0.6 < kept.mean() < 0.8
    dy = np.random.default_rng(9).normal(size=x.shape)
    np.testing.assert_allclose(a.backward(dy), np.where(kept, dy / 0.7, 0.0))
    np.testing.assert_array_equal(a.forward(x, train=False), x)
    with pytest.raises(ValueError, match="dropout probability"):
        Dropout(1.0, seed=0)


# splitmix64 written out on Python ints: the reference for the xp array version.
_U64 = (1 << 64) - 1


def _splitmix_finalizer(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def _reference_bits(key, first_sample, shape):
    """Element-by-element hash of ``hash_bits`` from its documented definition."""
    z = 0
    for part in key:
        z = _splitmix_finalizer((z + 0x9E3779B97F4A7C15 + part) & _U64)
    k1, k2 = z, _splitmix_finalizer((z + 0x9E3779B97F4A7C15) & _U64)
    per_sample = int(np.prod(shape[1:]))
    out = []
    for index in range(first_sample * per_sample, (first_sample + shape[0]) * per_sample):
        v = _splitmix_finalizer((index * 0x9E3779B97F4A7C15 + k1) & _U64)
        out.append(_splitmix_finalizer(v ^ k2))
    return np.array(out, dtype=np.uint64).reshape(shape)


@pytest.mark.parametrize("key, first, shape", [((3, 0, 14), 0, (4, 5)), ((1, 7, 2), 9, (3, 2, 2)),
                                                ((2**40 + 5, 123456, 0), 1000, (2, 3))])
def test_dropout_hash_equals_python_integer_reference(key, first, shape):
    from ringnet.layers.activation import hash_bits
    with np.errstate(all="raise"):                    # wrapping uint64 arithmetic, no float detour
        got = hash_bits(np, shape, key, first_sample=first)
    assert got.dtype == np.uint64 and got.shape == shape
    np.testing.assert_array_equal(got, _reference_bits(key, first, shape))


def _binomial_ok(count, n, q, sds=5.0):
    return abs(count - n * q) <= sds * np.sqrt(n * q * (1 - q))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_keep_rate_within_binomial_bounds(p):
    from ringnet.layers.activation import keep_mask
    for key in [(0, 0, 0), (5, 1, 14), (5, 2, 14), (6, 1, 14), (5, 1, 15), (2**63, 10**6, 3)]:
        keep = keep_mask(np, (400, 250), p, key)
        assert _binomial_ok(int(keep.sum()), keep.size, 1 - p), (key, keep.mean())
        for axis in (0, 1):                           # no sample or feature is favoured
            per = keep.mean(axis=axis)
            assert per.std() < 5 * np.sqrt(p * (1 - p) / keep.shape[axis]) + 0.01
    # the top bits are uniform: 16 buckets, chi-square with 15 degrees of freedom
    from ringnet.layers.activation import hash_bits
    top = (hash_bits(np, (1000, 64), (9, 4, 2)) >> np.uint64(60)).astype(np.int64)
    counts = np.bincount(top.ravel(), minlength=16)
    expected = top.size / 16
    assert ((counts - expected) ** 2 / expected).sum() < 60     # p < 1e-6 by chance


def test_dropout_masks_are_independent_across_steps_layers_seeds_and_neighbours():
    """Two masks of p = 0.5 agree on a fraction 0.5 of elements (binomial bounds) when they
    are independent: next step, next layer, next seed, a shifted key (seed + 1 at step t
    against seed at step t + 1: an additive key would make these equal), the next sample
    and the next element. Any reuse of a stream shows as agreement near 1."""
    from ringnet.layers.activation import keep_mask
    shape, p = (256, 256), 0.5
    base = keep_mask(np, shape, p, (5, 3, 14))
    others = {"next step": keep_mask(np, shape, p, (5, 4, 14)),
              "next layer": keep_mask(np, shape, p, (5, 3, 15)),
              "next seed": keep_mask(np, shape, p, (6, 3, 14)),
              "seed+1, step-1": keep_mask(np, shape, p, (6, 2, 14)),
              "swapped seed and step": keep_mask(np, shape, p, (3, 5, 14)),
              "next block of samples": keep_mask(np, shape, p, (5, 3, 14), first_sample=shape[0])}
    for name, other in others.items():
        agree = int((base == other).sum())
        assert _binomial_ok(agree, base.size, 0.5), f"{name}: agreement {agree / base.size:.4f}"
    for name, a, b in [("neighbouring samples", base[1:], base[:-1]),
                       ("neighbouring elements", base[:, 1:], base[:, :-1])]:
        assert _binomial_ok(int((a == b).sum()), a.size, 0.5), name


def test_dropout_mask_is_a_function_of_step_and_global_sample():
    """Stateless: a fresh layer set to step k draws what a layer that ran k forwards draws;
    part r of N on B rows draws rows r*B..(r+1)*B of the one-part mask of N*B rows."""
    x = np.ones((6, 10))
    walked = Dropout(0.4, seed=2)
    for _ in range(3):
        walked.forward(x)
    fresh = Dropout(0.4, seed=2)
    fresh.step = 3
    np.testing.assert_array_equal(fresh.forward(x), walked.forward(x))
    assert fresh.step == walked.step == 4
    assert not np.array_equal(fresh.forward(x), Dropout(0.4, seed=2).forward(x))   # step 4 vs 0
    whole = Dropout(0.4, seed=2)
    whole.step = 7
    expected = whole.forward(np.ones((18, 10)))
    for part in range(3):
        layer = Dropout(0.4, seed=2)
        layer.step, layer.batch_part = 7, (part, 3)
        np.testing.assert_array_equal(layer.forward(x), expected[part * 6:(part + 1) * 6])
    other_layer = Dropout(0.4, seed=2)
    other_layer.step, other_layer.layer_index = 7, 1
    assert not np.array_equal(other_layer.forward(np.ones((18, 10))), expected)


def test_softmax_cross_entropy_closed_form_and_fd():
    rng = np.random.default_rng(10)
    z = rng.normal(size=(6, 5))
    labels = rng.integers(0, 5, size=6)
    ce = SoftmaxCrossEntropy()
    loss = float(ce.forward(z, labels))
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    assert abs(loss - np.mean(-np.log(p[np.arange(6), labels]))) < 1e-12
    g = ce.backward()
    onehot = np.eye(5)[labels]
    np.testing.assert_allclose(g, (p - onehot) / 6, atol=1e-14)
    eps = 1e-6
    for idx in [(0, 0), (2, 3), (5, 4)]:
        zp, zm = z.copy(), z.copy()
        zp[idx] += eps
        zm[idx] -= eps
        numeric = (float(ce.forward(zp, labels)) - float(ce.forward(zm, labels))) / (2 * eps)
        assert abs(numeric - g[idx]) < 1e-8, idx


def test_softmax_cross_entropy_is_stable_for_huge_logits():
    ce = SoftmaxCrossEntropy()
    z = np.array([[1000.0, 0.0], [-1000.0, 0.0]], dtype=np.float32)
    loss = float(ce.forward(z, np.array([0, 0])))
    assert np.isfinite(loss) and abs(loss - 500.0) < 1e-3   # (0 + 1000) / 2
    assert np.all(np.isfinite(ce.backward()))


def test_float32_stays_float32():
    x = np.random.default_rng(11).normal(size=(2, 3, 9, 9)).astype(np.float32)
    conv = Conv2d(3, 4, 3, padding=1)
    _, grads = bound(conv, (3, 9, 9), dtype=np.float32)
    a = conv.forward(x)
    stack = [ReLU(), MaxPool2d(3, 2), AvgPool2d(2, 2), Flatten()]
    for layer in stack:
        a = layer.forward(a)
        assert a.dtype == np.float32, type(layer).__name__
    lin = Linear(a.shape[1], 3)
    _, lgrads = bound(lin, (a.shape[1],), dtype=np.float32)
    logits = lin.forward(a)
    ce = SoftmaxCrossEntropy()
    ce.forward(logits, np.array([0, 2]))
    d = lin.backward(ce.backward())
    for layer in reversed(stack):
        d = layer.backward(d)
        assert d.dtype == np.float32, type(layer).__name__
    assert conv.backward(d).dtype == np.float32
    for g in list(grads.values()) + list(lgrads.values()):
        assert g.dtype == np.float32 and np.all(np.isfinite(g))


def test_init_schemes_are_seeded_and_scaled():
    shape = (64, 32, 3, 3)
    a = init_array(("xavier",), shape, np.random.default_rng(0))
    b = init_array(("xavier",), shape, np.random.default_rng(0))
    np.testing.assert_array_equal(a, b)
    bound_ = np.sqrt(3.0 / (32 * 9))                          # Caffe XavierFiller, fan_in
    assert np.abs(a).max() <= bound_ and np.abs(a).max() > 0.9 * bound_
    he = init_array(("he",), (256, 128), np.random.default_rng(1), np.float64)
    assert abs(he.std() - np.sqrt(2.0 / 128)) < 0.01 * np.sqrt(2.0 / 128) * 5
    g = init_array(("gaussian", 0.01), (300, 300), np.random.default_rng(2), np.float64)
    assert abs(g.std() - 0.01) < 2e-4
    assert np.all(init_array(("constant", 0.2), (5,), np.random.default_rng(3)) == np.float32(0.2))
    with pytest.raises(ValueError, match="init spec"):
        init_array(("uniform",), (3,), np.random.default_rng(0))


@needs_torch
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("case", CONV_CASES)
def test_conv_matches_torch(case, algorithm):
    b, c, h, w, o, k, s, p = case
    layer = Conv2d(c, o, k, stride=s, padding=p)
    layer.algorithm = algorithm
    params, grads = bound(layer, (c, h, w))
    x = np.random.default_rng(12).normal(size=(b, c, h, w))
    y = layer.forward(x)
    dy = np.random.default_rng(13).normal(size=y.shape)
    dx = layer.backward(dy)
    xt = torch.tensor(x, requires_grad=True)
    wt = torch.tensor(params["weight"], requires_grad=True)
    bt = torch.tensor(params["bias"], requires_grad=True)
    yt = torch.nn.functional.conv2d(xt, wt, bt, stride=layer.stride, padding=layer.padding)
    yt.backward(torch.tensor(dy))
    np.testing.assert_allclose(y, yt.detach().numpy(), atol=1e-10)
    np.testing.assert_allclose(dx, xt.grad.numpy(), atol=1e-10)
    np.testing.assert_allclose(grads["weight"], wt.grad.numpy(), atol=1e-10)
    np.testing.assert_allclose(grads["bias"], bt.grad.numpy(), atol=1e-10)


@needs_torch
@pytest.mark.parametrize("case", POOL_CASES)
def test_pools_match_torch_ceil_mode(case, pool_chunks):
    b, c, h, w, k, s, p = case
    x = np.random.default_rng(14).normal(size=(b, c, h, w))
    for ours, theirs in [(MaxPool2d(k, s, p), torch.nn.MaxPool2d(k, s, p, ceil_mode=True)),
                         (AvgPool2d(k, s, p), torch.nn.AvgPool2d(k, s, p, ceil_mode=True))]:
        _pool_against_torch(ours, theirs, x, seed=15)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU with CuPy")
def test_layers_on_gpu_match_numpy():
    import cupy
    x = np.random.default_rng(16).normal(size=(4, 3, 11, 11)).astype(np.float32)
    stack = [("conv", Conv2d(3, 5, 3, padding=1)), ("pool", MaxPool2d(3, 2)),
             ("relu", ReLU()), ("avg", AvgPool2d(2, 2)), ("flat", Flatten())]
    results = {}
    for xp in (np, cupy):
        params, grads = bound(stack[0][1], (3, 11, 11), dtype=np.float32)
        params = {k: xp.asarray(v) for k, v in params.items()}
        grads = {k: xp.zeros_like(v) for k, v in params.items()}
        stack[0][1].bind(params, grads)
        a = xp.asarray(x)
        for _, layer in stack:
            a = layer.forward(a)
        d = xp.ones_like(a)
        for _, layer in reversed(stack):
            d = layer.backward(d)
        results[xp.__name__] = [cupy.asnumpy(v) if xp is cupy else v
                                for v in (a, d, grads["weight"], grads["bias"])]
    for ref, got in zip(results["numpy"], results["cupy"]):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


# --- the blocked im2col (CPU) and the phase-plane pools

def _conv_against_torch(layer, x, seed):
    """Run forward and backward of ``layer`` on ``x``; compare all four results with PyTorch."""
    params, grads = layer.params, layer.grads
    y = layer.forward(x)
    dy = np.random.default_rng(seed).normal(size=y.shape)
    dx = layer.backward(dy)
    xt = torch.tensor(np.ascontiguousarray(x), requires_grad=True)
    wt = torch.tensor(params["weight"], requires_grad=True)
    bt = torch.tensor(params["bias"], requires_grad=True)
    yt = torch.nn.functional.conv2d(xt, wt, bt, stride=layer.stride, padding=layer.padding)
    yt.backward(torch.tensor(dy))
    for name, ours, theirs in [("y", y, yt), ("dx", dx, xt.grad), ("dW", grads["weight"], wt.grad),
                               ("db", grads["bias"], bt.grad)]:
        np.testing.assert_allclose(ours, theirs.detach().numpy(), rtol=1e-12, atol=1e-12,
                                   err_msg=name)


@pytest.mark.parametrize("block_bytes", [1, 3000, 40000, 1 << 30])
def test_column_blocks_tile_the_output_in_contiguous_ranges(monkeypatch, block_bytes):
    from ringnet.layers import conv
    monkeypatch.setattr(conv, "CPU_BLOCK_BYTES", block_bytes)
    for ho, wo, b, rows in [(7, 5, 3, 4), (16, 16, 64, 800), (1, 9, 2, 75), (5, 1, 1, 9)]:
        blocks = conv.column_blocks(np, ho, wo, b, rows, 8)
        covered = np.zeros(ho * wo * b, dtype=int)
        for r0, r1, w0, w1 in blocks:
            assert r1 - r0 == 1 or (w0, w1) == (0, wo), (r0, r1, w0, w1)
            cols = conv._block_columns((r0, r1, w0, w1), wo, b)
            assert cols.stop - cols.start == (r1 - r0) * (w1 - w0) * b
            covered[cols] += 1
            if len(blocks) > 1:                       # no block much over the budget
                assert rows * (cols.stop - cols.start) * 8 <= max(block_bytes, rows * b * 8)
        np.testing.assert_array_equal(covered, 1)     # every column exactly once
        assert (len(blocks) == 1) == (rows * ho * wo * b * 8 <= block_bytes)
        assert conv.column_blocks(None, ho, wo, b, rows, 8) == [(0, ho, 0, wo)]  # a GPU: one


@needs_torch
@pytest.mark.parametrize("block_bytes", [8, 2000, 1 << 30])
@pytest.mark.parametrize("case", CONV_CASES + [(3, 4, 9, 9, 5, 3, 1, 2)])   # p > k-1: col2im
def test_conv_blocked_columns_match_torch(monkeypatch, block_bytes, case):
    # 8 bytes: one output position per block (every row split); 2000: whole rows and split
    # rows; 2**30: one block, whose columns the weight gradient reuses.
    from ringnet.layers import conv
    monkeypatch.setattr(conv, "CPU_BLOCK_BYTES", block_bytes)
    b, c, h, w, o, k, s, p = case
    layer = Conv2d(c, o, k, stride=s, padding=p)
    bound(layer, (c, h, w), seed=21)
    x = np.random.default_rng(22).normal(size=(b, c, h, w))
    _conv_against_torch(layer, x, seed=23)
    _conv_against_torch(layer, batch_last(x), seed=24)       # buffers reused, other layout
    layer.forward(x, train=False)                             # an eval pass in between keeps
    _conv_against_torch(layer, x, seed=25)                    # nothing of the train pass


POOL_EXTRA_CASES = [  # (B, C, H, W, kernel, stride, padding)
    (2, 3, 10, 12, 3, 2, 0),           # cifar10_quick's 3/2 on even sizes: one-copy phase split
    (1, 2, 7, 8, 2, 3, 0),             # kernel < stride: pixels no window reads
    (2, 2, 9, 7, 3, 3, 1),             # stride 3 with padding, odd sizes
    (1, 1, 4, 4, 1, 1, 0),             # identity window
]


def _pool_against_torch(ours, theirs, x, seed):
    y = ours.forward(x)
    dy = np.random.default_rng(seed).normal(size=y.shape)
    xt = torch.tensor(np.ascontiguousarray(x), requires_grad=True)
    yt = theirs(xt)
    yt.backward(torch.tensor(dy))
    name = type(ours).__name__
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=0, atol=1e-12, err_msg=name)
    np.testing.assert_allclose(ours.backward(dy), xt.grad.numpy(), rtol=0, atol=1e-12,
                               err_msg=name)


@needs_torch
@pytest.mark.parametrize("case", POOL_CASES + POOL_EXTRA_CASES)
def test_max_pool_ties_match_torch(case, pool_chunks):
    # Values from {0, 1, 2} tie in almost every window; PyTorch, like Caffe, routes the
    # gradient to the first maximum in row-major order, across the phase planes.
    b, c, h, w, k, s, p = case
    x = np.random.default_rng(26).integers(0, 3, size=(b, c, h, w)).astype(np.float64)
    layer = MaxPool2d(k, s, p)
    theirs = torch.nn.MaxPool2d(k, s, p, ceil_mode=True)
    _pool_against_torch(layer, theirs, x, seed=27)
    _pool_against_torch(layer, theirs, batch_last(x), seed=28)


@needs_torch
@pytest.mark.parametrize("case", POOL_EXTRA_CASES)
def test_pools_extra_geometries_match_torch(case, pool_chunks):
    b, c, h, w, k, s, p = case
    x = np.random.default_rng(29).normal(size=(b, c, h, w))
    for ours, theirs in [(MaxPool2d(k, s, p), torch.nn.MaxPool2d(k, s, p, ceil_mode=True)),
                         (AvgPool2d(k, s, p), torch.nn.AvgPool2d(k, s, p, ceil_mode=True))]:
        _pool_against_torch(ours, theirs, x, seed=30)
        _pool_against_torch(ours, theirs, batch_last(x), seed=31)


@pytest.mark.parametrize("cls", [MaxPool2d, AvgPool2d])
@pytest.mark.parametrize("case", POOL_EXTRA_CASES)
def test_pool_extra_geometries_match_finite_differences(cls, case, pool_chunks):
    b, c, h, w, k, s, p = case
    x = np.random.default_rng(32).normal(size=(b, c, h, w))
    fd_check(cls(k, s, p), x, {}, {})


def test_phase_planes_round_trip():
    from ringnet.layers.pool import merge_phases, phase_shape, split_phases
    for shape, stride in [((3, 8, 6, 2), (2, 2)), ((2, 7, 9, 1), (2, 3)), ((1, 5, 5, 3), (1, 1))]:
        xc = np.random.default_rng(33).normal(size=shape)          # (C, H, W, B)
        planes = split_phases(np, xc, stride, np.empty(phase_shape(shape, stride)))
        sh, sw = stride
        for a in range(sh):
            for e in range(sw):
                part = xc[:, a::sh, e::sw]
                np.testing.assert_array_equal(planes[a, e, :, :part.shape[1], :part.shape[2]],
                                              part)
        np.testing.assert_array_equal(merge_phases(np, planes, np.empty(shape)), xc)


def test_channel_chunks_cover_every_channel_in_even_parts():
    from ringnet.layers.pool import channel_chunks
    assert channel_chunks(32, 32, 32, 64, 4) == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 20),
                                                 (20, 24), (24, 28), (28, 32)]  # 256 KiB each
    assert channel_chunks(5, 4, 4, 2, 8, chunk_bytes=2 * 256) == [(0, 2), (2, 4), (4, 5)]
    assert channel_chunks(3, 8, 8, 8, 8, chunk_bytes=1) == [(0, 1), (1, 2), (2, 3)]
    assert channel_chunks(3, 2, 2, 1, 4) == [(0, 3)]


@pytest.fixture(params=["whole", "per-channel"])
def pool_chunks(request, monkeypatch):
    """Run a pool test with the default channel chunks (one, at these sizes) and with one
    channel per chunk (every chunk boundary)."""
    from ringnet.layers import pool
    if request.param == "per-channel":
        monkeypatch.setattr(pool, "CPU_CHUNK_BYTES", 1)
    return request.param


@pytest.mark.parametrize("make", [lambda: MaxPool2d(3, 2), lambda: AvgPool2d(3, 2),
                                  lambda: MaxPool2d(2, 2, 1), ReLU])
def test_results_survive_later_calls(make):
    # Work arrays are reused from call to call; what forward and backward return is not:
    # a later call (same shapes, train or eval) leaves earlier results as they were.
    layer = make()
    rng = np.random.default_rng(34)
    x1, x2 = (batch_last(rng.normal(size=(3, 2, 9, 9))) for _ in range(2))
    y1 = layer.forward(x1)
    dy = rng.normal(size=y1.shape)
    dx1 = layer.backward(dy)
    kept_y, kept_dx = y1.copy(), dx1.copy()
    layer.forward(x2, train=False)
    y2 = layer.forward(x2)
    dx2 = layer.backward(2 * dy)
    np.testing.assert_array_equal(y1, kept_y)
    np.testing.assert_array_equal(dx1, kept_dx)
    assert not np.array_equal(y1, y2) and not np.array_equal(dx1, dx2)
    # ...and a fresh layer on x2 gives the same results as the reused one
    fresh = make()
    np.testing.assert_array_equal(fresh.forward(x2), y2)
    np.testing.assert_array_equal(fresh.backward(2 * dy), dx2)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(64, 3, 5, 4), (64, 1, 32, 32), (13, 4, 16, 16), (8, 1, 2, 2),
                                   (1, 4, 2, 3), (20, 16), (40, 1024)])
def test_copy_samples_equals_a_plain_copy(shape, dtype):
    # sample-chunked copies between batch-first and batch-last memory (samples 4 KiB or more
    # apart: (64, 1, 32, 32), (13, 4, 16, 16), (40, 1024)), and every other pairing of orders
    # and sizes, write exactly what one whole copy writes
    from ringnet.layers.base import TRANSPOSE_SAMPLES, copy_samples, empty_like_layout
    assert 1 < TRANSPOSE_SAMPLES < 64
    x = np.random.default_rng(40).normal(size=shape).astype(dtype)
    flat = x.reshape(-1)
    flat[:3] = [np.nan, -0.0, np.inf]
    order = (1, 2, 3, 0) if len(shape) == 4 else (1, 0)
    last = np.ascontiguousarray(x.transpose(order)).transpose(np.argsort(order))
    for src in (x, last):
        for like in (x, last):
            dst = empty_like_layout(np, like, shape)
            out = copy_samples(np, dst, src)
            assert out is dst
            assert np.ascontiguousarray(dst).tobytes() == x.tobytes()


def test_batch_last_and_flatten_backward_keep_values_and_layouts():
    from ringnet.layers.base import batch_last as to_batch_last
    rng = np.random.default_rng(41)
    x = rng.normal(size=(24, 4, 4, 4)).astype(np.float32)       # 256-byte samples
    got = to_batch_last(np, x)
    assert got.flags.c_contiguous and got.shape == (4, 4, 4, 24)
    np.testing.assert_array_equal(got, x.transpose(1, 2, 3, 0))
    assert to_batch_last(np, batch_last(x)).base is not None    # already batch-last: a view
    for xin in (x, batch_last(x)):
        layer = Flatten()
        layer.forward(xin)
        dy = rng.normal(size=(24, 64)).astype(np.float32)
        dx = layer.backward(dy)
        assert dx.strides == xin.strides
        np.testing.assert_array_equal(dx, dy.reshape(x.shape))


def test_conv_reused_layer_follows_a_changed_block_size(monkeypatch):
    # The im2col views are kept per (buffer, blocks); a new block budget must rebuild them.
    from ringnet.layers import conv
    rng = np.random.default_rng(42)
    x = rng.normal(size=(5, 3, 7, 6))
    layer = Conv2d(3, 4, 3, stride=1, padding=1)
    bound(layer, (3, 7, 6), seed=43)
    runs = []
    for block_bytes in (5000, 1 << 30, 700, 1 << 30):
        monkeypatch.setattr(conv, "CPU_BLOCK_BYTES", block_bytes)
        fresh = Conv2d(3, 4, 3, stride=1, padding=1)
        params, _ = bound(fresh, (3, 7, 6), seed=43)
        for lay in (layer, fresh):
            y = lay.forward(x)
            dy = np.cos(np.arange(y.size)).reshape(y.shape)
            runs.append((y, lay.backward(dy), lay.grads["weight"].copy()))
        for a, b in zip(runs[-2], runs[-1]):
            np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13)
    np.testing.assert_array_equal(runs[2][0], runs[-1][0])   # same budget, same y


def test_pool_reused_layer_follows_input_sizes():
    # tap plans are kept per input size: alternating sizes give a fresh layer's results
    rng = np.random.default_rng(44)
    for make in (lambda: MaxPool2d(3, 2, 1), lambda: AvgPool2d(3, 2)):
        layer = make()
        for h, w in [(9, 9), (6, 7), (9, 9), (11, 4)]:
            x = batch_last(rng.normal(size=(3, 2, h, w)))
            y = layer.forward(x)
            dy = rng.normal(size=y.shape)
            dx = layer.backward(dy)
            fresh = make()
            np.testing.assert_array_equal(fresh.forward(x), y)
            np.testing.assert_array_equal(fresh.backward(dy), dx)


@pytest.mark.parametrize("block_bytes", [8, 2000, 1 << 30])
@pytest.mark.parametrize("case", [(3, 2, 12, 12, 5, 5, 1, 0), (2, 3, 9, 9, 4, 3, 2, 1),
                                  (2, 2, 11, 11, 3, 2, 2, 0), (3, 2, 8, 8, 3, 3, 1, 3)])
def test_col2im_adds_in_block_row_tap_column_tap_order(monkeypatch, block_bytes, case):
    # dx of the col2im path is bit-for-bit a sum, per block of output positions, over row
    # taps i then column taps j (the order the GPU kernel's emulation is checked against
    # with one block); a faster grouping of the adds must not reorder any element's terms.
    from ringnet.layers import conv
    monkeypatch.setattr(conv, "CPU_BLOCK_BYTES", block_bytes)
    b, c, h, w, o, k, s, p = case
    layer = Conv2d(c, o, k, stride=s, padding=p)
    params, _ = bound(layer, (c, h, w), seed=45)
    x = np.random.default_rng(46).normal(size=(b, c, h, w))
    y = layer.forward(x)
    dy = batch_last(np.random.default_rng(47).normal(size=y.shape))
    dx = layer.backward(dy)
    assert "cols-dx" not in layer._buffers                      # the col2im branch ran
    _, _, ho, wo = y.shape
    dy2 = np.ascontiguousarray(dy.transpose(1, 2, 3, 0)).reshape(o, -1)
    weight_t = params["weight"].reshape(o, -1).T
    want = np.zeros((c, h + 2 * p, w + 2 * p, b))
    for r0, r1, w0, w1 in conv.column_blocks(np, ho, wo, b, c * k * k, 8):
        cols = conv._block_columns((r0, r1, w0, w1), wo, b)
        dcols = (weight_t @ dy2[:, cols]).reshape(c, k, k, r1 - r0, w1 - w0, b)
        for i in range(k):
            for j in range(k):
                want[:, r0 * s + i:(r1 - 1) * s + i + 1:s,
                     w0 * s + j:(w1 - 1) * s + j + 1:s] += dcols[:, i, j]
    want = want[:, p:p + h, p:p + w].transpose(3, 0, 1, 2)
    assert np.ascontiguousarray(dx).tobytes() == np.ascontiguousarray(want).tobytes()
