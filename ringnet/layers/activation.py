"""ReLU and Dropout."""
import math

import numpy as np

from ringnet.backend import get_array_module, is_gpu_array
from ringnet.layers import cuda_ops
from ringnet.layers.base import Layer, zeros_like_layout

__all__ = ["ReLU", "Dropout", "keep_mask", "hash_bits"]


class ReLU(Layer):
    """y = max(x, 0).

    ``pass_through(x)`` is the forward when a neighbouring pool applies this ReLU itself
    (``rectify=True``; the model fuses the pair on the CPU): x and then the gradient pass
    unchanged."""

    def __init__(self):
        self._y = None
        self._zeros = None
        self._passed = False
        self._dbias = None

    def pass_through(self, x, train=True):
        """Return ``x``, already rectified by the neighbouring pool; backward passes dy."""
        self._y, self._passed = None, train
        return x

    def forward(self, x, train=True, bias=None, dbias=None):
        """Return max(x, 0). On a GPU the model may hand this kernel the previous layer's
        per-channel ``bias`` (max(x + bias, 0)) and that layer's bias gradient ``dbias``,
        which ``backward`` then writes (the sum of dx over all but the channel axis)."""
        self._passed = False
        if is_gpu_array(x):                   # one kernel, in x's memory order
            y = cuda_ops.relu_forward(get_array_module(x), x, bias=bias)
            self._y = y if train else None
            self._dbias = dbias
            return y
        xp = get_array_module(x)
        if bias is not None or dbias is not None:
            self._gpu_only(xp, "bias / dbias")
        if xp is np:
            # Against an array of zeros laid out like x: NumPy's maximum with a scalar (or
            # any broadcast operand) runs 2-3x slower than with two arrays of one order.
            zeros = self._zeros
            if zeros is None or zeros.shape != x.shape or zeros.dtype != x.dtype or \
                    zeros.strides != x.strides:
                zeros = self._zeros = zeros_like_layout(np, x, x.shape)
            y = np.maximum(x, zeros)                             # same shape and memory order
        else:
            y = xp.maximum(x, 0)
        self._y = y if train else None
        return y

    def backward(self, dy):
        # dy/dx = 1 where y > 0, else 0 (0 at x = 0, like Caffe and PyTorch).
        if self._passed:                      # the neighbouring pool's backward masks
            return dy
        if self._y is None:
            raise RuntimeError("ReLU.backward called without a forward(train=True)")
        if is_gpu_array(dy):                  # one kernel, in y's memory order
            if self._dbias is not None:
                return cuda_ops.relu_backward_bias(get_array_module(dy), dy, self._y,
                                                   self._dbias)
            return cuda_ops.relu_backward(get_array_module(dy), dy, self._y)
        xp = get_array_module(dy)
        return xp.multiply(dy, self._y > 0)


class Dropout(Layer):
    """Inverted dropout: in training keep with probability 1 - p and scale by 1 / (1 - p).

    The mask is stateless: element ``j`` of sample ``i`` is kept when a 64-bit hash of
    (``seed``, ``step``, ``layer_index``, global sample index ``i``, ``j``) is at least
    ``p * 2**53`` in its top 53 bits (:func:`keep_mask`). The hash is plain unsigned
    64-bit integer arithmetic on ``xp`` arrays, so NumPy and CuPy give bit-identical
    masks, and a resumed run that sets the same ``step`` applies the same masks: there
    is no random-stream state to save. ``step`` is set to the global training step
    before each step by the training loop and advances by one after each training
    forward (so consecutive calls draw fresh masks when nothing sets it);
    ``layer_index`` is the layer's position in its model (set by the model).
    ``batch_part = (part, parts)`` says this forward sees part ``part`` of ``parts``
    equal parts of a global batch (data-parallel ranks): sample ``i`` of the part is
    global sample ``part * B + i``, so every rank count applies the same mask to the
    same sample as one process would. Evaluation (``train=False``) is the identity.
    """

    def __init__(self, p=0.5, seed=0):
        if not 0.0 <= float(p) < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p, self.seed = float(p), int(seed)
        self.step, self.layer_index = 0, 0
        self._mask = None
        self.batch_part = (0, 1)
        self._keys = None            # GPU: this step's stream keys, on the device
        self.keys_preset = False     # True: set_keys wrote them; forward leaves step alone

    def __repr__(self):
        return f"Dropout(p={self.p})"

    def set_keys(self, xp):
        """Write the stream keys of step ``self.step`` into the device array the GPU kernel
        reads them from (allocated on first use): outside a CUDA graph, so that its replay
        draws this step's masks."""
        if self._keys is None:
            self._keys = xp.zeros(2, dtype=np.uint64)
        keys = stream_keys((self.seed, self.step, self.layer_index))
        cuda_ops.upload(xp, self._keys, np.array(keys, dtype=np.uint64))

    def forward(self, x, train=True):
        if not train or self.p == 0.0:
            self._mask = None
            return x
        xp = get_array_module(x)
        part, parts = self.batch_part
        if is_gpu_array(x):                   # the same mask, from one fused CUDA kernel
            if not self.keys_preset:
                self.set_keys(xp)
                self.step += 1
            self._mask = cuda_ops.dropout_mask(
                xp, x.shape, x.dtype, self._keys, keep_threshold(self.p), 1.0 / (1.0 - self.p),
                first_sample=part * x.shape[0])
            return x * self._mask
        keep = keep_mask(xp, x.shape, self.p, (self.seed, self.step, self.layer_index),
                         first_sample=part * x.shape[0])
        self.step += 1
        self._mask = keep.astype(x.dtype) * x.dtype.type(1.0 / (1.0 - self.p))
        return x * self._mask

    def backward(self, dy):
        # y = x * m  =>  dx = dy * m (identity when the forward was the identity).
        return dy if self._mask is None else dy * self._mask


_U64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15            # 2**64 / golden ratio, odd (splitmix64's increment)
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB   # splitmix64's finalizer constants


def _mix_int(z):
    """splitmix64's finalizer on a Python int (host side: stream keys)."""
    z &= _U64
    z = ((z ^ (z >> 30)) * _MIX1) & _U64
    z = ((z ^ (z >> 27)) * _MIX2) & _U64
    return z ^ (z >> 31)


def stream_keys(key):
    """Return two 64-bit keys hashed from the integer tuple ``key`` (seed, step, layer...)."""
    z = 0
    for part in key:
        z = _mix_int(z + _GOLDEN + (int(part) & _U64))
    return z, _mix_int(z + _GOLDEN)


def _mix(xp, v, tmp):
    """splitmix64's finalizer in place on the uint64 array ``v`` (wrapping arithmetic)."""
    for shift, mult in ((30, _MIX1), (27, _MIX2)):
        xp.right_shift(v, xp.uint64(shift), out=tmp)
        xp.bitwise_xor(v, tmp, out=v)
        xp.multiply(v, xp.uint64(mult), out=v)
    xp.right_shift(v, xp.uint64(31), out=tmp)
    xp.bitwise_xor(v, tmp, out=v)


def hash_bits(xp, shape, key, first_sample=0):
    """Return uint64 hashes of every element of a (B, ...) array, batch first.

    Element ``j`` (C order within a sample) of sample ``i`` hashes its global index
    ``(first_sample + i) * per_sample + j`` with the stream ``key`` (an integer tuple):
    two rounds of splitmix64's finalizer, keyed before each. A pure function: the
    same arguments give the same bits on NumPy and CuPy, in any process.
    """
    k1, k2 = stream_keys(key)
    per_sample = 1
    for n in shape[1:]:
        per_sample *= int(n)
    v = xp.arange(int(first_sample) * per_sample,
                  (int(first_sample) + int(shape[0])) * per_sample, dtype=xp.uint64)
    tmp = xp.empty_like(v)
    xp.multiply(v, xp.uint64(_GOLDEN), out=v)
    xp.add(v, xp.uint64(k1), out=v)
    _mix(xp, v, tmp)
    xp.bitwise_xor(v, xp.uint64(k2), out=v)
    _mix(xp, v, tmp)
    return v.reshape(shape)


def keep_mask(xp, shape, p, key, first_sample=0):
    """Return the boolean keep mask: the top 53 bits of each hash >= ceil(p * 2**53).

    Each element is kept with probability 1 - ceil(p * 2**53) / 2**53 (1 - p to 1e-16).
    """
    bits = hash_bits(xp, shape, key, first_sample)
    xp.right_shift(bits, xp.uint64(11), out=bits)
    return bits >= xp.uint64(keep_threshold(p))


def keep_threshold(p):
    """Return ceil(p * 2**53): an element is kept when the top 53 bits of its hash reach it."""
    return math.ceil(p * 2.0 ** 53)
