"""MaxPool2d and AvgPool2d with Caffe's ceil-mode output size, as sums over kernel taps.

The input is first split into stride x stride *phase planes* (plane (a, e) holds the
pixels whose row is a mod sh and column e mod sw), so every kernel tap reads a plain
rectangle of one plane, where a stride-2 view of the input would give runs of only B
elements. Planes, outputs and gradients are held column-major, (W, H, C, B) in memory, so
a tap's rectangle (a range of columns and of rows, all channels and samples) is one long
contiguous run per column: NumPy runs a pass over a few long runs up to 3x faster than over
the many short ones a column range of a (C, H, W, B) array would give. The output is
copied back to (C, H, W, B) memory at the end, and the input gradient is interleaved back
from its planes.
"""
import numpy as np

from ringnet.backend import get_array_module
from ringnet.layers import _cuda_ops
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
    """Return (C, H, W, B) ``xc`` as a (sh, sw, W/sw, H/sh, C, B) view (sizes divisible):
    entry (a, e, q, r, c, b) = xc[c, r*sh + a, q*sw + e, b]."""
    sh, sw = stride
    c, h, w, b = xc.shape
    sc, sy, sx, sb = xc.strides
    return xp.lib.stride_tricks.as_strided(
        xc, (sh, sw, w // sw, h // sh, c, b), (sy, sx, sw * sx, sh * sy, sc, sb))


def _plane_extent(size, phase, stride):
    """Return how many of ``size`` positions have index = phase mod stride."""
    return -(-(size - phase) // stride)


def phase_shape(shape, stride):
    """Return the shape of the phase planes of a logical (B, C, H, W) ``shape``."""
    (b, c, h, w), (sh, sw) = shape, stride
    return (sh, sw, -(-w // sw), -(-h // sh), c, b)


def split_phases(xp, x, stride, out=None):
    """Return logical (B, C, H, W) ``x`` as phase planes (sh, sw, ceil(W/sw), ceil(H/sh), C, B),
    in ``out`` when given (an array of that shape and x's dtype).

    Entries past an odd-sized plane's end are left unset (no tap reads them).
    """
    sh, sw = stride
    b, c, h, w = x.shape
    xc = x.transpose(1, 2, 3, 0)                                 # (C, H, W, B)
    planes = xp.empty(phase_shape(x.shape, stride), dtype=x.dtype) if out is None else out
    if h % sh == 0 and w % sw == 0:
        xp.copyto(planes, _phase_view(xp, xc, stride))           # one strided copy
    else:
        for a in range(sh):
            for e in range(sw):
                planes[a, e, :_plane_extent(w, e, sw), :_plane_extent(h, a, sh)] = \
                    xc[:, a::sh, e::sw].transpose(2, 1, 0, 3)
    return planes


def merge_phases(xp, planes, h, w):
    """Return phase planes as a C-contiguous (C, H, W, B) array (the inverse of split_phases)."""
    sh, sw, _, _, c, b = planes.shape
    xc = xp.empty((c, h, w, b), dtype=planes.dtype)
    if h % sh == 0 and w % sw == 0:
        xp.copyto(_phase_view(xp, xc, (sh, sw)), planes)         # one strided copy
    else:
        for a in range(sh):
            for e in range(sw):
                xc[:, a::sh, e::sw] = planes[a, e, :_plane_extent(w, e, sw),
                                             :_plane_extent(h, a, sh)].transpose(2, 1, 0, 3)
    return xc


def _to_rows(xp, t):
    """Return a column-major (W, H, C, B) array as a C-contiguous (C, H, W, B) copy."""
    out = xp.empty((t.shape[2], t.shape[1], t.shape[0], t.shape[3]), dtype=t.dtype)
    xp.copyto(out, t.transpose(2, 1, 0, 3))
    return out


def _to_columns(xp, x, out):
    """Copy logical (B, C, H, W) ``x`` into ``out``, a C-contiguous (W, H, C, B) array."""
    xp.copyto(out, x.transpose(3, 2, 1, 0))
    return out


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
        self._buffers = {}
        self._tap_plans = {}        # (H, W) -> _taps' result

    def __repr__(self):
        return window_repr(self)

    def _scratch(self, xp, role, shape, dtype):
        """Return this layer's work array for ``role``, reused while the shape repeats.

        Only for arrays that never leave the layer: a new array every call is memory the
        allocator may have handed back to the OS since the last step, and touching it again
        costs a page fault per 4 KiB (thousands per cifar10_quick step, each microseconds
        on a virtual machine).
        """
        entry = self._buffers.get(role)
        if entry is None or entry.shape != tuple(shape) or entry.dtype != dtype or \
                get_array_module(entry) is not xp:
            entry = self._buffers[role] = xp.empty(shape, dtype=dtype)
        return entry

    def output_shape(self, in_shape):
        c, h, w = in_shape
        return (c, *window_out_size(self, h, w, pool_output_size))

    def _taps(self, h, w):
        """Return (Ho, Wo, taps, covered): taps are (t, out, plane) for in-bounds taps in
        row-major order, ``out`` indexing a column-major (Wo, Ho, C, B) array and ``plane``
        the phase planes; ``covered`` says the first tap of every plane writes all of it.
        Made once per input size (the geometry is the layer's own)."""
        cached = self._tap_plans.get((h, w))
        if cached is None:
            cached = self._tap_plans[(h, w)] = self._make_taps(h, w)
        return cached

    def _make_taps(self, h, w):
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
                out = (slice(lj, hj), slice(lo, hi))
                plane = (a, e, slice(q // sw, q // sw + hj - lj),
                         slice(r // sh, r // sh + hi - lo))
                taps.append((i * kw + j, out, plane))
                first.setdefault((a, e), (plane[2], plane[3]))
        covered = all(first.get((a, e)) == (slice(0, _plane_extent(w, e, sw)),
                                            slice(0, _plane_extent(h, a, sh)))
                      for a in range(sh) for e in range(sw))
        return ho, wo, taps, covered

    def _scatter(self, xp, parts, taps, covered, shape, dtype):
        """Return dx (B, C, H, W) from per-tap gradient contributions ``parts(t, out)``."""
        h, w = shape[2:]
        planes = self._scratch(xp, "planes", phase_shape(shape, self.stride), dtype)
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
            y, argmax = _cuda_ops.maxpool_forward(xp, x, self.output_shape(x.shape[1:])[1:],
                                              self.kernel_size, self.stride, self.padding)
            self._cache = (x.shape, argmax, None, None) if train else None
            return y
        b, c, h, w = x.shape                                     # (B, C, H, W)
        ho, wo, taps, covered = self._taps(h, w)
        planes = split_phases(xp, x, self.stride, self._scratch(
            xp, "planes", phase_shape(x.shape, self.stride), x.dtype))
        y = self._scratch(xp, "y", (wo, ho, c, b), x.dtype)       # (Wo, Ho, C, B)
        argmax = None
        if train:
            argmax = self._scratch(xp, "argmax", y.shape, np.uint8)
            argmax.fill(0)
            win = self._scratch(xp, "win", y.shape, np.bool_)
            step = self._scratch(xp, "step", y.shape, np.uint8)
        t0, out0, plane0 = taps[0]
        if out0 == (slice(0, wo), slice(0, ho)):                 # tap 0 starts every window
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
        # kept as a (C, Ho, Wo, B) view: the tap index of each output, indexed as y is
        self._cache = (x.shape, argmax.transpose(2, 1, 0, 3), taps, covered) if train else None
        return _to_rows(xp, y).transpose(3, 0, 1, 2)             # (B, C, Ho, Wo)

    def backward(self, dy):
        # y = x[argmax]  =>  dx[argmax] += dy, zero elsewhere (overlapping windows add up).
        shape, argmax, taps, covered = self._cached()
        xp = get_array_module(dy)
        if xp is not np:                                         # one fused CUDA kernel
            return _cuda_ops.maxpool_backward(xp, dy, argmax, shape, self.kernel_size,
                                          self.stride, self.padding)
        argmax = argmax.transpose(2, 1, 0, 3)                    # (Wo, Ho, C, B) memory
        dyc = _to_columns(xp, dy, self._scratch(xp, "dy", argmax.shape, dy.dtype))
        hit = self._scratch(xp, "win", argmax.shape, np.bool_)
        part = self._scratch(xp, "part", argmax.shape, dy.dtype)

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
            return _cuda_ops.avgpool_forward(xp, x, inv, self.kernel_size, self.stride,
                                         self.padding)
        b, c, h, w = x.shape                                     # (B, C, H, W)
        ho, wo, taps, covered = self._taps(h, w)
        planes = split_phases(xp, x, self.stride, self._scratch(
            xp, "planes", phase_shape(x.shape, self.stride), x.dtype))
        y = self._scratch(xp, "y", (wo, ho, c, b), x.dtype)       # (Wo, Ho, C, B)
        t0, out0, plane0 = taps[0]
        if out0 == (slice(0, wo), slice(0, ho)):
            y[...] = planes[plane0]
            rest = taps[1:]
        else:
            y.fill(0)
            rest = taps
        for _, out, plane in rest:
            y[out] += planes[plane]
        inv = self._inv_count(xp, h, w, ho, wo, x.dtype)[:, :, 0].T[:, :, None, None]
        y *= inv                                                 # (Wo, Ho, 1, 1)
        self._cache = (x.shape, inv, taps, covered) if train else None
        return _to_rows(xp, y).transpose(3, 0, 1, 2)             # (B, C, Ho, Wo)

    def backward(self, dy):
        # y[o] = inv[o] * sum_{taps} x[o*s + k - p]  =>  dx[o*s + k - p] += inv[o] * dy[o].
        shape, inv, taps, covered = self._cached()
        xp = get_array_module(dy)
        if xp is not np:                                         # one fused CUDA kernel
            return _cuda_ops.avgpool_backward(xp, dy, inv, shape, self.kernel_size, self.stride,
                                          self.padding)
        b, c, ho, wo = dy.shape
        g = self._scratch(xp, "dy", (wo, ho, c, b), dy.dtype)     # (Wo, Ho, C, B)
        xp.multiply(dy.transpose(3, 2, 1, 0), inv, out=g)

        def parts(t, out, dst):
            if dst is None:
                return g[out]
            dst[...] = g[out]
            return dst

        return self._scatter(xp, parts, taps, covered, shape, dy.dtype)
