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
"""
from typing import Optional

import numpy as np

from ringnet.backend import get_array_module, to_numpy

__all__ = ["LocalPlan", "ShardedPlan", "RootedPlan", "DelayedUpdate", "synchronize"]


def synchronize(array):
    """Block until the device work queued on ``array``'s device (current stream) is done."""
    xp = get_array_module(array)
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


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


class ShardedPlan(LocalPlan):
    """Ring: reduce-scatter of the gradient, rank r updates shard r, all-gather of the weights.

    ``op`` is "mean" when each rank's gradient is its local mean (data-parallel), "sum"
    when the ranks' gradients are already partial sums of the global mean (split-fc).
    """

    def __init__(self, comm, size: int, op: str = "mean"):
        self.comm, self.op = comm, op
        self.bounds = comm.shard_bounds(size)
        self.owned = slice(*self.bounds[comm.rank])

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
    ``stats``: the StepStats the exchange's spans fill.
    """

    def __init__(self, params, grads, plan, optimizer, stats, delay: int = 0, stream=None):
        if delay not in (0, 1):
            raise ValueError(f"delay must be 0 or 1, got {delay}")
        self.params, self.grads = params, grads
        self.plan, self.optimizer, self.stats = plan, optimizer, stats
        self.delay, self.stream = delay, stream
        self.pending = None             # Handle of the exchange in flight
        self._saved_front = None        # the front while show_newest put the newest there
        if delay:
            self.back = params.copy()
            self.sent = grads.copy()

    # -- one step -------------------------------------------------------------------
    def _exchange(self, grads, weights, it, exposed):
        """Combine ``grads``, update this rank's slice of ``weights``, distribute ``weights``."""
        kind = "exposed_comm" if exposed else "comm"
        with self.stats.span(kind, op="reduce", bytes=grads.nbytes):
            self.plan.reduce(grads)
        owned = self.plan.owned
        if owned.stop > owned.start:
            with self.stats.span("update"):
                self.optimizer.step(weights[owned], grads[owned], it)
                synchronize(weights)
        with self.stats.span(kind, op="distribute", bytes=weights.nbytes):
            self.plan.distribute(weights)

    def gradients_ready(self, it: int):
        """Exchange the gradient of step ``it`` the model just wrote into ``grads``.

        Delay 0: blocks until the updated weights are in ``params``. Delay 1: waits for
        the previous exchange, makes its result the front (what step ``it + 1`` computes
        on) and starts this step's exchange on the stream.
        """
        if not self.delay:
            self._exchange(self.grads, self.params, it, exposed=True)
            return
        self.drain()
        self.params[...] = self.back            # w[it]: what step it + 1 computes on
        self.sent[...] = self.grads
        # No host wait: a GPU stream's operation waits on an event recorded at submit.
        if self.stream is None:
            self._exchange(self.sent, self.back, it, exposed=True)
        else:
            self.pending = self.stream.submit(self._exchange, self.sent, self.back, it, False)

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

    def load(self, newest, front=None, momentum=None):
        """Load host arrays of the region's length (``front`` defaults to ``newest``)."""
        self.drain()
        self._saved_front = None
        xp_newest = _asarray_like(self.params, newest)
        self.params[...] = xp_newest
        if self.delay:
            self.back[...] = xp_newest
            if front is not None:
                self.params[...] = _asarray_like(self.params, front)
        full = momentum if momentum is not None else np.zeros(len(self.params), self.params.dtype)
        self.optimizer.load_state_dict({"momentum": np.asarray(full)[self.plan.owned]})


def _asarray_like(target, host):
    return get_array_module(target).asarray(host)
