"""MaxPool2d and AvgPool2d with Caffe's ceil-mode output size, as sums over kernel taps.

On the CPU the (C, H, W, B) input is pooled a chunk of channels at a time (about a
megabyte: the chunk's work stays in the core's L2 cache). A chunk is first split into
stride x stride *phase planes* (plane (a, e) holds the pixels whose row is a mod sh and
column e mod sw), so every kernel tap reads a plain rectangle of one plane, where a
stride-2 view of the input would give runs of only B elements; a tap's rectangle is then
one contiguous run of (columns x B) elements per row. The output is written straight into
its (C, Ho, Wo, B) array, and the input gradient is interleaved back from its planes into
the chunk's channels of dx.
"""
import numpy as np

from ringnet.backend import get_array_module
from ringnet.layers import cuda_ops
from ringnet.layers.base import Layer, batch_last, tap_ranges, window_geometry, window_out_size, window_repr

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


# On the CPU a pool runs a few channels at a time, about this many bytes of input each, so
# that a chunk's phase planes, output and masks stay in the core's L2 cache through the
# passes each kernel tap makes (about four per tap): over whole cifar10_quick arrays those
# passes run at memory speed, 2-3x slower.
CPU_CHUNK_BYTES = 1 << 20


def channel_chunks(c, h, w, b, itemsize, chunk_bytes=None):
    """Return [(c0, c1)]: ranges of channels of a (C, H, W, B) input, each about
    ``chunk_bytes`` (CPU_CHUNK_BYTES by default) of it and at least one channel."""
    per = max(1, (CPU_CHUNK_BYTES if chunk_bytes is None else chunk_bytes) // (h * w * b * itemsize))
    n = -(-c // min(c, per))                                     # chunks, then even sizes
    size = -(-c // n)
    return [(c0, min(c0 + size, c)) for c0 in range(0, c, size)]


def _phase_view(xp, xc, stride):
    """Return (C, H, W, B) ``xc`` as a (sh, sw, C, H/sh, W/sw, B) view (sizes divisible):
    entry (a, e, c, r, q, b) = xc[c, r*sh + a, q*sw + e, b]."""
    sh, sw = stride
    c, h, w, b = xc.shape
    sc, sy, sx, sb = xc.strides
    return xp.lib.stride_tricks.as_strided(
        xc, (sh, sw, c, h // sh, w // sw, b), (sy, sx, sc, sh * sy, sw * sx, sb))


def _plane_extent(size, phase, stride):
    """Return how many of ``size`` positions have index = phase mod stride."""
    return -(-(size - phase) // stride)


def phase_shape(shape, stride):
    """Return the shape of the phase planes of a (C, H, W, B) ``shape``."""
    (c, h, w, b), (sh, sw) = shape, stride
    return (sh, sw, c, -(-h // sh), -(-w // sw), b)


def split_phases(xp, xc, stride, out):
    """Copy (C, H, W, B) ``xc`` into its phase planes ``out`` (sh, sw, C, ceil(H/sh),
    ceil(W/sw), B): plane (a, e) holds the pixels whose row is a mod sh and column e mod sw.

    Entries past an odd-sized plane's end are left unset (no tap reads them).
    """
    sh, sw = stride
    _, h, w, _ = xc.shape
    if h % sh == 0 and w % sw == 0:
        xp.copyto(out, _phase_view(xp, xc, stride))              # one strided copy
    else:
        for a in range(sh):
            for e in range(sw):
                out[a, e, :, :_plane_extent(h, a, sh), :_plane_extent(w, e, sw)] = \
                    xc[:, a::sh, e::sw]
    return out


def merge_phases(xp, planes, out):
    """Copy phase planes into (C, H, W, B) ``out`` (the inverse of split_phases)."""
    sh, sw = planes.shape[:2]
    _, h, w, _ = out.shape
    if h % sh == 0 and w % sw == 0:
        xp.copyto(_phase_view(xp, out, (sh, sw)), planes)        # one strided copy
    else:
        for a in range(sh):
            for e in range(sw):
                out[:, a::sh, e::sw] = planes[a, e, :, :_plane_extent(h, a, sh),
                                              :_plane_extent(w, e, sw)]
    return out


# Below this output width a tap's runs are short anyway and saving and restoring the
# columns outside it costs more than the long run saves (cifar10_quick's 8x8 -> 4x4 pool:
# 0.37 ms a step against 0.34 without; its 32 -> 16 max pool: 5.5 ms against 6.6).
FLAT_MIN_WIDTH = 8


class _Region:
    """Where one kernel tap reads and writes in a chunk: ``region(a)`` is the view of the
    (n, rows, columns, B) array ``a`` (output-shaped, or one phase plane) that the tap
    covers, ``key`` its rows and columns there.

    A tap that covers only some of the columns is a rectangle of short runs (columns x B
    elements per row), which NumPy's loops take 2-4x slower than one long run. Where the
    output and the plane have the same width (``flat``), such a tap runs instead over the
    one range per channel from its first element to its last; the elements in between
    that lie outside its columns are saved before (:meth:`keep`) and put back after
    (:meth:`restore`) in every array it writes."""

    def __init__(self, key, width, flat):
        self.key, self.width = key, width
        rows, cols = key[1], key[2]
        self.flat = flat and cols != slice(0, width) and rows.stop - rows.start > 1
        self.outside = [(slice(None), rows, part) for part in
                        (slice(0, cols.start), slice(cols.stop, width)) if part.stop > part.start]

    def __call__(self, a):
        if self.flat and a.flags.c_contiguous:
            rows, cols, b = self.key[1], self.key[2], a.shape[-1]
            start = (rows.start * self.width + cols.start) * b
            stop = ((rows.stop - 1) * self.width + cols.stop) * b
            return a.reshape(a.shape[0], -1)[:, start:stop]
        return a[self.key]

    def keep(self, arrays):
        """Copies of what a flat run overwrites outside the tap, in each of ``arrays``."""
        if not self.flat:
            return ()
        return [(a, part, a[part].copy()) for a in arrays for part in self.outside]

    @staticmethod
    def restore(kept):
        for a, part, value in kept:
            a[part] = value


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
        row-major order, ``out`` indexing the rows and columns of a (C, Ho, Wo, B) chunk and
        ``plane`` the phase planes (a, e, rows, columns); ``covered`` says the first tap of
        every plane writes all of it. Made once per input size (the geometry is the
        layer's own)."""
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
                out = (slice(None), slice(lo, hi), slice(lj, hj))
                plane = (a, e, slice(None), slice(r // sh, r // sh + hi - lo),
                         slice(q // sw, q // sw + hj - lj))
                width = _plane_extent(w, e, sw)
                flat = width == wo >= FLAT_MIN_WIDTH
                taps.append((i * kw + j, _Region(out, wo, flat),
                             (a, e, _Region(plane[2:], width, flat))))
                first.setdefault((a, e), (plane[3], plane[4]))
        covered = all(first.get((a, e)) == (slice(0, _plane_extent(h, a, sh)),
                                            slice(0, _plane_extent(w, e, sw)))
                      for a in range(sh) for e in range(sw))
        return ho, wo, taps, covered

    def _chunks(self, shape, dtype):
        """Return the channel chunks of a logical (B, C, H, W) ``shape``."""
        b, c, h, w = shape
        return channel_chunks(c, h, w, b, np.dtype(dtype).itemsize)

    def _forward_cpu(self, x, first, tap, start=None, rectify_input=False, finish=None,
                     written=lambda c0, c1: []):
        """Return (y, taps, covered) for (B, C, H, W) ``x``: y is a new (C, Ho, Wo, B)
        array; per channel chunk, ``first(c0, c1)`` starts its output, ``tap(c0, c1, t,
        out, dst, src)`` adds one tap (``out`` its :class:`_Region` of output-shaped
        arrays, ``dst`` and ``src`` its output and input) and ``finish(c0, c1, yc)``, when
        given, follows the last. ``written(c0, c1)``: the output-shaped arrays besides y
        that ``tap`` writes. ``start``: the value every window starts from instead of its
        first tap; ``rectify_input``: pool max(x, 0)."""
        b, c, h, w = x.shape
        ho, wo, taps, covered = self._taps(h, w)
        xc = batch_last(np, x)                                   # (C, H, W, B)
        y = np.empty((c, ho, wo, b), dtype=x.dtype)
        t0, out0, plane0 = taps[0]
        # tap 0 starts every window
        whole = start is None and out0.key[1:] == (slice(0, ho), slice(0, wo))
        for c0, c1 in self._chunks(x.shape, x.dtype):
            planes = split_phases(np, xc[c0:c1], self.stride, self._scratch(
                np, "planes", phase_shape((c1 - c0, h, w, b), self.stride), x.dtype))
            if rectify_input:                                    # in cache: the chunk's planes
                np.maximum(planes, 0, out=planes)
            yc = y[c0:c1]
            first(c0, c1)
            if whole:
                yc[...] = plane0[2](planes[plane0[0], plane0[1]])
                rest = taps[1:]
            else:
                yc.fill(self._empty if start is None else start)
                rest = taps
            for t, out, (a, e, region) in rest:
                kept = out.keep([yc] + written(c0, c1))
                tap(c0, c1, t, out, out(yc), region(planes[a, e]))
                out.restore(kept)
            if finish is not None:
                finish(c0, c1, yc)
        return y, taps, covered

    def _backward_cpu(self, shape, dtype, taps, covered, parts, mask_by=None):
        """Return dx (B, C, H, W) from per-tap gradient contributions ``parts(c0, c1, t,
        out, dst)``: a chunk's contribution of tap t, written to ``dst`` when given (the
        plane's first tap), else returned to be added. ``mask_by``: the (C, H, W, B)
        input of a pool of max(x, 0); dx is then zero where it is not positive."""
        b, c, h, w = shape
        dx = np.empty((c, h, w, b), dtype=dtype)                 # (C, H, W, B)
        for c0, c1 in self._chunks(shape, dtype):
            planes = self._scratch(np, "planes", phase_shape((c1 - c0, h, w, b), self.stride),
                                   dtype)
            if not covered:
                planes.fill(0)
            seen = set()
            for t, out, (a, e, region) in taps:
                plane = planes[a, e]
                if covered and (a, e) not in seen:               # the plane's first tap writes
                    seen.add((a, e))
                    parts(c0, c1, t, out, region(plane))
                else:
                    kept = region.keep([plane])
                    into = region(plane)
                    np.add(into, parts(c0, c1, t, out, None), out=into)
                    region.restore(kept)
            merge_phases(np, planes, dx[c0:c1])
            if mask_by is not None:                              # dx chunk still in cache
                positive = self._scratch(np, "positive", (c1 - c0, h, w, b), np.bool_)
                np.greater(mask_by[c0:c1], 0, out=positive)
                dx[c0:c1] *= positive
        return dx.transpose(3, 0, 1, 2)


class MaxPool2d(_Pool2d):
    """Max pooling; padding never wins; ties go to the first tap in row-major order (Caffe).

    ``forward(x, train, rectify=True)`` (the CPU path) returns max(pool(x), 0), which is
    also pool(max(x, 0)) with the same gradient: every window starts from 0 and a tap
    wins only above it, so a window with no positive tap passes no gradient. The model
    asks for it where a ReLU is next to the pool, and skips the ReLU."""

    _empty = -np.inf

    def forward(self, x, train=True, rectify=False, bias=None):
        """Return the pooled ``x`` (the CPU path: max(pool(x), 0) with ``rectify``). On a
        GPU the model may hand this kernel the previous layer's per-channel ``bias``: it
        pools x + bias, bit for bit what adding it first would give."""
        xp = get_array_module(x)
        if xp is not np:                                         # one fused CUDA kernel
            y, argmax = cuda_ops.maxpool_forward(xp, x, self.output_shape(x.shape[1:])[1:],
                                              self.kernel_size, self.stride, self.padding,
                                              bias=bias)
            self._cache = (x.shape, argmax, None, None) if train else None
            return y
        if bias is not None:
            self._gpu_only(xp, "bias")
        b, c, h, w = x.shape
        _, ho, wo = self.output_shape((c, h, w))
        # the tap index of each output, (C, Ho, Wo, B) as y
        argmax = self._scratch(np, "argmax", (c, ho, wo, b), np.uint8) if train else None
        n = max(c1 - c0 for c0, c1 in self._chunks(x.shape, x.dtype))
        win = self._scratch(np, "win", (n, ho, wo, b), np.bool_)
        step = self._scratch(np, "step", (n, ho, wo, b), np.uint8)

        def first(c0, c1):
            if train:
                argmax[c0:c1].fill(0)

        def tap(c0, c1, t, out, dst, src):
            if train:
                # Strictly greater, so ties keep the earlier tap; taps come in increasing
                # t, so argmax <- max(argmax, win * t) sets t exactly where this tap wins
                # (branch-free: a masked copy runs at the speed of the mask's pattern).
                won, at, best = out(win[:c1 - c0]), out(step[:c1 - c0]), out(argmax[c0:c1])
                np.greater(src, dst, out=won)
                np.multiply(won.view(np.uint8), np.uint8(t), out=at)
                np.maximum(best, at, out=best)
            np.maximum(dst, src, out=dst)

        def finish(c0, c1, yc):
            # Windows with no positive tap (still 0) pass no gradient: tap 255, which no
            # tap has (kernels have at most 255 taps, numbered from 0).
            nothing, at, best = win[:c1 - c0], step[:c1 - c0], argmax[c0:c1]
            np.less_equal(yc, 0, out=nothing)
            np.multiply(nothing.view(np.uint8), np.uint8(255), out=at)
            np.maximum(best, at, out=best)

        y, taps, covered = self._forward_cpu(x, first, tap, 0 if rectify else None,
                                             finish=finish if rectify and train else None,
                                             written=lambda c0, c1: [argmax[c0:c1]] if train else [])
        self._cache = (x.shape, argmax, taps, covered) if train else None
        return y.transpose(3, 0, 1, 2)                           # (B, C, Ho, Wo)

    def backward(self, dy):
        # y = x[argmax]  =>  dx[argmax] += dy, zero elsewhere (overlapping windows add up).
        shape, argmax, taps, covered = self._cached()
        xp = get_array_module(dy)
        if xp is not np:                                         # one fused CUDA kernel
            return cuda_ops.maxpool_backward(xp, dy, argmax, shape, self.kernel_size,
                                          self.stride, self.padding)
        dyc = batch_last(np, dy)                                 # (C, Ho, Wo, B)
        n = max(c1 - c0 for c0, c1 in self._chunks(shape, dy.dtype))
        hit = self._scratch(np, "win", (n,) + argmax.shape[1:], np.bool_)
        part = self._scratch(np, "part", (n,) + argmax.shape[1:], dy.dtype)

        def parts(c0, c1, t, out, dst):
            here = out(hit[:c1 - c0])
            np.equal(out(argmax[c0:c1]), np.uint8(t), out=here)
            return np.multiply(out(dyc[c0:c1]), here,
                               out=out(part[:c1 - c0]) if dst is None else dst)

        return self._backward_cpu(shape, dy.dtype, taps, covered, parts)


class AvgPool2d(_Pool2d):
    """Average pooling; divisor counts padding but not the ceil-mode overhang (Caffe AVE).

    ``forward(x, train, rectify=True)`` (the CPU path) pools max(x, 0), rectifying each
    chunk of channels while it is in cache, and its backward zeroes dx where x is not
    positive: a ReLU before the pool, which the model then skips."""

    _empty = 0

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

    def forward(self, x, train=True, rectify=False):
        xp = get_array_module(x)
        if xp is not np:                                         # one fused CUDA kernel
            inv = self._gpu_inv(xp, x.shape[2], x.shape[3], x.dtype)
            self._cache = (x.shape, inv, None, None, None) if train else None
            return cuda_ops.avgpool_forward(xp, x, inv, self.kernel_size, self.stride,
                                         self.padding)
        b, c, h, w = x.shape
        _, ho, wo = self.output_shape((c, h, w))
        inv = self._inv_count(np, h, w, ho, wo, x.dtype)         # (Ho, Wo, 1)

        def tap(c0, c1, t, out, dst, src):
            dst += src

        y, taps, covered = self._forward_cpu(x, lambda c0, c1: None, tap,
                                             rectify_input=rectify)
        y *= inv
        mask_by = batch_last(np, x) if rectify else None         # a view: x is batch-last
        self._cache = (x.shape, inv, taps, covered, mask_by) if train else None
        return y.transpose(3, 0, 1, 2)                           # (B, C, Ho, Wo)

    def backward(self, dy):
        # y[o] = inv[o] * sum_{taps} x[o*s + k - p]  =>  dx[o*s + k - p] += inv[o] * dy[o].
        shape, inv, taps, covered, mask_by = self._cached()
        xp = get_array_module(dy)
        if xp is not np:                                         # one fused CUDA kernel
            return cuda_ops.avgpool_backward(xp, dy, inv, shape, self.kernel_size, self.stride,
                                          self.padding)
        g = batch_last(np, dy) * inv                             # (C, Ho, Wo, B)

        def parts(c0, c1, t, out, dst):
            if dst is None:
                return out(g[c0:c1])
            dst[...] = out(g[c0:c1])
            return dst

        return self._backward_cpu(shape, dy.dtype, taps, covered, parts, mask_by)
