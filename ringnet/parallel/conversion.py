"""split-fc's data conversion layer: a differentiable all-gather over the sample bounds.

Forward: every rank's (b, F) conv features, each sample's label appended as one more
number (exact: class counts are far below 2**24), are all-gathered into one
sample-major (B, F + 1) block in rank order, so every rank sees the global batch.
Backward: each rank's FC slices write a *partial* (B, F) feature gradient (their
rows' share of ``W^T dz``); a reduce-scatter (sum) over the sample bounds gives every
rank the complete gradient of its own b samples. This is the pair ChainerMN calls a
differentiable ``AllGather``: the adjoint of an all-gather is a reduce-scatter.
"""
from typing import Callable, Optional

from ringnet.backend import get_array_module

__all__ = ["ActivationCollectives", "DataConversion", "sample_bounds"]


def sample_bounds(size: int, local: int, row: int):
    """The ranks' (start, stop) of a sample-major buffer of ``size`` ranks' ``local`` rows of
    ``row`` numbers each, in rank order: the conversion layer's collectives run over these."""
    return [(r * local * row, (r + 1) * local * row) for r in range(size)]


class ActivationCollectives:
    """The collectives of split-fc's training thread, each timed into ``stats``.

    ``allgather`` blocks (all of it is exposed communication). ``reduce_scatter`` sums
    and runs ``during()`` on this thread meanwhile: with a ``stream`` the reduce-scatter
    runs there (overlap), without one it runs first and ``during()`` after it.
    """

    def __init__(self, comm, stats, stream=None):
        self.comm, self.stats, self.stream = comm, stats, stream

    def allgather(self, buf, bounds):
        """All-gather the ranks' ``bounds`` parts of the flat ``buf`` in place."""
        with self.stats.span("exposed_comm", op="allgather", bytes=buf.nbytes):
            self.comm.allgather(buf, bounds=bounds)

    def _reduce_scatter(self, buf, bounds, kind):
        with self.stats.span(kind, op="reduce_scatter", bytes=buf.nbytes):
            self.comm.reduce_scatter(buf, op="sum", bounds=bounds)

    def reduce_scatter(self, buf, bounds, during: Optional[Callable[[], None]] = None):
        """Sum the ranks' ``buf`` into each rank's ``bounds`` part; run ``during()`` meanwhile."""
        if self.stream is None:
            self._reduce_scatter(buf, bounds, "exposed_comm")
            if during is not None:
                during()
            return
        handle = self.stream.submit(self._reduce_scatter, buf, bounds, "comm")
        if during is not None:
            during()
        with self.stats.span("wait", op="reduce_scatter"):
            handle.wait()


class DataConversion:
    """All-gather of (features, labels) forward, reduce-scatter of the feature gradient backward.

    ``collectives``: an :class:`ActivationCollectives`; ``rank``, ``size``: this rank
    and the rank count; ``features``: F, the length of one sample's flattened features.
    """

    def __init__(self, collectives, rank: int, size: int, features: int):
        self.collectives, self.rank, self.size, self.features = collectives, rank, size, features
        self._local = None

    def _prepare(self, like, local):
        if local == self._local and like.dtype == self._gathered.dtype:
            return
        xp, row, f = get_array_module(like), self.features + 1, self.features
        batch = local * self.size
        self._gathered = xp.empty(batch * row, dtype=like.dtype)        # (B, F + 1)
        self._bounds = sample_bounds(self.size, local, row)
        self._grad = xp.empty(batch * f, dtype=like.dtype)              # (B, F)
        self._grad_bounds = sample_bounds(self.size, local, f)
        self._local = local

    def forward(self, h, labels):
        """Return the global batch: features (F, B) (a view) and labels (B,) int64.

        ``h``: this rank's (b, ...) conv output; ``labels``: its b labels.
        """
        xp, local = get_array_module(h), h.shape[0]
        self._prepare(h, local)
        self._shape = h.shape
        lo, hi = self._bounds[self.rank]
        mine = self._gathered[lo:hi].reshape(local, self.features + 1)
        mine[:, :self.features] = h.reshape(local, self.features)
        mine[:, self.features] = xp.asarray(labels).reshape(-1)
        # No host wait: NCCL runs behind these kernels on the same stream, MPI waits itself.
        self.collectives.allgather(self._gathered, self._bounds)
        rows = self._gathered.reshape(local * self.size, self.features + 1)
        return rows[:, :self.features].T, rows[:, self.features].astype(xp.int64)

    def grad_buffer(self):
        """Return the (B, F) array this rank's FC slices write their partial feature gradient into."""
        return self._grad.reshape(self._local * self.size, self.features)

    def backward(self, during: Optional[Callable[[], None]] = None):
        """Reduce-scatter the partial gradients (running ``during()`` meanwhile); return
        the gradient of this rank's samples, shaped like the ``h`` given to ``forward``."""
        self.collectives.reduce_scatter(self._grad, self._grad_bounds, during)
        lo, hi = self._grad_bounds[self.rank]
        return self._grad[lo:hi].reshape(self._shape)
