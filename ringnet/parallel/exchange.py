"""The gradient exchange of the data-parallel structures, with or without delayed update.

Two pieces, composed by every strategy that keeps a replicated part of the model
(the whole model in single/ring/tree/master, the conv prefix in split-fc):

* a *plan* says who combines the gradients, who updates which slice, and how the
  updated weights reach every rank: :class:`LocalPlan` (one process),
  :class:`ShardedPlan` (ring: reduce-scatter, each rank updates its shard, all-gather),
  :class:`RootedPlan` (tree or master: reduce to the root, the root updates, broadcast);
* :class:`DelayedUpdate` runs the recurrence of DESIGN.md on one region of the model's
  flat buffers. Delay 0: ``w[t+1] = upd(w[t], G_t(w[t]))``, the exchange blocks.
  Delay 1: ``g_t = G_t(w[t-1])`` (``g_0 = G_0(w[0])``), ``w[t+1] = upd(w[t], g_t)``;
  the exchange of step t runs on the communication stream during step t+1.

Delay-1 buffers: ``front`` (the model's own region: what the next step computes on,
``w[t-1]`` during step t) and ``back`` (the newest weights, or those the exchange in
flight is writing); ``sent`` holds the gradient the exchange in flight reduces, so the
next backward can write the model's gradient region meanwhile. At the step boundary
the finished back is copied into the front and the new gradient into ``sent``.

Delay-0 buckets: with ``buckets``, the region is cut into contiguous parts on layer
boundaries (:func:`backward_buckets`, last layers first, as PyTorch DDP does); the
strategy calls :meth:`DelayedUpdate.part_ready` as soon as the backward has written
a part's gradient, and that part's whole exchange (combine, update, distribute) runs
on the stream while the backward of the earlier layers goes on. Each part keeps the
owners of the unbucketed plan (:meth:`ShardedPlan.part` clips the shard bounds to the
part), so every element is summed, averaged and updated exactly as without buckets.
"""
import copy
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ringnet.backend import get_array_module, to_numpy
from ringnet.errors import InputError
from ringnet.optim import lookahead_k, lookahead_warmup

__all__ = ["LocalPlan", "ShardedPlan", "RootedPlan", "DelayedUpdate", "Lookahead",
           "COMPENSATIONS", "compensation", "BUCKET_BYTES", "bucket_bytes",
           "backward_buckets", "layer_param_ranges"]

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


@dataclass(frozen=True)
class Lookahead:
    """Delay compensation of the delay-1 recurrence (``--delay-compensation lookahead``).

    With the user's lr and momentum mu, the delayed region runs heavy-ball SGD with
    ``mu' = 1 - (1 - mu) / k`` and ``lr' = lr / k`` (the same long-run step
    ``lr / (1 - mu)``, averaged over k times as many gradients), and step t computes
    its gradient at the look-ahead point ``w[t-1] + c * (w[t-1] - w[t-2])`` instead of
    at ``w[t-1]``::

        g_t     = G_t(w[t-1] + c * (w[t-1] - w[t-2]))      (w[-1] = w[0], g_0 = G_0(w[0]))
        v[t+1]  = mu' * v[t] + lr' * (g_t + weight_decay * w[t])
        w[t+1]  = w[t] - v[t+1]

    On a quadratic with curvature h the plain delayed update (k = 1, c = 0) is stable
    only while ``lr * h < 1 - mu`` (0.1 at mu = 0.9; synchronous SGD: ``2 (1 + mu)``).
    ``k = None`` (the default) takes ``k = ringnet.optim.lookahead_k(mu, c)``, the
    smallest k whose stable range is synchronous SGD's (15.005 at mu 0.9, c 2; the
    derivation is in ``ringnet.optim``). ``k = 1, c = 0`` is the plain recurrence.

    ``warmup`` W: the first W steps are synchronous with the user's mu and lr
    (``g_t = G_t(w[t])`` for t <= W, ``v <- mu v + lr (...)`` for t < W) and the
    compensated recurrence takes over at step W with the momentum buffer as it is (its
    long-run value ``lr' g / (1 - mu') = lr g / (1 - mu)`` is the same), so the
    heavier momentum does not start from zero. ``warmup = None`` (the default) takes
    ``ringnet.optim.lookahead_warmup(mu)`` (60 at mu 0.9); 0 starts delayed. Each phase
    is stable wherever synchronous SGD is; the warm-up's steps wait for their exchange.
    """
    k: Optional[float] = None
    c: float = 2.0
    warmup: Optional[int] = None

    @property
    def plain(self):
        return self.k == 1 and self.c == 0

    def k_for(self, momentum):
        """The k used with the user's ``momentum``."""
        return lookahead_k(momentum, self.c) if self.k is None else self.k

    def warmup_for(self, momentum):
        """The synchronous steps before the compensated recurrence, at ``momentum``."""
        return lookahead_warmup(momentum) if self.warmup is None else int(self.warmup)


COMPENSATIONS = {"none": Lookahead(1.0, 0.0), "lookahead": Lookahead()}


def compensation(name):
    """Return the Lookahead of ``--delay-compensation name`` (none, lookahead)."""
    if name not in COMPENSATIONS:
        raise InputError(f"unknown delay compensation {name!r}; choose one of "
                         f"{', '.join(COMPENSATIONS)}")
    return COMPENSATIONS[name]


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
        plan.bounds = [(min(max(a, lo), hi) - lo, min(max(b, lo), hi) - lo) for a, b in self.bounds]
        plan.owned = slice(*plan.bounds[self.comm.rank])
        return plan

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

    def reduce(self, grads):
        self.comm.reduce(grads, root=self.root, op="mean")

    def distribute(self, params):
        self.comm.bcast(params, root=self.root)

    def gather(self, owned_values, size):
        """Return the whole region on the root (it owns it all), None elsewhere."""
        return to_numpy(owned_values) if self.comm.rank == self.root else None


class DelayedUpdate:
    """Exchange and update one region of a model's flat buffers, at delay 0 or 1.

    ``params``, ``grads``: the region (views of the model's flat buffers) that the
    forward/backward reads and writes. ``plan``: who combines and who updates (see the
    module docstring); ``optimizer``: sized to ``plan.owned``. ``stream``: where a
    delay-1 exchange runs (None runs it at once: the one-process recurrence).
    ``stats``: the StepStats the exchange's spans fill. ``lookahead``: the delay
    compensation (:class:`Lookahead`; default: none, the plain recurrence); it changes
    the optimizer's momentum and lr scale, so pass an optimizer of this region only.
    ``buckets``: delay 0 with a stream only: [(lo, hi)] covering the region, in the
    order :meth:`part_ready` is called for them (see the module docstring).
    """

    def __init__(self, params, grads, plan, optimizer, stats, delay: int = 0, stream=None,
                 lookahead: Optional[Lookahead] = None, buckets=None):
        if delay not in (0, 1):
            raise ValueError(f"delay must be 0 or 1, got {delay}")
        self.params, self.grads = params, grads
        self.plan, self.optimizer, self.stats = plan, optimizer, stats
        self.delay, self.stream = delay, stream
        self.pending = None             # Handle of the exchange in flight
        self.parts = []                 # delay-0 buckets: (lo, hi, plan of the part)
        if buckets is not None and not delay and stream is not None:
            covered = sorted((int(lo), int(hi)) for lo, hi in buckets)
            if covered[0][0] != 0 or covered[-1][1] != len(params) or any(
                    covered[i][1] != covered[i + 1][0] for i in range(len(covered) - 1)):
                raise ValueError(f"buckets {buckets} do not cover [0, {len(params)}) exactly")
            self.parts = [(int(lo), int(hi), plan.part(int(lo), int(hi))) for lo, hi in buckets]
        self._started = []              # Handles of this step's started parts
        self._saved_front = None        # the front while show_newest put the newest there
        self.lookahead = None
        if delay:
            self.back = params.copy()
            self.sent = grads.copy()
            if lookahead is not None and not lookahead.plain:
                self.lookahead = lookahead
                mu = optimizer.momentum
                k = lookahead.k_for(mu)
                # (momentum, lr scale) of the warm-up and of the compensated recurrence
                self._phases = ((mu, 1.0), (1.0 - (1.0 - mu) / k, 1.0 / k))
                self.warmup = lookahead.warmup_for(mu)
                self._set_phase(self.warmup == 0)
                self.base = params.copy()   # w[t-1] during step t (the front is the look-ahead point)

    def _set_phase(self, compensated):
        self.optimizer.momentum, self.optimizer.lr_scale = self._phases[bool(compensated)]

    # -- one step -------------------------------------------------------------------
    def _exchange(self, grads, weights, it, exposed, source=None):
        """Combine ``grads``, update this rank's slice of ``weights``, distribute ``weights``.

        ``source``: where the weights to update are (default: ``weights`` itself); only
        this rank's slice is copied from it, the distribution fills in the rest.
        """
        kind = "exposed_comm" if exposed else "comm"
        with self.stats.span(kind, op="reduce", bytes=grads.nbytes):
            self.plan.reduce(grads)
        owned = self.plan.owned
        if owned.stop > owned.start:
            with self.stats.span("update"):
                if source is not None:
                    weights[owned] = source[owned]
                self.optimizer.step(weights[owned], grads[owned], it)
        with self.stats.span(kind, op="distribute", bytes=weights.nbytes):
            self.plan.distribute(weights)

    def _exchange_part(self, lo, hi, plan, it):
        """The whole exchange of bucket ``[lo, hi)`` (on the stream)."""
        owned = plan.owned
        optimizer = None
        if owned.stop > owned.start:
            # the part of the optimizer's state that covers this rank's elements of the bucket
            start = lo + owned.start - self.plan.owned.start
            optimizer = copy.copy(self.optimizer)
            optimizer.v = self.optimizer.v[start:start + owned.stop - owned.start]
            optimizer.size = owned.stop - owned.start
            optimizer._scratch = None
        kind = "comm"
        grads, weights = self.grads[lo:hi], self.params[lo:hi]
        with self.stats.span(kind, op="reduce", bytes=grads.nbytes, bucket=(lo, hi)):
            plan.reduce(grads)
        if optimizer is not None:
            with self.stats.span("update"):
                optimizer.step(weights[owned], grads[owned], it)
        with self.stats.span(kind, op="distribute", bytes=weights.nbytes, bucket=(lo, hi)):
            plan.distribute(weights)

    def part_ready(self, k: int, it: int):
        """Start the exchange of bucket ``k`` (and of any earlier one not started yet).

        Call once the backward of step ``it`` has written bucket ``k``'s gradient; its
        weights are then rewritten on the stream, so no later backward may read them.
        """
        while len(self._started) <= min(k, len(self.parts) - 1):
            lo, hi, plan = self.parts[len(self._started)]
            self._started.append(self.stream.submit(self._exchange_part, lo, hi, plan, it))

    def gradients_ready(self, it: int):
        """Exchange the gradient of step ``it`` the model just wrote into ``grads``.

        Delay 0: blocks until the updated weights are in ``params`` (with buckets: starts
        the parts not started yet and waits for all). Delay 1: waits for the previous
        exchange, makes its result the front (what step ``it + 1`` computes on) and
        starts this step's exchange on the stream.
        """
        if not self.delay:
            if not self.parts:
                self._exchange(self.grads, self.params, it, exposed=True)
                return
            self.part_ready(len(self.parts) - 1, it)
            started, self._started = self._started, []
            with self.stats.span("wait"):
                for handle in started:
                    handle.wait()
            return
        self.drain()
        source = None
        if self.lookahead is not None and it < self.warmup:   # synchronous warm-up step
            self._set_phase(False)
            self.base[...] = self.params                       # w[it]
            self._exchange(self.grads, self.params, it, exposed=True)
            self.back[...] = self.params                       # w[it + 1], front and newest
            return
        if self.lookahead is None:
            self.params[...] = self.back        # w[it]: what step it + 1 computes on
        else:                                   # w[it] + c * (w[it] - w[it-1])
            self._set_phase(True)
            c = self.lookahead.c
            xp = get_array_module(self.params)
            xp.multiply(self.back, self.params.dtype.type(1.0 + c), out=self.params)
            self.base *= self.params.dtype.type(c)
            self.params -= self.base
            # w[it] becomes the base by a swap, not a copy; the exchange writes w[it+1]
            # into the other buffer, starting from this rank's slice of w[it]
            self.base, self.back = self.back, self.base
            source = self.base
        self.sent[...] = self.grads
        # No host wait: a GPU stream's operation waits on an event recorded at submit.
        if self.stream is None:
            self._exchange(self.sent, self.back, it, True, source)
        else:
            self.pending = self.stream.submit(self._exchange, self.sent, self.back, it, False, source)

    def drain(self):
        """Wait for the exchange in flight (counted as exposed communication)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            with self.stats.span("wait"):
                pending.wait()

    # -- the newest weights ----------------------------------------------------------
    @property
    def newest(self):
        """The region's newest complete weights (after ``drain``)."""
        return self.back if self.delay else self.params

    def show_newest(self):
        """Put the newest weights into ``params`` (saving the front) for evaluation or export."""
        self.drain()
        if self.delay and self._saved_front is None:
            self._saved_front = self.params.copy()
            self.params[...] = self.back

    def show_front(self):
        """Undo ``show_newest``: ``params`` holds the weights the next step computes on."""
        if self._saved_front is not None:
            self.params[...] = self._saved_front
            self._saved_front = None

    # -- checkpoints -----------------------------------------------------------------
    def state(self):
        """Return (newest, front, momentum) of the region as host arrays (collective).

        ``front`` is None at delay 0; ``momentum`` is None on ranks that do not hold it
        (every rank but the root of a rooted plan).
        """
        self.drain()
        front = None
        if self.delay:
            front = to_numpy(self.params if self._saved_front is None else self._saved_front).copy()
        momentum = self.plan.gather(self.optimizer.v, len(self.params))
        return to_numpy(self.newest).copy(), front, momentum

    def lookahead_base(self):
        """Return ``w[t-1]`` of the look-ahead (host copy), or None without compensation."""
        self.drain()
        return to_numpy(self.base).copy() if self.lookahead is not None else None

    def load(self, newest, front=None, momentum=None, base=None):
        """Load host arrays of the region's length (``front`` and ``base`` default to ``newest``)."""
        self.drain()
        self._saved_front = None
        xp_newest = _asarray_like(self.params, newest)
        self.params[...] = xp_newest
        if self.delay:
            self.back[...] = xp_newest
            if front is not None:
                self.params[...] = _asarray_like(self.params, front)
            if self.lookahead is not None:
                self.base[...] = xp_newest if base is None else _asarray_like(self.params, base)
        full = momentum if momentum is not None else np.zeros(len(self.params), self.params.dtype)
        self.optimizer.load_state_dict({"momentum": np.asarray(full)[self.plan.owned]})


def _asarray_like(target, host):
    return get_array_module(target).asarray(host)
