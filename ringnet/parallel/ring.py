"""ring: the circle structure — every rank trains and updates one shard of the model.

Per step: ring reduce-scatter of the mean gradient (N-1 point-to-point steps), so rank
r holds the global mean of shard r; rank r applies ``upd`` to shard r only (its
momentum covers only that shard: optimizer memory is 1/N per rank); ring all-gather
of the updated shards (N-1 steps). With delay 1 this exchange runs on the
communication stream while the next step computes (see ``exchange``).
"""
from ringnet.parallel.base import DataParallelStrategy
from ringnet.parallel.plans import ShardedPlan

__all__ = ["RingStrategy"]


class RingStrategy(DataParallelStrategy):
    """Reduce-scatter, update own shard, all-gather."""
    name = "ring"
    plan_type = ShardedPlan

    def _plan(self, size):
        return ShardedPlan(self.comm, size, op="mean")
