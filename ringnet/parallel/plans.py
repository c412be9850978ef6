"""Exchange plans of the data-parallel structures, and the delay-0 buckets.

A *plan* says who combines the gradients, who updates which slice, and how the
updated weights reach every rank: :class:`LocalPlan` (one process),
:class:`ShardedPlan` (ring: reduce-scatter, each rank updates its shard, all-gather),
:class:`RootedPlan` (tree or master: reduce to the root, the root updates, broadcast).
:class:`~ringnet.parallel.delayed_update.DelayedUpdate` runs a plan, at delay 0 or 1.

Delay-0 buckets: with ``buckets``, the region is cut into contiguous parts on layer
boundaries (:func:`backward_buckets`, last layers first, as PyTorch DDP does); the
strategy calls ``DelayedUpdate.part_ready`` as soon as the backward has written a
part's gradient, and that part's whole exchange (combine, update, distribute) runs on
the stream while the backward of the earlier layers goes on. Each part keeps the
owners of the unbucketed plan (:meth:`ShardedPlan.part` clips the shard bounds to the
part), so every element is summed, averaged and updated exactly as without buckets.
"""
import os

import numpy as np

from ringnet.backend import get_array_module, to_numpy
from ringnet.errors import InputError
from ringnet.parallel.traffic import Part, Transfer, clip_bounds
from ringnet.shards import shard_bounds

__all__ = ["LocalPlan", "ShardedPlan", "RootedPlan", "BUCKET_BYTES", "bucket_bytes",
           "backward_buckets", "exchange_buckets", "exchange_on_stream", "layer_param_ranges"]

# Delay-0 bucket size: a part is closed once it holds this many bytes of gradient.
BUCKET_BYTES = 256 * 1024


def bucket_bytes():
    """Return the delay-0 bucket size in bytes: ``RINGNET_BUCKET_BYTES`` or :data:`BUCKET_BYTES`.

    0 turns buckets off: the whole exchange starts after the backward.
    """
    value = os.environ.get("RINGNET_BUCKET_BYTES", "")
    if not value:
        return BUCKET_BYTES
    if not value.isdigit():
        raise InputError(f"RINGNET_BUCKET_BYTES={value!r} is not a number of bytes (0: no buckets)")
    return int(value)


def layer_param_ranges(model):
    """Return {layer index: (lo, hi)}: where each layer's parameters lie in the flat buffer."""
    index = {name: i for i, (name, _) in enumerate(model.layers)}
    ranges = {}
    for name, (lo, hi, _) in model.param_offsets().items():
        layer = index[name.rsplit(".", 1)[0]]
        a, b = ranges.get(layer, (lo, hi))
        ranges[layer] = (min(a, lo), max(b, hi))
    return ranges


def backward_buckets(model, stop_layer, size_bytes):
    """Cut the parameters of ``model.layers[:stop_layer]`` into delay-0 buckets.

    Returns [(lo, hi, layer)] in the order the backward completes them (last layers
    first): bucket ``[lo, hi)`` of the flat buffer is final once the backward of layer
    index ``layer`` has run. Buckets follow layer boundaries and hold at least
    ``size_bytes`` each (the first layers' bucket may hold less). Returns [] where that
    makes one bucket only (it would be ready only when the backward ends) and for
    ``size_bytes`` 0: the whole region is then exchanged after the backward.
    """
    ranges = layer_param_ranges(model)
    itemsize = np.dtype(model.dtype).itemsize
    buckets, current = [], None
    for layer in reversed(range(stop_layer)):
        if layer not in ranges:
            continue
        lo, hi = ranges[layer]
        if current is None:
            current = [lo, hi, layer]
        else:
            assert hi == current[0], "layer parameters are not contiguous in layer order"
            current[0], current[2] = lo, layer
        if size_bytes and (current[1] - current[0]) * itemsize >= size_bytes:
            buckets.append(tuple(current))
            current = None
    if current is not None:
        buckets.append(tuple(current))
    return buckets if len(buckets) > 1 else []


def exchange_on_stream(delay, buckets):
    """Whether a strategy's exchange engine runs its exchange on a stream: at delay 1, and
    at delay 0 where the exchange is cut into ``buckets`` that the backward starts; else
    the training thread exchanges, blocking (the performance model prices the transfers'
    CPU by the same rule)."""
    return bool(delay or buckets)


def exchange_buckets(model, stop_layer, delay, bucket_size=None):
    """Return the buckets a strategy's exchange of ``model.layers[:stop_layer]`` runs in:
    :func:`backward_buckets` of ``bucket_size`` bytes (None: :func:`bucket_bytes`) at delay 0,
    none at delay 1 (the whole exchange runs on the stream beside the next step)."""
    if delay:
        return []
    if bucket_size is None:
        bucket_size = bucket_bytes()
    return backward_buckets(model, stop_layer, bucket_size) if bucket_size else []


class LocalPlan:
    """One process: no exchange, the whole region updated here."""

    def __init__(self, size: int):
        self.owned = slice(0, size)

    def reduce(self, grads):
        """Combine the ranks' gradients in place (nothing to combine)."""

    def distribute(self, params):
        """Give every rank the updated weights in place (nothing to give)."""

    def gather(self, owned_values, size):
        """Return the whole region assembled from every rank's owned slice (a host array)."""
        return to_numpy(owned_values)

    def part(self, lo, hi):
        """Return the plan of ``[lo, hi)`` of the region, with the same owner for every element."""
        return LocalPlan(hi - lo)

    @classmethod
    def traffic(cls, size, n, itemsize, parts, route=None, what=""):
        """What this plan sends per step over ``n`` ranks, as a :class:`~ringnet.parallel.traffic.Part`
        per ``(lo, hi)`` of ``parts`` of a region of ``size`` elements (pure: no communicator).
        One process: nothing, each part updated here."""
        return [Part(lo, hi, hi - lo, []) for lo, hi in parts]


class ShardedPlan(LocalPlan):
    """Ring: reduce-scatter of the gradient, rank r updates shard r, all-gather of the weights.

    ``op`` is "mean" when each rank's gradient is its local mean (data-parallel), "sum"
    when the ranks' gradients are already partial sums of the global mean (split-fc).
    """

    def __init__(self, comm, size: int, op: str = "mean"):
        self.comm, self.op = comm, op
        self.bounds = comm.shard_bounds(size)
        self.owned = slice(*self.bounds[comm.rank])

    def part(self, lo, hi):
        plan = object.__new__(ShardedPlan)
        plan.comm, plan.op = self.comm, self.op
        plan.bounds = clip_bounds(self.bounds, lo, hi)
        plan.owned = slice(*plan.bounds[self.comm.rank])
        return plan

    @classmethod
    def traffic(cls, size, n, itemsize, parts, route="ring", what=""):
        """Each part: a reduce-scatter and an all-gather over the region's shard bounds
        clipped to it (as :meth:`part` clips them); rank r updates its shard."""
        out = []
        for lo, hi in parts:
            clipped = clip_bounds(shard_bounds(size, n), lo, hi)
            out.append(Part(lo, hi, max(b - a for a, b in clipped), [
                Transfer("reduce", f"{what}gradients", "reduce_scatter", route, clipped, itemsize),
                Transfer("distribute", f"{what}weights", "allgather", route, clipped, itemsize)]))
        return out

    def reduce(self, grads):
        self.comm.reduce_scatter(grads, op=self.op, bounds=self.bounds)

    def distribute(self, params):
        self.comm.allgather(params, bounds=self.bounds)

    def gather(self, owned_values, size):
        if size == 0:
            return to_numpy(owned_values)
        full = get_array_module(owned_values).zeros(size, dtype=owned_values.dtype)
        full[self.owned] = owned_values
        self.comm.allgather(full, bounds=self.bounds)
        return to_numpy(full)


class RootedPlan(LocalPlan):
    """Tree or master: reduce (mean) to the root, the root updates all, broadcast."""

    def __init__(self, comm, size: int, root: int = 0):
        self.comm, self.root = comm, root
        self.owned = slice(0, size) if comm.rank == root else slice(0, 0)

    def part(self, lo, hi):
        return RootedPlan(self.comm, hi - lo, self.root)

    @classmethod
    def traffic(cls, size, n, itemsize, parts, route="tree", what=""):
        """Each part: a reduce to the root, which updates all of it, and a broadcast."""
        return [Part(lo, hi, hi - lo, [
            Transfer("reduce", f"{what}gradients", "reduce", route, [(0, hi - lo)], itemsize),
            Transfer("distribute", f"{what}weights", "bcast", route, [(0, hi - lo)], itemsize)])
            for lo, hi in parts]

    def reduce(self, grads):
        self.comm.reduce(grads, root=self.root, op="mean")

    def distribute(self, params):
        self.comm.bcast(params, root=self.root)

    def gather(self, owned_values, size):
        """Return the whole region on the root (it owns it all), None elsewhere."""
        return to_numpy(owned_values) if self.comm.rank == self.root else None
