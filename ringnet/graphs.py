"""CUDA graphs (``--cuda-graphs``): a training step's device work captured once, replayed.

On a GPU the step is host-bound: each of its kernel launches costs CuPy 10-25 us of
Python, far more than the kernel. :class:`GraphStep` runs the step's device work (the
forward, the loss, the backward and, in single mode, the SGD update) eagerly for
``WARMUP`` steps (kernels compiled, buffers made), then captures it once into a CUDA
graph and replays that graph each step: one launch instead of dozens.

A graph replays its kernels with the arguments and memory they had when captured, so
nothing that changes from step to step may be an argument, and nothing it uses may be
freed:

- **inputs** are copied into static buffers (one per model and batch size) before each
  step; **per-step values** (the learning rate, each Dropout's stream keys) are written
  to device memory the kernels read (:meth:`ringnet.optim.SGD.set_lr`,
  :meth:`ringnet.layers.Dropout.set_keys`). These copies are asynchronous and stay
  outside the graph;
- the warm-up and the capture allocate from a **private memory pool**, so memory the
  graph uses never goes back to the pool the rest of the run allocates from; every
  device array the layers hold when the capture ends is kept for the graph's life;
- the GEMMs go through a cuBLAS handle of ringnet's own (:mod:`ringnet.layers.gemm`):
  CuPy's ``matmul`` cannot be captured;
- the loss and the correct count the graph writes each step are copied into a ring of
  device slots after each replay (one launch), so the losses the training loop reads
  every ``GPU_LOSS_EVERY`` steps are each step's own.

**Checked before use.** The capture step is also run eagerly from the same state; the
replay must give the same loss, correct count, weights, gradients and momentum bit for
bit. If it does not, or the capture itself fails, graphs are turned off for the rest of
the run, the eager result kept and the reason in the summary (``auto``), or the run stops
with one line saying so (``on``). The data-parallel modes capture the forward and backward and
run their exchange and update outside the graph, ordered on the stream as before. At delay
0 with buckets the step is captured as one graph per bucket span, cut after the backward of
each layer that completes a bucket; the replay launches them in turn and starts that
bucket's exchange between them, so it overlaps the rest of the backward as in an eager
step. split-fc exchanges activations inside its step and runs without graphs.

The same class runs on the recording stand-in for CuPy (:mod:`ringnet.testing.recording_cupy`),
where a "graph" is the list of recorded launches replayed on the same memory: CI checks
there that the replayed steps equal the eager ones and that two consecutive steps issue
the same launches on the same buffers with the same arguments
(:func:`capture_signature`).
"""
import contextlib
import gc

import numpy as np

from ringnet.errors import TrainingError, UsageError
from ringnet.layers import Dropout, cuda_kernels, cuda_ops, gemm
from ringnet.stats import GPU_LOSS_EVERY

__all__ = ["CHOICES", "WARMUP", "GraphStep", "GraphMismatch", "CudaGraphs", "StandinGraphs",
           "unavailable", "setup", "status", "capture_signature"]

CHOICES = ("auto", "on", "off")
WARMUP = 2                      # eager steps before the capture
RING = 2 * GPU_LOSS_EVERY       # device slots of the per-step loss and correct count


class GraphMismatch(TrainingError):
    """The replayed step differed from the eager step it was captured from (``on``)."""


def unavailable(xp, strategy):
    """Return why ``strategy`` on array module ``xp`` cannot use CUDA graphs, or None."""
    if xp is np:
        return "the arrays live on the CPU"
    if getattr(strategy, "graph_step", None) is None:
        return f"{strategy.name} exchanges activations inside its step"
    return None


def setup(choice, strategy, xp):
    """Apply ``--cuda-graphs choice`` (auto, on, off) to ``strategy``, whose arrays live on
    ``xp``; return what the run header says of it. ``on`` where graphs cannot run is a
    UsageError naming why."""
    if choice not in CHOICES:
        raise UsageError(f"--cuda-graphs must be auto, on or off, got {choice!r}")
    if choice == "off":
        return "off (asked for)"
    why = unavailable(xp, strategy)
    if why is not None:
        if choice == "on":
            raise UsageError(f"--cuda-graphs on: {why}; use --cuda-graphs auto or off")
        return f"off (auto: {why})"
    strategy.graph_step(CudaGraphs(xp), strict=choice == "on")
    step = strategy.graphs
    if step.optimizer is not None:
        what = "forward, backward and update"
    elif step.splits:
        what = (f"forward and backward as {len(step.splits) + 1} graphs, one per delay-0 "
                f"bucket span, each bucket's exchange started between them; the update outside")
    else:
        what = "forward and backward; the exchange and update outside"
    return f"on ({'asked for' if choice == 'on' else 'auto'}: {what}, captured after " \
           f"{WARMUP} eager steps)"


def status(strategy):
    """What the run's summary says of its graphs: "on (N steps replayed)", or "off (why)"."""
    step = getattr(strategy, "graphs", None)
    if step is None:                      # never on: what setup said
        return getattr(getattr(strategy, "placement", None), "graphs", None) or "off"
    if step.off is not None:
        return f"off ({step.off})"
    return f"on ({step.replays} steps replayed)"


class _Backend:
    """What both backends share: one graph, or several cut where the captured work says."""

    def capture(self, fn):
        """Return (graph, fn()) with fn's device work captured, not run."""
        segments, out = self.capture_segments(lambda cut: fn())
        return segments[0], out

    def capture_segments(self, fn):
        """Return ([graph, ...], fn(cut)): fn's device work captured as consecutive graphs,
        a new one begun at each call of ``cut()``; launched in order they do fn's work."""
        raise NotImplementedError


class CudaGraphs(_Backend):
    """Capture and replay with CuPy: a side stream to capture on (the legacy default stream
    cannot capture), a private memory pool, replays on the current stream."""

    def __init__(self, cupy):
        self.cupy = cupy
        self.pool = cupy.cuda.MemoryPool()
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def allocating(self):
        return self.cupy.cuda.using_allocator(self.pool.malloc)

    def capture_segments(self, fn):
        cuda = self.cupy.cuda
        relaxed = cuda.runtime.streamCaptureModeRelaxed   # other threads may call CUDA meanwhile
        current = cuda.get_current_stream()
        self.stream.wait_event(current.record())
        segments = []

        def cut():
            segments.append(self.stream.end_capture())
            self.stream.begin_capture(mode=relaxed)
        with self.stream:
            gemm.bind()                     # the handle on this stream before capturing
            self.stream.begin_capture(mode=relaxed)
            try:
                out = fn(cut)
            except BaseException:
                with contextlib.suppress(Exception):
                    self.stream.end_capture()
                raise
            segments.append(self.stream.end_capture())
        current.wait_event(self.stream.record())
        return segments, out

    captures_run = False                    # captured work is recorded, not run

    def launch(self, graph):
        graph.launch(self.cupy.cuda.get_current_stream())

    def close(self):
        """After the graphs are dropped: wait for the capture stream, and give the pool's
        blocks nobody holds back to CUDA."""
        if self.stream is not None:
            self.stream.synchronize()
            self.stream = None
        self.pool.free_all_blocks()


class StandinGraphs(_Backend):
    """Capture and replay on the recording stand-in: the "graph" is the recorded launches."""

    def __init__(self, recorder):
        self.recorder = recorder
        self.pool = recorder.cuda.MemoryPool()

    def allocating(self):
        return self.recorder.cuda.using_allocator(self.pool.malloc)

    def capture_segments(self, fn):
        recorder, segments = self.recorder, []

        def cut():
            segments.append(recorder.captured)
            recorder.captured = []
        with recorder.capturing():
            out = fn(cut)
            segments.append(recorder.captured)
        return segments, out

    captures_run = True                     # NumPy computes while it records

    def launch(self, graph):
        self.recorder.replay(graph)

    def close(self):
        self.pool.free_all_blocks()


def _held_arrays(objects, xp):
    """Every device array the objects hold in their attributes (one level into dicts,
    lists and tuples): what a graph may use that was made before it."""
    found = []
    for obj in objects:
        for value in vars(obj).values():
            items = value.values() if isinstance(value, dict) else \
                value if isinstance(value, (list, tuple)) else (value,)
            found.extend(v for v in items if isinstance(v, xp.ndarray))
    return found


class GraphStep:
    """The device work of one training step, as one replayed CUDA graph.

    ``model``: the rank's :class:`~ringnet.models.Model`; ``optimizer``: an SGD over the
    whole flat buffer to update in the graph (single mode), or None (the strategy
    updates); ``backend``: :class:`CudaGraphs` or :class:`StandinGraphs`; ``strict``:
    raise :class:`GraphMismatch` when the replay differs from the eager step (``on``),
    else fall back to eager steps (``auto``), saying why in ``self.off``.

    ``splits``: layer indices (last first) after whose backward the step is cut into
    another graph, and ``at_split(index)`` runs between the graphs of a replay (a delay-0
    bucket's exchange starting); ``self.graph`` is the list of graphs (one without
    splits). The eager steps (warm-up, and after a fall-back) run the model's own
    ``layer_hook``.
    """

    def __init__(self, model, optimizer, backend, warmup=WARMUP, strict=False, splits=(),
                 at_split=None):
        self.model, self.optimizer, self.backend = model, optimizer, backend
        self.xp = model.xp
        self.warmup, self.strict = int(warmup), strict
        self.splits = tuple(sorted(splits, reverse=True))
        if self.splits and at_split is None:
            raise ValueError("GraphStep: splits need an at_split to run between the graphs")
        self.at_split = at_split
        self.dropouts = [layer for _, layer in model.layers if isinstance(layer, Dropout)]
        for layer in self.dropouts:
            layer.keys_preset = True         # their keys come from _load, outside the graph
        self.x = self.labels = None          # static inputs
        self.graph = self.outputs = None
        self.off = None                      # why eager steps run instead (after a mismatch)
        self.steps = 0                       # steps run through this object
        self.replays = 0
        self._keep = []
        self._ring = (self.xp.zeros(RING, dtype=model.dtype), self.xp.zeros(RING, dtype=np.int64))
        self.closed = False
        # The buffers the layers make in the warm-up come from the backend's private pool
        # and hold it only weakly (as CuPy's pool arrays do): the model keeps the pool for
        # as long as it keeps them, also after this step is closed and gone.
        pool = getattr(backend, "pool", None)
        if pool is not None:
            model.__dict__.setdefault("_graph_pools", []).append(pool)

    def close(self):
        """Drop the graphs and every array kept for them, and give the private pool's
        blocks nobody holds back (the layers' buffers stay); no step may follow. The
        strategy's ``close`` calls it, so a finished run frees its graphs here, on this
        thread, and not whenever the garbage collector gets to them."""
        if self.closed:
            return
        self.closed = True
        self.graph = self.outputs = None
        self._keep, self._batch, self.x, self.labels = [], None, None, None
        self.at_split = None
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()

    # -- one step ----------------------------------------------------------------------
    def step(self, x, labels, it):
        """Run step ``it`` on the batch (host or device arrays); return (loss, correct) as
        0-d device arrays of this step alone."""
        if self.closed:
            raise RuntimeError("GraphStep.step after close()")
        with gemm.routed():                  # the eager steps multiply as the graph does
            return self._step(x, labels, it)

    def _step(self, x, labels, it):
        static = self._load(x, labels, it)
        self.steps += 1
        if not static or self.off is not None:
            return self._record(*self._compute(self.model.layer_hook))
        if self.graph is None:
            if self.steps <= self.warmup:
                with self.backend.allocating():
                    return self._record(*self._compute(self.model.layer_hook))
            return self._capture(it)
        self._launch(between=True)
        self.replays += 1
        return self._record(*self.outputs)

    def _launch(self, between):
        """Replay the step: its graphs in order, ``at_split`` after each cut (``between``)."""
        for k, graph in enumerate(self.graph):
            self.backend.launch(graph)
            if between and k < len(self.splits):
                self.at_split(self.splits[k])

    def _load(self, x, labels, it):
        """Copy the inputs into the static buffers and write the step's device scalars;
        return whether the batch fits them (another batch size runs eagerly)."""
        xp, model = self.xp, self.model
        shape = (len(x),) + model.input_shape
        if self.x is None:
            self.x = xp.empty(shape, dtype=model.dtype)
            self.labels = xp.empty(len(x), dtype=np.int64)
        if self.optimizer is not None:
            self.optimizer.set_lr(xp, it)
        for layer in self.dropouts:
            layer.set_keys(xp)
            layer.step += 1
        if tuple(x.shape) != shape or self.x.shape != shape:
            self._batch = (model.as_input(x), xp.asarray(labels).reshape(-1))
            return False
        for target, value in ((self.x, x), (self.labels, labels)):
            if isinstance(value, xp.ndarray):                 # already on the device
                target[...] = value.reshape(target.shape)
            else:
                cuda_ops.upload(xp, target, np.asarray(value).reshape(target.shape))
        self._batch = (self.x, self.labels)
        return True

    def _compute(self, hook=None):
        """The captured work: forward, loss, backward (and the update), with ``hook`` as
        the model's layer hook meanwhile (None: no exchange starts in here)."""
        model = self.model
        hook, model.layer_hook = model.layer_hook, hook
        try:
            loss, correct = model.loss_and_grad(*self._batch)
            if self.optimizer is not None:
                self.optimizer.apply(model.params, model.grads)
        finally:
            model.layer_hook = hook
        return loss, correct

    def _cut_compute(self, cut):
        """:meth:`_compute` cut into another graph after the backward of each split layer."""
        splits = set(self.splits)

        def hook(phase, index):
            if phase == "backward" and index in splits:
                cut()
        return self._compute(hook)

    def _record(self, loss, correct):
        """Copy this step's loss and count into their ring slots; return the slots."""
        slot = (self.steps - 1) % RING
        ring_loss, ring_correct = self._ring
        cuda_kernels.launch(self.xp, "step_record", self.model.dtype, 1,
                            (loss, correct, ring_loss, ring_correct, np.int64(slot)))
        return ring_loss[slot:slot + 1].reshape(()), ring_correct[slot:slot + 1].reshape(())

    # -- capture and its check -----------------------------------------------------------
    def _state(self):
        arrays = [self.model.params, self.model.grads]
        if self.optimizer is not None:
            arrays.append(self.optimizer.v)
        return arrays

    def _capture(self, it):
        """Run step ``it`` eagerly, capture it from the same state, replay, and compare."""
        before = [a.copy() for a in self._state()]
        with self.backend.allocating():
            eager = self._compute()
            after = [a.copy() for a in self._state()] + [eager[0].copy(), eager[1].copy()]
            for target, value in zip(self._state(), before):
                target[...] = value
            # Collect now, as torch.cuda.graph does: a collection inside the capture could
            # free device memory or destroy CUDA objects, which a capturing stream refuses.
            gc.collect()
            try:
                graph, outputs = self.backend.capture_segments(self._cut_compute)
            except Exception as exc:                    # CUDA or CuPy refused the capture
                return self._fall_back(f"step {it} could not be captured "
                                       f"({type(exc).__name__}: {exc})", after)
            if len(graph) != len(self.splits) + 1:
                return self._fall_back(f"step {it} was captured as {len(graph)} graphs, "
                                       f"not one per bucket span ({len(self.splits) + 1})", after)
        if self.backend.captures_run:                   # the stand-in ran what it captured
            for target, value in zip(self._state(), before):
                target[...] = value
        self.graph, self.outputs = graph, outputs
        self._keep = _held_arrays([layer for _, layer in self.model.layers] +
                                  ([self.optimizer] if self.optimizer is not None else []), self.xp)
        self._launch(between=False)                     # every bucket starts after it
        replayed = self._state() + [outputs[0], outputs[1]]
        names = ["weights", "gradients", "momentum"][:len(self._state())] + ["loss", "correct count"]
        differ = [name for name, a, b in zip(names, after, replayed)
                  if not bool(self.xp.array_equal(a, b, equal_nan=True))]
        if differ:
            return self._fall_back(f"the CUDA graph's replay of step {it} differs from the "
                                   f"eager step in its {', '.join(differ)}", after)
        self.replays += 1
        return self._record(*outputs)

    def _fall_back(self, message, after):
        """``on``: raise GraphMismatch(message). ``auto``: eager steps from now on, this one's
        result the eager step's (``after``: the state, then the loss and the count)."""
        if self.strict:
            raise GraphMismatch(message)
        self.off, self.graph, self.outputs, self._keep = message, None, None, []
        for target, value in zip(self._state(), after):
            target[...] = value
        return self._record(after[-2], after[-1])


def capture_signature(recorder, run, steps=2):
    """Run ``run(i)`` for i in range(steps) on the recording stand-in and return, per step,
    the signature of its launches: (kind, name, operands) with arrays named by memory (a
    buffer made in the step by its order of making) and numbers by value. A CUDA graph
    replays the first; any difference from it is a value or buffer it would get wrong."""
    out = []
    for i in range(steps):
        recorder.begin_step()
        run(i)
        out.append([s for s in recorder.signatures if s[0] in recorder.launch_kinds])
    return out
