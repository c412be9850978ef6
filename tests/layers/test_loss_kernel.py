"""The fused softmax cross-entropy kernels (``xent_rows``, ``xent_total`` in
ringnet/layers/cuda_kernels.py) against the NumPy SoftmaxCrossEntropy.

Without a GPU: the kernels' NumPy emulation through the host wrapper, and the layer's GPU
branch on NumPy under another name; with a GPU (marked ``gpu``): the real kernels. The
loss and the gradient agree to rounding (the exponentials and the row sums are not added
in NumPy's pairwise order), the correct count exactly (first maximum, as NumPy's argmax).
"""
import numpy as np
import pytest

from ringnet.backend import gpu_available
from ringnet.layers import SoftmaxCrossEntropy, cuda_ops, loss as loss_module

DTYPES = [np.float32, np.float64]
TOL = {np.float32: dict(rtol=2e-6, atol=2e-7), np.float64: dict(rtol=1e-13, atol=1e-15)}


def _logits(kind, b, k, dtype, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "ties":                 # few distinct values: rows with several maxima
        return rng.integers(-1, 2, size=(b, k)).astype(dtype)
    if kind == "large":                # exp would overflow without the max shift
        return (rng.normal(size=(b, k)) * 3e3 + 1e4).astype(dtype)
    if kind == "peaked":               # one class far ahead: softmax of exactly 1 and 0
        z = rng.normal(size=(b, k)).astype(dtype)
        z[np.arange(b), rng.integers(0, k, b)] += dtype(200)
        return z
    return rng.normal(size=(b, k)).astype(dtype) * dtype(3)


def _reference(z, labels):
    layer = SoftmaxCrossEntropy()
    loss = layer.forward(z, labels)
    return float(loss), int((z.argmax(axis=1) == labels).sum()), layer.backward()


CASES = [(kind, b, k) for kind in ("normal", "ties", "large", "peaked")
         for b, k in [(1, 2), (7, 10), (64, 10), (33, 4), (5, 129)]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind,b,k", CASES)
def test_emulated_fused_loss_equals_the_numpy_layer(kind, b, k, dtype):
    z = _logits(kind, b, k, dtype)
    labels = np.random.default_rng(1).integers(0, k, size=b)
    if kind == "ties":                 # labels at the first, a later, and no maximum
        labels[: b // 2] = z[: b // 2].argmax(axis=1)
    want_loss, want_correct, want_grad = _reference(z, labels)
    loss, correct, grad = cuda_ops.softmax_cross_entropy(np, z, labels.astype(np.int64))
    assert loss.shape == () and loss.dtype == dtype
    assert correct.shape == () and correct.dtype == np.int64
    assert grad.shape == (b, k) and grad.dtype == dtype
    assert int(correct) == want_correct
    np.testing.assert_allclose(float(loss), want_loss, **TOL[dtype])
    np.testing.assert_allclose(grad, want_grad, **TOL[dtype])
    np.testing.assert_allclose(grad.sum(axis=1), 0, atol=10 * TOL[dtype]["atol"] * k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind,b,k", CASES)
def test_the_loss_kernel_adds_the_last_bias_and_writes_its_gradient(kind, b, k, dtype):
    # The last Linear leaves its bias to the loss kernel on a GPU: the same loss, count
    # and gradient as on logits + bias, and the bias gradient is the gradient's column sums.
    z = _logits(kind, b, k, dtype)
    bias = np.random.default_rng(2).normal(size=k).astype(dtype)
    labels = np.random.default_rng(1).integers(0, k, size=b).astype(np.int64)
    want = cuda_ops.softmax_cross_entropy(np, z + bias, labels)
    dbias = np.full(k, np.nan, dtype)
    got = cuda_ops.softmax_cross_entropy(np, z, labels, bias=bias, dbias=dbias)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    np.testing.assert_allclose(dbias, want[2].sum(axis=0, dtype=np.float64), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_fused_loss_propagates_nan_and_inf(dtype):
    z = _logits("normal", 6, 10, dtype)
    labels = np.arange(6) % 10
    z[2, 3] = np.nan
    loss, correct, grad = cuda_ops.softmax_cross_entropy(np, z, labels)
    assert np.isnan(float(loss)) and np.isnan(grad[2]).all() and np.isfinite(grad[[0, 1, 3]]).all()
    assert int(correct) == int((z.argmax(axis=1) == labels).sum())    # NaN wins the argmax
    z[2, 3] = np.inf
    with np.errstate(invalid="ignore"):
        assert not np.isfinite(float(cuda_ops.softmax_cross_entropy(np, z, labels)[0]))
    labels[4] = 10                                                    # not a class
    assert np.isnan(float(cuda_ops.softmax_cross_entropy(np, z[[0, 4]], labels[[0, 4]])[0]))


class _StandIn:
    """NumPy under another name: the layer takes its GPU branch."""

    def __getattr__(self, name):
        return getattr(np, name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_loss_layer_gpu_branch_runs_the_fused_kernel(monkeypatch, dtype):
    z = _logits("ties", 16, 10, dtype)
    labels = np.random.default_rng(2).integers(0, 10, size=16)
    want_loss, want_correct, want_grad = _reference(z, labels)
    cpu = SoftmaxCrossEntropy()
    cpu.forward(z, labels)
    assert cpu.correct is None                                    # the CPU path: unchanged
    layer = SoftmaxCrossEntropy()
    xp = _StandIn()
    monkeypatch.setattr(loss_module, "get_array_module", lambda *a: xp)
    monkeypatch.setattr(loss_module, "is_gpu_array", lambda a: True)
    launch = cuda_ops.cuda_kernels.launch
    monkeypatch.setattr(cuda_ops.cuda_kernels, "launch", lambda _xp, *args: launch(np, *args))
    loss = layer.forward(z, labels)
    assert isinstance(loss, np.ndarray) and loss.shape == ()      # a device scalar, not read
    assert int(layer.correct) == want_correct
    np.testing.assert_allclose(float(loss), want_loss, **TOL[dtype])
    grad = layer.backward()
    np.testing.assert_allclose(grad, want_grad, **TOL[dtype])
    assert layer.backward() is grad                               # written by the forward
    with pytest.raises(ValueError):
        layer.forward(z, labels[:-1])


gpu = pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU with CuPy")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind,b,k", CASES)
def test_gpu_fused_loss_equals_the_numpy_layer(kind, b, k, dtype):
    import cupy
    z = _logits(kind, b, k, dtype)
    labels = np.random.default_rng(1).integers(0, k, size=b)
    want_loss, want_correct, want_grad = _reference(z, labels)
    layer = SoftmaxCrossEntropy()
    loss = layer.forward(cupy.asarray(z), cupy.asarray(labels))
    assert isinstance(loss, cupy.ndarray) and int(layer.correct) == want_correct
    tol = {np.float32: dict(rtol=1e-5, atol=1e-6), np.float64: dict(rtol=1e-12, atol=1e-14)}[dtype]
    np.testing.assert_allclose(float(loss), want_loss, **tol)
    np.testing.assert_allclose(cupy.asnumpy(layer.backward()), want_grad, **tol)
