"""MasterSlaveCommunicator: workers send to the root, the root combines and answers each."""
from ringnet.comm.base import CommunicatorBase

__all__ = ["MasterSlaveCommunicator"]


class MasterSlaveCommunicator(CommunicatorBase):
    """Synchronous master-slave baseline: the root's link carries (N-1)x the buffer each way."""

    name = "master"

    def _workers(self, root):
        return [(root + i) % self.size for i in range(1, self.size)]

    def reduce(self, buf, root=0, op="sum", stream=None):
        """Sum every rank's ``buf`` on ``root`` (workers' ``buf`` is left as it was)."""
        self._check(buf, op, root)
        return self._launch(self._reduce, (buf, root, op), stream)

    def bcast(self, buf, root=0, stream=None):
        """Send ``root``'s ``buf`` to each worker point-to-point."""
        self._check(buf, root=root)
        return self._launch(self._bcast, (buf, root), stream)

    def allreduce(self, buf, op="sum", stream=None):
        """Reduce on rank 0, then rank 0 answers every worker."""
        self._check(buf, op)
        return self._launch(self._allreduce, (buf, op), stream)

    def _reduce(self, buf, root, op):
        if self.rank != root:
            self.transport.isendrecv(buf, root, None, None).wait()
            return
        if self.size > 1:
            scratch = self._scratch_for(buf, buf.size)
            # In rank order, so the sum is the same float result on every run.
            for worker in self._workers(root):
                self.transport.isendrecv(None, None, scratch, worker).wait()
                self._add_from(buf, scratch)
        if op == "mean":
            self._divide(buf)

    def _bcast(self, buf, root):
        if self.rank != root:
            self.transport.isendrecv(None, None, buf, root).wait()
            return
        pending = [self.transport.isendrecv(buf, worker, None, None) for worker in self._workers(root)]
        for p in pending:
            p.wait()

    def _allreduce(self, buf, op):
        self._reduce(buf, 0, op)
        self._bcast(buf, 0)
