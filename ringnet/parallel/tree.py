"""tree: gradients reduced over a binary tree to rank 0, which alone updates; weights broadcast down the tree."""
from ringnet.parallel.base import DataParallelStrategy

__all__ = ["TreeStrategy"]


class TreeStrategy(DataParallelStrategy):
    """Tree reduce to the root, whole update on the root, tree broadcast."""
    name = "tree"
    root = 0

    def __init__(self, model, make_optimizer, world, comm, delay=0):
        super().__init__(model, make_optimizer, world, comm=comm, delay=delay)

    def _owned_slice(self, size):
        return slice(0, size) if self.comm.rank == self.root else slice(0, 0)

    def _reduce(self, grads):
        self.comm.reduce(grads, root=self.root, op="mean")

    def _distribute(self, params):
        self.comm.bcast(params, root=self.root)

    def _full_momentum(self):
        if self.comm.rank != self.root:
            return None
        return super()._full_momentum()
