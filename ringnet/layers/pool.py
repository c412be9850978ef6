"""MaxPool2d and AvgPool2d with Caffe's ceil-mode output size, as sums over kernel taps."""
import numpy as np

from ringnet.backend import get_array_module
from ringnet.layers.base import (Layer, empty_like_layout, tap_ranges, tap_slice, window_geometry,
                                 window_out_size, window_repr, zeros_like_layout)

__all__ = ["MaxPool2d", "AvgPool2d", "pool_output_size"]


def pool_output_size(size, kernel, stride, pad):
    """Return Caffe's pooled size: ceil((size + 2*pad - kernel) / stride) + 1.

    As in Caffe (and PyTorch ``ceil_mode=True``) the last window must start inside the
    input or its left padding, so one is dropped when (out - 1) * stride >= size + pad.
    Example: cifar10_quick's 3/2 pools take 32 -> 16 -> 8 -> 4 (floor mode would give 15).
    """
    if size + 2 * pad < kernel:
        raise ValueError(f"pool kernel {kernel} (pad {pad}) does not fit input size {size}")
    out = -(-(size + 2 * pad - kernel) // stride) + 1
    if (out - 1) * stride >= size + pad:
        out -= 1
    return out


def _covers(tap, ho, wo):
    """Return True when a (t, out slices, in slices) tap reaches every output position."""
    _, (_, rows, cols), _ = tap
    return tap[0] == 0 and rows == slice(0, ho) and cols == slice(0, wo)


class _Pool2d(Layer):
    def __init__(self, kernel_size, stride=None, padding=0):
        self.kernel_size, self.stride, self.padding = window_geometry(
            "pool", kernel_size, kernel_size if stride is None else stride, padding)
        if self.kernel_size[0] * self.kernel_size[1] > 255:
            raise ValueError(f"pool kernel {self.kernel_size} has more than 255 taps")
        if any(2 * p > k for p, k in zip(self.padding, self.kernel_size)):
            raise ValueError(f"pool padding {self.padding} must be at most half the "
                             f"kernel {self.kernel_size}")
        self._cache = None

    def __repr__(self):
        return window_repr(self)

    def output_shape(self, in_shape):
        c, h, w = in_shape
        return (c, *window_out_size(self, h, w, pool_output_size))

    def _taps(self, h, w):
        """Yield (tap index, output slices, input slices) for in-bounds taps."""
        _, ho, wo = self.output_shape((1, h, w))
        (kh, kw), (sh, sw), (ph, pw) = self.kernel_size, self.stride, self.padding
        rows, cols = tap_ranges(h, ho, kh, sh, ph), tap_ranges(w, wo, kw, sw, pw)
        taps = []
        for i, ri in enumerate(rows):
            for j, rj in enumerate(cols):
                if ri is not None and rj is not None:
                    (oi, ii), (oj, ij) = tap_slice(ri, sh), tap_slice(rj, sw)
                    taps.append((i * kw + j, (Ellipsis, oi, oj), (Ellipsis, ii, ij)))
        return ho, wo, taps


class MaxPool2d(_Pool2d):
    """Max pooling; padding never wins; ties go to the first tap in row-major order (Caffe)."""

    def forward(self, x, train=True):
        xp = get_array_module(x)
        b, c, h, w = x.shape                                     # (B, C, H, W)
        ho, wo, taps = self._taps(h, w)
        y = empty_like_layout(xp, x, (b, c, ho, wo))             # (B, C, Ho, Wo)
        argmax = zeros_like_layout(xp, x, y.shape, np.uint8) if train else None
        if train:
            wins = empty_like_layout(xp, x, y.shape, np.bool_)
            step = empty_like_layout(xp, x, y.shape, np.uint8)
        if _covers(taps[0], ho, wo):
            y[...] = x[taps[0][2]]                               # tap 0 starts every window
            taps = taps[1:]
        else:
            y.fill(-np.inf)
        for t, out_sl, in_sl in taps:
            src, dst = x[in_sl], y[out_sl]
            if train:
                # argmax <- t where src wins, branch-free: a += win * (t - a) (mod 256)
                win, delta, arg = wins[out_sl], step[out_sl], argmax[out_sl]
                xp.greater(src, dst, out=win)
                xp.subtract(np.uint8(t), arg, out=delta)
                xp.multiply(delta, win, out=delta)
                xp.add(arg, delta, out=arg)
            xp.maximum(dst, src, out=dst)
        self._cache = (x, argmax, self._taps(h, w)[2]) if train else None
        return y

    def backward(self, dy):
        # y = x[argmax]  =>  dx[argmax] += dy, zero elsewhere (overlapping windows add up).
        x, argmax, taps = self._cached()
        xp = get_array_module(dy)
        (kh, kw), (sh, sw) = self.kernel_size, self.stride
        dx = zeros_like_layout(xp, x, x.shape)                   # (B, C, H, W)
        hit = empty_like_layout(xp, argmax, argmax.shape, np.bool_)
        part = empty_like_layout(xp, argmax, argmax.shape, dy.dtype)
        for t, out_sl, in_sl in taps:
            xp.equal(argmax[out_sl], np.uint8(t), out=hit[out_sl])
            if t // kw < sh and t % kw < sw:
                # taps in the first stride x stride block never share an input pixel
                xp.multiply(dy[out_sl], hit[out_sl], out=dx[in_sl])
            else:
                xp.multiply(dy[out_sl], hit[out_sl], out=part[out_sl])
                dx[in_sl] += part[out_sl]
        return dx


class AvgPool2d(_Pool2d):
    """Average pooling; divisor counts padding but not the ceil-mode overhang (Caffe AVE)."""

    def _inv_count(self, xp, h, w, ho, wo, dtype):
        (kh, kw), (sh, sw), (ph, pw) = self.kernel_size, self.stride, self.padding
        def count(size, out, k, s, p):
            start = np.arange(out) * s - p
            return np.minimum(start + k, size + p) - start
        inv = 1.0 / np.outer(count(h, ho, kh, sh, ph), count(w, wo, kw, sw, pw))
        return xp.asarray(inv.astype(dtype))                      # (Ho, Wo)

    def forward(self, x, train=True):
        xp = get_array_module(x)
        b, c, h, w = x.shape                                     # (B, C, H, W)
        ho, wo, taps = self._taps(h, w)
        if _covers(taps[0], ho, wo):
            y = empty_like_layout(xp, x, (b, c, ho, wo))         # (B, C, Ho, Wo)
            y[...] = x[taps[0][2]]
            rest = taps[1:]
        else:
            y, rest = zeros_like_layout(xp, x, (b, c, ho, wo)), taps
        for _, out_sl, in_sl in rest:
            y[out_sl] += x[in_sl]
        inv = self._inv_count(xp, h, w, ho, wo, x.dtype)
        y *= inv
        self._cache = (x, inv, taps) if train else None
        return y

    def backward(self, dy):
        # y[o] = inv[o] * sum_{taps} x[o*s + k - p]  =>  dx[o*s + k - p] += inv[o] * dy[o].
        x, inv, taps = self._cached()
        xp = get_array_module(dy)
        g = dy * inv                                             # (B, C, Ho, Wo)
        dx = zeros_like_layout(xp, x, x.shape)                   # (B, C, H, W)
        for _, out_sl, in_sl in taps:
            dx[in_sl] += g[out_sl]
        return dx
