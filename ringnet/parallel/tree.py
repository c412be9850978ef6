"""tree: gradients reduced over a binary tree to rank 0, which alone updates; weights broadcast down the tree."""
from ringnet.parallel.base import DataParallelStrategy
from ringnet.parallel.plans import RootedPlan

__all__ = ["TreeStrategy"]


class TreeStrategy(DataParallelStrategy):
    """Reduce to the root, whole update on the root, broadcast (the communicator decides the route)."""
    name = "tree"
    root = 0

    def __init__(self, model, make_optimizer, world, comm, delay=0, lookahead=None,
                 bucket_size=None):
        super().__init__(model, make_optimizer, world, comm=comm, delay=delay, lookahead=lookahead,
                         bucket_size=bucket_size)

    def _plan(self, size):
        return RootedPlan(self.comm, size, root=self.root)
