"""What one training step sends: the collectives of every structure, without MPI.

Every strategy says what it sends per step (:meth:`Strategy.step_traffic
<ringnet.parallel.base.Strategy.step_traffic>`, or :func:`ringnet.parallel.step_traffic`
by mode name): a :class:`StepTraffic`, a pure function of the model, N, the global batch
and the dtype, built from the same bounds the strategies run with (the plans'
``shard_bounds``, split-fc's FC blocks and conversion layer). Each collective is a
:class:`Transfer` of one phase:

* ``reduce``: the gradients combined (ring reduce-scatter, rooted reduce);
* ``distribute``: the updated weights given back (ring all-gather, rooted broadcast);
* ``activations``: split-fc's all-gathers of activations and reduce-scatters of their
  gradients.

A transfer's ``route`` is the communicator that runs it (a key of
``ringnet.comm.COMMUNICATORS``); :meth:`Transfer.sent` and :meth:`Transfer.messages` say
what each rank posts on that route: the ring's N-1 lockstep steps (a step of an empty
shard sends nothing), the tree's heap (children 2v+1, 2v+2) and the master's star, cut
into the rooted communicators' pieces.
"""
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple


__all__ = ["Transfer", "Part", "StepTraffic", "PHASES", "clip_bounds", "heap_children",
           "ring_phase_bytes", "rooted_pieces"]

PHASES = ("reduce", "distribute", "activations")

Bounds = List[Tuple[int, int]]


def clip_bounds(bounds: Bounds, lo: int, hi: int) -> Bounds:
    """Return ``bounds`` clipped to ``[lo, hi)`` and shifted to start at 0: a part's shards."""
    return [(min(max(a, lo), hi) - lo, min(max(b, lo), hi) - lo) for a, b in bounds]


def heap_children(v: int, n: int) -> List[int]:
    """The tree's children of heap index ``v`` among ``n`` ranks (the root is 0)."""
    return [c for c in (2 * v + 1, 2 * v + 2) if c < n]


def rooted_pieces(route: str, length: int, itemsize: int, n: int) -> Bounds:
    """The element ranges a rooted transfer of ``length`` elements is cut into, as the
    communicator ``route`` cuts them at ``n`` ranks (its own ``pieces`` rule)."""
    from ringnet.comm import COMMUNICATORS      # late: loading mpi4py initialises MPI
    return COMMUNICATORS[route].pieces(length, itemsize, n)


def ring_phase_bytes(bounds: Bounds, itemsize: int) -> Tuple[List[int], List[int]]:
    """Return bytes each rank sends in one ring reduce-scatter and one all-gather over ``bounds``.

    Reduce-scatter step k: rank r sends shard (r-k-1) mod N, so over N-1 steps every
    shard but its own; all-gather step k sends shard (r-k) mod N: every shard but r+1's.
    """
    n = len(bounds)
    sizes = [b - a for a, b in bounds]
    total = sum(sizes)
    if n == 1:
        return [0], [0]
    rs = [(total - sizes[r]) * itemsize for r in range(n)]
    ag = [(total - sizes[(r + 1) % n]) * itemsize for r in range(n)]
    return rs, ag


def _ring_shard(op: str, r: int, k: int, n: int) -> int:
    """The shard rank r sends in step k of a ring reduce-scatter or all-gather."""
    return (r - k - 1) % n if op == "reduce_scatter" else (r - k) % n


@dataclass
class Transfer:
    """One collective of a step.

    ``phase``: one of :data:`PHASES`; ``label``: what moves (e.g. "ip1 output");
    ``op``: "reduce_scatter", "allgather", "reduce" or "bcast"; ``route``: the communicator
    that runs it; ``bounds``: the ranks' (start, stop) element bounds of a ring collective,
    ``[(0, length)]`` for a rooted one; ``beside``: the FC layer whose weight gradients the
    training thread computes while this reduce-scatter runs (split-fc), or None.
    """
    phase: str
    label: str
    op: str
    route: str
    bounds: Bounds
    itemsize: int
    beside: Optional[str] = None

    @property
    def length(self) -> int:
        """Elements of the buffer the collective runs over."""
        return sum(b - a for a, b in self.bounds)

    def sent(self, n: int) -> List[int]:
        """Bytes each of the ``n`` ranks sends."""
        size = self.length * self.itemsize
        if self.route == "tree":
            if self.op == "reduce":
                return [size * (v > 0) for v in range(n)]
            return [size * len(heap_children(v, n)) for v in range(n)]
        if self.route == "master":
            if self.op == "reduce":
                return [0] + [size] * (n - 1)
            return [(n - 1) * size] + [0] * (n - 1)
        rs, ag = ring_phase_bytes(self.bounds, self.itemsize)
        return rs if self.op == "reduce_scatter" else ag

    def messages(self, n: int, pieces: Optional[int] = None) -> List[int]:
        """Non-empty sends each of the ``n`` ranks posts. ``pieces``: what a rooted transfer
        is cut into (None: the communicator's own rule, :func:`rooted_pieces`)."""
        if self.route in ("tree", "master"):
            if pieces is None:
                pieces = len(rooted_pieces(self.route, self.length, self.itemsize, n))
            if self.route == "tree":
                per = [(v > 0) for v in range(n)] if self.op == "reduce" else \
                    [len(heap_children(v, n)) for v in range(n)]
            else:
                per = [0] + [1] * (n - 1) if self.op == "reduce" else [n - 1] + [0] * (n - 1)
            return [pieces * k for k in per]
        count = [0] * n
        for r in range(n):
            for k in range(n - 1):
                a, b = self.bounds[_ring_shard(self.op, r, k, n)]
                count[r] += b > a
        return count


@dataclass
class Part:
    """One part ``[lo, hi)`` of the exchanged region (a delay-0 bucket, or all of it):
    its collectives (reduce, then distribute) and the elements the busiest rank updates."""
    lo: int
    hi: int
    updated: int
    transfers: List[Transfer]


@dataclass
class StepTraffic:
    """Everything one step of a strategy sends over ``n`` ranks.

    ``region``: elements of the parameter region the plan exchanges (the whole model, or
    split-fc's conv prefix), held by layers ``[0, stop_layer)``; ``parts``: that exchange,
    part by part; ``activations``: split-fc's activation collectives, in the order the step
    runs them (forward all-gathers, then the backward's reduce-scatters).
    """
    n: int
    region: int
    stop_layer: int
    parts: List[Part]
    activations: List[Transfer] = field(default_factory=list)

    def transfers(self) -> List[Transfer]:
        """Every collective of the step: the activations', then each part's exchange."""
        return self.activations + [t for part in self.parts for t in part.transfers]

    def sent(self) -> List[int]:
        """Bytes each rank sends in one step."""
        total = [0] * self.n
        for transfer in self.transfers():
            total = [a + b for a, b in zip(total, transfer.sent(self.n))]
        return total

    def messages(self, pieces: Optional[int] = None) -> List[int]:
        """Non-empty sends each rank posts in one step (``pieces``: see :meth:`Transfer.messages`)."""
        total = [0] * self.n
        for transfer in self.transfers():
            total = [a + b for a, b in zip(total, transfer.messages(self.n, pieces))]
        return total

    def by_phase(self) -> Dict[str, List[int]]:
        """Bytes each rank sends per phase: {phase: [bytes per rank]} for every phase of :data:`PHASES`."""
        out = {phase: [0] * self.n for phase in PHASES}
        for transfer in self.transfers():
            out[transfer.phase] = [a + b for a, b in zip(out[transfer.phase], transfer.sent(self.n))]
        return out

