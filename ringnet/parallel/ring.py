"""ring: the circle structure — every rank trains and updates one shard of the model.

Per step: ring reduce-scatter of the mean gradient (N-1 point-to-point steps), so rank
r holds the global mean of shard r; rank r applies ``upd`` to shard r only (its
momentum covers only that shard: optimizer memory is 1/N per rank); ring all-gather
of the updated shards (N-1 steps). With delay 1 this exchange runs on the
communication stream while the next step computes (see ``base``).
"""
import numpy as np

from ringnet.backend import to_numpy
from ringnet.parallel.base import DataParallelStrategy

__all__ = ["RingStrategy"]


class RingStrategy(DataParallelStrategy):
    """Reduce-scatter, update own shard, all-gather."""
    name = "ring"

    def __init__(self, model, make_optimizer, world, comm, delay=1):
        self.bounds = comm.shard_bounds(model.num_params)
        super().__init__(model, make_optimizer, world, comm=comm, delay=delay)

    def _owned_slice(self, size):
        lo, hi = self.bounds[self.comm.rank]
        return slice(lo, hi)

    def _reduce(self, grads):
        self.comm.reduce_scatter(grads, op="mean", bounds=self.bounds)

    def _distribute(self, params):
        self.comm.allgather(params, bounds=self.bounds)

    def _full_momentum(self):
        # every rank holds the momentum of its shard: all-gather them into one vector
        xp = self.xp
        full = xp.zeros(self.model.num_params, dtype=self.model.dtype)
        lo, hi = self.owned.start, self.owned.stop
        if hi > lo:
            full[lo:hi] = xp.asarray(self.optimizer.state_dict()["momentum"])
        self.comm.allgather(full, bounds=self.bounds)
        return np.asarray(to_numpy(full))
