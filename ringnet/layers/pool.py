"""MaxPool2d and AvgPool2d with Caffe's ceil-mode output size, as sums over kernel taps.

The input is first split into stride x stride *phase planes* (plane (a, b) holds the
pixels whose row is a mod sh and column b mod sw), so every kernel tap reads a plain
rectangle of one plane: in batch-last (C, H, W, B) memory each tap's rows are then long
contiguous runs, where a stride-2 view of the input would give runs of only B elements.
The input gradient is gathered in the same planes and interleaved back at the end.
"""
import numpy as np

from ringnet.backend import get_array_module
from ringnet.layers import _cuda
from ringnet.layers.base import Layer, tap_ranges, window_geometry, window_out_size, window_repr

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


def _phase_view(xp, xc, stride):
    """Return (C, H, W, B) ``xc`` as a (sh, sw, C, H/sh, W/sw, B) view (sizes divisible)."""
    sh, sw = stride
    c, h, w, b = xc.shape
    st = xc.strides
    return xp.lib.stride_tricks.as_strided(
        xc, (sh, sw, c, h // sh, w // sw, b), (st[1], st[2], st[0], sh * st[1], sw * st[2], st[3]))


def _plane_extent(size, phase, stride):
    """Return how many of ``size`` positions have index = phase mod stride."""
    return -(-(size - phase) // stride)


def split_phases(xp, x, stride):
    """Return logical (B, C, H, W) ``x`` as phase planes (sh, sw, C, ceil(H/sh), ceil(W/sw), B).

    Entries past an odd-sized plane's end are left unset (no tap reads them).
    """
    sh, sw = stride
    b, c, h, w = x.shape
    xc = x.transpose(1, 2, 3, 0)                                 # (C, H, W, B)
    planes = xp.empty((sh, sw, c, -(-h // sh), -(-w // sw), b), dtype=x.dtype)
    if h % sh == 0 and w % sw == 0:
        xp.copyto(planes, _phase_view(xp, xc, stride))           # one strided copy
    else:
        for a in range(sh):
            for e in range(sw):
                planes[a, e, :, :_plane_extent(h, a, sh), :_plane_extent(w, e, sw)] = \
                    xc[:, a::sh, e::sw]
    return planes


def merge_phases(xp, planes, h, w):
    """Return phase planes as a C-contiguous (C, H, W, B) array (the inverse of split_phases)."""
    sh, sw, c, _, _, b = planes.shape
    xc = xp.empty((c, h, w, b), dtype=planes.dtype)
    if h % sh == 0 and w % sw == 0:
        xp.copyto(_phase_view(xp, xc, (sh, sw)), planes)         # one strided copy
    else:
        for a in range(sh):
            for e in range(sw):
                xc[:, a::sh, e::sw] = \
                    planes[a, e, :, :_plane_extent(h, a, sh), :_plane_extent(w, e, sw)]
    return xc


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
        """Return (Ho, Wo, taps, covered): taps are (t, out, plane) for in-bounds taps in
        row-major order, ``out`` indexing a (C, Ho, Wo, B) array and ``plane`` the phase
        planes; ``covered`` says the first tap of every plane writes all of that plane."""
        _, ho, wo = self.output_shape((1, h, w))
        (kh, kw), (sh, sw), (ph, pw) = self.kernel_size, self.stride, self.padding
        rows, cols = tap_ranges(h, ho, kh, sh, ph), tap_ranges(w, wo, kw, sw, pw)
        taps, first = [], {}
        for i, ri in enumerate(rows):
            for j, rj in enumerate(cols):
                if ri is None or rj is None:
                    continue
                (lo, hi, r), (lj, hj, q) = ri, rj
                a, e = r % sh, q % sw
                out = (slice(None), slice(lo, hi), slice(lj, hj))
                plane = (a, e, slice(None), slice(r // sh, r // sh + hi - lo),
                         slice(q // sw, q // sw + hj - lj))
                taps.append((i * kw + j, out, plane))
                first.setdefault((a, e), (plane[3], plane[4]))
        covered = all(first.get((a, e)) == (slice(0, _plane_extent(h, a, sh)),
                                            slice(0, _plane_extent(w, e, sw)))
                      for a in range(sh) for e in range(sw))
        return ho, wo, taps, covered

    def _scatter(self, xp, parts, taps, covered, shape, dtype):
        """Return dx (B, C, H, W) from per-tap gradient contributions ``parts(t, out)``."""
        b, c, h, w = shape
        (sh, sw) = self.stride
        planes = xp.empty((sh, sw, c, -(-h // sh), -(-w // sw), b), dtype=dtype)
        if not covered:
            planes.fill(0)
        seen = set()
        for t, out, plane in taps:
            if covered and plane[:2] not in seen:              # the plane's first tap writes
                seen.add(plane[:2])
                parts(t, out, planes[plane])
            else:
                planes[plane] += parts(t, out, None)
        return merge_phases(xp, planes, h, w).transpose(3, 0, 1, 2)


class MaxPool2d(_Pool2d):
    """Max pooling; padding never wins; ties go to the first tap in row-major order (Caffe)."""

    def forward(self, x, train=True):
        xp = get_array_module(x)
        if xp is not np:                                         # one fused CUDA kernel
            y, argmax = _cuda.maxpool_forward(xp, x, self.output_shape(x.shape[1:])[1:],
                                              self.kernel_size, self.stride, self.padding)
            self._cache = (x.shape, argmax, None, None) if train else None
            return y
        b, c, h, w = x.shape                                     # (B, C, H, W)
        ho, wo, taps, covered = self._taps(h, w)
        planes = split_phases(xp, x, self.stride)
        y = xp.empty((c, ho, wo, b), dtype=x.dtype)              # (C, Ho, Wo, B)
        argmax = xp.zeros(y.shape, dtype=np.uint8) if train else None
        if train:
            win = xp.empty(y.shape, dtype=np.bool_)
            step = xp.empty(y.shape, dtype=np.uint8)
        t0, out0, plane0 = taps[0]
        if out0 == (slice(None), slice(0, ho), slice(0, wo)):    # tap 0 starts every window
            y[...] = planes[plane0]
            rest = taps[1:]
        else:
            y.fill(-np.inf)
            rest = taps
        for t, out, plane in rest:
            src, dst = planes[plane], y[out]
            if train:
                # Strictly greater, so ties keep the earlier tap; taps come in increasing
                # t, so argmax <- max(argmax, win * t) sets t exactly where this tap wins
                # (branch-free: a masked copy runs at the speed of the mask's pattern).
                xp.greater(src, dst, out=win[out])
                xp.multiply(win[out].view(np.uint8), np.uint8(t), out=step[out])
                xp.maximum(argmax[out], step[out], out=argmax[out])
            xp.maximum(dst, src, out=dst)
        self._cache = (x.shape, argmax, taps, covered) if train else None
        return y.transpose(3, 0, 1, 2)                           # (B, C, Ho, Wo)

    def backward(self, dy):
        # y = x[argmax]  =>  dx[argmax] += dy, zero elsewhere (overlapping windows add up).
        shape, argmax, taps, covered = self._cached()
        xp = get_array_module(dy)
        if xp is not np:                                         # one fused CUDA kernel
            return _cuda.maxpool_backward(xp, dy, argmax, shape, self.kernel_size,
                                          self.stride, self.padding)
        dyc = dy.transpose(1, 2, 3, 0)                           # (C, Ho, Wo, B)
        hit = xp.empty(argmax.shape, dtype=np.bool_)
        part = xp.empty(argmax.shape, dtype=dy.dtype)

        def parts(t, out, dst):
            xp.equal(argmax[out], np.uint8(t), out=hit[out])
            return xp.multiply(dyc[out], hit[out], out=part[out] if dst is None else dst)

        return self._scatter(xp, parts, taps, covered, shape, dy.dtype)


class AvgPool2d(_Pool2d):
    """Average pooling; divisor counts padding but not the ceil-mode overhang (Caffe AVE)."""

    def _inv_count(self, xp, h, w, ho, wo, dtype):
        (kh, kw), (sh, sw), (ph, pw) = self.kernel_size, self.stride, self.padding
        def count(size, out, k, s, p):
            start = np.arange(out) * s - p
            return np.minimum(start + k, size + p) - start
        inv = 1.0 / np.outer(count(h, ho, kh, sh, ph), count(w, wo, kw, sw, pw))
        return xp.asarray(inv.astype(dtype)[:, :, None])          # (Ho, Wo, 1)

    def _gpu_inv(self, xp, h, w, dtype):
        # Kept on the device: a fresh copy per call would be a host-to-device transfer.
        key = (h, w, np.dtype(dtype))
        cached = getattr(self, "_inv_on_gpu", None)
        if cached is None or cached[0] != key:
            _, ho, wo = self.output_shape((1, h, w))
            inv = self._inv_count(xp, h, w, ho, wo, dtype).reshape(ho, wo)
            cached = self._inv_on_gpu = (key, xp.ascontiguousarray(inv))
        return cached[1]

    def forward(self, x, train=True):
        xp = get_array_module(x)
        if xp is not np:                                         # one fused CUDA kernel
            inv = self._gpu_inv(xp, x.shape[2], x.shape[3], x.dtype)
            self._cache = (x.shape, inv, None, None) if train else None
            return _cuda.avgpool_forward(xp, x, inv, self.kernel_size, self.stride,
                                         self.padding)
        b, c, h, w = x.shape                                     # (B, C, H, W)
        ho, wo, taps, covered = self._taps(h, w)
        planes = split_phases(xp, x, self.stride)
        t0, out0, plane0 = taps[0]
        if out0 == (slice(None), slice(0, ho), slice(0, wo)):
            y = xp.empty((c, ho, wo, b), dtype=x.dtype)          # (C, Ho, Wo, B)
            y[...] = planes[plane0]
            rest = taps[1:]
        else:
            y, rest = xp.zeros((c, ho, wo, b), dtype=x.dtype), taps
        for _, out, plane in rest:
            y[out] += planes[plane]
        inv = self._inv_count(xp, h, w, ho, wo, x.dtype)
        y *= inv
        self._cache = (x.shape, inv, taps, covered) if train else None
        return y.transpose(3, 0, 1, 2)                           # (B, C, Ho, Wo)

    def backward(self, dy):
        # y[o] = inv[o] * sum_{taps} x[o*s + k - p]  =>  dx[o*s + k - p] += inv[o] * dy[o].
        shape, inv, taps, covered = self._cached()
        xp = get_array_module(dy)
        if xp is not np:                                         # one fused CUDA kernel
            return _cuda.avgpool_backward(xp, dy, inv, shape, self.kernel_size, self.stride,
                                          self.padding)
        g = xp.multiply(dy.transpose(1, 2, 3, 0), inv)           # (C, Ho, Wo, B)

        def parts(t, out, dst):
            if dst is None:
                return g[out]
            dst[...] = g[out]
            return dst

        return self._scatter(xp, parts, taps, covered, shape, dy.dtype)
