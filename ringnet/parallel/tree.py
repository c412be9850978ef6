"""tree: gradients reduced over a binary tree to rank 0, which alone updates; weights broadcast down the tree."""
from ringnet.parallel.rooted import RootedStrategy

__all__ = ["TreeStrategy"]


class TreeStrategy(RootedStrategy):
    """Rooted exchange over the tree communicator (binary heap: children 2v+1, 2v+2)."""
    name = "tree"
