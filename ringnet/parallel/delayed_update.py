"""The delayed model update: its recurrence, the compensation that keeps it stable, its rules.

This module is the one home of the delayed update. The configuration
(:mod:`ringnet.config`) checks ``--delay``/``--delay-compensation``/``--warmup-steps``
against :data:`COMPENSATIONS` and :func:`lookahead_warmup`, the strategies run
:class:`DelayedUpdate`, checkpoints store what :meth:`DelayedUpdate.state` and
:meth:`DelayedUpdate.lookahead_base` return, and the performance model counts the step
boundary's work from :data:`BOUNDARY_PASSES`.

The recurrence, on one region of the model's flat buffers (``upd`` is one SGD step,
``G_t`` the mean gradient of step t's global batch)::

    delay 0:  w[t+1] = upd(w[t], G_t(w[t]))                 the exchange blocks
    delay 1:  g_t = G_t(w[t-1])  (g_0 = G_0(w[0])),  w[t+1] = upd(w[t], g_t)

At delay 1 the exchange of step t runs on the communication stream during step t+1.
Buffers: ``front`` (the model's own region: what the next step computes on, ``w[t-1]``
during step t), ``back`` (the newest weights, or those the exchange in flight is
writing) and ``sent`` (the gradient the exchange in flight reduces, so the next backward
can write the model's gradient region meanwhile). At the step boundary the finished back
is copied into the front and the new gradient into ``sent``.

The lookahead compensation (:class:`Lookahead`, the default at delay 1), with the user's
lr, momentum mu and weight decay wd, c = 2 and k = :func:`lookahead_k` (mu, c)::

    mu' = 1 - (1 - mu) / k,   lr' = lr / k           (the same long-run step lr / (1 - mu))
    g_t     = G_t(w[t])                               t <= W (synchronous warm-up)
    g_t     = G_t(w[t-1] + c (w[t-1] - w[t-2]))       t > W  (w[-1] = w[0])
    v[t+1]  = mu v[t] + lr (g_t + wd w[t])            t < W
    v[t+1]  = mu' v[t] + lr' (g_t + wd w[t])          t >= W  (v[W] rescaled, below)
    w[t+1]  = w[t] - v[t+1]

W = :func:`lookahead_warmup` (mu) by default. At the switch (t = W > 0) the momentum the
warm-up built is rescaled, ``v[W] <- v[W] (1 - mu') / (1 - mu)`` (= v[W] / k): what a
velocity v still moves the weights with no further gradient is ``mu v / (1 - mu)`` under
the warm-up's momentum and ``mu' v / (1 - mu')`` under the compensated one, k times
longer. Carried over unscaled, the velocity of training's first, large gradients coasts
k times as far as the warm-up would have let it (a warm-up of 5 or 10 steps drove LeNet
from loss 0.001 to NaN); rescaled, it coasts as far as before, and the compensated
phase's steady velocity (``lr' g / (1 - mu') = lr g / (1 - mu)``, the warm-up's) builds
from there within about 1/(1 - mu') steps. ``w[t-1]`` is a third copy of the region (the
checkpoint's ``/lookahead_base``).

Why k: on a quadratic ``f(w) = h w^2 / 2`` with ``a = lr h``, heavy-ball SGD
``w+ = (1 + mu - a) w - mu w-`` converges iff ``0 < a < 2 (1 + mu)``. The compensated
recurrence is, with ``b = a / k``::

    w[t+1] = (1 + mu') w[t] - (mu' + b (1 + c)) w[t-1] + b c w[t-2]
    z^3 - (1 + mu') z^2 + (mu' + b (1 + c)) z - b c = 0

and Jury's test of that cubic (P(1) = b > 0, -P(-1) > 0 always, ``|b c| < 1``,
``1 - (b c)^2 > |b (c mu' - 1) - mu'|``) gives, for c > 1, convergence iff
``0 < b < min(1/c, b*)``, ``b* = (c mu' - 1 + sqrt((c mu' - 1)^2 + 4 c^2 (1 - mu'))) / (2 c^2)``;
``k = 1, c = 0`` (the plain recurrence) gives ``a < 1 - mu``. Solving ``k b*(mu') = A`` for
k (``mu'`` depends on k) gives the smallest k whose delayed bound reaches ``A``:
``k = A (c^2 A + c (1 - mu)) / ((c - 1) A + (1 - mu))``. With ``A = 2 (1 + mu)``,
heavy-ball's own bound, the compensated delay-1 update is stable on every quadratic where
synchronous SGD is (k = 15.005 at mu 0.9, c 2).
"""
import copy
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ringnet.backend import get_array_module, to_numpy
from ringnet.errors import InputError

__all__ = ["DelayedUpdate", "Lookahead", "COMPENSATIONS", "compensation",
           "heavy_ball_bound", "lookahead_bound", "lookahead_k", "lookahead_warmup",
           "WARMUP_SPANS", "BOUNDARY_PASSES"]


# -- stability and the compensation's constants ---------------------------------------
def heavy_ball_bound(momentum):
    """Largest ``lr * h`` for which heavy-ball SGD converges on a quadratic: ``2 (1 + mu)``."""
    return 2.0 * (1.0 + momentum)


def lookahead_bound(momentum, k, c):
    """Largest ``lr * h`` for which the compensated delay-1 recurrence converges (module doc)."""
    mu = 1.0 - (1.0 - momentum) / k
    if c == 0:
        return k * (1.0 - mu)
    if c <= 1:
        raise ValueError(f"lookahead_bound takes c = 0 or c > 1, got {c}")
    b = c * mu - 1.0
    root = (b + math.sqrt(b * b + 4.0 * c * c * (1.0 - mu))) / (2.0 * c * c)
    return k * min(root, 1.0 / c)


def lookahead_k(momentum, c=2.0):
    """Smallest k for which ``lookahead_bound(momentum, k, c)`` reaches heavy-ball's bound.

    ``k = A (c^2 A + c (1 - mu)) / ((c - 1) A + (1 - mu))`` with ``A = 2 (1 + mu)``; the
    ``1/c`` cap of the bound is then slack (``k > c A``), so the two bounds are equal.
    """
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    if c <= 1:
        raise ValueError(f"lookahead_k takes c > 1, got {c}")
    a, e = heavy_ball_bound(momentum), 1.0 - momentum
    return a * (c * c * a + c * e) / ((c - 1.0) * a + e)


# spans of 1/(1 - mu) in the default synchronous warm-up of the lookahead compensation
WARMUP_SPANS = 10


def lookahead_warmup(momentum, spans=WARMUP_SPANS):
    """Synchronous steps before the compensated delay-1 recurrence: ``ceil(spans / (1 - mu))``
    (the default of ``--warmup-steps``: 100 at mu 0.9).

    Heavy-ball's momentum averages over about ``1/(1 - mu)`` steps; the compensated
    momentum ``mu'`` over k times as many, so started from zero it lags the synchronous
    run for hundreds of steps, and a net that learns most of what it learns in those
    steps ends lower. Measured on digits (20 epochs, 440 steps, mean of 20 seeds, against
    single): no warm-up -0.89 points, 10 / 30 steps -0.75 / -0.64, 60 / 100 / 150 steps
    -0.03 / +0.24 / +0.01 (README). Ten spans (100 steps at mu 0.9) is past that edge
    with a margin.
    """
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    return math.ceil(spans / (1.0 - momentum) - 1e-9)


@dataclass(frozen=True)
class Lookahead:
    """Delay compensation of the delay-1 recurrence (``--delay-compensation``; module doc).

    ``k = None`` (the default) takes :func:`lookahead_k` of the user's momentum (15.005
    at mu 0.9, c 2); ``k = 1, c = 0`` is the plain recurrence. ``warmup = None`` (the
    default) takes :func:`lookahead_warmup` of it (100 at mu 0.9); 0 starts delayed.
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

# Element-wise passes over the region at the delay-1 step boundary, on the training thread
# (DelayedUpdate.gradients_ready): "none" puts the exchanged weights in front
# (params[...] = back) and copies the gradient out (sent[...] = grads); "lookahead" computes
# params = (1 + c) back - c base in three passes (multiply, base *= c, params -= base) and
# copies the gradient out.
BOUNDARY_PASSES = {"none": 2, "lookahead": 4}


# -- the engine -----------------------------------------------------------------------
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

    def _rescale_momentum(self):
        """At the switch from the warm-up to the compensated phase: v *= (1 - mu') / (1 - mu)
        (= 1/k), so the displacement the momentum still carries, mu v / (1 - mu) with no
        further gradient, stays what it was (module doc)."""
        (mu, _), (mu_c, _) = self._phases
        v = self.optimizer.v
        v *= v.dtype.type((1.0 - mu_c) / (1.0 - mu))

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
            if it == self.warmup and it > 0:    # the switch: keep the momentum's coasting
                self._rescale_momentum()
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
