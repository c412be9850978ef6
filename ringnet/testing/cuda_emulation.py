"""NumPy emulations of the GPU path's device code, for the tests: the fused CUDA kernels
that :mod:`ringnet.layers.cuda_kernels` declares (each kernel's parameter list and CUDA body
stay there, in the library) and the column-major cuBLAS ``gemm`` that
:mod:`ringnet.layers.gemm` plans (:func:`gemm`).

Each kernel's emulation, registered under the kernel's name with :func:`emulates`, has the
kernel's parameters and performs its CUDA body's index arithmetic for all threads at once,
statement by statement: one NumPy lane per CUDA thread (:func:`lanes`), ``continue`` a lane
mask, a read that only some threads make a :func:`gather`. The index arithmetic the bodies
share is written once: :func:`unravel` splits the flat thread index as the bodies do,
:func:`taps` walks a window's taps from its output (pooling forward), :func:`windows` finds
the windows whose tap covers an input (pooling backward, col2im).

:func:`~ringnet.layers.cuda_kernels.launch` runs a kernel's emulation (:func:`run`) for
NumPy arrays, after checking them against the kernel's C signature; only that path
imports this module (the layers call the kernels only on CuPy arrays), so a training job
never loads it.
"""
import numpy as np

__all__ = ["EMULATIONS", "emulates", "run", "lanes", "unravel", "taps", "windows", "gather",
           "gemm"]

EMULATIONS = {}                 # kernel name -> its emulation


def emulates(name):
    """Register the decorated function as the emulation of kernel ``name`` (one a kernel)."""
    def register(emulation):
        if name in EMULATIONS:
            raise ValueError(f"kernel {name} has an emulation already")
        EMULATIONS[name] = emulation
        return emulation
    return register


def run(name, args):
    """Run kernel ``name``'s emulation on ``args``, its arrays flat (C-contiguous, as the
    kernel's pointers see them: writes land in the caller's arrays)."""
    EMULATIONS[name](*(a.reshape(-1) if isinstance(a, np.ndarray) else a for a in args))


# --- the index arithmetic the kernels share

def lanes(n):
    """The thread indices of a launch of ``n`` threads, one NumPy lane each."""
    return np.arange(n, dtype=np.int64)


def unravel(idx, *sizes):
    """Split thread indices over row-major ``sizes`` as the CUDA bodies do, the outermost
    index left unbounded: ``c, oy, ox, b = unravel(idx, Ho, Wo, B)`` is ``b = idx % B;
    rest = idx / B; ox = rest % Wo; rest /= Wo; oy = rest % Ho; c = rest / Ho``."""
    inner = []
    rest = idx
    for size in reversed(sizes):
        inner.append(rest % size)
        rest = rest // size
    return (rest, *reversed(inner))


def taps(out, k, stride, pad, size):
    """The taps of the windows at outputs ``out`` along one axis, as a forward body walks
    them: ``for (int i = 0; i < k; ++i) { int r = out * stride + i - pad;
    if (r < 0 || r >= size) continue; ...``: yields (i, r, lanes where r is inside)."""
    for i in range(k):
        r = out * stride + i - pad
        yield i, r, ~((r < 0) | (r >= size))


def windows(pos, k, stride, pad, out_size):
    """The windows whose tap covers input ``pos`` along one axis, as a backward body finds
    them: ``for (int i = 0; i < k; ++i) { int d = pos + pad - i; if (d < 0 || d % stride != 0)
    continue; int o = d / stride; if (o >= out_size) continue; ...``: yields (i, o, lanes
    where window o has tap i on pos)."""
    for i in range(k):
        d = pos + pad - i
        o = d // stride
        yield i, o, ~((d < 0) | (d % stride != 0)) & ~(o >= out_size)


def gather(a, lane, index):
    """``a[index]`` in the lanes ``lane`` (the threads that read it); element 0 elsewhere,
    a value no masked-out lane uses."""
    return a[np.where(lane, index, 0)]


# --- pooling, im2col, col2im (ringnet/layers/cuda_kernels.py)

@emulates("maxpool_fwd")
def _maxpool_fwd(x, y, argmax, n, C, H, W, B, Ho, Wo, kh, kw, sh, sw, ph, pw, neg_inf, bias,
                 has_bias):
    c, oy, ox, b = unravel(lanes(n), Ho, Wo, B)
    m = np.full(n, neg_inf, dtype=y.dtype)
    arg = np.zeros(n, dtype=np.int64)
    for i, r, lane_i in taps(oy, kh, sh, ph, H):
        for j, q, lane_j in taps(ox, kw, sw, pw, W):
            lane = lane_i & lane_j
            v = gather(x, lane, ((c * H + r) * W + q) * B + b)
            if has_bias:
                v = v + bias[c]
            win = lane & (v > m)
            m = np.where(win, v, m)
            arg = np.where(win, i * kw + j, arg)
            m = np.where(lane & ~win & (v != v), v, m)
    y[:] = m
    argmax[:] = arg.astype(np.uint8)


@emulates("maxpool_bwd")
def _maxpool_bwd(dy, argmax, dx, n, C, H, W, B, Ho, Wo, kh, kw, sh, sw, ph, pw,
                 ds_c, ds_h, ds_w, ds_b):
    c, r, q, b = unravel(lanes(n), H, W, B)
    acc = np.zeros(n, dtype=dx.dtype)
    for i, oy, lane_i in windows(r, kh, sh, ph, Ho):
        for j, ox, lane_j in windows(q, kw, sw, pw, Wo):
            lane = lane_i & lane_j
            o = np.where(lane, ((c * Ho + oy) * Wo + ox) * B + b, 0)
            hit = lane & (argmax[o] == i * kw + j)
            g = gather(dy, lane, c * ds_c + oy * ds_h + ox * ds_w + b * ds_b)
            acc = np.where(hit, acc + g, acc)
    dx[:] = acc


@emulates("avgpool_fwd")
def _avgpool_fwd(x, inv, y, n, C, H, W, B, Ho, Wo, kh, kw, sh, sw, ph, pw):
    c, oy, ox, b = unravel(lanes(n), Ho, Wo, B)
    acc = np.zeros(n, dtype=y.dtype)
    for i, r, lane_i in taps(oy, kh, sh, ph, H):
        for j, q, lane_j in taps(ox, kw, sw, pw, W):
            lane = lane_i & lane_j
            v = gather(x, lane, ((c * H + r) * W + q) * B + b)
            acc = np.where(lane, acc + v, acc)
    y[:] = acc * inv[oy * Wo + ox]


@emulates("avgpool_bwd")
def _avgpool_bwd(dy, inv, dx, n, C, H, W, B, Ho, Wo, kh, kw, sh, sw, ph, pw,
                 ds_c, ds_h, ds_w, ds_b):
    c, r, q, b = unravel(lanes(n), H, W, B)
    acc = np.zeros(n, dtype=dx.dtype)
    for i, oy, lane_i in windows(r, kh, sh, ph, Ho):
        for j, ox, lane_j in windows(q, kw, sw, pw, Wo):
            lane = lane_i & lane_j
            g = gather(dy, lane, c * ds_c + oy * ds_h + ox * ds_w + b * ds_b)
            acc = np.where(lane, acc + g * gather(inv, lane, oy * Wo + ox), acc)
    dx[:] = acc


@emulates("col2im")
def _col2im(cols, dx, n, C, H, W, B, Ho, Wo, kh, kw, sh, sw, ph, pw):
    c, r, q, b = unravel(lanes(n), H, W, B)
    acc = np.zeros(n, dtype=dx.dtype)
    for i, oy, lane_i in windows(r, kh, sh, ph, Ho):
        for j, ox, lane_j in windows(q, kw, sw, pw, Wo):
            lane = lane_i & lane_j
            v = gather(cols, lane, ((((c * kh + i) * kw + j) * Ho + oy) * Wo + ox) * B + b)
            acc = np.where(lane, acc + v, acc)
    dx[:] = acc


@emulates("im2col")
def _im2col(x, cols, n, C, H, W, B, Ho, Wo, kh, kw, sh, sw, ph, pw, xs_c, xs_h, xs_w, xs_b):
    c, i, j, oy, ox, b = unravel(lanes(n), kh, kw, Ho, Wo, B)
    r = oy * sh + i - ph
    q = ox * sw + j - pw
    lane = (r >= 0) & (r < H) & (q >= 0) & (q < W)
    v = gather(x, lane, c * xs_c + r * xs_h + q * xs_w + b * xs_b)
    cols[:] = np.where(lane, v, cols.dtype.type(0))


# --- the element-wise kernels (ringnet/layers/cuda_pointwise.py)

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(z):
    z = z ^ (z >> np.uint64(30))
    z = z * np.uint64(0xBF58476D1CE4E5B9)
    z = z ^ (z >> np.uint64(27))
    z = z * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return z


@emulates("dropout_mask")
def _dropout_mask(mask, n, first, keys, threshold, scale):
    idx = lanes(n)
    v = (first + idx.astype(np.uint64)) * _GOLDEN + keys[0]
    v = _mix64(v)
    v ^= keys[1]
    v = _mix64(v)
    mask[:] = np.where((v >> np.uint64(11)) >= threshold, scale, mask.dtype.type(0))


@emulates("relu_fwd")
def _relu_fwd(x, y, n, bias, inner, C, has_bias):
    idx = lanes(n)
    v = x[idx]
    if has_bias:
        v = v + bias[(idx // inner) % C]
    y[:] = np.where((v > 0) | (v != v), v, y.dtype.type(0))


@emulates("relu_bwd")
def _relu_bwd(dy, y, dx, n):
    idx = lanes(n)
    with np.errstate(invalid="ignore"):                      # inf * 0 is NaN, as in CUDA
        dx[:] = dy[idx] * (y[idx] > 0).astype(dx.dtype)


@emulates("relu_bwd_bias")
def _relu_bwd_bias(dy, y, dx, dbias, n, outer, inner):
    c = lanes(n)
    acc = np.zeros(n, dtype=dx.dtype)
    with np.errstate(invalid="ignore"):
        for o in range(outer):
            for t in range(inner):
                idx = (o * n + c) * inner + t
                g = dy[idx] * (y[idx] > 0).astype(dx.dtype)
                dx[idx] = g
                acc += g
    dbias[c] = acc


@emulates("xent_rows")
def _xent_rows(logits, labels, grad, row_loss, hit, n, K, scale, invalid, bias, has_bias):
    b = lanes(n)
    row = b * K
    for j in range(K):
        z = logits[row + j]
        if has_bias:
            z = z + bias[j]
        grad[row + j] = z
    m = grad[row]
    arg = np.zeros(n, dtype=np.int64)
    for j in range(1, K):
        v = grad[row + j]
        win = (v > m) | ((v != v) & (m == m))
        m = np.where(win, v, m)
        arg = np.where(win, j, arg)
    y = labels[b]
    lane = (y >= 0) & (y < K)
    picked = np.where(lane, gather(grad, lane, row + y) - m, invalid)
    total = np.zeros(n, dtype=grad.dtype)
    for j in range(K):
        e = np.exp(grad[row + j] - m)
        grad[row + j] = e
        total += e
    row_loss[:] = np.log(total) - picked
    hit[:] = (arg == y).astype(np.uint8)
    for j in range(K):
        g = grad[row + j] / total
        g = np.where(j == y, g - grad.dtype.type(1), g)
        grad[row + j] = g * scale


@emulates("xent_total")
def _xent_total(row_loss, hit, loss, correct, n, B, grad, dbias, K, has_dbias):
    acc = np.zeros(1, dtype=loss.dtype)
    count = np.zeros(1, dtype=np.int64)
    for b in range(B):
        acc += row_loss[b]
        count += hit[b]
    loss[0] = (acc / B)[0]
    correct[0] = count[0]
    if has_dbias:
        idx = lanes(n)
        column = np.zeros(n, dtype=loss.dtype)
        for b in range(B):
            column += grad[b * K + idx]
        dbias[:] = column


@emulates("step_record")
def _step_record(loss, correct, ring_loss, ring_correct, slot):
    ring_loss[slot] = loss[0]
    ring_correct[slot] = correct[0]


# --- cuBLAS's gemm (ringnet/layers/gemm.py plans it)

def _colmajor(x, rows, cols, ld):
    item = x.dtype.itemsize
    return np.lib.stride_tricks.as_strided(x, shape=(rows, cols), strides=(item, ld * item))


def gemm(transa, transb, m, n, k, first, lda, second, ldb, c_first, ldc):
    """Run the column-major ``gemm`` a :func:`ringnet.layers.gemm.plan` describes on NumPy
    arrays: C (m x n, column-major from the start of ``c_first``, leading dimension ``ldc``)
    = op(A) op(B), reading A and B from their arrays' memory as cuBLAS reads device memory."""
    ma = _colmajor(first, k if transa else m, m if transa else k, lda)
    mb = _colmajor(second, n if transb else k, k if transb else n, ldb)
    out = _colmajor(c_first, m, n, ldc)
    out[...] = np.matmul(ma.T if transa else ma, mb.T if transb else mb)
