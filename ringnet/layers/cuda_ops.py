"""Host wrappers of the fused CUDA kernels (:mod:`ringnet.layers.cuda_kernels`): logical
(B, C, H, W) arrays in, the NumPy layers' layouts out. Each calls :func:`~ringnet.layers.cuda_kernels.launch`,
which runs the CUDA kernel on CuPy arrays and its NumPy emulation on NumPy arrays."""
import numpy as np

from ringnet.layers import cuda_kernels
from ringnet.layers.base import memory_order

__all__ = ["maxpool_forward", "maxpool_backward", "avgpool_forward", "avgpool_backward",
           "im2col", "col2im", "dropout_mask", "relu_forward", "relu_backward",
           "relu_backward_bias", "softmax_cross_entropy", "upload"]


def _geometry(c, h, w, b, ho, wo, kernel, stride, padding):
    return tuple(np.int32(v) for v in (c, h, w, b, ho, wo, *kernel, *stride, *padding))


def _bias_arg(xp, bias, unused):
    """Return (pointer, flag) for a kernel's optional bias: the C-contiguous ``bias``, else
    ``unused`` (another array of the launch, which no thread reads then: no allocation),
    and whether there is a bias."""
    if bias is None:
        return unused, np.int32(0)
    return xp.ascontiguousarray(bias), np.int32(1)


def maxpool_forward(xp, x, out_hw, kernel, stride, padding, bias=None):
    """Return (y, argmax): y logical (B, C, Ho, Wo) in (C, Ho, Wo, B) memory, argmax the
    (C, Ho, Wo, B) uint8 row-major tap index of each window's first maximum. ``bias``
    (C,): pool x + bias, each tap's sum rounded before it is compared, which is what
    adding the bias first and pooling gives, bit for bit."""
    b, c, h, w = x.shape
    ho, wo = out_hw
    xc = xp.ascontiguousarray(x.transpose(1, 2, 3, 0))          # a no-op for batch-last x
    y = xp.empty((c, ho, wo, b), dtype=x.dtype)
    argmax = xp.empty((c, ho, wo, b), dtype=np.uint8)
    n = c * ho * wo * b
    cuda_kernels.launch(xp, "maxpool_fwd", x.dtype, n,
                        (xc, y, argmax, np.int64(n), *_geometry(c, h, w, b, ho, wo, kernel, stride, padding),
                         x.dtype.type(-np.inf), *_bias_arg(xp, bias, xc)))
    return y.transpose(3, 0, 1, 2), argmax


def maxpool_backward(xp, dy, argmax, in_shape, kernel, stride, padding):
    """Return dx logical (B, C, H, W) in (C, H, W, B) memory from dy and the forward's argmax."""
    return _pool_backward(xp, "maxpool_bwd", dy, argmax, in_shape, kernel, stride, padding)


def avgpool_forward(xp, x, inv, kernel, stride, padding):
    """Return y logical (B, C, Ho, Wo) in (C, Ho, Wo, B) memory; ``inv`` is the (Ho, Wo)
    reciprocal window size (C-contiguous, x's dtype)."""
    b, c, h, w = x.shape
    ho, wo = inv.shape[:2]
    xc = xp.ascontiguousarray(x.transpose(1, 2, 3, 0))
    y = xp.empty((c, ho, wo, b), dtype=x.dtype)
    n = c * ho * wo * b
    cuda_kernels.launch(xp, "avgpool_fwd", x.dtype, n,
                        (xc, inv, y, np.int64(n), *_geometry(c, h, w, b, ho, wo, kernel, stride, padding)))
    return y.transpose(3, 0, 1, 2)


def avgpool_backward(xp, dy, inv, in_shape, kernel, stride, padding):
    """Return dx logical (B, C, H, W) in (C, H, W, B) memory."""
    return _pool_backward(xp, "avgpool_bwd", dy, inv, in_shape, kernel, stride, padding)


def _pool_backward(xp, name, dy, aux, in_shape, kernel, stride, padding):
    """The backward of a pooling kernel: ``aux`` is max pooling's argmax or average pooling's
    reciprocal window sizes."""
    b, c, h, w = in_shape
    _, _, ho, wo = dy.shape
    m, strides = _strided(xp, dy)                                # any memory order: no copy
    ds_b, ds_c, ds_h, ds_w = strides
    dx = xp.empty((c, h, w, b), dtype=dy.dtype)
    n = c * h * w * b
    cuda_kernels.launch(xp, name, dy.dtype, n,
                        (m, aux, dx, np.int64(n), *_geometry(c, h, w, b, ho, wo, kernel, stride, padding),
                         ds_c, ds_h, ds_w, ds_b))
    return dx.transpose(3, 0, 1, 2)


def _dense(xp, x):
    """Return (m, order): m a C-contiguous array over x's memory, x == m.transpose(inverse
    of order); x is copied to C order first only if its memory is not dense."""
    order = memory_order(x)
    m = x.transpose(order)
    if not m.flags.c_contiguous:
        order = list(range(x.ndim))
        m = xp.ascontiguousarray(x)
    return m, order


def _inverse(order):
    return [order.index(a) for a in range(len(order))]


def _strided(xp, x):
    """Return (m, strides): m the dense C-contiguous array over x's memory (see
    :func:`_dense`) and x's strides per logical axis, in elements, as int64."""
    m, order = _dense(xp, x)
    strides = [0] * x.ndim
    for axis, stride_m in zip(order, m.strides):
        strides[axis] = np.int64(stride_m // m.itemsize)
    return m, strides


def _around_channels(x, order):
    """Return (outer, inner): how many elements come before and after logical axis 1 (the
    channel) in the memory order ``order`` of ``x``."""
    at = order.index(1)
    sizes = [x.shape[a] for a in order]
    outer = inner = 1
    for size in sizes[:at]:
        outer *= int(size)
    for size in sizes[at + 1:]:
        inner *= int(size)
    return outer, inner


def im2col(xp, x, cols, stride, padding):
    """Fill ``cols`` (C, kh, kw, Ho, Wo, B), C-contiguous, with the columns of the logical
    (B, C, H, W) ``x`` in any memory order: entry (c, i, j, oy, ox, b) is
    x[b, c, oy*sh + i - ph, ox*sw + j - pw], 0 where that falls in the padding. One kernel
    instead of a padded copy and a strided copy."""
    b, c, h, w = x.shape
    _, kh, kw, ho, wo, _ = cols.shape
    m, strides = _strided(xp, x)
    xs_b, xs_c, xs_h, xs_w = strides
    n = c * kh * kw * ho * wo * b
    cuda_kernels.launch(xp, "im2col", x.dtype, n,
                        (m, cols, np.int64(n), *_geometry(c, h, w, b, ho, wo, (kh, kw), stride, padding),
                         xs_c, xs_h, xs_w, xs_b))
    return cols


def relu_forward(xp, x, bias=None):
    """Return max(x, 0) (as NumPy's maximum: NaN kept, -0 -> +0) in x's memory order;
    with ``bias`` (one per channel, logical axis 1), max(x + bias, 0)."""
    m, order = _dense(xp, x)
    y = xp.empty(m.shape, dtype=x.dtype)
    _, inner = _around_channels(x, order) if bias is not None else (1, 1)
    channels = x.shape[1] if bias is not None else 1
    cuda_kernels.launch(xp, "relu_fwd", x.dtype, m.size,
                        (m, y, np.int64(m.size), _bias_arg(xp, bias, m)[0], np.int64(inner),
                         np.int32(channels), np.int32(bias is not None)))
    return y.transpose(_inverse(order))


def _relu_grad_operands(xp, dy, y):
    """Return (dy, y, dx, order) of a ReLU backward: y's dense memory, dy in the same
    order (copied only if it differs) and a new dx like it."""
    ym, order = _dense(xp, y)
    dym = xp.ascontiguousarray(dy.transpose(order))           # a no-op when dy is laid out as y
    return dym, ym, xp.empty(ym.shape, dtype=dy.dtype), order


def _contiguous(array, what):
    """Return ``array``, an output a kernel writes through its pointer; ValueError unless
    it is C-contiguous."""
    if not array.flags.c_contiguous:
        raise ValueError(f"{what} must be contiguous")
    return array


def relu_backward(xp, dy, y):
    """Return dy * (y > 0) in y's memory order (dy is copied into it only if it differs)."""
    dym, ym, dx, order = _relu_grad_operands(xp, dy, y)
    cuda_kernels.launch(xp, "relu_bwd", dy.dtype, ym.size, (dym, ym, dx, np.int64(ym.size)))
    return dx.transpose(_inverse(order))


def relu_backward_bias(xp, dy, y, dbias):
    """Return dy * (y > 0) as :func:`relu_backward` does, and write its sum over every axis
    but the channel (logical axis 1), added in memory order, into ``dbias``: the bias
    gradient of the layer whose bias :func:`relu_forward` added. One thread per channel."""
    dym, ym, dx, order = _relu_grad_operands(xp, dy, y)
    outer, inner = _around_channels(y, order)
    cuda_kernels.launch(xp, "relu_bwd_bias", dy.dtype, y.shape[1],
                        (dym, ym, dx, _contiguous(dbias, "relu_backward_bias: dbias"),
                         np.int64(y.shape[1]), np.int64(outer), np.int64(inner)))
    return dx.transpose(_inverse(order))


def col2im(xp, cols, in_hw, stride, padding):
    """Return dx (C, H, W, B), C-contiguous, from the (C, kh, kw, Ho, Wo, B) column
    gradient: every column entry added back to the input pixel it was read from."""
    c, kh, kw, ho, wo, b = cols.shape
    h, w = in_hw
    dx = xp.empty((c, h, w, b), dtype=cols.dtype)
    n = c * h * w * b
    cuda_kernels.launch(xp, "col2im", cols.dtype, n,
                        (cols, dx, np.int64(n), *_geometry(c, h, w, b, ho, wo, (kh, kw), stride, padding)))
    return dx


def dropout_mask(xp, shape, dtype, keys, threshold, scale, first_sample=0):
    """Return the scaled dropout mask (C-contiguous ``shape``, ``dtype``): ``scale`` where
    the top 53 bits of element j's hash are >= ``threshold``, else 0; the hash is
    :func:`ringnet.layers.activation.hash_bits` with stream ``keys`` = (k1, k2): a device
    array of two uint64 (a CUDA graph replays it with the keys written there before each
    step), or a host pair, copied to the device here."""
    dtype = np.dtype(dtype)
    per_sample = 1
    for size in shape[1:]:
        per_sample *= int(size)
    n = int(shape[0]) * per_sample
    mask = xp.empty(shape, dtype=dtype)
    if isinstance(keys, tuple):
        keys = xp.asarray(np.array(keys, dtype=np.uint64))
    cuda_kernels.launch(xp, "dropout_mask", dtype, n,
                        (mask, np.int64(n), np.uint64((int(first_sample) * per_sample) & ((1 << 64) - 1)),
                         keys, np.uint64(threshold), dtype.type(scale)))
    return mask


def upload(xp, dst, host):
    """Copy the host array ``host`` into the device array ``dst`` without a host wait: an
    asynchronous copy on the current stream, from pageable memory, which the driver stages
    at once, so ``host`` may change as soon as this returns. Outside any captured work:
    it is how per-step values (inputs, learning rate, dropout keys) reach a CUDA graph."""
    host = np.ascontiguousarray(host, dtype=dst.dtype).reshape(dst.shape)
    if xp is np:
        np.copyto(dst, host)
    elif hasattr(dst, "set"):                                 # CuPy
        dst.set(host, stream=xp.cuda.get_current_stream())
    else:                                                     # a stand-in array module
        xp.copyto(dst, host)


def softmax_cross_entropy(xp, logits, labels, bias=None, dbias=None):
    """Return (loss, correct, dlogits) of the (B, K) ``logits`` against the B int64
    ``labels``: the mean cross-entropy (0-d, the logits' dtype), how many rows have their
    first maximum at the label (0-d int64), (softmax - onehot) / B (B, K); all on the device,
    in two launches. A label outside [0, K) makes the loss NaN. ``bias`` (K,): the logits
    are ``logits + bias``; ``dbias`` (K,): also write the column sums of dlogits there
    (the bias gradient of the layer that made the logits)."""
    b, k = logits.shape
    dtype = logits.dtype
    z = xp.ascontiguousarray(logits)
    grad = xp.empty((b, k), dtype=dtype)
    row_loss = xp.empty(b, dtype=dtype)
    hit = xp.empty(b, dtype=np.uint8)
    loss = xp.empty((), dtype=dtype)
    correct = xp.empty((), dtype=np.int64)
    cuda_kernels.launch(xp, "xent_rows", dtype, b,
                        (z, xp.ascontiguousarray(labels), grad, row_loss, hit, np.int64(b), np.int32(k),
                         dtype.type(1.0 / b), dtype.type(np.nan), *_bias_arg(xp, bias, z)))
    sums = grad if dbias is None else _contiguous(dbias, "softmax_cross_entropy: dbias")
    # (grad stands in for dbias without one: no thread writes it then)
    threads = k if dbias is not None else 1
    cuda_kernels.launch(xp, "xent_total", dtype, threads,
                        (row_loss, hit, loss, correct, np.int64(threads), np.int32(b), grad, sums,
                         np.int32(k), np.int32(dbias is not None)))
    return loss, correct, grad
