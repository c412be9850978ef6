"""What the tree and master modes share: gradients reduced to one root, which alone updates.

The two differ only in the communicator that carries the reduce and the broadcast (the
mode's ``communicator``: a binary tree, or point-to-point with the root).
"""
from ringnet.parallel.base import DataParallelStrategy
from ringnet.parallel.plans import RootedPlan

__all__ = ["RootedStrategy"]


class RootedStrategy(DataParallelStrategy):
    """Reduce (mean) to the root, whole update on the root, broadcast."""
    root = 0
    plan_type = RootedPlan

    def _plan(self, size):
        return RootedPlan(self.comm, size, root=self.root)
