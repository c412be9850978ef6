"""master: synchronous master-slave — workers send gradients to rank 0, which updates and answers each."""
from ringnet.parallel.rooted import RootedStrategy

__all__ = ["MasterStrategy"]


class MasterStrategy(RootedStrategy):
    """Rooted exchange over the master-slave communicator: point-to-point with the root.

    The master computes a share of the batch too; its cost grows linearly with N
    because it receives N-1 gradients and sends N-1 weight vectors itself.
    """
    name = "master"
