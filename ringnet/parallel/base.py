"""What every training strategy shares, and the data-parallel strategy.

A strategy owns how one optimizer step uses the ranks. The data-parallel ones
(single, ring, tree, master) keep the whole model on every rank and differ only in
the exchange *plan* (``ringnet.parallel.plans``): who combines the gradients, who
updates which slice, how the weights come back. Their step is: forward and backward
on this rank's samples, then :class:`~ringnet.parallel.delayed_update.DelayedUpdate` runs
the exchange (delay 0: blocking; delay 1: on the communication stream, the delayed
model update of DESIGN.md).
"""
import weakref
import zlib
from contextlib import contextmanager
from typing import Callable, Dict, Optional, Tuple

import numpy as np

from ringnet.backend import to_numpy
from ringnet.comm.stream import progress_all
from ringnet.layers import Dropout
from ringnet.parallel.delayed_update import DelayedUpdate
from ringnet.parallel.plans import LocalPlan, exchange_buckets, exchange_on_stream
from ringnet.parallel.traffic import StepTraffic
from ringnet.stats import StepStats

__all__ = ["Strategy", "DataParallelStrategy", "StepStats", "StepTraffic"]


class Strategy:
    """Base of all strategies: how one optimizer step uses the ranks.

    ``model``: the :class:`~ringnet.models.Model` this rank computes with (its flat
    buffers are the strategy's to bind); ``make_optimizer(n)``: returns an optimizer
    for a flat slice of ``n`` parameters; ``world``: the mpi4py communicator of the
    ranks (None for one process); ``delay``: 0 or 1 (see ``exchange``).
    ``stats`` (:class:`~ringnet.stats.StepStats`) is filled by every step.
    """
    name = None

    def __init__(self, model, make_optimizer: Callable[[int], object], world, delay: int = 0):
        self.model = model
        self.xp = model.xp
        self.world = world
        self.rank = world.Get_rank() if world is not None else 0
        self.size = world.Get_size() if world is not None else 1
        self.delay = delay
        self.make_optimizer = make_optimizer
        self.stats = StepStats(gpu=None if self.xp is np else self.xp)
        self.transport = None
        self.graphs = None        # a GraphStep once graph_step is called (--cuda-graphs)

    # -- contract -----------------------------------------------------------
    def step(self, x, labels, it: int) -> Tuple[float, int]:
        """Run optimizer step ``it`` on this rank's part of the global batch.

        ``x``: this rank's (B/N, C, H, W) images; ``labels``: their B/N class indices.
        Returns (loss, correct): the loss this rank computed (split-fc: the global
        batch's) and how many of this rank's samples the model classified right.
        """
        raise NotImplementedError

    def drain(self) -> None:
        """Wait for any exchange still in flight; afterwards the newest weights are complete."""

    def eval_model(self):
        """Return the model holding the newest complete weights (collective in split-fc).

        The next ``step`` puts back the weights it computes on, so evaluate before it.
        """
        raise NotImplementedError

    def full_state(self) -> Tuple[Dict[str, np.ndarray], Optional[Dict[str, np.ndarray]],
                                  Optional[Dict[str, np.ndarray]]]:
        """Return (params, momentum, prev_params) as name -> host array (PyTorch layout).

        Collective; complete on rank 0 (momentum may be None elsewhere). ``prev_params``
        is None at delay 0: at delay 1 it is what the next step computes on.
        """
        raise NotImplementedError

    def load_full_state(self, params: Dict[str, np.ndarray], momentum=None, prev_params=None,
                        lookahead_base=None) -> None:
        """Load name -> host array dicts as ``full_state`` (and ``lookahead_state``) return them,
        on every rank.

        Raises ValueError when the names or shapes do not match the model.
        """
        raise NotImplementedError

    def lookahead_state(self) -> Optional[Dict[str, np.ndarray]]:
        """Return the look-ahead's w[t-1] as name -> host array, or None (call after ``full_state``)."""
        return None

    def close(self) -> None:
        """Wait for the exchange in flight and release the streams."""

    graph_step = None             # strategies that can run their step as a CUDA graph

    # -- what a step sends (pure: no communicator) ----------------------------
    @classmethod
    def fits(cls, model, n: int) -> bool:
        """True when this strategy can run ``model`` on ``n`` ranks."""
        return True

    @classmethod
    def exchange_region(cls, model) -> Tuple[int, int]:
        """Return (elements, layers): the plan exchanges the parameters of ``model.layers[:layers]``,
        the first ``elements`` of the flat buffer."""
        return model.num_params, len(model.layers)

    @classmethod
    def step_traffic(cls, model, n: int, batch: int, communicator: Optional[str] = None,
                     delay: int = 0, buckets=None) -> StepTraffic:
        """Return what one step sends over ``n`` ranks with global ``batch`` (a
        :class:`~ringnet.parallel.traffic.StepTraffic`), from the bounds the strategy runs with.

        ``communicator``: the name of the communicator the mode uses (its route; None: no
        communication); ``buckets``: the delay-0 buckets [(lo, hi, layer)] the exchange runs
        in (None: the strategy's own, :func:`~ringnet.parallel.plans.exchange_buckets`).
        """
        raise NotImplementedError

    @classmethod
    def _exchange_traffic(cls, plan_type, model, n, communicator, delay, buckets, what=""):
        """The StepTraffic of ``plan_type``'s exchange of :meth:`exchange_region` over ``n`` ranks."""
        size, stop = cls.exchange_region(model)
        if buckets is None:
            buckets = (exchange_buckets(model, stop, delay)
                       if communicator is not None and n > 1 and size else [])
        parts = [(lo, hi) for lo, hi, _ in buckets] or [(0, size)]
        return StepTraffic(n, size, stop, plan_type.traffic(size, n, model.dtype.itemsize, parts,
                                                            communicator, what))

    # -- the exchange engine of the strategies that use one ------------------
    def _exchange_engine(self, params, grads, plan, comm, upto: int, bucket_size=None,
                         lookahead=None) -> None:
        """Set ``self.engine``: a :class:`DelayedUpdate` of ``plan`` over ``params``/``grads``.

        ``comm``: the communicator (None for one process); ``upto``: the layers [0, upto)
        whose parameters ``params`` holds. At delay 0 with a communicator their gradient is
        cut into buckets of ``bucket_size`` bytes (None: :func:`bucket_bytes`; 0: none) that
        :meth:`layer_done` starts during the backward. The engine gets a stream of ``comm``
        when it runs anything in the background (delay 1 or buckets).
        """
        self.buckets = []
        if comm is not None and len(params):
            self.buckets = exchange_buckets(self.model, upto, self.delay, bucket_size)
        # layer index whose backward completes bucket k -> k
        self._bucket_at = {layer: k for k, (_, _, layer) in enumerate(self.buckets)}
        self._it = 0
        on_stream = comm is not None and exchange_on_stream(self.delay, self.buckets)
        stream = comm.new_stream() if on_stream else None
        self.engine = DelayedUpdate(params, grads, plan,
                                    self.make_optimizer(plan.owned.stop - plan.owned.start),
                                    self.stats, delay=self.delay, stream=stream,
                                    lookahead=lookahead,
                                    buckets=[(lo, hi) for lo, hi, _ in self.buckets] or None)

    def layer_done(self, phase: str, index: int) -> None:
        """After each layer: progress the streams; start a bucket whose gradient is complete."""
        if phase == "backward" and index in self._bucket_at:
            self.engine.part_ready(self._bucket_at[index], self._it)
        progress_all()

    @contextmanager
    def _exchange_step(self, it: int):
        """Frame of step ``it`` around its compute: the ``step`` span, the weights to compute
        on, the layer hook that starts buckets; on leaving, the gradients go to the engine."""
        with self.stats.span("step"):
            self.engine.show_front()
            self._it = it
            self.model.layer_hook = self.layer_done
            try:
                yield
            finally:
                self.model.layer_hook = None
            self.engine.gradients_ready(it)

    # -- shared -------------------------------------------------------------
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

    def wait_totals(self):
        """Return (CPU seconds, waits, waits that slept) of this rank's training thread's
        waits for transfers so far (:class:`~ringnet.comm.transport.WaitAccount`)."""
        account = getattr(self.transport, "wait_account", None)
        return (0.0, 0, 0) if account is None else account.totals()

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
    """Every rank holds the whole model; the plan combines gradients and redistributes weights.

    ``plan_type``: the class of the plan (subclasses choose); :meth:`_plan` makes it.
    """
    plan_type = LocalPlan

    def __init__(self, model, make_optimizer, world, comm=None, delay=0, lookahead=None,
                 bucket_size=None):
        super().__init__(model, make_optimizer, world, delay)
        self.comm = comm
        self.transport = comm.transport if comm is not None else None
        for _, layer in model.layers:
            if isinstance(layer, Dropout):      # this rank's rows of the global-batch mask
                layer.batch_part = (self.rank, self.size)
        size, stop = self.exchange_region(model)
        self._exchange_engine(model.params, model.grads, self._plan(size), comm,
                              stop, bucket_size=bucket_size, lookahead=lookahead)

    def _plan(self, size):
        """Return the exchange plan over a flat buffer of ``size``."""
        return LocalPlan(size)

    @classmethod
    def step_traffic(cls, model, n, batch, communicator=None, delay=0, buckets=None):
        return cls._exchange_traffic(cls.plan_type, model, n, communicator, delay, buckets)

    @property
    def owned(self):
        """The slice of the flat parameter vector this rank updates."""
        return self.engine.plan.owned

    @property
    def optimizer(self):
        """The optimizer of the owned slice (its momentum covers that slice only)."""
        return self.engine.optimizer

    def step(self, x, labels, it):
        with self._exchange_step(it):
            with self.stats.span("compute", phase="forward_backward"):
                if self.graphs is not None:
                    loss, correct = self.graphs.step(x, labels, it)
                else:
                    loss, correct = self.model.loss_and_grad(x, labels)
        return loss, correct

    def graph_step(self, backend, strict=False, optimizer=None):
        """Run every later step's forward and backward (and, with ``optimizer``, its update)
        as a replayed CUDA graph (:class:`ringnet.graphs.GraphStep`; the exchange, and the
        update without ``optimizer``, stay outside it); return it. With delay-0 buckets the
        step is one graph per bucket span, and each bucket's exchange starts between them
        (the first layer's bucket: after the last graph, as in an eager step)."""
        from ringnet.graphs import GraphStep
        splits = [layer for layer in self._bucket_at if layer > 0]
        # Weakly: the strategy holds the graph step, and a closure over the strategy would
        # make the two a cycle that only the garbage collector frees, at a random time.
        done = weakref.WeakMethod(self.layer_done)
        self.graphs = GraphStep(self.model, optimizer, backend, strict=strict, splits=splits,
                                at_split=lambda layer: done()("backward", layer))
        return self.graphs

    def drain(self):
        self.engine.drain()

    def eval_model(self):
        self.engine.show_newest()
        return self.model

    # -- checkpoints ---------------------------------------------------------
    def full_state(self):
        newest, front, momentum = self.engine.state()
        return (self._named(newest), self._named(momentum) if momentum is not None else None,
                self._named(front) if front is not None else None)

    def lookahead_state(self):
        base = self.engine.lookahead_base()
        return self._named(base) if base is not None else None

    def load_full_state(self, params, momentum=None, prev_params=None, lookahead_base=None):
        self.engine.load(self._flat(params), self._flat(prev_params) if prev_params else None,
                         self._flat(momentum) if momentum else None,
                         self._flat(lookahead_base) if lookahead_base else None)

    def close(self):
        self.drain()
        if self.graphs is not None:          # its graphs and pool freed now, on this thread
            self.graphs.close()
        if self.engine.stream is not None:
            self.engine.stream.close()
            self.engine.stream = None
