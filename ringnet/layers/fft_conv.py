"""Stride-1 convolution on the CPU through 2-D discrete Fourier transforms.

On batch-last (C, H, W, B) memory, with the padded size N = H + 2p per axis:

* forward: Y[f] = conj(W[f]) X[f] per frequency f, a (O x C) by (C x B) complex product;
* input gradient: DX[f] = W[f]^T DY[f], the circular convolution of dy with the kernel;
* weight gradient: DW[f] = conj(DY[f]) X[f]^T, the circular correlation of dy with x,

where X is the transform of the zero-padded input, W of the kernel and DY of the output
gradient, each zero-padded to N x N. N = H + 2p is exactly large enough that no circular
term wraps into a kept output, so the results equal the direct convolution up to rounding.

Transforms are matrix products with precomputed DFT matrices, not FFTs: at these sizes
(N of 12 to 20 on cifar10_quick and LeNet) a transform is a few GEMMs, and the padding is
folded into the matrices (a phase shift), so no padded copy is made. The inverse
transforms evaluate only the outputs that are kept (Ho x Wo of the output, the interior of
dx, kh x kw of the weight gradient), using the half spectrum of a real signal. Per
frequency the products are O*C*B complex multiply-adds where im2col needs O*C*kh*kw*B per
output position: a 5x5 kernel on a 16x16 map costs about a seventh of the GEMM FLOPs.

Spectra are held *split*, (nh, F2, 2, M, B): the real and imaginary parts as separate
(M, B) blocks per frequency, so every product is a real GEMM. A complex matrix A acts on
[Re x; Im x] as the real block matrix [[Re A, -Im A], [Im A, Re A]], whose transpose is
the block matrix of A^H: the input gradient's product uses the forward's block matrix
transposed. Real GEMMs on split data need no pass to interleave real and imaginary parts
or to take a real part, and OpenBLAS ran the thin complex GEMMs an interleaved layout
needs at about half its real rate (measured). The bias rides in frequency 0 of the
output's spectrum (a constant map is its DC term alone), and its gradient is frequency 0
of the output gradient's spectrum summed over the batch: no pass over the output for
either.
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


def _dft(freqs, n, size, shift, sign=-1):
    """Return the complex (freqs, size) matrix exp(sign * 2 pi i f (t + shift) / n)."""
    return np.exp(sign * 2j * np.pi * np.outer(np.arange(freqs), np.arange(size) + shift) / n)


@functools.lru_cache(maxsize=64)
def _forward_matrices(w, nw, shift_w, h, nh, shift_h, dtype):
    """Return the real matrices of the transform of an (h, w) map placed at (shift_h,
    shift_w) in an (nh, nw) zero map:

    * along w, (2*F2, w): the real and imaginary parts of the half spectrum, stacked;
    * along h, (2*nh, 2*h): the full transform's complex matrix in block form, mapping a
      complex signal held as (position, re/im) rows to (re/im, frequency) rows:
      [[Re, -Im], [Im, Re]].
    """
    f2 = nw // 2 + 1
    half = _dft(f2, nw, w, shift_w)
    full = _dft(nh, nh, h, shift_h)
    block = np.empty((2, nh, h, 2))
    block[0, :, :, 0], block[0, :, :, 1] = full.real, -full.imag
    block[1, :, :, 0], block[1, :, :, 1] = full.imag, full.real
    real = np.dtype(dtype)
    return (np.concatenate([half.real, half.imag]).astype(real),
            block.reshape(2 * nh, 2 * h).astype(real))


@functools.lru_cache(maxsize=64)
def _inverse_matrices(rows, cols, nh, nw, start_h, start_w, dtype):
    """Return the real matrices of the inverse transform evaluated at rows start_h..
    (``rows`` of them) and columns start_w.. (``cols``):

    * along w, (2*cols, 2*F2): the half spectrum's inverse with its Hermitian weights (1
      for frequency 0 and n/2, else 2) and the 1/(nh*nw) scale, a complex matrix in block
      form mapping (frequency, re/im) rows to (re/im, column) rows: [[Re, -Im], [Im, Re]];
    * along h, (rows, 2*nh): the real part of the full inverse applied to a complex
      signal held as (frequency, re/im) rows, [Re, -Im] interleaved by frequency.
    """
    f2 = nw // 2 + 1
    weight = np.full(f2, 2.0)
    weight[0] = 1.0
    if nw % 2 == 0:
        weight[-1] = 1.0
    along_h = _dft(nh, nh, rows, start_h, 1).T                           # (rows, nh)
    along_w = weight * _dft(f2, nw, cols, start_w, 1).T / (nh * nw)      # (cols, F2)
    block = np.empty((2, cols, f2, 2))
    block[0, :, :, 0], block[0, :, :, 1] = along_w.real, -along_w.imag
    block[1, :, :, 0], block[1, :, :, 1] = along_w.imag, along_w.real
    real_part = np.empty((rows, nh, 2))
    real_part[:, :, 0], real_part[:, :, 1] = along_h.real, -along_h.imag
    real = np.dtype(dtype)
    return (block.reshape(2 * cols, 2 * f2).astype(real),
            real_part.reshape(rows, 2 * nh).astype(real))


def _transform(a, shape, shift):
    """Return the 2-D transform of real (M, h, w, B) ``a`` placed at ``shift`` in an
    (nh, nw) zero map, split: a new (nh, F2, 2, M, B) array of real and imaginary parts.

    Along w, one real GEMM per map row gives (h, re/im, F2, B) per map: a (2h, F2*B)
    matrix of a complex signal held as real rows, so the transform along h is one real
    GEMM per map with the block form of its complex matrix; one pass writes the result
    frequency-major. Every array here is made fresh: the allocator hands back the memory
    the previous call freed, still in cache, where arrays kept from step to step were
    measured 10% slower on a cifar10_quick step."""
    (nh, nw) = shape
    m, h, w, b = a.shape
    f2 = nw // 2 + 1
    along_w, along_h = _forward_matrices(w, nw, shift[1], h, nh, shift[0], a.dtype)
    parts = np.matmul(along_w, a.reshape(m * h, w, b))           # (M*h, 2*F2, B)
    full = np.matmul(along_h, parts.reshape(m, 2 * h, f2 * b))    # (M, 2*nh, F2*B)
    out = np.empty((nh, f2, 2, m, b), dtype=a.dtype)
    np.copyto(out, full.reshape(m, 2, nh, f2, b).transpose(2, 3, 1, 0, 4))
    return out


def _kernel_block(weight, shape):
    """Return conj of the 2-D transform of (O, C, kh, kw) ``weight`` zero-padded to
    ``shape``, in the real block form that acts on split spectra: (nh*F2, 2*O, 2*C),
    [[Re, -Im], [Im, Re]] per frequency. Two GEMM stages over all O*C maps at once."""
    (nh, nw) = shape
    o, c, kh, kw = weight.shape
    f2 = nw // 2 + 1
    along_w, along_h = _forward_matrices(kw, nw, 0, kh, nh, 0, weight.dtype)
    # per kernel row: (2*F2, kw) by (kw, O*C), a strided view of the weight
    parts = np.matmul(along_w, weight.reshape(o * c, kh, kw).transpose(1, 2, 0))
    full = np.matmul(along_h, parts.reshape(2 * kh, f2 * o * c))  # (2*nh, F2*O*C)
    full = full.reshape(2, nh, f2, o, c)
    out = np.empty((nh, f2, 2, o, 2, c), dtype=weight.dtype)
    # the transform is R + iI, its conjugate R - iI: [[R, I], [-I, R]]
    out[:, :, 0, :, 0], out[:, :, 0, :, 1] = full[0], full[1]
    np.negative(full[1], out=out[:, :, 1, :, 0])
    out[:, :, 1, :, 1] = full[0]
    return out.reshape(nh * f2, 2 * o, 2 * c)


def _inverse(spectrum, shape, rows, cols, start, out):
    """Write the real inverse transform of split (nh, F2, 2, M, B) ``spectrum`` at ``rows``
    x ``cols`` positions from ``start`` into ``out``, an (M, rows, cols, B) array or view:
    along w one real GEMM per row frequency, each on a contiguous (2*F2, M*B) block; along
    h, where the real part is taken, one GEMM over all of them; then one pass puts the
    (rows, cols, M, B) result in ``out``'s order. Along h first, the second stage was a
    GEMM per output row and map, each a few kilobytes: up to twice as slow (measured)."""
    nh, nw = shape
    f2 = nw // 2 + 1
    m, b = spectrum.shape[3:]
    along_w, along_h = _inverse_matrices(rows, cols, nh, nw, start[0], start[1], out.dtype)
    half = np.matmul(along_w, spectrum.reshape(nh, 2 * f2, m * b))  # (nh, 2*cols, M*B)
    full = np.matmul(along_h, half.reshape(2 * nh, cols * m * b))   # (rows, cols*M*B)
    np.copyto(out, full.reshape(rows, cols, m, b).transpose(2, 0, 1, 3))
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
        f2 = shape[1] // 2 + 1
        xs = _transform(x, shape, (ph, pw))                         # (nh, F2, 2, C, B)
        ws = _kernel_block(weight, shape)                           # (F, 2*O, 2*C)
        self._spectra = (x.shape, shape, xs, ws) if train else None
        ys = np.matmul(ws, xs.reshape(-1, 2 * c, b))                # (F, 2*O, B)
        ys[0, :o] += bias[:, None] * (shape[0] * shape[1])          # a constant map: DC only
        y = np.empty((o, ho, wo, b), dtype=x.dtype)
        return _inverse(ys.reshape(shape[0], f2, 2, o, b), shape, ho, wo, (0, 0), y)

    def backward(self, dy, dweight, dbias, needs_dx):
        """Write the weight and bias gradients into (O, C, kh, kw) ``dweight`` and (O,)
        ``dbias`` and return dx as a new (C, H, W, B) array (None without ``needs_dx``),
        for C-contiguous (O, Ho, Wo, B) ``dy``."""
        if self._spectra is None:
            raise RuntimeError("Conv2d.backward called without a forward(train=True)")
        (c, h, w, b), shape, xs, ws = self._spectra
        (kh, kw), (ph, pw) = self.kernel, self.padding
        o = dy.shape[0]
        nh, f2 = shape[0], shape[1] // 2 + 1
        ds = _transform(dy, shape, (0, 0))                          # (nh, F2, 2, O, B)
        np.sum(ds[0, 0, 0], axis=1, out=dbias)                      # frequency 0: the sums
        # conj(DY) X^T per frequency, from one real GEMM of [Re; Im] by [Re; Im]^T
        g = np.matmul(ds.reshape(-1, 2 * o, b), xs.reshape(-1, 2 * c, b).transpose(0, 2, 1))
        g = g.reshape(nh, f2, 2, o, 2, c)
        dws = np.empty((nh, f2, 2, o, c), dtype=dy.dtype)
        np.add(g[:, :, 0, :, 0], g[:, :, 1, :, 1], out=dws[:, :, 0])
        np.subtract(g[:, :, 0, :, 1], g[:, :, 1, :, 0], out=dws[:, :, 1])
        # the correlation kept at the kh x kw lags: (O, kh, kw, C) is dweight's transpose
        _inverse(dws, shape, kh, kw, (0, 0), dweight.transpose(0, 2, 3, 1))
        if not needs_dx:
            return None
        # conj(W)^H DY: the block form's transpose is the conjugate transpose's block form
        dxs = np.matmul(ws.transpose(0, 2, 1), ds.reshape(-1, 2 * o, b))  # (F, 2*C, B)
        dx = np.empty((c, h, w, b), dtype=dy.dtype)
        return _inverse(dxs.reshape(nh, f2, 2, c, b), shape, h, w, (ph, pw), dx)
