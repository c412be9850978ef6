"""Layer base class, parameter init schemes and memory-layout helpers."""
import math

import numpy as np

__all__ = ["Layer", "init_array", "check_init", "empty_like_layout", "zeros_like_layout", "memory_order",
           "as_channel_rows", "batch_last", "copy_samples", "tap_ranges", "tap_slice", "as_pair", "window_geometry", "window_out_size", "window_repr"]


class Layer:
    """A forward/backward pair; parameterised layers own views into the model's flat buffers.

    ``forward(x, train=True)`` caches what ``backward`` needs; ``backward(dy)`` returns
    ``dx`` and *overwrites* the layer's gradient views. ``needs_dx = False`` (set by the
    model on its first layer) lets ``backward`` skip the input gradient and return None.
    """

    needs_dx = True

    def param_specs(self, in_shape: tuple) -> list:
        """Return [(suffix, shape, init spec)] of the parameters for a per-sample input shape
        (e.g. ``[("weight", (out, in), ("he",)), ("bias", (out,), ("constant", 0.0))]``)."""
        return []

    def bind(self, params: dict, grads: dict) -> None:
        """Point the layer at parameter and gradient views (dicts suffix -> array)."""
        self.params, self.grads = params, grads

    def output_shape(self, in_shape: tuple) -> tuple:
        """Return the per-sample output shape for a per-sample input shape (raise ValueError
        when the input does not fit the layer)."""
        return tuple(in_shape)

    def forward(self, x, train: bool = True):
        """Return the output for the batch ``x`` (batch first); with ``train``, keep what
        ``backward`` needs."""
        raise NotImplementedError

    def backward(self, dy):
        """Return dx for the output gradient ``dy`` (None when ``needs_dx`` is False);
        overwrite this layer's gradient views. Needs a ``forward(train=True)`` first."""
        raise NotImplementedError

    def __repr__(self):
        return f"{type(self).__name__}()"

    def _gpu_only(self, xp, what):
        """Raise ValueError when ``what`` (a bias handed to or taken from a neighbouring
        layer's kernel, which the model arranges on a GPU only) is asked of a NumPy call."""
        if xp is np:
            raise ValueError(f"{self!r}: {what} is for the GPU path (fused CUDA kernels)")

    def _cached(self):
        """Return what the last ``forward(train=True)`` kept for ``backward``."""
        cache = getattr(self, "_cache", None)
        if cache is None:
            raise RuntimeError(f"{type(self).__name__}.backward called without a forward(train=True)")
        return cache


# --- initialisation: always drawn on the host with a seeded Generator, then copied to xp

def check_init(spec):
    """Validate an init spec: ("xavier",), ("he",)/("msra",), ("gaussian", std), ("constant", value)."""
    if isinstance(spec, str):
        spec = (spec,)
    spec = tuple(spec)
    kind = spec[0] if spec else None
    if kind in ("xavier", "he", "msra") and len(spec) == 1:
        return spec
    if kind == "gaussian" and len(spec) == 2 and float(spec[1]) > 0:
        return spec
    if kind == "constant" and len(spec) == 2:
        return spec
    raise ValueError(f"bad init spec {spec!r}: use ('xavier',), ('he',), ('gaussian', std) "
                     "or ('constant', value)")


def init_array(spec, shape, rng, dtype=np.float32):
    """Draw a host array for ``shape`` from ``spec`` (fan_in = prod(shape[1:])).

    xavier follows Caffe's XavierFiller (variance_norm FAN_IN): U(-a, a), a = sqrt(3 / fan_in).
    he/msra follows Caffe's MSRAFiller: N(0, 2 / fan_in). Values are drawn in float64 and
    cast, so float32 and float64 models start from the same numbers.
    """
    spec = check_init(spec)
    kind = spec[0]
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else int(shape[0])
    if kind == "xavier":
        a = math.sqrt(3.0 / fan_in)
        values = rng.uniform(-a, a, size=shape)
    elif kind in ("he", "msra"):
        values = rng.normal(0.0, math.sqrt(2.0 / fan_in), size=shape)
    elif kind == "gaussian":
        values = rng.normal(0.0, float(spec[1]), size=shape)
    else:
        values = np.full(shape, float(spec[1]))
    return values.astype(dtype)


# --- layout: layers take and return logical (B, C, H, W) arrays, but conv outputs live in
# (C, H, W, B) memory: the GEMM produces that order without a transposing copy, and with
# the batch innermost every kernel-tap slice of it is a run of whole (W, B) rows, so the
# im2col/col2im and pooling loops move long contiguous blocks. Element-wise and pooling
# layers keep whatever memory order they are given.

def as_pair(v, name):
    """Return ``v`` as an (int, int) pair: an int is used twice (kernel size, stride, padding)."""
    if isinstance(v, int):
        v = (v, v)
    v = tuple(int(a) for a in v)
    if len(v) != 2:
        raise ValueError(f"{name} must be an int or a pair, got {v!r}")
    return v


def window_geometry(kind, kernel_size, stride, padding):
    """Return (kernel, stride, padding) pairs of a sliding window, checked (``kind`` names it)."""
    kernel, stride, padding = (as_pair(kernel_size, "kernel_size"), as_pair(stride, "stride"),
                               as_pair(padding, "padding"))
    if min(kernel) < 1 or min(stride) < 1 or min(padding) < 0:
        raise ValueError(f"bad {kind} geometry: kernel {kernel}, stride {stride}, padding {padding}")
    return kernel, stride, padding


def window_out_size(layer, h, w, size):
    """Return (Ho, Wo) of a window layer (``kernel_size``, ``stride``, ``padding`` pairs) on an
    (h, w) input; ``size(n, kernel, stride, pad)`` is the layer's rounding rule."""
    (kh, kw), (sh, sw), (ph, pw) = layer.kernel_size, layer.stride, layer.padding
    return size(h, kh, sh, ph), size(w, kw, sw, pw)


def window_repr(layer, *leading):
    """Return ``Name(leading..., kernel, stride=..., padding=...)`` for a window layer."""
    args = [str(a) for a in leading] + [str(layer.kernel_size), f"stride={layer.stride}",
                                        f"padding={layer.padding}"]
    return f"{type(layer).__name__}({', '.join(args)})"


def memory_order(x):
    """Return the axes of ``x`` from outermost to innermost in memory."""
    return sorted(range(x.ndim), key=lambda a: (-abs(x.strides[a]), -a))


def empty_like_layout(xp, x, shape, dtype=None):
    """Return an empty array of logical ``shape`` whose memory order is ``x``'s."""
    order = memory_order(x)
    inverse = tuple(order.index(a) for a in range(x.ndim))
    buf = xp.empty([shape[a] for a in order], dtype=x.dtype if dtype is None else dtype)
    return buf.transpose(inverse)


def zeros_like_layout(xp, x, shape, dtype=None):
    """Return a zero array of logical ``shape`` whose memory order is ``x``'s."""
    out = empty_like_layout(xp, x, shape, dtype)
    out.fill(0)
    return out


# Samples per copy when copying between batch-first and batch-last memory on the CPU.
TRANSPOSE_SAMPLES = 8
_PAGE, _WAYS = 4096, 8           # sets of a 4 KiB span, associativity: an L1 data cache's


def copy_samples(xp, dst, src):
    """Copy logical (B, ...) ``src`` into ``dst`` (same logical shape, any memory orders).

    A copy between batch-first and batch-last memory reads (or writes) one element per
    sample per innermost run. When samples lie a multiple of a large power of two bytes
    apart (cifar10_quick: 12 KiB images, 4 KiB flatten rows), those elements all fall in
    the same few cache sets and evict each other: there, on NumPy, the copy goes a few
    samples at a time (4-5x faster, measured; with other sample sizes one copy is faster).
    The copied values are the same either way.
    """
    b = src.shape[0]
    if xp is np and b > TRANSPOSE_SAMPLES:
        first = [abs(a.strides[0]) for a in (src, dst) if abs(a.strides[0]) != a.itemsize]
        if len(first) == 1 and b * math.gcd(first[0], _PAGE) > _WAYS * _PAGE:
            for i in range(0, b, TRANSPOSE_SAMPLES):
                dst[i:i + TRANSPOSE_SAMPLES] = src[i:i + TRANSPOSE_SAMPLES]
            return dst
    dst[...] = src
    return dst


def batch_last(xp, x):
    """Return logical (B, C, H, W) ``x`` as a C-contiguous (C, H, W, B) array (a view if it is one)."""
    if xp is np and not x.transpose(1, 2, 3, 0).flags.c_contiguous:
        b, c, h, w = x.shape
        out = np.empty((c, h, w, b), dtype=x.dtype)
        copy_samples(np, out.transpose(3, 0, 1, 2), x)
        return out
    return xp.ascontiguousarray(x.transpose(1, 2, 3, 0))


def as_channel_rows(xp, x):
    """Return logical (B, C, H, W) as a (C, H*W*B) matrix (a view for batch-last memory)."""
    b, c, h, w = x.shape
    return batch_last(xp, x).reshape(c, h * w * b)


def tap_ranges(size_in, size_out, kernel, stride, pad):
    """Return per kernel tap k: (lo, hi, start) or None.

    Output positions o in [lo, hi) read input position start + (o - lo) * stride for
    tap k (o * stride + k - pad inside [0, size_in)); positions outside read padding.
    """
    ranges = []
    for k in range(kernel):
        lo = max(0, -((k - pad) // stride))        # ceil((pad - k) / stride)
        last = size_in - 1 - k + pad
        hi = min(size_out, last // stride + 1) if last >= 0 else 0
        ranges.append((lo, hi, lo * stride + k - pad) if hi > lo else None)
    return ranges


def tap_slice(rng, stride):
    """Return (output slice, input slice) for a (lo, hi, start) tap range."""
    lo, hi, start = rng
    return slice(lo, hi), slice(start, start + (hi - lo - 1) * stride + 1, stride)
