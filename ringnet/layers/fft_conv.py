"""Stride-1 convolution on the CPU through 2-D discrete Fourier transforms.

On batch-last (C, H, W, B) memory, with the padded size N = H + 2p per axis:

* forward: Y[f] = conj(W[f]) X[f] per frequency f, a (O x C) by (C x B) complex GEMM;
* input gradient: DX[f] = W[f]^T DY[f], the circular convolution of dy with the kernel;
* weight gradient: DW[f] = conj(DY[f]) X[f]^T, the circular correlation of dy with x,

where X is the transform of the zero-padded input, W of the kernel and DY of the output
gradient, each zero-padded to N x N. N = H + 2p is exactly large enough that no circular
term wraps into a kept output, so the results equal the direct convolution up to rounding.

Transforms are matrix products with precomputed DFT matrices, not FFTs: at these sizes
(N of 12 to 20 on cifar10_quick and LeNet) a transform is a few batched GEMMs, and the
padding is folded into the matrices (a phase shift), so no padded copy is made. The
inverse transforms evaluate only the outputs that are kept (Ho x Wo of the output, the
interior of dx, kh x kw of the weight gradient), using the half spectrum of a real
signal. Per frequency the products are O*C*B complex multiply-adds where im2col needs
O*C*kh*kw*B per output position: a 5x5 kernel on a 16x16 map costs about a seventh of
the GEMM FLOPs. The bias rides in frequency 0 of the output's spectrum (a constant map
is its DC term alone), and its gradient is frequency 0 of the output gradient's spectrum
summed over the batch: no pass over the output for either.
"""
import functools

import numpy as np

__all__ = ["FourierConv", "fits"]

# The geometries where this beats im2col on a CPU core (measured with `python -m
# ringnet.bench layers`): stride 1, a kernel of at least 3x3, at least this many input and
# output channels (a first layer's 1 or 3 channels give im2col a thin, cheap GEMM), and a
# padded map of at most this many pixels (a transform's cost per pixel grows with N).
MIN_CHANNELS = 8
MAX_PADDED_PIXELS = 32 * 32


def fits(in_channels, out_channels, kernel, stride, padded):
    """Whether a convolution of this geometry runs through the transforms on the CPU."""
    (kh, kw), (nh, nw) = kernel, padded
    return (tuple(stride) == (1, 1) and kh * kw >= 9 and in_channels >= MIN_CHANNELS
            and out_channels >= MIN_CHANNELS and nh * nw <= MAX_PADDED_PIXELS)


def _complex(dtype):
    return np.complex64 if np.dtype(dtype) == np.float32 else np.complex128


@functools.lru_cache(maxsize=64)
def _forward_matrices(size, n, shift, dtype, sign=-1):
    """Return the transform of a length-``size`` signal placed at ``shift`` in a length-``n``
    zero signal: (real (2*F2, size) matrix stacking the real and imaginary parts of the
    half-spectrum transform, complex (n, size) matrix of the full transform), F2 = n//2 + 1.
    ``sign`` +1 gives the conjugate transform (of a real signal: the conjugate spectrum)."""
    f2 = n // 2 + 1
    half = np.exp(sign * 2j * np.pi * np.outer(np.arange(f2), np.arange(size) + shift) / n)
    full = np.exp(sign * 2j * np.pi * np.outer(np.arange(n), np.arange(size) + shift) / n)
    real = np.dtype(dtype)
    return (np.concatenate([half.real, half.imag]).astype(real),
            full.astype(_complex(real)))


@functools.lru_cache(maxsize=64)
def _inverse_matrices(rows, cols, nh, nw, start_h, start_w, dtype, sign=1):
    """Return the inverse transform evaluated at rows start_h.. (``rows`` of them) and
    columns start_w.. (``cols``): a complex (rows, nh) matrix for the first axis and a
    complex (cols, F2) matrix for the half spectrum of the second, which carries the
    Hermitian weights (1 for frequency 0 and n/2, else 2) and the 1/(nh*nw) scale.
    ``sign`` -1 inverts a conjugated spectrum (the real part is the same signal)."""
    f2 = nw // 2 + 1
    weight = np.full(f2, 2.0)
    weight[0] = 1.0
    if nw % 2 == 0:
        weight[-1] = 1.0
    first = np.exp(sign * 2j * np.pi * np.outer(np.arange(rows) + start_h, np.arange(nh)) / nh)
    second = weight * np.exp(sign * 2j * np.pi * np.outer(np.arange(cols) + start_w,
                                                          np.arange(f2)) / nw)
    ct = _complex(dtype)
    return first.astype(ct), (second / (nh * nw)).astype(ct)


@functools.lru_cache(maxsize=64)
def _block_matrix(size, n, shift, dtype, sign=-1):
    """Return the full transform of a length-``size`` signal placed at ``shift`` in a
    length-``n`` zero signal as the real (2*n, 2*size) matrix that maps a complex signal
    held as (position, re/im) rows to (re/im, frequency) rows: [[Re, -Im], [Im, Re]]."""
    full = _forward_matrices(size, n, shift, dtype, sign)[1]
    block = np.empty((2, n, size, 2), dtype=np.dtype(dtype))
    block[0, :, :, 0], block[0, :, :, 1] = full.real, -full.imag
    block[1, :, :, 0], block[1, :, :, 1] = full.imag, full.real
    return block.reshape(2 * n, 2 * size)


def _transform(a, shape, shift, sign):
    """Return the 2-D transform of real (M, h, w, B) ``a`` placed at ``shift`` in an
    (nh, nw) zero map, as a complex (nh*F2, M, B) array (frequency-major); ``sign`` +1
    gives its conjugate.

    Along w, the half spectrum's real and imaginary parts come from one real GEMM per
    map row, (h, re/im, F2, B) per map: a (2h, F2*B) matrix of a complex signal held as
    real rows, so the full transform along h is one real GEMM per map with the block form
    of the complex matrix (half as fast as a complex GEMM, measured, and no pass to
    assemble a complex array first). The last pass writes the frequency-major complex
    result. Every array here is made fresh: the allocator hands back the memory the
    previous call freed, still in cache, where arrays kept from step to step were measured
    10% slower on a cifar10_quick step."""
    (nh, nw) = shape
    m, h, w, b = a.shape
    f2 = nw // 2 + 1
    along_w, _ = _forward_matrices(w, nw, shift[1], a.dtype, sign)
    along_h = _block_matrix(h, nh, shift[0], a.dtype, sign)
    parts = np.matmul(along_w, a.reshape(m * h, w, b))           # (M*h, 2*F2, B)
    full = np.matmul(along_h, parts.reshape(m, 2 * h, f2 * b))    # (M, 2*nh, F2*B)
    full = full.reshape(m, 2, nh, f2, b)
    out = np.empty((nh, f2, m, b), dtype=_complex(a.dtype))
    np.copyto(out.real, full[:, 0].transpose(1, 2, 0, 3))
    np.copyto(out.imag, full[:, 1].transpose(1, 2, 0, 3))
    return out.reshape(nh * f2, m, b)


def _kernel_spectrum(weight, shape, sign):
    """Return the 2-D transform of (O, C, kh, kw) ``weight`` zero-padded to ``shape``, as a
    complex (nh*F2, O, C) array; ``sign`` +1 gives its conjugate. Two single GEMMs over
    all O*C maps (as (O*C, kh, kw, 1) maps, :func:`_transform` would make one GEMM call
    per kernel row: thousands of tiny calls)."""
    (nh, nw) = shape
    o, c, kh, kw = weight.shape
    f2 = nw // 2 + 1
    along_w, _ = _forward_matrices(kw, nw, 0, weight.dtype, sign)
    _, along_h = _forward_matrices(kh, nh, 0, weight.dtype, sign)
    ct = along_h.dtype
    rows = np.matmul(weight.reshape(o * c * kh, kw), along_w.T)   # (O*C*kh, 2*F2) real
    half = np.empty((kh, o * c, f2), dtype=ct)                      # kernel row first
    rows = rows.reshape(o * c, kh, 2, f2).transpose(1, 0, 2, 3)
    half.real, half.imag = rows[:, :, 0], rows[:, :, 1]
    full = np.matmul(along_h, half.reshape(kh, o * c * f2))       # (nh, O*C*F2)
    out = np.empty((nh, f2, o * c), dtype=ct)
    np.copyto(out, full.reshape(nh, o * c, f2).transpose(0, 2, 1))
    return out.reshape(nh * f2, o, c)


def _inverse(spectrum, shape, rows, cols, start, out, sign=1):
    """Write the real inverse transform of complex (nh*F2, M, B) ``spectrum`` at ``rows`` x
    ``cols`` positions from ``start`` into ``out``, an (M, rows, cols, B) array or view
    (``sign`` -1: of the conjugate of ``spectrum``)."""
    nh, nw = shape
    f2 = nw // 2 + 1
    _, m, b = spectrum.shape
    first, second = _inverse_matrices(rows, cols, nh, nw, start[0], start[1], out.dtype, sign)
    part = np.matmul(first, spectrum.reshape(nh, f2 * m * b))      # (rows, F2*M*B)
    values = np.matmul(second, part.reshape(rows, f2, m * b))      # (rows, cols, M*B)
    np.copyto(out, values.real.reshape(rows, cols, m, b).transpose(2, 0, 1, 3))
    return out


class FourierConv:
    """The transforms of one Conv2d layer: ``forward(train=True)`` keeps the input's and
    the kernel's spectra for ``backward``."""

    def __init__(self, kernel, padding):
        self.kernel, self.padding = tuple(kernel), tuple(padding)
        self._spectra = None

    def forward(self, x, weight, bias, train=True):
        """Return a new (O, Ho, Wo, B) array for C-contiguous (C, H, W, B) ``x``,
        (O, C, kh, kw) ``weight`` and (O,) ``bias``."""
        c, h, w, b = x.shape
        o = weight.shape[0]
        (kh, kw), (ph, pw) = self.kernel, self.padding
        shape = (h + 2 * ph, w + 2 * pw)
        ho, wo = shape[0] - kh + 1, shape[1] - kw + 1
        xs = _transform(x, shape, (ph, pw), -1)                     # (F, C, B)
        ws = _kernel_spectrum(weight, shape, 1)                     # conj(W): (F, O, C)
        self._spectra = (x.shape, shape, xs, ws) if train else None
        ys = np.matmul(ws, xs)                                      # (F, O, B)
        ys[0] += bias[:, None] * (shape[0] * shape[1])              # a constant map: DC only
        y = np.empty((o, ho, wo, b), dtype=x.dtype)
        return _inverse(ys, shape, ho, wo, (0, 0), y)

    def backward(self, dy, dweight, dbias, needs_dx):
        """Write the weight and bias gradients into (O, C, kh, kw) ``dweight`` and (O,)
        ``dbias`` and return dx as a new (C, H, W, B) array (None without ``needs_dx``),
        for C-contiguous (O, Ho, Wo, B) ``dy``."""
        if self._spectra is None:
            raise RuntimeError("Conv2d.backward called without a forward(train=True)")
        (c, h, w, b), shape, xs, ws = self._spectra
        (kh, kw), (ph, pw) = self.kernel, self.padding
        # conj(DY), straight from the conjugate transform: no conjugating pass
        ds = _transform(dy, shape, (0, 0), 1)                       # (F, O, B)
        np.sum(ds[0].real, axis=1, out=dbias)                       # frequency 0: the sums
        # correlation of dy with x: kept at the kh x kw lags, as (O, kh, kw, C) = dweight^T
        dws = np.matmul(ds, xs.transpose(0, 2, 1))                  # (F, O, C)
        _inverse(dws, shape, kh, kw, (0, 0), dweight.transpose(0, 2, 3, 1))
        if not needs_dx:
            return None
        # conj(W)^T conj(DY) = conj(DX), inverted as such
        dxs = np.matmul(ws.transpose(0, 2, 1), ds)                  # (F, C, B)
        dx = np.empty((c, h, w, b), dtype=dy.dtype)
        return _inverse(dxs, shape, h, w, (ph, pw), dx, sign=-1)
