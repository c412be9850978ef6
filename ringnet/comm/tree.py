"""TreeCommunicator: binary-tree reduce to a root and tree broadcast, any N."""
from ringnet.comm.base import RootedCommunicator

__all__ = ["TreeCommunicator"]


class TreeCommunicator(RootedCommunicator):
    """Ranks, renumbered so that ``root`` is 0, form a binary heap: v has children 2v+1, 2v+2.

    A reduce takes ceil(log2(N+1)) - 1 rounds of depth; every inner node receives the
    whole buffer from up to two children, so the root's link carries 2x the buffer.
    An inner rank sums its children's partials into a scratch buffer, so after ``reduce``
    every non-root ``buf`` is unchanged (the contract of every rooted communicator).
    """

    name = "tree"

    def _family(self, root):
        """Return (parent, children) of this rank as real ranks for a tree rooted at ``root``."""
        n = self.size
        v = (self.rank - root) % n
        parent = None if v == 0 else ((v - 1) // 2 + root) % n
        children = [(c + root) % n for c in (2 * v + 1, 2 * v + 2) if c < n]
        return parent, children

    def _reduce(self, buf, root, op):
        parent, children = self._family(root)
        partial = buf                   # the root sums into its own buffer
        if children:
            incoming = self._scratch_for(buf, buf.size)
            if parent is not None:
                partial = self._scratch_for(buf, buf.size, slot=1)
                partial[...] = buf
            for child in children:
                self.transport.isendrecv(None, None, incoming, child).wait()
                self._add_from(partial, incoming)
        if parent is not None:
            self.transport.isendrecv(partial, parent, None, None).wait()
        elif op == "mean":
            self._divide(buf)

    def _bcast(self, buf, root):
        parent, children = self._family(root)
        if parent is not None:
            self.transport.isendrecv(None, None, buf, parent).wait()
        # Both children at once: the two sends share the wait.
        pending = [self.transport.isendrecv(buf, child, None, None) for child in children]
        for p in pending:
            p.wait()
