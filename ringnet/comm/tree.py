"""TreeCommunicator: binary-tree reduce to a root and tree broadcast, any N."""
from ringnet.comm.base import RootedCommunicator

__all__ = ["TreeCommunicator"]


class TreeCommunicator(RootedCommunicator):
    """Ranks, renumbered so that ``root`` is 0, form a binary heap: v has children 2v+1, 2v+2.

    A reduce takes ceil(log2(N+1)) - 1 rounds of depth; every inner node receives the
    whole buffer from up to two children, so the root's link carries 2x the buffer.
    An inner rank sums its children's partials into a scratch buffer, so after ``reduce``
    every non-root ``buf`` is unchanged (the contract of every rooted communicator).

    A rank receives from both children at once, and from 4 ranks on (when inner nodes
    forward) large buffers move in pieces (``chunk_bytes``, default
    :func:`~ringnet.comm.base.pipeline_pieces`): a rank sums and forwards piece k while
    piece k+1 arrives, so the depth costs one piece, not the buffer.
    """

    name = "tree"

    def _family(self, root):
        """Return (parent, children) of this rank as real ranks for a tree rooted at ``root``."""
        n = self.size
        v = (self.rank - root) % n
        parent = None if v == 0 else ((v - 1) // 2 + root) % n
        children = [(c + root) % n for c in (2 * v + 1, 2 * v + 2) if c < n]
        return parent, children

    @classmethod
    def forwards(cls, n):
        return n >= 4               # from 4 ranks on, inner nodes pass partial sums up

    def _reduce(self, buf, root, op):
        parent, children = self._family(root)
        # Both children's pieces are received at once; each piece goes up as soon as it is
        # summed (buf + first child + second child, in that order).
        self._gather_sum(buf, children, parent)
        if parent is None and op == "mean":
            self._divide(buf)

    def _bcast(self, buf, root):
        parent, children = self._family(root)
        self._relay(buf, parent, children)
