"""ReLU and Dropout."""
import numpy as np

from ringnet.backend import get_array_module
from ringnet.layers.base import Layer

__all__ = ["ReLU", "Dropout"]


class ReLU(Layer):
    """y = max(x, 0)."""

    def __init__(self):
        self._y = None

    def forward(self, x, train=True):
        xp = get_array_module(x)
        y = xp.maximum(x, 0)                                     # same shape and memory order
        self._y = y if train else None
        return y

    def backward(self, dy):
        # dy/dx = 1 where y > 0, else 0 (0 at x = 0, like Caffe and PyTorch).
        if self._y is None:
            raise RuntimeError("ReLU.backward called without a forward(train=True)")
        xp = get_array_module(dy)
        return xp.multiply(dy, self._y > 0)


class Dropout(Layer):
    """Inverted dropout: in training keep with probability 1 - p and scale by 1 / (1 - p).

    The mask stream is seeded (``seed``) and reproducible for a given array module;
    evaluation (``train=False``) is the identity. ``batch_part = (part, parts)`` says this
    forward sees part ``part`` of ``parts`` equal parts of a global batch (data-parallel
    ranks): the mask is drawn for the whole global batch and this part's rows are used,
    so every rank count applies the same mask to the same sample as one process would.
    """

    def __init__(self, p=0.5, seed=0):
        if not 0.0 <= float(p) < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p, self.seed = float(p), int(seed)
        self._rng, self._rng_xp, self._mask = None, None, None
        self.batch_part = (0, 1)

    def __repr__(self):
        return f"Dropout(p={self.p})"

    def rng_state(self):
        """Return the mask stream's state (JSON-able; None before the first draw or on a GPU)."""
        if self._rng is None or self._rng_xp is not np:
            return None
        return self._rng.bit_generator.state

    def set_rng_state(self, state):
        """Continue the mask stream from ``state`` (as returned by :meth:`rng_state`)."""
        self._rng, self._rng_xp = None, None
        if state is not None:
            self._rng, self._rng_xp = np.random.default_rng(self.seed), np
            self._rng.bit_generator.state = state

    def _uniform(self, xp, shape, dtype):
        if self._rng_xp is not xp:
            self._rng = (np.random.default_rng(self.seed) if xp is np
                         else xp.random.default_rng(self.seed))
            self._rng_xp = xp
        return self._rng.random(shape, dtype=dtype)

    def forward(self, x, train=True):
        if not train or self.p == 0.0:
            self._mask = None
            return x
        xp = get_array_module(x)
        part, parts = self.batch_part
        if parts == 1:
            keep = self._uniform(xp, x.shape, x.dtype) >= self.p
        else:  # (B, ...) rows of a (parts * B, ...) global mask
            b = x.shape[0]
            whole = self._uniform(xp, (parts * b,) + x.shape[1:], x.dtype)
            keep = whole[part * b:(part + 1) * b] >= self.p
        self._mask = keep.astype(x.dtype) * x.dtype.type(1.0 / (1.0 - self.p))
        return x * self._mask

    def backward(self, dy):
        # y = x * m  =>  dx = dy * m (identity when the forward was the identity).
        return dy if self._mask is None else dy * self._mask
