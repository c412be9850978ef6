"""What every training strategy shares: step statistics and the data-parallel exchange.

A strategy owns how one optimizer step uses the ranks. The data-parallel ones
(single, ring, tree, master) differ only in three things, which subclasses supply:

* ``_reduce(grads)``       combine the ranks' mean gradients (in place),
* ``owned``                the slice of the flat parameter vector this rank updates,
* ``_distribute(params)``  give every rank the updated weights (in place).

Delay 0 runs reduce → update → distribute synchronously. Delay 1 (the circle
structure's delayed model update) runs the exchange of step t on the communication
stream while step t+1 computes on the weights complete at its start:
``g_t = G_t(w[t-1])`` (``g_0 = G_0(w[0])``) and ``w[t+1] = upd(w[t], g_t)``, with two
weight buffers and two gradient buffers that alternate (double buffering).
"""
import time
import zlib
from dataclasses import dataclass, field

import numpy as np

from ringnet.backend import to_numpy

__all__ = ["StepStats", "Strategy", "DataParallelStrategy"]


@dataclass
class StepStats:
    """Per-rank time and traffic totals; ``as_dict`` gives the --json fields."""
    steps: int = 0
    compute_s: float = 0.0
    comm_wait_s: float = 0.0    # time the training thread was blocked on communication
    comm_total_s: float = 0.0   # time communication took, hidden or not
    update_s: float = 0.0
    data_s: float = 0.0
    step_times: list = field(default_factory=list)

    def overlap(self):
        """Return the fraction of communication time hidden behind computation."""
        if self.comm_total_s <= 0:
            return 0.0
        hidden = self.comm_total_s - self.comm_wait_s
        return float(min(1.0, max(0.0, hidden / self.comm_total_s)))


def _synchronize(xp):
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


class Strategy:
    """Base of all strategies; see the module docstring for the contract."""
    name = None

    def __init__(self, model, make_optimizer, world, delay=0):
        self.model = model
        self.xp = model.xp
        self.world = world
        self.rank = world.Get_rank() if world is not None else 0
        self.size = world.Get_size() if world is not None else 1
        self.delay = delay
        self.make_optimizer = make_optimizer
        self.stats = StepStats()
        self.transport = None
        self.pending = None     # Handle of the exchange in flight (delay 1)

    # -- contract -----------------------------------------------------------
    def step(self, x, labels, it):
        """Run optimizer step ``it`` on this rank's part of the global batch; return (loss, correct)."""
        raise NotImplementedError

    def drain(self):
        """Wait for any exchange still in flight; afterwards the newest weights are complete."""
        self._wait_pending()

    def eval_model(self):
        """Return a full model holding the newest complete weights (call after drain)."""
        raise NotImplementedError

    def full_state(self):
        """Return (params, momentum, prev_params) as named host arrays; collective, valid on rank 0."""
        raise NotImplementedError

    def load_full_state(self, params, momentum=None, prev_params=None):
        """Load named host arrays (as written by ``full_state``) on every rank."""
        raise NotImplementedError

    def close(self):
        """Release streams and communicators."""

    # -- shared -------------------------------------------------------------
    def _wait_pending(self):
        """Block on the exchange in flight (if any), counting the time as exposed communication."""
        if self.pending is not None:
            t = time.perf_counter()
            pending, self.pending = self.pending, None
            pending.wait()
            self.stats.comm_wait_s += time.perf_counter() - t

    def _named(self, flat):
        flat = to_numpy(flat)
        return {name: flat[start:stop].reshape(shape).copy()
                for name, (start, stop, shape) in self.model.param_offsets().items()}

    def _flat(self, named):
        offsets = self.model.param_offsets()
        missing = set(offsets) - set(named)
        extra = set(named) - set(offsets)
        if missing or extra:
            raise ValueError(f"checkpoint parameters do not match model {self.model.name!r}: "
                             f"missing {sorted(missing)}, unexpected {sorted(extra)}")
        flat = np.empty(self.model.num_params, dtype=self.model.dtype)
        for name, (start, stop, shape) in offsets.items():
            value = np.asarray(named[name])
            if value.shape != tuple(shape):
                raise ValueError(f"checkpoint parameter {name} has shape {value.shape}, "
                                 f"model expects {tuple(shape)}")
            flat[start:stop] = value.ravel()
        return flat

    def bytes_moved(self):
        """Return (bytes_sent, bytes_recv) of this rank so far."""
        if self.transport is None:
            return 0, 0
        return int(self.transport.bytes_sent), int(self.transport.bytes_recv)

    def extra_summary(self):
        """Return mode-specific fields for the --json summary (FC parameter memory per rank)."""
        model = self.model
        try:
            first_fc = model.layers[model.fc_start()][0]
        except ValueError:
            return {}
        conv = model.param_offsets()[f"{first_fc}.weight"][0]
        fc = model.num_params - conv
        return {"conv_params": int(conv), "fc_params": int(fc), "fc_params_per_rank": int(fc)}

    def checksum(self):
        """Return a CRC32 of this rank's newest complete weights (bit-exact replica check)."""
        return zlib.crc32(np.ascontiguousarray(to_numpy(self.eval_model().params)).view(np.uint8))


class DataParallelStrategy(Strategy):
    """Every rank holds the whole model; gradients are combined, weights redistributed."""

    def __init__(self, model, make_optimizer, world, comm=None, delay=0):
        super().__init__(model, make_optimizer, world, delay)
        self.comm = comm
        self.transport = comm.transport if comm is not None else None
        from ringnet.layers import Dropout
        for _, layer in model.layers:
            if isinstance(layer, Dropout):      # this rank's rows of the global-batch mask
                layer.batch_part = (self.rank, self.size)
        size = model.num_params
        self.owned = self._owned_slice(size)
        self.optimizer = make_optimizer(self.owned.stop - self.owned.start)
        xp = self.xp
        if delay:
            self.weights = [model.params, xp.empty_like(model.params)]
            self.weights[1][...] = self.weights[0]
            self.grad_bufs = [model.grads, xp.empty_like(model.grads)]
            self.stream = comm.new_stream() if comm is not None else None
        else:
            self.weights = [model.params]
            self.grad_bufs = [model.grads]
            self.stream = None
        self.front = 0      # buffer the next step computes on
        self.latest = 0     # buffer that holds (or is receiving) the newest weights
        self._k = 0         # which gradient buffer the next step writes

    # -- what subclasses define ------------------------------------------------
    def _owned_slice(self, size):
        return slice(0, size)

    def _reduce(self, grads):
        pass

    def _distribute(self, params):
        pass

    # -- the exchange of one step: reduce, update the owned slice, distribute ---
    def _exchange(self, grads, src, dst, it):
        t0 = time.perf_counter()
        self._reduce(grads)
        t1 = time.perf_counter()
        lo, hi = self.owned.start, self.owned.stop
        if hi > lo:
            if dst is not src:
                dst[lo:hi] = src[lo:hi]
            self.optimizer.step(dst[lo:hi], grads[lo:hi], it)
            _synchronize(self.xp)
        t2 = time.perf_counter()
        self._distribute(dst)
        t3 = time.perf_counter()
        self.stats.comm_total_s += (t1 - t0) + (t3 - t2)
        self.stats.update_s += t2 - t1

    def step(self, x, labels, it):
        t0 = time.perf_counter()
        model = self.model
        if self.delay:
            model.bind_flat(params=self.weights[self.front], grads=self.grad_bufs[self._k])
        loss, correct = model.loss_and_grad(x, labels)
        _synchronize(self.xp)
        t1 = time.perf_counter()
        self.stats.compute_s += t1 - t0
        if not self.delay:
            before = self.stats.comm_total_s
            self._exchange(self.model.grads, self.model.params, self.model.params, it)
            # a synchronous exchange exposes all of its communication
            self.stats.comm_wait_s += self.stats.comm_total_s - before
        else:
            self._wait_pending()
            src = self.weights[self.latest]
            target = 1 - self.latest
            grads = self.grad_bufs[self._k]
            if self.stream is not None:
                self.pending = self.stream.submit(self._exchange, grads, src, self.weights[target], it)
            else:  # one process, delay 1: the recurrence without a communicator
                self._exchange(grads, src, self.weights[target], it)
            self.front, self.latest = self.latest, target
            self._k = 1 - self._k
        self.stats.steps += 1
        self.stats.step_times.append(time.perf_counter() - t0)
        return loss, correct

    def eval_model(self):
        self.model.bind_flat(params=self.weights[self.latest])
        return self.model

    # -- checkpoints ---------------------------------------------------------
    def _full_momentum(self):
        """Return the whole momentum vector on rank 0 (None elsewhere)."""
        return to_numpy(self.optimizer.state_dict()["momentum"])

    def full_state(self):
        self.drain()
        params = self._named(self.weights[self.latest])
        prev = None
        if self.delay and self.front != self.latest:
            prev = self._named(self.weights[self.front])
        momentum = self._full_momentum()
        momentum = self._named(momentum) if momentum is not None else None
        return params, momentum, prev

    def load_full_state(self, params, momentum=None, prev_params=None):
        self.drain()
        xp = self.xp
        flat = self._flat(params)
        self.weights[0][...] = xp.asarray(flat)
        self.latest = self.front = 0
        if self.delay:
            self.weights[1][...] = xp.asarray(self._flat(prev_params) if prev_params else flat)
            if prev_params:
                self.front = 1
        self.model.bind_flat(params=self.weights[self.latest])
        lo, hi = self.owned.start, self.owned.stop
        full = self._flat(momentum) if momentum else np.zeros(self.model.num_params, self.model.dtype)
        self.optimizer.load_state_dict({"momentum": full[lo:hi]})

    def close(self):
        self.drain()
        if self.stream is not None:
            self.stream.close()
            self.stream = None
