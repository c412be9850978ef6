"""Convolution on the CPU lowered along the kernel's width only (MEC: Cho and Brand,
"MEC: Memory-efficient Convolution for Deep Neural Network", ICML 2017), on batch-last
(C, H, W, B) memory.

im2col copies every input pixel kh*kw times into a (C*kh*kw, Ho*Wo*B) column matrix. Here
each pixel is copied kw times, into the *lowered rows* L of shape (Hp, G, Wo*B), Hp = H +
2*ph: group g = (c, j) of input row y holds L[y, (c, j), (w, b)] = xpad[c, y, w*sw + j, b].
Output row r reads input rows r*sh .. r*sh + kh - 1, which are kh consecutive groups of L:
one contiguous (kh*G, Wo*B) matrix, a GEMM operand with no copy. So, with the kernel
reordered to W' of shape (O, kh, G):

* forward: Y[:, r] = W' L[r*sh : r*sh + kh] for each output row r;
* weight gradient: dW'^T = sum_r L[r*sh : r*sh + kh] dY[:, r]^T;
* input gradient: dL[r*sh : r*sh + kh] += W'^T dY[:, r], then each of the kw column taps
  of dL adds back into the input it was read from.

Each group ends in a row of ones (G = C*kw + 1), so the bias rides in the GEMMs: its
weight sits in the first kernel row's ones column (zeros in the others), and the same
column of dW'^T is the bias gradient, since every output row's window holds one group's
ones row for each kernel row. That saves the passes over the whole output that adding the
bias and summing its gradient would take. The copy is kh times smaller than im2col's
(cifar10_quick's conv1 at batch 64: 4.6 MB where im2col writes 19.7 MB), and a row's GEMM
operand (cifar10_quick: 80 x 2048 floats) stays in cache for the next row, which shares
kh - 1 of its groups when the stride is 1.
"""
import numpy as np

from ringnet.layers.base import batch_last, tap_ranges, tap_slice

__all__ = ["RowConv"]


class RowConv:
    """The lowered rows of one Conv2d layer: ``forward(train=True)`` keeps them for
    ``backward``. The buffer of lowered rows is kept while the input shape repeats: its
    padding and ones rows are written once."""

    def __init__(self, kernel, stride, padding):
        self.kernel, self.stride, self.padding = tuple(kernel), tuple(stride), tuple(padding)
        self._lowered = None        # (shape, dtype, L) for the last input shape
        self._cache = None

    def _rows(self, c, h, w, b, dtype):
        """Return the (Hp, G, Wo, B) buffer for a (C, H, W, B) input: zeros where a tap
        reads padding, ones in each group's last row; the interior is overwritten per call."""
        (_, kw), (_, sw), (ph, pw) = self.kernel, self.stride, self.padding
        wo = (w + 2 * pw - kw) // sw + 1
        key = ((c, h, w, b), np.dtype(dtype))
        if self._lowered is None or self._lowered[:2] != key:
            rows = np.zeros((h + 2 * ph, c * kw + 1, wo, b), dtype=dtype)
            rows[:, -1] = 1
            self._lowered = (*key, rows)
        return self._lowered[2]

    def _kernel(self, weight, bias):
        """Return W' (O, kh*G): the kernel reordered by (kernel row, channel, column tap),
        each row's group closed by the bias column (the bias in kernel row 0, else 0)."""
        o, c, kh, kw = weight.shape
        w2 = np.zeros((o, kh, c * kw + 1), dtype=weight.dtype)
        w2[:, :, :-1] = weight.transpose(0, 2, 1, 3).reshape(o, kh, c * kw)
        w2[:, 0, -1] = bias
        return w2.reshape(o, kh * (c * kw + 1))

    def forward(self, x, weight, bias, train=True):
        """Return a new (O, Ho, Wo, B) array for logical (B, C, H, W) ``x`` (any memory
        order), (O, C, kh, kw) ``weight`` and (O,) ``bias``."""
        b, c, h, w = x.shape
        o = weight.shape[0]
        (kh, kw), (sh, sw), (ph, pw) = self.kernel, self.stride, self.padding
        xc = batch_last(np, x)                                   # (C, H, W, B)
        lowered = self._rows(c, h, w, b, x.dtype)                 # (Hp, G, Wo, B)
        hp, g, wo, _ = lowered.shape
        ho = (hp - kh) // sh + 1
        groups = lowered[ph:ph + h, :-1].reshape(h, c, kw, wo, b)
        for j, taps in enumerate(tap_ranges(w, wo, kw, sw, pw)):  # one strided copy per tap
            if taps is not None:
                outs, ins = tap_slice(taps, sw)
                groups[:, :, j, outs] = xc[:, :, ins].transpose(1, 0, 2, 3)
        kernel = self._kernel(weight, bias)
        flat = lowered.reshape(hp * g, wo * b)
        n = wo * b
        y = np.empty((o, ho * n), dtype=x.dtype)                 # (O, Ho*Wo*B)
        for r in range(ho):
            np.matmul(kernel, flat[r * sh * g:(r * sh + kh) * g], out=y[:, r * n:(r + 1) * n])
        self._cache = (x.shape, kernel) if train else None
        return y.reshape(o, ho, wo, b)

    def backward(self, dy, dweight, dbias, needs_dx):
        """Write the weight and bias gradients into (O, C, kh, kw) ``dweight`` and (O,)
        ``dbias`` and return dx as a new (C, H, W, B) array (None without ``needs_dx``),
        for an (O, Ho*Wo*B) matrix ``dy``."""
        if self._cache is None:
            raise RuntimeError("Conv2d.backward called without a forward(train=True)")
        (b, c, h, w), kernel = self._cache
        (kh, kw), (sh, sw), (ph, pw) = self.kernel, self.stride, self.padding
        lowered = self._lowered[2]
        hp, g, wo, _ = lowered.shape
        o, n = dy.shape[0], wo * b
        ho = dy.shape[1] // n
        flat = lowered.reshape(hp * g, n)
        # dW'^T in the (kh*G, O) orientation, the faster one for OpenBLAS at these shapes
        total = np.empty((kh * g, o), dtype=dy.dtype)
        part = np.empty_like(total)
        for r in range(ho):
            np.matmul(flat[r * sh * g:(r * sh + kh) * g], dy[:, r * n:(r + 1) * n].T,
                      out=part if r else total)
            if r:
                total += part
        total = total.reshape(kh, g, o)
        dweight[...] = total[:, :-1].reshape(kh, c, kw, o).transpose(3, 1, 0, 2)
        dbias[...] = total[0, -1]
        if not needs_dx:
            return None
        dflat = np.zeros((hp * g, n), dtype=dy.dtype)
        kernel_t = kernel.T                                      # (kh*G, O)
        part = np.empty((kh * g, n), dtype=dy.dtype)
        for r in range(ho):
            np.matmul(kernel_t, dy[:, r * n:(r + 1) * n], out=part)
            dflat[r * sh * g:(r * sh + kh) * g] += part
        dgroups = dflat.reshape(hp, g, wo, b)[ph:ph + h, :-1].reshape(h, c, kw, wo, b)
        dx = np.zeros((c, h, w, b), dtype=dy.dtype)
        for j, taps in enumerate(tap_ranges(w, wo, kw, sw, pw)):
            if taps is not None:
                outs, ins = tap_slice(taps, sw)
                dx[:, :, ins] += dgroups[:, :, j, outs].transpose(1, 0, 2, 3)
        return dx
