"""SGD with momentum and weight decay (Caffe's update) and Caffe's learning-rate policies.

The delayed update's compensation and its stability bounds are in
:mod:`ringnet.parallel.delayed_update`.
"""
import math

import numpy as np

from ringnet.backend import get_array_module, resolve_dtype, to_numpy
from ringnet.layers.cuda_ops import upload

__all__ = ["LRPolicy", "SGD"]


class LRPolicy:
    """Learning rate at iteration ``it`` (Caffe's formulas).

    fixed: base_lr;  step: base_lr * gamma ** floor(it / stepsize);
    inv: base_lr * (1 + gamma * it) ** (-power).
    """

    KINDS = ("fixed", "step", "inv")

    def __init__(self, kind="fixed", base_lr=0.01, gamma=0.1, stepsize=None, power=0.75):
        if kind not in self.KINDS:
            raise ValueError(f"unknown lr policy {kind!r}: choose one of {', '.join(self.KINDS)}")
        if not (math.isfinite(base_lr) and base_lr > 0):
            raise ValueError(f"base_lr must be a positive number, got {base_lr}")
        if kind == "step" and (stepsize is None or int(stepsize) < 1):
            raise ValueError(f"lr policy 'step' needs stepsize >= 1, got {stepsize}")
        self.kind, self.base_lr, self.gamma = kind, float(base_lr), float(gamma)
        self.stepsize = None if stepsize is None else int(stepsize)
        self.power = float(power)

    def __call__(self, it):
        if self.kind == "fixed":
            return self.base_lr
        if self.kind == "step":
            return self.base_lr * self.gamma ** (int(it) // self.stepsize)
        return self.base_lr * (1.0 + self.gamma * it) ** (-self.power)

    def __repr__(self):
        return (f"LRPolicy({self.kind!r}, base_lr={self.base_lr}, gamma={self.gamma}, "
                f"stepsize={self.stepsize}, power={self.power})")


# On the CPU the update runs this many elements at a time (128 KiB of float32 per array):
# its six passes over w, g, v and a scratch block then stay in the core's L2 cache, where
# over LeNet's whole 431 K parameters each pass went to memory (0.64-0.67 -> 0.46-0.50 ms,
# after a cache-flushing read; the same arithmetic element by element).
CPU_BLOCK = 32768

_FUSED = {}


def _fused_kernel(xp):
    # One pass over w, g, v on the GPU instead of four element-wise launches; lr is a 0-d
    # device array (broadcast), so that a CUDA graph replaying the update reads each
    # step's value from memory.
    if "sgd" not in _FUSED:
        _FUSED["sgd"] = xp.ElementwiseKernel(
            "T g, T lr, T momentum, T decay", "T w, T v",
            "v = momentum * v + lr * (g + decay * w); w = w - v;",
            "ringnet_sgd_update")
    return _FUSED["sgd"]


class SGD:
    """SGD with momentum on a 1-D array of ``size`` (a whole flat buffer or one shard of it).

    Update at iteration ``it`` (Caffe's SGDSolver)::

        v <- momentum * v + lr(it) * (g + weight_decay * w)
        w <- w - v

    ``v`` (the momentum) is kept for these ``size`` entries only. ``lr_scale`` (default
    1) multiplies lr(it); the delayed update's compensation sets it (see
    ``ringnet.parallel.delayed_update.Lookahead``).
    """

    def __init__(self, size, lr_policy, momentum=0.9, weight_decay=0.0, xp=np, dtype=np.float32):
        if isinstance(lr_policy, (int, float)):
            lr_policy = LRPolicy("fixed", float(lr_policy))
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        self.size, self.lr_policy = int(size), lr_policy
        self.momentum, self.weight_decay = float(momentum), float(weight_decay)
        self.xp, self.dtype = xp, resolve_dtype(dtype)
        self.v = xp.zeros(self.size, dtype=self.dtype)
        self.lr_scale = 1.0
        self._scratch = None
        self._lr = None               # GPU: lr(it) * lr_scale on the device (set_lr)

    def step(self, w, g, it):
        """Update ``w`` in place from gradient ``g`` at iteration ``it``; return lr(it)."""
        if w.shape != (self.size,) or g.shape != (self.size,):
            raise ValueError(f"SGD of size {self.size} got w {w.shape} and g {g.shape}")
        if w.dtype != self.dtype or g.dtype != self.dtype:
            raise ValueError(f"SGD of dtype {self.dtype} got w {w.dtype} and g {g.dtype}")
        xp = get_array_module(w)
        if xp is not np:
            lr = self.set_lr(xp, it)
            self.apply(w, g)
            return lr
        lr = self.lr_policy(it) * self.lr_scale
        if self._scratch is None:
            self._scratch = np.empty(min(self.size, CPU_BLOCK), dtype=self.dtype)
        decay, momentum, rate = (self.dtype.type(v) for v in (self.weight_decay, self.momentum, lr))
        for lo in range(0, self.size, CPU_BLOCK):       # the six passes on one block in cache
            hi = min(lo + CPU_BLOCK, self.size)
            ws, gs, vs, t = w[lo:hi], g[lo:hi], self.v[lo:hi], self._scratch[:hi - lo]
            if self.weight_decay:
                np.multiply(ws, decay, out=t)
                t += gs                                          # g + wd * w
                t *= rate
            else:
                np.multiply(gs, rate, out=t)
            vs *= momentum
            vs += t
            ws -= vs
        return lr

    def set_lr(self, xp, it):
        """GPU: write lr(it) * lr_scale where :meth:`apply` reads it (allocated on first use;
        a copy on the stream, no host wait); return it."""
        lr = self.lr_policy(it) * self.lr_scale
        if self._lr is None:
            self._lr = xp.zeros((), dtype=self.dtype)
        upload(xp, self._lr, np.array(lr))
        return lr

    def apply(self, w, g):
        """GPU: the update with the learning rate :meth:`set_lr` wrote last (one fused kernel,
        which a CUDA graph can replay: no value of the step is an argument)."""
        _fused_kernel(get_array_module(w))(g, self._lr, self.momentum, self.weight_decay,
                                           w, self.v)

    def state_dict(self):
        """Return {"momentum": host copy of v}."""
        return {"momentum": to_numpy(self.v).copy()}

    def load_state_dict(self, state):
        """Restore the momentum from ``state_dict()`` output."""
        v = np.asarray(to_numpy(state["momentum"]))
        if v.shape != (self.size,):
            raise ValueError(f"momentum of shape {v.shape} does not fit SGD of size {self.size}")
        self.v[...] = self.xp.asarray(v.astype(self.dtype, copy=False))
