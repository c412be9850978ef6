"""MasterSlaveCommunicator: workers send to the root, the root combines and answers each."""
from ringnet.comm.base import RootedCommunicator

__all__ = ["MasterSlaveCommunicator"]


class MasterSlaveCommunicator(RootedCommunicator):
    """Synchronous master-slave baseline: the root's link carries (N-1)x the buffer each way.
    """

    name = "master"

    def _workers(self, root):
        return [(root + i) % self.size for i in range(1, self.size)]

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
