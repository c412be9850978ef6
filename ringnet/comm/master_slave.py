"""MasterSlaveCommunicator: workers send to the root, the root combines and answers each."""
from ringnet.comm.base import RootedCommunicator

__all__ = ["MasterSlaveCommunicator"]


class MasterSlaveCommunicator(RootedCommunicator):
    """Synchronous master-slave baseline: the root's link carries (N-1)x the buffer each way.

    The root posts the receives of all workers at once and adds each piece as it completes
    (in rank order); the answers to all workers are in flight together.
    """

    name = "master"

    def _workers(self, root):
        return [(root + i) % self.size for i in range(1, self.size)]

    def _reduce(self, buf, root, op):
        if self.rank != root:
            self._gather_sum(buf, [], root)
            return
        # Every worker's receive is posted at once; the sums run in rank order, so the
        # float result is the same on every run.
        self._gather_sum(buf, self._workers(root), None)
        if op == "mean":
            self._divide(buf)

    def _bcast(self, buf, root):
        if self.rank != root:
            self._relay(buf, root, [])
        else:
            self._relay(buf, None, self._workers(root))
