"""RingCommunicator: reduce-scatter, all-gather and all-reduce in N-1 neighbour steps."""
from typing import Any, Optional

from ringnet.comm.base import Array, Bounds, CommunicatorBase
from ringnet.comm.schedules import ring_steps, step_pieces
from ringnet.comm.stream import CpuStream, Handle

__all__ = ["RingCommunicator"]


class RingCommunicator(CommunicatorBase):
    """Ranks form a ring ordered by node (``order``: by node, then node-local rank, so each
    node's ranks are neighbours and the ring crosses between nodes once per node, however
    the launcher placed the ranks; on one node, or with ranks placed in blocks, rank r sends
    to r+1 and receives from r-1). Rank r owns shard r of the bounds whatever its place.

    Each rank moves 2(N-1)/N of the buffer per all-reduce, independent of N. With
    ``chunk_bytes`` every step is cut into chunks; with ``pipeline`` (default) the
    transfer of chunk k+1 is in flight while chunk k is being added.
    """

    name = "ring"

    def __init__(self, transport: Any, chunk_bytes: Optional[int] = None, pipeline: bool = True,
                 layout: Any = None):
        super().__init__(transport, layout)
        if chunk_bytes is not None and int(chunk_bytes) <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes!r}")
        self.chunk_bytes = None if chunk_bytes is None else int(chunk_bytes)
        self.pipeline = bool(pipeline)
        self.order = self.layout.node_order()          # rank at each place of the ring
        self.place = self.order.index(self.rank)
        self.right = self.order[(self.place + 1) % self.size]
        self.left = self.order[(self.place - 1) % self.size]

    # -- public collectives -------------------------------------------------------------
    def reduce_scatter(self, buf: Array, op: str = "sum", bounds: Optional[Bounds] = None,
                       stream: Optional[CpuStream] = None) -> Optional[Handle]:
        """Reduce ``buf`` over the ranks so that ``buf[bounds[rank]]`` holds this rank's shard.

        ``buf``: flat contiguous array, same length on every rank; ``op``: "sum" or "mean";
        ``bounds``: one (start, stop) per rank covering ``buf`` in order (default
        :meth:`shard_bounds`). Outside its own shard a rank's ``buf`` holds partial sums
        afterwards (scratch). Returns None, or a Handle when queued on ``stream``.
        """
        self._check(buf, op)
        bounds = self._bounds(buf, bounds)
        return self._launch(self._reduce_scatter, (buf, op, bounds), stream)

    def allgather(self, buf: Array, bounds: Optional[Bounds] = None,
                  stream: Optional[CpuStream] = None) -> Optional[Handle]:
        """Fill all of ``buf`` on every rank from every rank's ``buf[bounds[rank]]``.

        ``bounds`` as for :meth:`reduce_scatter`. Returns None, or a Handle on ``stream``.
        """
        self._check(buf)
        bounds = self._bounds(buf, bounds)
        return self._launch(self._allgather, (buf, bounds), stream)

    def allreduce(self, buf: Array, op: str = "sum",
                  stream: Optional[CpuStream] = None) -> Optional[Handle]:
        """Reduce ``buf`` over the ranks in place on every rank (reduce-scatter + all-gather).

        Returns None, or a Handle when queued on ``stream``.
        """
        self._check(buf, op)
        bounds = self.shard_bounds(buf.size)
        return self._launch(self.allreduce_now, (buf, op, bounds), stream)

    # -- implementation -----------------------------------------------------------------
    def _bounds(self, buf, bounds):
        if bounds is None:
            return self.shard_bounds(buf.size)
        bounds = [(int(a), int(b)) for a, b in bounds]
        ok = len(bounds) == self.size and bounds[0][0] == 0 and bounds[-1][1] == buf.size \
            and all(a <= b for a, b in bounds) \
            and all(bounds[i][1] == bounds[i + 1][0] for i in range(self.size - 1))
        if not ok:
            raise ValueError(f"bounds must be {self.size} contiguous (start, stop) pairs covering "
                             f"[0, {buf.size}), got {bounds}")
        return bounds

    def _chunks(self, send_len, recv_len, itemsize):
        """Return element ranges cutting a step into pipeline chunks."""
        return step_pieces(max(send_len, recv_len), itemsize, self.chunk_bytes)

    def _reduce_scatter(self, buf, op, bounds):
        n, r = self.size, self.rank
        if n > 1:
            scratch = self._scratch_for(buf, max(b - a for a, b in bounds))
            send = self.transport.isendrecv
            for out_place, in_place in ring_steps(self.place, n)[0]:
                # Step k: pass on the shard summed at step k-1, receive the next one.
                sa, sb = bounds[self.order[out_place]]
                ra, rb = bounds[self.order[in_place]]
                out, got = buf[sa:sb], scratch[:rb - ra]
                mine = buf[ra:rb]
                chunks = self._chunks(sb - sa, rb - ra, buf.itemsize)
                if self.pipeline and len(chunks) > 1:
                    a, b = chunks[0]
                    pending = send(out[a:b], self.right, got[a:b], self.left)
                    for j, (a, b) in enumerate(chunks):
                        pending.wait()
                        if j + 1 < len(chunks):
                            c, d = chunks[j + 1]
                            pending = send(out[c:d], self.right, got[c:d], self.left)
                        self._add_from(mine[a:b], got[a:b])
                else:
                    for a, b in chunks:
                        send(out[a:b], self.right, got[a:b], self.left).wait()
                        self._add_from(mine[a:b], got[a:b])
        if op == "mean":
            a, b = bounds[r]
            self._divide(buf[a:b])

    def _allgather(self, buf, bounds):
        for out_place, in_place in ring_steps(self.place, self.size)[1]:
            # Step k: forward the shard that arrived at step k-1 (own shard first).
            sa, sb = bounds[self.order[out_place]]
            ra, rb = bounds[self.order[in_place]]
            for a, b in self._chunks(sb - sa, rb - ra, buf.itemsize):
                self.transport.isendrecv(buf[sa:sb][a:b], self.right,
                                         buf[ra:rb][a:b], self.left).wait()

    def allreduce_now(self, buf, op, bounds):
        """The all-reduce of a checked ``buf`` over ``bounds``, blocking, on this thread
        (what :meth:`allreduce` runs or queues; auto's ring runs it)."""
        self._reduce_scatter(buf, op, bounds)
        self._allgather(buf, bounds)
