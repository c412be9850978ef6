"""The fused CUDA kernels (ringnet/layers/cuda_kernels.py) against the NumPy layers.

Without a GPU: each kernel's NumPy emulation (ringnet/testing/cuda_emulation.py: the same
index arithmetic, one NumPy lane per CUDA thread) run through the same host wrappers, and
the layers' GPU branches run on a stand-in array module that is NumPy under another name;
the CUDA sources compile with NVRTC where its library loads. With a GPU (marked ``gpu``):
the real kernels. The emulations against the CUDA bodies, expression by expression:
tests/testing/test_cuda_emulation.py.
Max, argmax, masks and the sums taken in the same order as NumPy's must be bit-identical;
the convolution's GEMMs, whose shapes differ between the branches, agree within the bound
of summing in another order (_summation_bounds).
"""
import numpy as np
import pytest

from ringnet.backend import gpu_available
from ringnet.layers.base import memory_order
from ringnet.layers import (AvgPool2d, Conv2d, Dropout, Flatten, MaxPool2d, ReLU, activation, conv,
                            cuda_kernels, cuda_ops, cuda_registry, linear, pool)

POOL_CASES = [  # (B, C, H, W, kernel, stride, padding)
    (2, 3, 8, 8, 2, 2, 0),             # non-overlapping
    (1, 2, 7, 9, 3, 2, 0),             # overlapping with ceil-mode overhang, batch 1
    (2, 2, 6, 5, 3, 1, 1),             # padding, stride 1
    (2, 1, 5, 5, 2, 2, 1),             # ceil rule drops the window starting in the pad
    (3, 2, 11, 11, 3, 2, 1),           # padding and overhang, odd batch
    (2, 3, 10, 12, 3, 2, 0),           # cifar10_quick's 3/2 on even sizes
    (2, 2, 4, 6, (2, 3), (1, 2), (1, 1)),   # non-square geometry
    (5, 1, 3, 3, 3, 3, 0),             # one window
    (1, 1, 1, 1, 1, 1, 0),             # one pixel
    (4, 3, 9, 7, 4, 3, 2),             # kernel 4 stride 3 pad 2: windows in the pad
]
DTYPES = [np.float32, np.float64]


def _data(case, dtype, kind, seed=0):
    b, c, h, w = case[:4]
    rng = np.random.default_rng(seed)
    if kind == "ties":                 # few distinct values: many ties inside windows
        return rng.integers(-1, 2, size=(b, c, h, w)).astype(dtype)
    x = rng.normal(size=(b, c, h, w)).astype(dtype)
    if kind == "inf":                  # whole windows of -inf: nothing beats the start
        x[:, :, ::2] = -np.inf
    return x


def _run(layer, x, dy_seed=1):
    """Return (y, dx, cache) of a train forward and a backward with a random dy."""
    y = layer.forward(x)
    cache = layer._cache
    dy = np.random.default_rng(dy_seed).normal(size=y.shape).astype(x.dtype)
    dx = layer.backward(dy)
    return np.asarray(y), np.asarray(dx), cache


# --- without a GPU: the emulated kernels through the host wrappers

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["normal", "ties", "inf"])
@pytest.mark.parametrize("case", POOL_CASES)
def test_emulated_maxpool_kernels_equal_the_numpy_layer_bit_for_bit(case, kind, dtype):
    b, c, h, w, k, s, p = case
    x = _data(case, dtype, kind)
    layer = MaxPool2d(k, s, p)
    y = layer.forward(x)
    argmax = layer._cache[1]
    dy = np.random.default_rng(1).normal(size=y.shape).astype(dtype)
    dx = layer.backward(dy)
    out_hw = layer.output_shape((c, h, w))[1:]
    ye, argmax_e = cuda_ops.maxpool_forward(np, x, out_hw, layer.kernel_size, layer.stride,
                                         layer.padding)
    np.testing.assert_array_equal(ye, y)
    np.testing.assert_array_equal(argmax_e, argmax)
    assert argmax_e.shape == argmax.shape and argmax_e.dtype == np.uint8
    dxe = cuda_ops.maxpool_backward(np, dy, argmax_e, x.shape, layer.kernel_size, layer.stride,
                                 layer.padding)
    np.testing.assert_array_equal(dxe, dx)
    assert dxe.dtype == dtype and dxe.shape == x.shape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["normal", "ties", "inf"])
@pytest.mark.parametrize("case", POOL_CASES[:6])
def test_a_bias_handed_to_the_maxpool_kernel_equals_adding_it_first(case, kind, dtype):
    # The convolution before leaves its bias to the pool kernel on a GPU: pooling x + bias
    # tap by tap is what adding the bias over the whole map and pooling gives, bit for bit.
    b, c, h, w, k, s, p = case
    x = _data(case, dtype, kind)
    bias = np.random.default_rng(4).normal(size=c).astype(dtype)
    layer = MaxPool2d(k, s, p)
    y = layer.forward(x + bias[:, None, None])
    argmax = layer._cache[1]
    out_hw = layer.output_shape((c, h, w))[1:]
    ye, argmax_e = cuda_ops.maxpool_forward(np, x, out_hw, layer.kernel_size, layer.stride,
                                            layer.padding, bias=bias)
    np.testing.assert_array_equal(ye, y)
    np.testing.assert_array_equal(argmax_e, argmax)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pool", [MaxPool2d, AvgPool2d])
def test_pool_backward_kernels_read_a_batch_first_dy_in_place(pool, dtype):
    # After a Flatten dy comes batch-first (a Linear's dx): the kernels read it through its
    # strides, with the result of a batch-last copy.
    case = (3, 2, 10, 12, 3, 2, 0)
    b, c, h, w, k, s, p = case
    x = _data(case, dtype, "normal")
    layer = pool(k, s, p)
    y = layer.forward(x)
    dy = np.random.default_rng(5).normal(size=y.shape).astype(dtype)     # C-order: batch first
    want = layer.backward(np.ascontiguousarray(dy.transpose(1, 2, 3, 0)).transpose(3, 0, 1, 2))
    if pool is MaxPool2d:
        got = cuda_ops.maxpool_backward(np, dy, layer._cache[1], x.shape, layer.kernel_size,
                                        layer.stride, layer.padding)
    else:
        got = cuda_ops.avgpool_backward(np, dy, layer._gpu_inv(np, h, w, dtype), x.shape,
                                        layer.kernel_size, layer.stride, layer.padding)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_maxpool_propagates_nan_like_numpy(dtype):
    x = _data((2, 2, 7, 7), dtype, "normal")
    x[0, 0, 1, 1] = np.nan
    x[1, 1, 4, 4] = np.nan
    layer = MaxPool2d(3, 2, 1)
    y = layer.forward(x)
    ye, argmax_e = cuda_ops.maxpool_forward(np, x, y.shape[2:], layer.kernel_size,
                                         layer.stride, layer.padding)
    assert np.isnan(y).sum() >= 2
    np.testing.assert_array_equal(ye, y)
    np.testing.assert_array_equal(argmax_e, layer._cache[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", POOL_CASES)
def test_emulated_avgpool_kernels_equal_the_numpy_layer(case, dtype):
    b, c, h, w, k, s, p = case
    x = _data(case, dtype, "normal")
    layer = AvgPool2d(k, s, p)
    y = layer.forward(x)
    dy = np.random.default_rng(2).normal(size=y.shape).astype(dtype)
    dx = layer.backward(dy)
    inv = layer._gpu_inv(np, h, w, dtype)
    ye = cuda_ops.avgpool_forward(np, x, inv, layer.kernel_size, layer.stride, layer.padding)
    dxe = cuda_ops.avgpool_backward(np, dy, inv, x.shape, layer.kernel_size, layer.stride,
                                 layer.padding)
    # The kernels add in the NumPy layer's order: equal to the last bit.
    np.testing.assert_array_equal(ye, y)
    np.testing.assert_array_equal(dxe, dx)


CONV_CASES = [  # (B, C, H, W, O, kernel, stride, padding): the col2im branch of backward
    (3, 2, 12, 12, 4, 5, 1, 0),        # lenet conv2's shape class: output smaller than input
    (2, 3, 9, 9, 2, 3, 2, 1),          # stride 2 with padding
    (2, 2, 9, 8, 3, 5, 3, 2),          # stride 3, windows overlap the pad
    (1, 1, 7, 7, 2, (3, 2), (2, 1), (1, 0)),
    (3, 4, 9, 9, 5, 3, 1, 3),          # stride 1, padding p >= k: taps that read only the pad
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CONV_CASES)
def test_emulated_col2im_equals_the_numpy_col2im(monkeypatch, case, dtype):
    monkeypatch.setattr(conv, "CPU_BLOCK_BYTES", 1 << 40)     # one block, as on a GPU
    b, c, h, w, o, k, s, p = case
    layer = Conv2d(c, o, k, stride=s, padding=p)
    rng = np.random.default_rng(3)
    layer.bind({"weight": rng.normal(size=(o, c, *layer.kernel_size)).astype(dtype),
                "bias": rng.normal(size=o).astype(dtype)},
               {"weight": np.empty((o, c, *layer.kernel_size), dtype), "bias": np.empty(o, dtype)})
    x = rng.normal(size=(b, c, h, w)).astype(dtype)
    y = layer.forward(x)
    dx = layer.backward(rng.normal(size=y.shape).astype(dtype))
    _, ho, wo = layer.output_shape((c, h, w))
    kh, kw = layer.kernel_size
    # The column gradient the NumPy col2im read is still in the column buffer.
    dcols = layer._buffers["cols-train"][2][:c * kh * kw * ho * wo * b]
    dxe = cuda_ops.col2im(np, dcols.reshape(c, kh, kw, ho, wo, b), (h, w), layer.stride,
                       layer.padding)
    np.testing.assert_array_equal(dxe.transpose(3, 0, 1, 2), dx)


# Geometries whose backward takes the flipped-convolution branch (stride 1, "same"-like
# padding: output not smaller than input) and a few more for the columns themselves.
FLIPPED_CASES = [  # (B, C, H, W, O, kernel, stride, padding)
    (2, 3, 8, 8, 4, 5, 1, 2),          # cifar10_quick's 5x5 pad 2
    (3, 2, 7, 9, 3, 3, 1, 1),          # odd sizes, 3x3 pad 1
    (1, 4, 5, 6, 2, (3, 5), 1, (1, 2)),     # non-square kernel
    (2, 1, 4, 4, 2, 3, 1, 2),          # output larger than the input
]
IM2COL_CASES = CONV_CASES + FLIPPED_CASES + [(2, 3, 6, 6, 2, 1, 1, 0), (1, 2, 9, 7, 3, 4, 2, 3)]


def _conv_layer(case, dtype, seed=3):
    b, c, h, w, o, k, s, p = case
    layer = Conv2d(c, o, k, stride=s, padding=p)
    rng = np.random.default_rng(seed)
    kh, kw = layer.kernel_size
    layer.bind({"weight": rng.normal(size=(o, c, kh, kw)).astype(dtype),
                "bias": rng.normal(size=o).astype(dtype)},
               {"weight": np.empty((o, c, kh, kw), dtype), "bias": np.empty(o, dtype)})
    return layer


def _layouts(x):
    """x batch-first, batch-last, channel-last and as a non-dense view (every other row of
    a larger array): the memory orders a layer's input can have."""
    b, c, h, w = x.shape
    wide = np.zeros((b, c, 2 * h, w), x.dtype)
    wide[:, :, ::2] = x
    return {"batch-first": x,
            "batch-last": np.ascontiguousarray(x.transpose(1, 2, 3, 0)).transpose(3, 0, 1, 2),
            "channel-last": np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2),
            "strided": wide[:, :, ::2]}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", IM2COL_CASES)
def test_emulated_im2col_equals_the_numpy_columns(monkeypatch, case, dtype):
    monkeypatch.setattr(conv, "CPU_BLOCK_BYTES", 1 << 40)     # one block, as on a GPU
    b, c, h, w, o, k, s, p = case
    layer = _conv_layer(case, dtype)
    x = np.random.default_rng(6).normal(size=(b, c, h, w)).astype(dtype)
    y = layer.forward(x)
    _, ho, wo = layer.output_shape((c, h, w))
    kh, kw = layer.kernel_size
    want = layer._buffers["cols-train"][2][:c * kh * kw * ho * wo * b].copy()
    for name, xl in _layouts(x).items():
        cols = np.full((c, kh, kw, ho, wo, b), np.nan, dtype)
        cuda_ops.im2col(np, xl, cols, layer.stride, layer.padding)
        np.testing.assert_array_equal(cols.reshape(-1), want, err_msg=name)
    # the flipped branch's columns: dy padded by k - 1 - p, read with stride 1
    dy = np.random.default_rng(7).normal(size=y.shape).astype(dtype)
    layer.backward(dy)
    if "cols-dx" in layer._buffers:
        want = layer._buffers["cols-dx"][2][:o * kh * kw * h * w * b]
        dcols = np.full((o, kh, kw, h, w, b), np.nan, dtype)
        ph, pw = layer.padding
        for name, dyl in _layouts(dy).items():
            cuda_ops.im2col(np, dyl, dcols, (1, 1), (kh - 1 - ph, kw - 1 - pw))
            np.testing.assert_array_equal(dcols.reshape(-1), want, err_msg=name)
    else:
        assert case in IM2COL_CASES[:len(CONV_CASES)] or s > 1 or p >= k


def test_the_flipped_cases_take_the_flipped_branch(monkeypatch):
    monkeypatch.setattr(conv, "CPU_BLOCK_BYTES", 1 << 40)
    for case in FLIPPED_CASES:
        layer = _conv_layer(case, np.float64)
        y = layer.forward(np.ones(case[:4]))
        layer.backward(np.ones(y.shape))
        assert "cols-dx" in layer._buffers, case
    for case in CONV_CASES:
        layer = _conv_layer(case, np.float64)
        y = layer.forward(np.ones(case[:4]))
        layer.backward(np.ones(y.shape))
        assert "cols-dx" not in layer._buffers, case


def _relu_data(shape, dtype, seed=8):
    x = np.random.default_rng(seed).normal(size=shape).astype(dtype)
    flat = x.reshape(-1)
    flat[:6] = [np.nan, -0.0, 0.0, np.inf, -np.inf, -np.nan]
    return x


@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_relu_kernels_equal_numpy_bit_for_bit(dtype):
    x = _relu_data((3, 2, 5, 4), dtype)
    dy = _relu_data((3, 2, 5, 4), dtype, seed=9)[::-1].copy()   # NaN/inf/-0 against all y
    for name, xl in _layouts(x).items():
        y = cuda_ops.relu_forward(np, xl)
        want = np.maximum(xl, 0)
        assert y.tobytes() == want.tobytes() or \
            np.ascontiguousarray(y).tobytes() == np.ascontiguousarray(want).tobytes(), name
        np.testing.assert_array_equal(np.signbit(y), np.signbit(want))      # -0, -NaN
        if name != "strided":
            assert y.strides == xl.strides, name                           # x's memory order
        for dname, dyl in _layouts(dy).items():
            dx = cuda_ops.relu_backward(np, dyl, y)
            with np.errstate(invalid="ignore"):
                want_dx = np.multiply(dyl, y > 0)
            assert np.ascontiguousarray(dx).tobytes() == \
                np.ascontiguousarray(want_dx).tobytes(), (name, dname)
            assert dx.strides == y.strides or name == "strided", (name, dname)


@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_relu_kernels_with_the_bias_before_them(dtype):
    # A Linear's (B, K) output and a convolution's (B, C, H, W) in (C, H, W, B) memory:
    # the forward is max(x + bias, 0) bit for bit; the backward's dx is relu_backward's and
    # its bias gradient the sum of dx over all but the channel axis, in memory order.
    rng = np.random.default_rng(6)
    for x in (_relu_data((5, 7), dtype),
              _relu_data((2, 3, 4, 5), dtype).transpose(1, 2, 3, 0).copy().transpose(3, 0, 1, 2)):
        c = x.shape[1]
        bias = rng.normal(size=c).astype(dtype)
        shape = (1, c) + (1,) * (x.ndim - 2)
        y = cuda_ops.relu_forward(np, x, bias=bias)
        want = np.maximum(x + bias.reshape(shape), 0)
        assert np.ascontiguousarray(y).tobytes() == np.ascontiguousarray(want).tobytes()
        assert y.strides == x.strides
        dy = rng.normal(size=x.shape).astype(dtype)
        dbias = np.full(c, np.nan, dtype)
        dx = cuda_ops.relu_backward_bias(np, dy, y, dbias)
        np.testing.assert_array_equal(dx, cuda_ops.relu_backward(np, dy, y))
        axes = tuple(a for a in range(x.ndim) if a != 1)
        np.testing.assert_allclose(dbias, dx.sum(axis=axes, dtype=np.float64),
                                   rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,p,key,first", [
    ((4, 7), 0.5, (0, 0, 3), 0),
    ((3, 2, 5, 5), 0.3, (12, 345, 1), 6),
    ((1, 1000), 0.9, (2 ** 40, 7, 0), 3),
    ((5, 3), 0.1, (-1, 2, 9), 0),
])
def test_emulated_dropout_mask_equals_the_numpy_mask(shape, p, key, first, dtype):
    keep = activation.keep_mask(np, shape, p, key, first_sample=first)
    scale = 1.0 / (1.0 - p)
    mask = cuda_ops.dropout_mask(np, shape, dtype, activation.stream_keys(key),
                              activation.keep_threshold(p), scale, first_sample=first)
    np.testing.assert_array_equal(mask, keep.astype(dtype) * np.dtype(dtype).type(scale))
    assert mask.dtype == dtype and mask.shape == shape and 0 < keep.sum() < keep.size


def test_argument_types_are_checked_against_the_c_signature():
    x = np.zeros((1, 1, 4, 4), np.float32)
    cuda_ops.maxpool_forward(np, x, (2, 2), (2, 2), (2, 2), (0, 0))       # fine
    args = (np.zeros(16, np.float32), np.zeros(4, np.float32), np.zeros(4, np.uint8),
            np.int64(4), *cuda_ops._geometry(1, 4, 4, 1, 2, 2, (2, 2), (2, 2), (0, 0)),
            np.float32(-np.inf), np.zeros(1, np.float32), np.int32(0))
    cuda_kernels.launch(np, "maxpool_fwd", np.float32, 4, args)
    for i, bad in [(3, 4), (4, np.int64(1)), (1, np.zeros(4, np.float64)),
                   (2, np.zeros(4, np.int8)), (16, np.float64(-np.inf))]:
        broken = args[:i] + (bad,) + args[i + 1:]
        with pytest.raises(TypeError):
            cuda_kernels.launch(np, "maxpool_fwd", np.float32, 4, broken)
    with pytest.raises(TypeError):
        cuda_kernels.launch(np, "maxpool_fwd", np.float32, 4, args[:-1])


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
        return nvrtc
    except Exception:  # noqa: BLE001 - no NVRTC library on this machine
        return None


@pytest.mark.skipif(_nvrtc() is None, reason="no NVRTC library (CUDA runtime compiler) here")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_sources_compile_with_nvrtc(dtype):
    nvrtc = _nvrtc()
    for name in cuda_kernels.KERNELS:
        prog = nvrtc.createProgram(cuda_kernels.source(name, dtype), name + ".cu", [], [])
        try:
            nvrtc.compileProgram(prog, ["-arch=compute_70", *cuda_kernels.OPTIONS])
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"{name} ({np.dtype(dtype).name}): {exc}\n{nvrtc.getProgramLog(prog)}")
        ptx = nvrtc.getPTX(prog)
        nvrtc.destroyProgram(prog)
        assert f".entry {name}(".encode() in ptx


# --- without a GPU: the layers' GPU branches on NumPy under another name

class _StandIn:
    """An array module that is NumPy but not ``numpy``: the layers take their GPU branch."""

    def __getattr__(self, name):
        return getattr(np, name)


def _patch(m):
    xp = _StandIn()
    for module in (pool, conv, activation):
        m.setattr(module, "get_array_module", lambda *a: xp)
    m.setattr(activation, "is_gpu_array", lambda a: True)
    m.setattr(linear, "is_gpu_array", lambda a: True)
    launch = cuda_kernels.launch
    m.setattr(cuda_kernels, "launch", lambda _xp, *args: launch(np, *args))


def _layer_pair(make, dtype, in_shape=None):
    a, b = make(), make()
    if in_shape is not None:
        rng = np.random.default_rng(4)
        params = {s: rng.normal(size=shape).astype(dtype)
                  for s, shape, _ in a.param_specs(in_shape)}
        for layer in (a, b):
            layer.bind({s: v.copy() for s, v in params.items()},
                       {s: np.empty_like(v) for s, v in params.items()})
    return a, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", POOL_CASES)
def test_pool_layers_gpu_branch_equals_numpy_branch(monkeypatch, case, dtype):
    b, c, h, w, k, s, p = case
    for cls in (MaxPool2d, AvgPool2d):
        for layout in ("batch-first", "batch-last"):
            x = _data(case, dtype, "ties" if cls is MaxPool2d else "normal")
            if layout == "batch-last":
                x = np.ascontiguousarray(x.transpose(1, 2, 3, 0)).transpose(3, 0, 1, 2)
            ref, gpu = _layer_pair(lambda: cls(k, s, p), dtype)
            want = _run(ref, x)
            with monkeypatch.context() as m:
                _patch(m)
                got = _run(gpu, x)
                assert gpu._cache[2] is None          # the kernel branch ran
                gpu.forward(x, train=False)
                assert gpu._cache is None
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])
            if cls is MaxPool2d:
                np.testing.assert_array_equal(got[2][1], want[2][1])     # argmax
            assert got[0].strides == want[0].strides  # the same (C, Ho, Wo, B) memory


def _summation_bounds(case, dtype, params, x, dy):
    """Elementwise bounds on |GPU branch - NumPy branch| for the convolution's y, dx, dW, db.

    The two branches run their GEMMs in different shapes and orientations (and the col2im
    of dx after its GEMM), so BLAS sums the same products in another order: on OpenBLAS's
    Haswell and Zen kernels the results differ in the last bits. Any order of summing n
    rounded products p_i has |fl(sum) - sum| <= gamma_n * sum |p_i| with gamma_n =
    n u / (1 - n u) (Higham, Accuracy and Stability of Numerical Algorithms, 3.1 and
    4.2; a fused multiply-add only removes roundings), so two orders differ by at most
    2 gamma_n * sum |p_i|. The layer is linear in each operand, so sum |p_i| is the same
    layer run in float64 on |W|, |b|, |x| and |dy|. n is each output's number of terms:
    C*kh*kw + 1 for y (the bias), O*kh*kw for dx (GEMM over O, then col2im over the
    taps), B*Ho*Wo for dW and db.
    """
    b, c, h, w, o, k, s, p = case
    layer = Conv2d(c, o, k, stride=s, padding=p)
    kh, kw = layer.kernel_size
    abs_params = {n: np.abs(v).astype(np.float64) for n, v in params.items()}
    layer.bind(abs_params, {n: np.empty_like(v) for n, v in abs_params.items()})
    y = layer.forward(np.abs(x).astype(np.float64))
    dx = layer.backward(np.abs(dy).astype(np.float64))
    _, ho, wo = layer.output_shape((c, h, w))
    u = np.finfo(dtype).eps / 2

    def twice_gamma(n):
        return 2 * n * u / (1 - n * u)

    return {"y": twice_gamma(c * kh * kw + 1) * y, "dx": twice_gamma(o * kh * kw) * dx,
            "dW": twice_gamma(b * ho * wo) * layer.grads["weight"],
            "db": twice_gamma(b * ho * wo) * layer.grads["bias"]}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CONV_CASES + FLIPPED_CASES)
def test_conv_gpu_branch_equals_numpy_branch(monkeypatch, case, dtype):
    """The GPU branch against the NumPy branch, both as one block: equal within the bound
    that summing the same products in another order allows (_summation_bounds), not bit
    for bit, since their GEMMs have other shapes. The memory orders are equal exactly."""
    monkeypatch.setattr(conv, "CPU_BLOCK_BYTES", 1 << 40)     # one block, as on a GPU
    b, c, h, w, o, k, s, p = case
    x0 = np.random.default_rng(5).normal(size=(b, c, h, w)).astype(dtype)
    for layout, x in _layouts(x0).items():
        ref, gpu = _layer_pair(lambda: Conv2d(c, o, k, stride=s, padding=p), dtype, (c, h, w))
        params = {n: v.copy() for n, v in ref.params.items()}
        want = _run(ref, x)
        with monkeypatch.context() as m:
            _patch(m)
            got = _run(gpu, x)
            assert "cols-train" not in gpu._buffers           # the GPU branch ran
            gpu.forward(x, train=False)
            assert gpu._cache is None
        dy = np.random.default_rng(1).normal(size=want[0].shape).astype(dtype)   # _run's dy
        bounds = _summation_bounds(case, dtype, params, x, dy)
        for name, g, r in [("y", got[0], want[0]), ("dx", got[1], want[1]),
                           ("dW", gpu.grads["weight"], ref.grads["weight"]),
                           ("db", gpu.grads["bias"], ref.grads["bias"])]:
            err = np.abs(g.astype(np.float64) - r.astype(np.float64))
            worst = np.max(err - bounds[name])
            assert worst <= 0, f"{name} {layout}: {np.max(err):.3g} off, past its bound by {worst:.3g}"
        assert got[0].strides == want[0].strides                  # (O, Ho, Wo, B) memory
        assert memory_order(got[1]) == memory_order(want[1]) == [1, 2, 3, 0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_relu_and_flatten_gpu_branches_equal_numpy_branches(monkeypatch, dtype):
    x0 = _relu_data((4, 3, 5, 6), dtype)
    for layout, x in _layouts(x0).items():
        dy = _relu_data(x.shape, dtype, seed=10)
        ref, gpu = ReLU(), ReLU()
        y, dx = ref.forward(x), ref.backward(dy)
        with monkeypatch.context() as m:
            _patch(m)
            yg = gpu.forward(x)
            dxg = gpu.backward(dy)
            assert gpu.forward(x, train=False) is not None and gpu._y is None
        for name, g, r in [("y", yg, y), ("dx", dxg, dx)]:
            assert np.ascontiguousarray(g).tobytes() == np.ascontiguousarray(r).tobytes(), \
                f"{name} {layout}"
        if layout != "strided":
            assert yg.strides == x.strides
    x = _layouts(x0)["batch-last"]
    ref, gpu = Flatten(), Flatten()
    dy = np.random.default_rng(11).normal(size=(4, 90)).astype(dtype)
    want = (ref.forward(x), ref.backward(dy))
    with monkeypatch.context() as m:
        _patch(m)
        got = (gpu.forward(x), gpu.backward(dy))
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert np.shares_memory(got[1], dy)                       # a view, no copy


@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout_gpu_branch_equals_numpy_branch(monkeypatch, dtype):
    x = np.random.default_rng(6).normal(size=(6, 3, 4, 5)).astype(dtype)
    dy = np.random.default_rng(7).normal(size=x.shape).astype(dtype)
    ref, gpu = Dropout(0.4, seed=11), Dropout(0.4, seed=11)
    for layer in (ref, gpu):
        layer.layer_index, layer.step, layer.batch_part = 5, 17, (1, 3)
    want = [(ref.forward(x), ref.backward(dy)) for _ in range(2)]
    with monkeypatch.context() as m:
        _patch(m)
        got = [(gpu.forward(x), gpu.backward(dy)) for _ in range(2)]
        assert gpu.forward(x, train=False) is x
    assert ref.step == gpu.step == 19
    for (y, dx), (yr, dxr) in zip(got, want):
        np.testing.assert_array_equal(y, yr)
        np.testing.assert_array_equal(dx, dxr)
    assert not np.array_equal(got[0][0], got[1][0])           # fresh masks per step


# --- with a GPU: the real kernels

gpu = pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU with CuPy")


def _on_gpu(layer_ref, layer_gpu, x, dy_seed=1):
    import cupy
    want = _run(layer_ref, x, dy_seed)
    y = layer_gpu.forward(cupy.asarray(x))
    cache = layer_gpu._cache
    dy = np.random.default_rng(dy_seed).normal(size=y.shape).astype(x.dtype)
    dx = layer_gpu.backward(cupy.asarray(dy))
    return (cupy.asnumpy(y), cupy.asnumpy(dx), cache), want


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", POOL_CASES)
def test_gpu_pool_kernels_equal_the_numpy_layers(case, dtype):
    import cupy
    b, c, h, w, k, s, p = case
    for kind in ("normal", "ties", "inf"):
        x = _data(case, dtype, kind)
        got, want = _on_gpu(MaxPool2d(k, s, p), MaxPool2d(k, s, p), x)
        np.testing.assert_array_equal(got[0], want[0], err_msg=f"max y {kind}")
        np.testing.assert_array_equal(cupy.asnumpy(got[2][1]), want[2][1],
                                      err_msg=f"argmax {kind}")
        np.testing.assert_array_equal(got[1], want[1], err_msg=f"max dx {kind}")
    x = _data(case, dtype, "normal")
    got, want = _on_gpu(AvgPool2d(k, s, p), AvgPool2d(k, s, p), x)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == np.float32 else dict(rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(got[0], want[0], **tol, err_msg="avg y")
    np.testing.assert_allclose(got[1], want[1], **tol, err_msg="avg dx")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_maxpool_nan_and_eval(dtype):
    import cupy
    x = _data((2, 2, 7, 7), dtype, "normal")
    x[0, 0, 1, 1] = np.nan
    ref, dev = MaxPool2d(3, 2, 1), MaxPool2d(3, 2, 1)
    got, want = _on_gpu(ref, dev, x)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(cupy.asnumpy(got[2][1]), want[2][1])
    y = dev.forward(cupy.asarray(x), train=False)
    assert dev._cache is None
    np.testing.assert_array_equal(cupy.asnumpy(y), want[0])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CONV_CASES + FLIPPED_CASES)
def test_gpu_conv_equals_the_numpy_layer(case, dtype):
    import cupy
    b, c, h, w, o, k, s, p = case
    x0 = np.random.default_rng(5).normal(size=(b, c, h, w)).astype(dtype)
    for layout in ("batch-first", "batch-last"):
        x = _layouts(x0)[layout]
        ref, dev = _layer_pair(lambda: Conv2d(c, o, k, stride=s, padding=p), dtype, (c, h, w))
        dev.bind({n: cupy.asarray(v) for n, v in dev.params.items()},
                 {n: cupy.asarray(v) for n, v in dev.grads.items()})
        want = _run(ref, x)
        xd = cupy.asarray(x0)
        if layout == "batch-last":
            xd = cupy.ascontiguousarray(xd.transpose(1, 2, 3, 0)).transpose(3, 0, 1, 2)
        y = dev.forward(xd)
        dy = np.random.default_rng(1).normal(size=y.shape).astype(dtype)
        dx = dev.backward(cupy.asarray(dy))
        tol = dict(rtol=1e-4, atol=1e-4) if dtype == np.float32 else dict(rtol=1e-11, atol=1e-11)
        np.testing.assert_allclose(cupy.asnumpy(y), want[0], **tol, err_msg=f"y {layout}")
        np.testing.assert_allclose(cupy.asnumpy(dx), want[1], **tol, err_msg=f"dx {layout}")
        np.testing.assert_allclose(cupy.asnumpy(dev.grads["weight"]), ref.grads["weight"],
                                   **tol, err_msg=f"dW {layout}")
        np.testing.assert_allclose(cupy.asnumpy(dev.grads["bias"]), ref.grads["bias"],
                                   **tol, err_msg=f"db {layout}")
        assert memory_order(dx) == [1, 2, 3, 0]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", IM2COL_CASES)
def test_gpu_im2col_equals_the_emulation_bit_for_bit(case, dtype):
    # the emulation equals the NumPy layer's columns (test above); the kernel must equal it
    import cupy
    b, c, h, w, o, k, s, p = case
    layer = _conv_layer(case, dtype)
    _, ho, wo = layer.output_shape((c, h, w))
    kh, kw = layer.kernel_size
    x0 = np.random.default_rng(6).normal(size=(b, c, h, w)).astype(dtype)
    want = np.empty((c, kh, kw, ho, wo, b), dtype)
    cuda_ops.im2col(np, x0, want, layer.stride, layer.padding)
    for name, xl in _layouts(x0).items():
        xd = cupy.asarray(xl)                  # asarray keeps C order: rebuild each layout
        if name == "batch-last":
            xd = cupy.ascontiguousarray(cupy.asarray(x0).transpose(1, 2, 3, 0)).transpose(
                3, 0, 1, 2)
        elif name == "channel-last":
            xd = cupy.ascontiguousarray(cupy.asarray(x0).transpose(0, 2, 3, 1)).transpose(
                0, 3, 1, 2)
        elif name == "strided":
            wide = cupy.zeros((b, c, 2 * h, w), dtype)
            wide[:, :, ::2] = cupy.asarray(x0)
            xd = wide[:, :, ::2]
        cols = cupy.full((c, kh, kw, ho, wo, b), np.nan, dtype)
        cuda_ops.im2col(cupy, xd, cols, layer.stride, layer.padding)
        np.testing.assert_array_equal(cupy.asnumpy(cols), want, err_msg=name)


def _assert_same_floats(got, want):
    """Equal to the last bit, signs of zeros included; NaN where NaN (CUDA does not keep
    NaN payloads or signs, x86 does, so NaN bits may differ)."""
    np.testing.assert_array_equal(got, want)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.signbit(got[~nan]), np.signbit(want[~nan]))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_relu_and_flatten_equal_numpy_bit_for_bit(dtype):
    import cupy
    x = _relu_data((64, 8, 6, 5), dtype)
    dy = _relu_data(x.shape, dtype, seed=10)
    ref, dev = ReLU(), ReLU()
    y, dx = ref.forward(x), ref.backward(dy)
    xd = cupy.ascontiguousarray(cupy.asarray(x).transpose(1, 2, 3, 0)).transpose(3, 0, 1, 2)
    yd = dev.forward(xd)
    assert yd.strides == xd.strides                           # batch-last stays batch-last
    for dyd in (cupy.asarray(dy), cupy.ascontiguousarray(cupy.asarray(dy).transpose(
            1, 2, 3, 0)).transpose(3, 0, 1, 2)):
        dxd = dev.backward(dyd)
        assert dxd.strides == yd.strides
        _assert_same_floats(cupy.asnumpy(dxd), dx)
    _assert_same_floats(cupy.asnumpy(yd), y)
    flat = Flatten()
    flat.forward(xd)
    g = cupy.asarray(np.random.default_rng(12).normal(size=(64, 240)).astype(dtype))
    back = flat.backward(g)
    assert back.shape == x.shape and back.data.ptr == g.data.ptr           # a view
    np.testing.assert_array_equal(cupy.asnumpy(back), cupy.asnumpy(g).reshape(x.shape))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_dropout_masks_equal_the_numpy_masks(dtype):
    import cupy
    for shape, p, part in [((6, 3, 4, 5), 0.4, (1, 3)), ((64, 500), 0.5, (0, 1)),
                           ((7, 33), 0.9, (3, 4))]:
        x = np.random.default_rng(6).normal(size=shape).astype(dtype)
        ref, dev = Dropout(p, seed=11), Dropout(p, seed=11)
        for layer in (ref, dev):
            layer.layer_index, layer.step, layer.batch_part = 5, 17, part
        for _ in range(2):
            y = ref.forward(x)
            yd = dev.forward(cupy.asarray(x))
            np.testing.assert_array_equal(cupy.asnumpy(dev._mask), ref._mask)
            np.testing.assert_array_equal(cupy.asnumpy(yd), y)
            dy = np.random.default_rng(8).normal(size=shape).astype(dtype)
            np.testing.assert_array_equal(cupy.asnumpy(dev.backward(cupy.asarray(dy))),
                                          ref.backward(dy))


@pytest.mark.gpu
@gpu
def test_gpu_kernels_compile_once_per_dtype():
    import cupy
    x = cupy.asarray(_data((2, 3, 8, 8), np.float32, "normal"))
    layer = MaxPool2d(2, 2)
    layer.forward(x)
    kernel = cuda_registry._compiled[("maxpool_fwd", "f")]
    layer.forward(x)
    MaxPool2d(3, 2).forward(x)
    assert cuda_registry._compiled[("maxpool_fwd", "f")] is kernel
    layer.forward(x.astype(cupy.float64))
    assert ("maxpool_fwd", "d") in cuda_registry._compiled
