"""Compute profiles measured here: layers timed inside real training steps, or alone."""
import sys
import time

import numpy as np

from ringnet.perfmodel.compute import (ISOLATED_LAYERS, TRAINING_STEPS, ComputeProfile,
                                       fit_batch_times, median_time, load_compute)
from ringnet.perfmodel.roofline import GPUS, roofline_compute
from ringnet.models import build_model

__all__ = ["measure_compute", "isolated_compute", "compute_profile", "layer_times"]


def layer_times(model, x, iters, clock=time.perf_counter):
    """Return [(name, forward ms, backward ms)] medians over ``iters`` passes (``clock``:
    wall time by default, ``time.process_time`` for CPU time). Layers run as in a training
    step: a ReLU that its neighbouring pool applies (on the CPU) takes next to no time, and
    the pool's time includes it."""
    fwd = {name: [] for name, _ in model.layers}
    bwd = {name: [] for name, _ in model.layers}
    for _ in range(iters):
        a = model.as_input(x)
        for index, (name, layer) in enumerate(model.layers):
            t0 = clock()
            a = model.forward_layer(index, a, True)
            fwd[name].append(clock() - t0)
        d = np.ones_like(a) / a.size
        for name, layer in reversed(model.layers):
            t0 = clock()
            d = layer.backward(d)
            bwd[name].append(clock() - t0)
    return [(name, 1e3 * float(np.median(fwd[name])), 1e3 * float(np.median(bwd[name])))
            for name, _ in model.layers]


def _training_steps(name, batch, dtype, seed):
    """Set up one single-mode run of ``python -m ringnet.train`` (its own ``setup``: data
    set, loader with its prefetch thread, model, optimizer, strategy) in this process and
    return ``step()``: run the next training step, return its marks and the CPU time of
    its training thread in the step's ``compute`` span (s)."""
    from mpi4py import MPI
    from ringnet.config import TrainConfig
    from ringnet.train import set_dropout_step, setup
    cfg = TrainConfig(model=name, mode="single", dataset="synthetic", batch_size=batch,
                      steps=1 << 30, dtype=dtype, device="cpu", seed=seed, quiet=True,
                      progress=False)
    cfg, _, _, model, strategy, loader = setup(cfg, MPI.COMM_SELF)
    marks = []
    layer_done, loss_backward = strategy.layer_done, model.loss_layer.backward

    def hook(phase, index):          # after each layer, before the strategy's own hook
        marks.append((phase, index, time.perf_counter()))
        layer_done(phase, index)

    def loss_done(*args, **kwargs):
        out = loss_backward(*args, **kwargs)
        marks.append(("loss", -1, time.perf_counter()))
        return out
    strategy.layer_done, model.loss_layer.backward = hook, loss_done

    def batches():
        epoch = 0
        while True:
            yield from loader.epoch(epoch)
            epoch += 1
    data, it = batches(), [0]

    def step():
        x, labels = next(data)
        marks.clear()
        set_dropout_step(model, it[0])
        cpu = strategy.stats.compute_cpu_s
        strategy.step(x, labels, it[0])
        it[0] += 1
        return list(marks), strategy.stats.compute_cpu_s - cpu
    return model, step


def _split_step(n_layers, marks, spans):
    """One step's hook marks and spans -> (forward s per layer, backward s per layer,
    rest s: loss and the step's glue, update s). The marks telescope: the layer times,
    the rest and the update add up to the step span."""
    fwd = {i: t for phase, i, t in marks if phase == "forward"}
    bwd = {i: t for phase, i, t in marks if phase == "backward"}
    loss = next(t for phase, _, t in marks if phase == "loss")
    (c0, cd), (_, ud), (_, sd) = spans["compute"], spans["update"], spans["step"]
    last = n_layers - 1
    forward = [fwd[0] - c0] + [fwd[i] - fwd[i - 1] for i in range(1, n_layers)]
    backward = [bwd[i] - (bwd[i + 1] if i < last else loss) for i in range(n_layers)]
    rest = (loss - fwd[last]) + (c0 + cd - bwd[0]) + (sd - cd - ud)
    return forward, backward, rest, ud


def _step_medians(rows, mean=False):
    """[(forward list, backward list, rest, update, step)] of several steps -> the parts'
    medians (forward..., backward..., rest, update) scaled to add up to the median step,
    then the median step. On a loaded machine each step loses its core in a few of its
    parts; medians part by part would leave that out of the total. ``mean``: under a CPU
    quota, whose periods make steps of one work a period apart (the mean is the rate the
    quota allows): each part's least time scaled to the mean step. There the quota's hold
    lands where the period's budget runs out, step after step in the same part where the
    steps have one length, and a median keeps it in that part (measured at half a core:
    LeNet's rest at batch 64 from 0.6 to 3.0 ms at a core's speed, profile to profile,
    its least time 0.2 ms in each); each part's least time is its own work."""
    pick = np.min if mean else np.median
    cols = [float(pick(col))
            for col in zip(*[f + bw + [rest, upd] for f, bw, rest, upd, _ in rows])]
    steps = [row[-1] for row in rows]
    total = float(np.mean(steps) if mean else np.median(steps))
    return [c * total / max(sum(cols), 1e-12) for c in cols] + [total]


def measure_compute(models, batches=(16, 32, 64), rounds=4, steps=6, dtype="float32", seed=0,
                    progress=None):
    """Time every layer inside real training steps here; fit the profile ``a + b * batch``.

    Each batch size runs its own single-mode training (``ringnet.train``'s set-up and
    ``strategy.step``: the same buffers, order, data loader and optimizer as a training
    run), in blocks of ``steps`` consecutive steps (the first of each block, which follows
    another model's block, is not kept), the batch sizes taking turns ``rounds`` times so
    that a change of the machine's load hits them alike. A layer's time is the interval
    between the model's ``layer_hook`` calls, so the layers, the rest of the step (loss,
    the strategy's glue) and the update add up to the step; their medians over the steps
    are scaled to add up to the median step (under a CPU quota: their least times, scaled
    to the mean step; see :func:`_step_medians`). The update's cost per
    parameter comes from these steps' updates (every parameter, after the backward),
    its cost per call and the reduction's add from small and large calls timed alone.
    ``progress``: a stream (stderr) that gets one updating line per model and round
    (measuring takes seconds a model), or None.
    """
    from ringnet import stats
    from ringnet.optim import SGD, LRPolicy
    layers, overhead, updates, steps_ms, cpu_ms = {}, {}, [], {}, {}
    spans = {}
    quota = _quota()

    def listen(event):
        if event.name in ("compute", "update", "step"):
            spans[event.name] = (event.start, event.duration)
    unsubscribe = stats.subscribe(listen)
    # the training loop's errstate: overflow on random data is not warned about
    try:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            for name in models:
                runs = {batch: _training_steps(name, batch, dtype, seed) for batch in batches}
                kept = {batch: [] for batch in batches}
                cpu = {batch: [] for batch in batches}
                for r in range(rounds):
                    if progress is not None:
                        print(f"\rmeasuring the compute here: {name} "
                              f"({list(models).index(name) + 1}/{len(models)}), round {r + 1}/{rounds} ",
                              end="", file=progress, flush=True)
                    for batch, (model, step) in runs.items():
                        for k in range(steps):
                            spans.clear()
                            marks, cpu_s = step()
                            if k:
                                kept[batch].append(_split_step(len(model.layers), marks,
                                                               dict(spans)) + (spans["step"][1],))
                                cpu[batch].append(cpu_s)
                model = runs[batches[0]][0]
                n = len(model.layers)
                med = {b: _step_medians(kept[b], mean=quota < 1) for b in batches}
                layers[name] = [(model.layers[i][0], fit_batch_times(batches, [med[b][i] for b in batches]),
                                 fit_batch_times(batches, [med[b][n + i] for b in batches]))
                                for i in range(n)]
                overhead[name] = fit_batch_times(batches, [med[b][2 * n] for b in batches])
                updates.append((model.num_params,
                                float(np.median([med[b][2 * n + 1] for b in batches]))))
                steps_ms[name] = {b: 1e3 * med[b][2 * n + 2] for b in batches}
                cpu_ms[name] = {b: 1e3 * float(np.median(cpu[b])) for b in batches}
    finally:
        unsubscribe()
    # update per call and the add: one large and one small call timed alone
    big, small = 1 << 20, 1 << 10
    costs = {}
    for n in (big, small):
        w, g = np.ones(n, np.dtype(dtype)), np.full(n, 1e-3, np.dtype(dtype))
        sgd = SGD(n, LRPolicy("fixed", 1e-3), momentum=0.9, weight_decay=5e-4, dtype=dtype)
        costs[("upd", n)] = median_time(lambda: sgd.step(w, g, 0), 24)
        costs[("add", n)] = median_time(lambda: np.add(w, g, out=w), 24)
    per_add = max((costs[("add", big)] - costs[("add", small)]) / (big - small), 0.0)
    per_call = max(costs[("upd", small)] - small * max(
        (costs[("upd", big)] - costs[("upd", small)]) / (big - small), 0.0), 0.0)
    # in the step the update finds its arrays out of cache: its per-parameter cost there
    per_param = max(0.0, float(np.median([(t - per_call) / p for p, t in updates])))
    return ComputeProfile(
        "here", "cpu", layers, overhead, per_param, per_call, per_add,
        max(costs[("add", small)] - small * per_add, 0.0),
        f"measured on this machine in training steps (single mode), {dtype}, 1 BLAS thread, "
        f"batches {list(batches)}", method=TRAINING_STEPS, steps_ms=steps_ms, quota=quota,
        compute_cpu_ms=cpu_ms)


def isolated_compute(models, batches=(16, 64), iters=8, dtype="float32", seed=0):
    """Time every layer alone (``bench layers``' code) at two batch sizes; fit the profile.

    The older way, kept to compare against :func:`measure_compute` (``--compute
    here-isolated``): each layer is timed on its own call, outside a training step.

    The batch sizes alternate pass by pass, so a change of the machine's load hits both
    alike; the rest of a step (the loss) is timed directly, not as a difference. Each batch
    size has its own model instance: a layer keeps its work buffers (padded input, im2col
    columns, their views) while the shapes repeat, as they do in training, where the batch
    never changes; one instance fed both sizes in turn would rebuild them on every call.
    """
    from ringnet.optim import SGD, LRPolicy
    layers, overhead = {}, {}
    for name in models:
        rng = np.random.default_rng(seed)
        data = {}
        for batch in batches:
            model = build_model(name, dtype=dtype, seed=seed)
            x = rng.normal(size=(batch,) + model.input_shape).astype(model.dtype)
            y = rng.integers(0, model.num_classes, size=batch)
            model.loss_and_grad(x, y)                                   # warm-up
            data[batch] = (model, x, y)
        passes = {batch: [] for batch in batches}
        losses = {batch: [] for batch in batches}
        for _ in range(iters):
            for batch, (model, x, y) in data.items():
                passes[batch].append(layer_times(model, x, 1))
                logits = model.forward(x, train=True)
                t0 = time.perf_counter()
                model.loss_layer.forward(logits, y)
                model.loss_layer.backward()
                losses[batch].append(time.perf_counter() - t0)
        rows = []
        for i, (lname, _, _) in enumerate(passes[batches[0]][0]):
            fwd = fit_batch_times(batches, [np.median([p[i][1] for p in passes[b]]) / 1e3 for b in batches])
            bwd = fit_batch_times(batches, [np.median([p[i][2] for p in passes[b]]) / 1e3 for b in batches])
            rows.append((lname, fwd, bwd))
        layers[name] = rows
        overhead[name] = fit_batch_times(batches, [float(np.median(losses[b])) for b in batches])
    # update and add: one large and one small call give per element and per call
    big, small = 1 << 20, 1 << 10
    costs = {}
    for n in (big, small):
        w, g = np.ones(n, np.dtype(dtype)), np.full(n, 1e-3, np.dtype(dtype))
        sgd = SGD(n, LRPolicy("fixed", 1e-3), momentum=0.9, weight_decay=5e-4, dtype=dtype)
        costs[("upd", n)] = median_time(lambda: sgd.step(w, g, 0), 3 * iters)
        costs[("add", n)] = median_time(lambda: np.add(w, g, out=w), 3 * iters)
    per_upd = (costs[("upd", big)] - costs[("upd", small)]) / (big - small)
    per_add = (costs[("add", big)] - costs[("add", small)]) / (big - small)
    return ComputeProfile(
        "here", "cpu", layers, overhead, max(per_upd, 0.0),
        max(costs[("upd", small)] - small * per_upd, 0.0), max(per_add, 0.0),
        max(costs[("add", small)] - small * per_add, 0.0),
        f"measured on this machine, layers timed alone, {dtype}, 1 BLAS thread, batches "
        f"{list(batches)}, one model per batch", method=ISOLATED_LAYERS, quota=_quota())


def _quota():
    """The CFS quota this process runs under where it is less than a core, else 1.0 (no
    quota holds it to less than a core)."""
    from ringnet.placement import cpu_quota
    q = cpu_quota()
    return q if q is not None and q < 1 else 1.0


def compute_profile(spec, models, dtype):
    """Return the profile ``--compute`` names: here, here-isolated, a GPU of :data:`GPUS`, or a file."""
    if spec == "here":
        profile = measure_compute(models, dtype=dtype, progress=sys.stderr)
        print(file=sys.stderr)
        return profile
    if spec == "here-isolated":
        return isolated_compute(models, dtype=dtype)
    if spec in GPUS:
        return roofline_compute(spec, models, dtype)
    return load_compute(spec)
