"""Conv2d on batch-last (C, H, W, B) memory: im2col as one strided copy per column block +
one GEMM per block; on the CPU, (stride 1, enough channels, small maps) through 2-D
Fourier transforms (:mod:`ringnet.layers.fft_conv`), and a first layer through rows
lowered along the kernel's width only (:mod:`ringnet.layers.row_conv`)."""
import functools

import numpy as np

from ringnet.backend import get_array_module
from ringnet.layers import cuda_ops, fft_conv, gemm, row_conv
from ringnet.layers.base import (Layer, as_channel_rows, check_init, copy_samples,
                                 window_geometry, window_out_size, window_repr)

__all__ = ["Conv2d", "conv_output_size", "column_blocks"]

# On the CPU the column matrix is built and multiplied one block of output positions at a
# time, each block about this many bytes: it stays in the core's cache between the copy
# that writes it and the GEMM that reads it (the whole matrix of a cifar10_quick conv2 at
# batch 64 is 52 MB and would make both passes run at memory speed). On a GPU there is one
# block: every extra block is two more kernel launches.
CPU_BLOCK_BYTES = 1 << 20


def conv_output_size(size, kernel, stride, pad):
    """Return floor((size + 2*pad - kernel) / stride) + 1 (Caffe and PyTorch agree here)."""
    out = (size + 2 * pad - kernel) // stride + 1
    if out < 1:
        raise ValueError(f"conv kernel {kernel} (pad {pad}) does not fit input size {size}")
    return out


def column_blocks(xp, ho, wo, b, rows, itemsize):
    """Return :func:`_column_blocks`; on the CPU the same tuple for the same geometry and
    block size (layers keep their im2col views while it is the same object)."""
    if xp is not np:
        return [(0, ho, 0, wo)]
    return _column_blocks(ho, wo, b, rows, itemsize, CPU_BLOCK_BYTES)


@functools.lru_cache(maxsize=256)
def _column_blocks(ho, wo, b, rows, itemsize, block_bytes):
    """Split an (ho, wo) grid of output positions into blocks (r0, r1, w0, w1).

    Each block is whole rows or part of one row, so its columns (``b`` per position, batch
    innermost) are one contiguous range of a (rows, ho*wo*b) matrix; on the CPU a block's
    column matrix holds about ``block_bytes``.
    """
    per = max(1, block_bytes // (rows * b * itemsize))           # positions per block
    if per >= wo:
        n = -(-ho // min(ho, per // wo))                         # blocks, then even rows each
        nr = -(-ho // n)
        return tuple((r, min(r + nr, ho), 0, wo) for r in range(0, ho, nr))
    n = -(-wo // per)
    nw = -(-wo // n)
    return tuple((r, r + 1, w, min(w + nw, wo)) for r in range(ho) for w in range(0, wo, nw))


def _block_columns(block, wo, b):
    """Return the slice of a block's columns in an (rows, ho*wo*b) matrix."""
    r0, r1, w0, w1 = block
    return slice((r0 * wo + w0) * b, ((r1 - 1) * wo + w1) * b)


def _window_view(xp, src, kernel, stride, block):
    """Return the (C, kh, kw, rows, cols, B) view of padded ``src`` (C, Hp, Wp, B) that is
    ``block``'s column matrix: entry (c, i, j, r, w, b) = src[c, r*sh + i, w*sw + j, b]."""
    (kh, kw), (sh, sw) = kernel, stride
    c, _, _, b = src.shape
    r0, r1, w0, w1 = block
    sc, sy, sx, sb = src.strides
    return xp.lib.stride_tricks.as_strided(src[:, r0 * sh:, w0 * sw:, :],
                                           (c, kh, kw, r1 - r0, w1 - w0, b),
                                           (sc, sy, sx, sy * sh, sx * sw, sb))


class Conv2d(Layer):
    """2-D convolution (cross-correlation), weight (out, in, kh, kw), bias (out,).

    Columns are laid out (C*kh*kw, Ho*Wo*B) so forward, weight gradient and input
    gradient are each one GEMM per column block; the output comes out in (O, Ho, Wo, B)
    memory and is returned as a logical (B, O, Ho, Wo) view of it.

    ``algorithm`` picks the CPU path: "auto" (the default) takes the Fourier transforms
    where :func:`ringnet.layers.fft_conv.fits` says they are faster, else the lowered
    rows for a first layer (``needs_dx`` False: its thin GEMMs run without im2col's
    kh-fold copy), else im2col; "im2col", "fourier" and "rows" force one (the GPU always
    runs im2col). They agree to rounding (float64: about 1e-15 of the largest output).
    """

    algorithm = "auto"

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, *,
                 weight_init=("xavier",), bias_init=("constant", 0.0)):
        self.in_channels, self.out_channels = int(in_channels), int(out_channels)
        self.kernel_size, self.stride, self.padding = window_geometry(
            "Conv2d", kernel_size, stride, padding)
        self.weight_init, self.bias_init = check_init(weight_init), check_init(bias_init)
        self._buffers = {}       # role -> (shape, dtype, array), reused while shapes repeat
        self._plans = {}         # role -> im2col views of those buffers
        self._fourier_plan = None  # the transforms' work arrays (fft_conv.FourierConv)
        self._row_plan = None      # the lowered rows (row_conv.RowConv)
        self._cache = None

    def __repr__(self):
        return window_repr(self, self.in_channels, self.out_channels)

    def output_shape(self, in_shape):
        c, h, w = in_shape
        if c != self.in_channels:
            raise ValueError(f"Conv2d expects {self.in_channels} input channels, got {c}")
        return (self.out_channels, *window_out_size(self, h, w, conv_output_size))

    def param_specs(self, in_shape):
        self.output_shape(in_shape)
        kh, kw = self.kernel_size
        return [("weight", (self.out_channels, self.in_channels, kh, kw), self.weight_init),
                ("bias", (self.out_channels,), self.bias_init)]

    def _buffer(self, xp, role, shape, dtype, zero=False):
        # Zero-bordered buffers (zero=True) are zeroed once: every call with this shape
        # writes exactly the same interior, so the border stays zero.
        entry = self._buffers.get(role)
        if entry is None or entry[0] != shape or entry[1] != dtype or \
                get_array_module(entry[2]) is not xp:
            array = xp.zeros(shape, dtype=dtype) if zero else xp.empty(shape, dtype=dtype)
            entry = self._buffers[role] = (shape, dtype, array)
        return entry[2]

    def _padded(self, xp, src, pad, role):
        """Copy (C, H, W, B) ``src`` into this role's buffer, with ``pad`` zeros around H, W."""
        ph, pw = pad
        c, h, w, b = src.shape
        buf = self._buffer(xp, role, (c, h + 2 * ph, w + 2 * pw, b), src.dtype, zero=True)
        copy_samples(xp, buf[:, ph:ph + h, pw:pw + w].transpose(3, 0, 1, 2),
                     src.transpose(3, 0, 1, 2))
        return buf

    def _column_buffer(self, xp, role, rows, blocks, b, dtype):
        n = max((r1 - r0) * (w1 - w0) for r0, r1, w0, w1 in blocks) * b
        return self._buffer(xp, role, (rows * n,), dtype)

    def _im2col_plan(self, xp, role, src, stride, blocks, b):
        """Return per block (column matrix, its columns' slice, copy destination, source
        view): one copy per block fills the matrix. Views are made once and kept while
        the source buffer and the blocks (one cached tuple per geometry) stay the same: a
        strided view costs microseconds to make, and a cifar10_quick step needs ~200."""
        plan = self._plans.get(role)
        if plan is not None and plan[0] is src and plan[1] is blocks:
            return plan[2]
        kh, kw = self.kernel_size
        rows = src.shape[0] * kh * kw
        buf = self._column_buffer(xp, "cols-" + role, rows, blocks, b, src.dtype)
        wo = blocks[-1][3]
        steps = []
        for block in blocks:
            r0, r1, w0, w1 = block
            n = (r1 - r0) * (w1 - w0) * b
            dst = buf[:rows * n].reshape(src.shape[0], kh, kw, r1 - r0, w1 - w0, b)
            steps.append((dst.reshape(rows, n), _block_columns(block, wo, b), dst,
                          _window_view(xp, src, self.kernel_size, stride, block)))
        self._plans[role] = (src, blocks, steps)
        return steps

    def forward(self, x, train=True, add_bias=True):
        """Return the convolution of ``x`` plus the bias; on a GPU the model may leave the
        bias to the next layer's kernel (``add_bias=False``)."""
        xp = get_array_module(x)
        if xp is not np:
            return self._forward_gpu(xp, x, train, add_bias)
        if not add_bias:
            self._gpu_only(xp, "add_bias=False")
        b, c, h, w = x.shape                                     # (B, C, H, W)
        _, ho, wo = self.output_shape((c, h, w))
        (kh, kw), o = self.kernel_size, self.out_channels
        algorithm = self._cpu_algorithm(c, h, w)
        if algorithm == "rows":
            if self._row_plan is None:
                self._row_plan = row_conv.RowConv(self.kernel_size, self.stride, self.padding)
            y = self._row_plan.forward(x, self.params["weight"], self.params["bias"], train)
            self._cache = ("rows", self._row_plan) if train else None
            return y.transpose(3, 0, 1, 2)                       # (B, O, Ho, Wo)
        if algorithm == "fourier":
            if self._fourier_plan is None:
                self._fourier_plan = fft_conv.FourierConv(self.kernel_size, self.padding)
            y = self._fourier_plan.forward(np.ascontiguousarray(x.transpose(1, 2, 3, 0)),
                                           self.params["weight"], self.params["bias"], train)
            self._cache = ("fourier", self._fourier_plan) if train else None
            return y.transpose(3, 0, 1, 2)                       # (B, O, Ho, Wo)
        role = "train" if train else "eval"
        xpad = self._padded(xp, x.transpose(1, 2, 3, 0), self.padding, "x-" + role)
        blocks = column_blocks(xp, ho, wo, b, c * kh * kw, x.dtype.itemsize)
        weight = self.params["weight"].reshape(o, c * kh * kw)
        y = xp.empty((o, ho * wo * b), dtype=x.dtype)            # (O, Ho*Wo*B)
        for cols, columns, dst, view in self._im2col_plan(xp, role, xpad, self.stride, blocks, b):
            xp.copyto(dst, view)                                 # im2col of one block
            xp.matmul(weight, cols, out=y[:, columns])
        y += self.params["bias"][:, None]
        # With one block the column matrix is still in its buffer for the weight gradient.
        self._cache = (x.shape, xpad, blocks, len(blocks) == 1) if train else None
        return y.reshape(o, ho, wo, b).transpose(3, 0, 1, 2)     # (B, O, Ho, Wo)

    def backward(self, dy):
        # y = W @ cols + b  =>  dW = dy @ cols^T,  db = sum_cols dy,  dcols = W^T @ dy,
        # and dx = col2im(dcols): every column entry adds back to the pixel it was read from.
        # With stride 1 the same dx is a convolution of dy (padded by k-1-p) with the
        # flipped, in/out-swapped kernel: cheaper when the output is not smaller than the
        # input ("same" padding), as a copy replaces the scattered adds of col2im.
        xp = get_array_module(dy)
        if xp is not np:
            return self._backward_gpu(xp, dy)
        if self._cached()[0] == "rows":
            dx = self._cache[1].backward(as_channel_rows(xp, dy), self.grads["weight"],
                                         self.grads["bias"], self.needs_dx)
            return None if dx is None else dx.transpose(3, 0, 1, 2)  # (B, C, H, W)
        if self._cached()[0] == "fourier":
            dyc = np.ascontiguousarray(dy.transpose(1, 2, 3, 0))  # (O, Ho, Wo, B)
            dx = self._cache[1].backward(dyc, self.grads["weight"], self.grads["bias"],
                                         self.needs_dx)
            return None if dx is None else dx.transpose(3, 0, 1, 2)  # (B, C, H, W)
        (b, c, h, w), xpad, blocks, kept = self._cached()
        _, o, ho, wo = dy.shape
        (kh, kw), (sh, sw), (ph, pw) = self.kernel_size, self.stride, self.padding
        k = c * kh * kw
        dy2 = as_channel_rows(xp, dy)                            # (O, Ho*Wo*B)
        # dW^T = cols @ dy^T, summed over blocks: the (C*kh*kw, O) orientation runs the
        # GEMM faster than dy @ cols^T when a block has few columns (measured in OpenBLAS).
        dweight_t = self._buffer(xp, "dweight", (k, o), dy.dtype)
        part = self._buffer(xp, "dweight-part", (k, o), dy.dtype)
        for i, (cols, columns, dst, view) in enumerate(
                self._im2col_plan(xp, "train", xpad, self.stride, blocks, b)):
            if not kept:
                xp.copyto(dst, view)                             # rebuilt from xpad
            xp.matmul(cols, dy2[:, columns].T, out=part if i else dweight_t)
            if i:
                dweight_t += part
        self.grads["weight"].reshape(o, k)[...] = dweight_t.T
        xp.sum(dy2, axis=1, out=self.grads["bias"])
        if not self.needs_dx:
            return None
        if (sh, sw) == (1, 1) and ph < kh and pw < kw and h * w <= ho * wo:
            flipped = self.params["weight"].transpose(1, 0, 2, 3)[:, :, ::-1, ::-1]
            flipped = xp.ascontiguousarray(flipped).reshape(c, o * kh * kw)
            dypad = self._padded(xp, dy2.reshape(o, ho, wo, b), (kh - 1 - ph, kw - 1 - pw),
                                 "dy")
            dx_blocks = column_blocks(xp, h, w, b, o * kh * kw, dy.dtype.itemsize)
            dxc = xp.empty((c, h * w * b), dtype=dy.dtype)       # (C, H*W*B)
            for cols, columns, dst, view in self._im2col_plan(xp, "dx", dypad, (1, 1),
                                                              dx_blocks, b):
                xp.copyto(dst, view)
                xp.matmul(flipped, cols, out=dxc[:, columns])
            return dxc.reshape(c, h, w, b).transpose(3, 0, 1, 2)  # (B, C, H, W)
        # col2im into a zero-padded dx, block by block; taps that read padding add into
        # the border, which is cut off at the end.
        weight_t = self.params["weight"].reshape(o, k).T         # (C*kh*kw, O)
        dxpad = xp.zeros((c, h + 2 * ph, w + 2 * pw, b), dtype=dy.dtype)
        for (r0, r1, w0, w1), (dcols, columns, dst, _) in zip(
                blocks, self._im2col_plan(xp, "train", xpad, self.stride, blocks, b)):
            xp.matmul(weight_t, dy2[:, columns], out=dcols)
            if r1 - r0 == 1:
                # One output row: its kh row taps add into kh different input rows, so one
                # add per column tap takes all of them (5x fewer calls for a 5x5 kernel);
                # every element still receives its terms in the same order.
                top = r0 * sh
                for j in range(kw):
                    dxpad[:, top:top + kh, w0 * sw + j:(w1 - 1) * sw + j + 1:sw] += dst[:, :, j, 0]
                continue
            for i in range(kh):
                rows = slice(r0 * sh + i, (r1 - 1) * sh + i + 1, sh)
                for j in range(kw):
                    dxpad[:, rows, w0 * sw + j:(w1 - 1) * sw + j + 1:sw] += dst[:, i, j]
        return dxpad[:, ph:ph + h, pw:pw + w].transpose(3, 0, 1, 2)  # (B, C, H, W)

    def _cpu_algorithm(self, c, h, w):
        """Return the CPU path of this call: "fourier", "rows" or "im2col"."""
        if self.algorithm not in ("auto", "im2col", "fourier", "rows"):
            raise ValueError(f"Conv2d algorithm {self.algorithm!r}: use auto, im2col, "
                             f"fourier or rows")
        if self.algorithm == "fourier":
            return "fourier" if tuple(self.stride) == (1, 1) else "im2col"
        if self.algorithm != "auto":
            return self.algorithm
        (ph, pw) = self.padding
        if fft_conv.fits(c, self.out_channels, self.kernel_size, self.stride,
                         (h + 2 * ph, w + 2 * pw)):
            return "fourier"
        return "im2col" if self.needs_dx else "rows"

    # --- the GPU path: the same GEMMs on one column matrix, which one fused kernel builds
    # straight from the input (any memory order, padding included) instead of a padded
    # copy and a strided copy, and col2im as one fused kernel.

    def _forward_gpu(self, xp, x, train, add_bias=True):
        b, c, h, w = x.shape                                     # (B, C, H, W)
        _, ho, wo = self.output_shape((c, h, w))
        (kh, kw), o = self.kernel_size, self.out_channels
        k = c * kh * kw
        cols = self._buffer(xp, "gpu-cols-" + ("train" if train else "eval"),
                            (c, kh, kw, ho, wo, b), x.dtype)
        cuda_ops.im2col(xp, x, cols, self.stride, self.padding)
        y = xp.empty((o, ho * wo * b), dtype=x.dtype)            # (O, Ho*Wo*B)
        gemm.matmul(xp, self.params["weight"].reshape(o, k), cols.reshape(k, ho * wo * b), out=y)
        if add_bias:
            y += self.params["bias"][:, None]
        self._cache = (x.shape, cols) if train else None
        return y.reshape(o, ho, wo, b).transpose(3, 0, 1, 2)     # (B, O, Ho, Wo)

    def _backward_gpu(self, xp, dy):
        (b, c, h, w), cols = self._cached()
        _, o, ho, wo = dy.shape
        (kh, kw), (ph, pw) = self.kernel_size, self.padding
        k = c * kh * kw
        dy2 = as_channel_rows(xp, dy)                            # (O, Ho*Wo*B)
        # dW = dy cols^T straight into the gradient buffer (cuBLAS takes either orientation
        # at one speed, where OpenBLAS wants the transposed one and a copy)
        gemm.matmul(xp, dy2, cols.reshape(k, ho * wo * b).T, out=self.grads["weight"].reshape(o, k))
        xp.sum(dy2, axis=1, out=self.grads["bias"])
        if not self.needs_dx:
            return None
        if tuple(self.stride) == (1, 1) and ph < kh and pw < kw and h * w <= ho * wo:
            # the flipped convolution: the columns of dy padded by k-1-p, one kernel
            flipped = self.params["weight"].transpose(1, 0, 2, 3)[:, :, ::-1, ::-1]
            flipped = xp.ascontiguousarray(flipped).reshape(c, o * kh * kw)
            dcols = self._buffer(xp, "gpu-cols-dx", (o, kh, kw, h, w, b), dy.dtype)
            cuda_ops.im2col(xp, dy2.reshape(o, ho, wo, b).transpose(3, 0, 1, 2), dcols, (1, 1),
                         (kh - 1 - ph, kw - 1 - pw))
            dxc = xp.empty((c, h * w * b), dtype=dy.dtype)       # (C, H*W*B)
            gemm.matmul(xp, flipped, dcols.reshape(o * kh * kw, h * w * b), out=dxc)
            return dxc.reshape(c, h, w, b).transpose(3, 0, 1, 2)  # (B, C, H, W)
        # col2im: the column gradient overwrites the columns (no longer needed), then one
        # gather kernel adds every column entry back to its input pixel.
        gemm.matmul(xp, self.params["weight"].reshape(o, k).T, dy2, out=cols.reshape(k, ho * wo * b))
        dxc = cuda_ops.col2im(xp, cols, (h, w), self.stride, self.padding)
        return dxc.transpose(3, 0, 1, 2)                         # (B, C, H, W)
